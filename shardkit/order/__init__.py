"""The order on keys: pure functions of (seed, epoch, key) with no payload, I/O or communication.

The block schedule, exact and on-demand (Feistel) permutations, reservoir primitives, seed domains, mixture
plans and the many-node locality assignment (docs/design.md §4, §10, §12). Every rank and process computes the
same answer from the same arguments, which is what lets the tiers read in ascending order without talking.
"""
