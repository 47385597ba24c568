"""Everything NATS: the embedded server, connections, and each stream, bucket and subject's I/O."""
