"""The order on keys: pure functions of (seed, epoch, key) with no payload, I/O or communication, so
every rank and process computes the same answer (docs/design.md §4, §10, §12).
"""
