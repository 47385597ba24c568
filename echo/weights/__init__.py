"""Weights between versions: what goes over the wire and what is kept.

delta.py        sparse deltas between full-weight versions, bit for bit, and their checks
retention.py    which weight versions may leave the bucket
"""
