"""TensorFlow adapter: the tiered sampler as a ``tf.data.Dataset`` of its batches (docs/design.md §6)."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardkit._extras import import_extra
from shardkit.adapters._ahead import NextPass
from shardkit.adapters._options import PayloadOptions, SamplerFactory
from shardkit.errors import ConfigError
from shardkit.order.schedule import pass_length
from shardkit.readers import SamplerOptions, TieredSampler
from shardkit.readers.sources import Mixture, as_source

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = import_extra("tensorflow", "tensorflow", needed_by="shardkit.adapters.tf")

__all__ = ["make_tf_dataset"]

logger = logging.getLogger(__name__)

#: TensorFlow's tensor alignment (``Allocator::kAllocatorAlignment``): a tensor adopted from memory
#: that is not aligned to it aborts the process in some kernels, so such arrays are copied instead.
_TF_ALIGNMENT = 64


def adopt_payload(batch: dict[str, np.ndarray], payload: str) -> dict[str, Any]:
    """The batch with its payload as a tensor *viewing* the sampler's buffer (DLPack), saving the
    copy ``from_generator`` would make; the tensor keeps the buffer from reuse. Arrays TensorFlow
    cannot adopt safely (read-only, not C-contiguous or native-endian, not 64-byte aligned, empty)
    are left for the usual copy."""
    array = batch[payload]
    if not (
        array.flags.writeable and array.flags.c_contiguous and array.dtype.isnative and array.size
        and array.ctypes.data % _TF_ALIGNMENT == 0
    ):
        return batch
    return {**batch, payload: tf.experimental.dlpack.from_dlpack(array.__dlpack__())}


def _consumer(
    input_context: Any, rank: int | None, world_size: int | None, options: SamplerOptions, global_batch_size: int | None
) -> tuple[int, int, int]:
    """(consumer, number of consumers, per-consumer batch size), before the options check them."""
    if input_context is not None:
        if rank is not None or world_size is not None:
            raise ConfigError(
                "make_tf_dataset: pass either input_context (tf.distribute) or rank/world_size, not both; "
                f"found input_context and rank={rank}, world_size={world_size}"
            )
        consumer, consumers = int(input_context.input_pipeline_id), int(input_context.num_input_pipelines)
        batch_size = options.batch_size
        if global_batch_size is not None:
            batch_size = int(input_context.get_per_replica_batch_size(global_batch_size))
        return consumer, consumers, batch_size
    if global_batch_size is not None:
        raise ConfigError(
            "make_tf_dataset: global_batch_size needs an input_context to split it among replicas; "
            f"found global_batch_size={global_batch_size} without one (use batch_size)"
        )
    # SamplerOptions checks the values (and names rank / world_size in its errors).
    return (options.rank if rank is None else rank), (options.world_size if world_size is None else world_size), \
        options.batch_size


def make_tf_dataset(
    path: str | os.PathLike[str] | Mixture,
    options: SamplerOptions | None = None,
    *,
    global_batch_size: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    nodes: int | None = None,
    input_context: Any = None,
    as_tuple: Sequence[str] | None = None,
    layout: str = "NHWC",
    scale: str | None = None,
    prefetch: bool | int = True,
    shared: str | None = None,
    **overrides: Any,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of batches from the tiered sampler.

    Parameters
    ----------
    path
        Dataset directory or URL, or a :func:`shardkit.mix` mixture (elements then carry
        ``dataset``, each record's dataset index, and ``key`` is the record's key in it).
    options, **overrides
        The sampler options (listed below): a :class:`~shardkit.readers.SamplerOptions`, and any of
        its options by name (``batch_size=64``, ``ram_size="2GiB"``), validated against its
        declaration. ``batch_size`` is per consumer (input pipeline or rank); the static cache is
        held until the dataset and all derived from it are collected. Each iteration runs ``epochs``
        sampler epochs (``None``: endless), the next iteration the next epochs.
    global_batch_size
        With ``input_context``: the global batch; each pipeline yields
        ``input_context.get_per_replica_batch_size(global_batch_size)`` records per batch (this
        overrides ``batch_size``).
    rank, world_size
        Consumer ``rank`` of ``world_size`` when no ``input_context`` is given (default: the
        options', 0 of 1).
    input_context
        The ``tf.distribute.InputContext`` from ``strategy.distribute_datasets_from_function``.
    as_tuple
        Names of the entries to yield as a tuple instead of a dict, e.g. ``("image", "label")`` for
        ``model.fit(ds)`` (x, y).
    layout, scale
        Payload presentation: ``"NHWC"`` as stored (default) or ``"NCHW"``; ``scale="float"`` gives
        float32 (uint8 in ``[0, 1]``, int16 in ``[-1, 1)``). Done with TensorFlow ops in a parallel
        ``map`` so the Python generator only moves stored bytes.
    prefetch
        ``True`` (default): append ``.prefetch(tf.data.AUTOTUNE)`` so a device step overlaps the
        next batch; an int: a fixed prefetch buffer of that many batches; ``False``: none. The
        sampler already prefetches batches in its own threads, so on a machine with very few cores
        ``False`` can be faster (benchmarks/RESULTS.md, "Adapters").
    shared
        Name of a running ``shardkit serve`` to attach to (:class:`~shardkit.readers.SharedSampler`,
        ``seed`` as the job seed; mode ``"epoch"`` only).
    nodes
        With ``locality`` (many nodes, see Notes): with ``input_context`` every input
        pipeline is a node of its own (``nodes`` defaults to ``num_input_pipelines``: one pipeline
        per worker machine); with ``rank`` / ``world_size`` it defaults to the options'. Every
        consumer must get the same values.

    Returns
    -------
    tf.data.Dataset
        Elements are dicts ``{payload, every field, "key"}`` (or tuples per ``as_tuple``) with a
        leading batch dimension that is ``None``, or ``batch_size`` when ``drop_last`` (and no
        ``limit``) makes every batch full.

    Notes
    -----
    The dataset yields the sampler's batches: do not call ``.batch()`` on it. ``element_spec`` is
    complete before a record is read. Under ``tf.distribute`` input pipeline ``i`` of ``P`` is
    consumer ``i`` of ``P``; ``rank`` / ``world_size`` do the same for other launchers. With
    ``locality=True`` and one pipeline per worker machine a step trains on the same records as
    without locality (docs/design.md §6, §10). ``model.fit(ds, epochs=E)`` sees a new permutation
    every epoch; ``epochs=None`` gives one endless iteration (use ``steps_per_epoch``).
    """
    placed = {"rank": rank, "world_size": world_size}
    base = SamplerOptions.given(options, **overrides, **{k: v for k, v in placed.items() if v is not None})
    consumer, consumers, per_consumer = _consumer(input_context, rank, world_size, base, global_batch_size)
    if nodes is None:
        nodes = consumers if input_context is not None and base.locality else base.nodes
    options = base.replace(batch_size=per_consumer, rank=consumer, world_size=consumers, nodes=nodes)
    factory = SamplerFactory(options, shared=shared)
    present = PayloadOptions(layout=layout, scale=scale)
    source = as_source(path)  # a mixture of one dataset or more (shardkit.readers.sources)

    # Each iteration builds its own sampler; this one, kept for as long as the dataset exists, holds
    # the node-shared static cache, so later iterations read only the uncached records.
    holder = factory.build(source, consumer=consumer, num_consumers=consumers, start_epoch=options.start_epoch)
    spec = holder.element_spec()
    payload = holder.payload_name
    num_records = holder.num_records
    # The next iteration's sampler is built ahead (at make_tf_dataset, then while an iteration ends),
    # so that an iteration's first batch waits for its reads only, not for opening the dataset.
    ahead: NextPass | None = None
    if isinstance(holder, TieredSampler):
        holder.hold_shared()

        def build_ahead(epoch: int) -> TieredSampler:
            sampler = factory.build(source, consumer=consumer, num_consumers=consumers, start_epoch=epoch)
            assert isinstance(sampler, TieredSampler)  # the holder's kind: the factory builds one kind
            return sampler

        ahead = NextPass(build_ahead)
        ahead.prepare(options.start_epoch)
    else:
        holder.close()
    present.check(spec[payload][0], str(path))
    names = list(spec)
    if as_tuple is not None:
        as_tuple = tuple(as_tuple)
        unknown = [n for n in as_tuple if n not in spec]
        if unknown or not as_tuple:
            raise ConfigError(f"{path}: as_tuple names {unknown or '()'} are not entries; expected some of {names}")

    rows = options.batch_size if options.drop_last and options.limit is None else None
    signature = {
        name: tf.TensorSpec(shape=(rows, *shape), dtype=tf.as_dtype(dtype), name=name)
        for name, (shape, dtype) in spec.items()
    }
    next_epoch = [options.start_epoch]  # advanced by each finished iteration
    # Weakly: TensorFlow keeps the generator function to the end of the process, the sampler built
    # ahead must go with the dataset (below).
    ahead_ref = weakref.ref(ahead) if ahead is not None else None

    def generate() -> Iterator[dict[str, Any]]:
        # Refers to the factory, never to the holder: TensorFlow keeps this function to the end of the
        # process, and the holder must go with the dataset (below).
        epoch = next_epoch[0]
        spare = ahead_ref() if ahead_ref is not None else None
        taken = spare.take(epoch) if spare is not None else None
        del spare  # the iteration must not keep it alive
        sampler = taken[0] if taken is not None else factory.build(
            source, consumer=consumer, num_consumers=consumers, start_epoch=epoch
        )  # fmt: skip
        try:
            for batch in sampler:
                yield adopt_payload(batch, payload)
            if options.epochs is not None:
                next_epoch[0] = epoch + options.epochs
                # Built while the consumer finishes this iteration and starts the next (TensorFlow's
                # iterator set-up), not after it asks for the next iteration's first batch.
                spare = ahead_ref() if ahead_ref is not None else None
                if spare is not None:
                    spare.prepare_in_background(next_epoch[0])
                del spare
        finally:
            sampler.close()

    dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
    # Every dataset derived from this one (map, prefetch, the user's own) refers to it, so it is
    # collected when the last of them is: the node-shared static cache is let go of then, although
    # TensorFlow keeps the generator function itself until the process ends.
    weakref.finalize(dataset, _let_go, holder, ahead)
    if options.epochs is not None:
        # A known length gives Keras its steps per epoch (progress bar, no "ran out of data").
        batches, _ = pass_length(
            num_records, options.batch_size, consumer, consumers, drop_last=options.drop_last, start=0,
            epochs=options.epochs, limit=options.limit,
        )  # fmt: skip
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(batches))

    if not present.identity or as_tuple is not None:
        stored = spec[payload][1]
        factor = present.factor(stored)

        def arrange(batch: dict[str, Any]) -> Any:
            batch = dict(batch)
            x = batch[payload]
            if present.layout == "NCHW":
                x = tf.transpose(x, (0, 3, 1, 2))
            if present.scale == "float":
                x = tf.cast(x, tf.float32)
                if factor != 1.0:
                    x = x * tf.constant(factor, tf.float32)
            batch[payload] = x
            if as_tuple is not None:
                return tuple(batch[name] for name in as_tuple)
            return batch

        dataset = dataset.map(arrange, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if prefetch is True:
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
    elif prefetch:
        dataset = dataset.prefetch(int(prefetch))
    return dataset.with_options(_untuned())


def _untuned() -> tf.data.Options:
    """Options that turn tf.data's autotuning off. Its model thread sleeps between optimizations at
    periods that double, and deleting an iterator (the end of every ``for`` loop and Keras epoch)
    waits for that thread to wake: an iteration whose batches are all delivered then still lasts
    until the next wake-up. The sampler sizes its own reads and prefetching, so the model has
    nothing to tune; the ``prefetch`` and ``map`` stages asked for ``AUTOTUNE`` keep their own
    static tuning. A later ``with_options`` may turn autotuning on again."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def _let_go(holder: Any, ahead: NextPass | None) -> None:
    """The dataset was collected: close the sampler built ahead and the holder (static cache)."""
    if ahead is not None:
        ahead.close()
    holder.close()


#: Every sampler option, from its declaration, for help() and the IDE.
make_tf_dataset.__doc__ = f"{make_tf_dataset.__doc__}{SamplerOptions.describe()}"
