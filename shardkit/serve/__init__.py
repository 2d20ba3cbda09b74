"""One tier stack shared by concurrent training jobs on one machine (hyper-parameter searches).

A :class:`TierServer` (``shardkit serve PATH --name NAME``) reads the dataset once for every job of
the same user that attaches by name with :class:`SharedSampler`; each job still sees an exactly
uniform order of its own, dependent on the other jobs' (fine for independent trials, not for an
ensemble). Modules: :mod:`~.order`, :mod:`~.protocol`, :mod:`~.rundir`, :mod:`~.ring`,
:mod:`~.server`, :mod:`~.client`. Design: docs/design.md §8; security: docs/design.md §13.
"""

from shardkit.serve.client import SharedSampler, wait_for_server
from shardkit.serve.order import job_order
from shardkit.serve.server import ServeOptions, TierServer, serve

__all__ = ["SharedSampler", "TierServer", "ServeOptions", "serve", "wait_for_server", "job_order"]
