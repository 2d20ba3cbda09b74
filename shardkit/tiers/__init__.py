"""The tier engine: the one machinery that moves record bytes from storage to a consumer's batches.

The pipeline threads, batch buffers, SSD reservoir slots, static cache, node cache and node-shared memory
(docs/design.md §4, §8, §10). The tiered sampler and the ``serve`` server both run it; what differs is where a
block's records go (batch buffers or a shared ring slot).
"""
