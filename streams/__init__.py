"""Everything NATS: the embedded server, connections, and each stream, bucket and subject's I/O."""

from echo import passive_openmp

passive_openmp()  # before anything imports torch
