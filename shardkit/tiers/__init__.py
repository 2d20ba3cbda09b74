"""The tier engine: the one machinery that moves record bytes from storage to a consumer's batches,
run by the tiered sampler and by ``serve`` (docs/design.md §4, §8, §10).
"""
