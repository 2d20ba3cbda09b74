"""One tier stack shared by concurrent training jobs on one machine (hyper-parameter searches).

A :class:`TierServer` (``shardkit serve PATH --name NAME``) reads the dataset once for every job that
attaches with :class:`SharedSampler`, each in an exactly uniform order of its own (docs/design.md §8, §13).
"""

from shardkit.serve.client import SharedSampler, wait_for_server
from shardkit.serve.order import job_order
from shardkit.serve.server import ServeOptions, TierServer, serve

__all__ = ["SharedSampler", "TierServer", "ServeOptions", "serve", "wait_for_server", "job_order"]
