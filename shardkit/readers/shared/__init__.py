"""One tier stack shared by concurrent training jobs on one machine (hyper-parameter searches).

A :class:`TierServer` (``shardkit serve PATH --name NAME``) reads the dataset; any number of jobs of
the same user attach by name with :class:`SharedSampler`. Reservoirs are read from disk once for all
attached jobs, and each job still sees an exactly uniform order of its own.

Modules: :mod:`~.order` (the partition and the jobs' permutations), :mod:`~.protocol` (messages,
framing, ``info.json``), :mod:`~.rundir` (the private run directory), :mod:`~.ring` (the shared
memory), :mod:`~.server` and :mod:`~.client`.

Design
------
**Order.** For server epoch ``e`` the server draws ``pi_e`` from its own random domain and cuts it into
consecutive blocks of ``K`` positions: reservoir ``r`` is the key set ``pi_e[r*K : (r+1)*K]``. Job ``j``
emits the keys of reservoir ``r`` in the order of its own permutation, drawn from another domain with
``(job_seed, e, r)``, of the reservoir's stored (ascending) keys. Blocks of a uniform random partition,
each permuted uniformly and independently, form an exactly uniform permutation (see
:mod:`~.order`). With the SSD tier the server's SSD reservoirs are ``K1`` consecutive positions of
``pi_e`` and the published blocks are ``K`` consecutive positions inside each: still consecutive
segments of sizes fixed in advance, so the argument is unchanged.

**What sharing costs.** Jobs attached to one server see the same reservoirs at the same time: each
job's order is uniform, but the orders of two jobs are dependent. An item's positions in two jobs
differ by less than ``K``, and the Spearman correlation of two jobs' positions is
``(N**2 - K**2) / (N**2 - 1)``, about ``1 - (K/N)**2`` (``tests/readers/test_shared_order.py``
measures it). Independent trials of a hyper-parameter search do not need independent orders; an
ensemble whose members should see the data differently does (give each member its own sampler).

**Consumers of one job.** DataLoader workers and ranks of one job are ``W`` consumers with the same
``job_seed`` (and ``group``). Each attaches with its own connection, sees every reservoir, copies
only its slices of the job's global batches (the :class:`~shardkit.readers.TieredSampler`
global-batch semantics) and releases every slot. The server activates a group only when all ``W``
ranks are attached, at an epoch boundary, so they all start the same epoch; a consumer claiming a
rank already present in its group is refused.

**Payload path.** The ring (:mod:`~.ring`) holds ``slots`` (>= 2: double buffering) payload slots of
``K`` records, then ``slots`` key arrays of ``K`` int64. The server reads each reservoir once, ascending
offsets, into a free slot, writes the slot's sorted keys, and sends a :class:`~.protocol.Reservoir`
message to every active job over a Unix socket. Payload never goes through the socket, only small
fixed-size messages. A job copies each batch out of the slot (one gather per batch), so batches own
their memory.

**Release and the slow-job bound.** A slot's holders are the jobs that were active when it was
published. It is refilled only after every holder released it (a job releases a slot as soon as it
copied the reservoir's last record out). The server therefore runs at most ``slots`` reservoirs
ahead of the slowest job; that is the price of reading once.

**Leases and silence.** Each side heartbeats the other every ``lease_seconds / 4``. A job that exits,
crashes or is SIGKILLed closes its socket and the server drops it at once; a job silent for
``lease_seconds`` (stopped, hung) is dropped too, so it never stalls the others. A job that hears
nothing from the server for ``lease_seconds`` while it waits raises
:class:`~shardkit.errors.PeerTimeoutError` instead of blocking. A job that abandons its iterator
(``break``) detaches when the iterator is garbage collected, or at once with
:meth:`SharedSampler.close`.

**Epoch boundaries.** A job attaching while an epoch is under way is *pending* and becomes active at
the next server epoch. With ``wait_for`` jobs the server waits for that many before its first epoch;
otherwise it starts as soon as one job is there and idles while none is. If every active job leaves
mid-epoch, the rest of the epoch is skipped. A job runs ``epochs`` whole epochs, then detaches.

**Security.** Only processes of the server's user can attach, and nothing received is ever
unpickled. The run directory ``<base>/shardkit-serve-<uid>-<NAME>/`` (base ``/dev/shm``) must be a
real directory of this user with mode 0700, else both sides refuse it (:mod:`~.rundir`). It holds a
secret token (0600) that a job must present in its :class:`~.protocol.Hello` (compared in constant
time); the server also checks the peer's uid, bounds every message before reading it, bounds the
connections it serves (``max_connections``) and the time a new one has to say hello. A job
validates ``info.json`` field by field, maps the ring read-only and checks the socket's peer is of its uid.
Protocol violations end that one connection with one log line; the server keeps serving the others.

**Lifetime.** The server holds an exclusive ``flock`` on the run directory's ``lock`` for its whole
life; the kernel drops it when the process dies, even by SIGKILL. ``info.json`` is written last, so a
job never sees a half-started server. On exit, and on SIGTERM (``serve`` turns it into a clean
shutdown), the server removes the ring, its SSD directory and the run directory. At start, a run
directory whose lock is free is stale (SIGKILLed server): its files are removed. A run directory
whose lock is held is a live server: starting another one with that name raises
:class:`~shardkit.errors.ConfigError` naming it.

**Dataset identity.** ``info.json`` and each hello carry a fingerprint (SHA-256 of the dataset's root
``zarr.json``, which lists every shard's checksum); a job given ``dataset=`` is refused unless the
server serves that exact dataset.
"""

from shardkit.readers.shared.client import SharedSampler, wait_for_server
from shardkit.readers.shared.order import job_order
from shardkit.readers.shared.server import ServeOptions, TierServer, serve

__all__ = ["SharedSampler", "TierServer", "ServeOptions", "serve", "wait_for_server", "job_order"]
