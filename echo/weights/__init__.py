"""Weights between versions: what goes over the wire and what is kept.

shards.py       a policy's weights as safetensors shards: made, read as views, checked, loaded
files.py        the published versions kept in the run directory
digest.py       the one digest of weights: in memory, in files, of a base model
delta.py        sparse deltas between full-weight versions, bit for bit, and their checks
retention.py    which weight versions may leave the bucket
"""
