"""One tier stack shared by concurrent training jobs on one machine (hyper-parameter searches).

A :class:`TierServer` (``shardkit serve PATH --name NAME``) reads the dataset; any number of jobs of
the same user attach by name with :class:`SharedSampler`. Reservoirs are read from disk once for all
attached jobs, and each job still sees an exactly uniform order of its own.

Modules: :mod:`~.order` (the partition and the jobs' permutations), :mod:`~.protocol` (messages,
framing, ``info.json``), :mod:`~.rundir` (the private run directory), :mod:`~.ring` (the shared
memory), :mod:`~.server` and :mod:`~.client`.

Each job's order is exactly uniform, but the orders of jobs attached at the same time are dependent
(they see the same reservoirs): fine for independent trials, not for an ensemble that needs different
orders. The design (order and its proof, what sharing costs, the payload ring, the slow-job bound,
leases, epoch boundaries, lifetime) is docs/design.md §8; its security model (private run directory,
secret token, a protocol without pickle) is docs/design.md §13.
"""

from shardkit.serve.client import SharedSampler, wait_for_server
from shardkit.serve.order import job_order
from shardkit.serve.server import ServeOptions, TierServer, serve

__all__ = ["SharedSampler", "TierServer", "ServeOptions", "serve", "wait_for_server", "job_order"]
