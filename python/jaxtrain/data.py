"""Feeding data to a multi-process JAX run: each process reads its part, and the parts form one
global ``jax.Array``.

Inside the training function::

    from jaxtrain import data

    for local in data.iter_batches(x, global_batch_size=64):   # this process's rows
        batch = data.global_batch(local)                        # one jax.Array over all processes

``shard`` splits a dataset by process (a NumPy array by rows, a list of files, any iterable);
``iter_batches`` cuts an array into global batches and yields this process's rows of each, so that
the global batch of step t is rows ``t*B .. (t+1)*B - 1``, the batch a single process would see;
``global_batch`` builds the global array from every process's local batch with
``jax.make_array_from_process_local_data``, sharded along the batch axis over every device of the
run (or over the mesh or sharding you give). The process index and count come from
``get_context()`` inside a worker, from JAX elsewhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

DATA_AXIS = "data"


def process_index_and_count() -> tuple[int, int]:
    """This process's index and the number of processes: the worker's world rank and world
    size inside a jaxtrain worker, else ``jax.process_index()`` and ``jax.process_count()``."""
    from jaxtrain import session

    if session._session is not None:
        ctx = session._session.context
        return ctx.world_rank, ctx.world_size
    import jax

    return jax.process_index(), jax.process_count()


def _where(index: int | None, count: int | None) -> tuple[int, int]:
    if (index is None) != (count is None):
        raise ValueError("give both index and count, or neither (then they are this process's)")
    if index is None or count is None:
        return process_index_and_count()
    for field, value in (("index", index), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{field}={value!r} is not allowed; it must be a whole number")
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"index={index}, count={count} is not allowed; need 0 <= index < count")
    return index, count


def shard(dataset: Any, *, index: int | None = None, count: int | None = None,
          drop_remainder: bool = True) -> Any:
    """This process's part of ``dataset``, every ``count``-th element from ``index`` (by default
    this process's index and the number of processes):

    * a NumPy array (or anything with ``shape`` and slicing): rows ``index::count``; with
      ``drop_remainder`` (the default) the rows that would give some processes one more are
      dropped, so every process gets as many (SPMD steps must match);
    * a list or tuple (of file names, say): a list of the same elements, remainder kept (files
      differ in length anyway; balance them yourself when it matters);
    * any other iterable (a generator, a ``grain``/``tf.data``-like dataset): an iterator over
      its elements ``index``, ``index + count``, ... (the others are read and skipped).
    """
    index, count = _where(index, count)
    if hasattr(dataset, "shape") and hasattr(dataset, "__getitem__"):
        rows = dataset.shape[0] if dataset.shape else 0
        if not dataset.shape:
            raise ValueError("shard(dataset): a 0-d array has no rows to split")
        if drop_remainder:
            dataset = dataset[: rows - rows % count]
        return dataset[index::count]
    if isinstance(dataset, (list, tuple)):
        return list(dataset[index::count])
    if isinstance(dataset, (str, bytes)) or not isinstance(dataset, Iterable):
        raise ValueError(
            f"shard(dataset) takes an array, a list or an iterable; got {type(dataset).__name__}")
    return itertools.islice(dataset, index, None, count)


def iter_batches(data: Any, global_batch_size: int, *, index: int | None = None,
                 count: int | None = None, drop_last: bool = True) -> Iterator[Any]:
    """This process's rows of each global batch of ``data`` (an array, or a dict / tuple of
    arrays with equal first dimensions): for step t, rows ``t*B + index*b .. t*B + (index+1)*b -
    1`` with ``B = global_batch_size`` and ``b = B / count``. Assembled by ``global_batch``, step
    t is exactly rows ``t*B .. (t+1)*B - 1``. ``drop_last``: skip a last, short batch (a short
    batch would give the processes different shapes unless it divides; it is refused then)."""
    index, count = _where(index, count)
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size!r} is not allowed; it must be a "
                         "whole number >= 1")
    if global_batch_size % count:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not allowed with {count} processes; it "
            "must be a multiple of the number of processes")
    leaves = _leaves(data)
    rows = {leaf.shape[0] for leaf in leaves}
    if len(rows) != 1:
        raise ValueError(f"iter_batches(data): the arrays have different numbers of rows {rows}")
    n = rows.pop()
    local = global_batch_size // count
    for start in range(0, n, global_batch_size):
        size = min(global_batch_size, n - start)
        if size < global_batch_size:
            if drop_last:
                return
            if size % count:
                raise ValueError(
                    f"iter_batches: the last batch has {size} rows, which does not divide among "
                    f"{count} processes; pass drop_last=True or a size that divides")
            local = size // count
        lo = start + index * local
        yield _map(data, lambda a, lo=lo, local=local: a[lo:lo + local])


def mesh(axis_name: str = DATA_AXIS) -> Any:
    """A one-axis ``jax.sharding.Mesh`` over every device of the run, in process order: the
    data-parallel mesh that ``global_batch`` uses when given none."""
    import jax
    import numpy as np

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices), (axis_name,))


def global_batch(local: Any, sharding: Any = None) -> Any:
    """One global ``jax.Array`` (or a pytree of them, for a dict or tuple batch) from this
    process's ``local`` batch, every process calling it with its own rows (the rows of process
    p come p-th). ``sharding``: a ``jax.sharding.Sharding`` or a ``Mesh`` (then the batch axis is
    split over the mesh's first axis); default: the batch axis over every device of the run."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if sharding is None:
        sharding = mesh()
    if isinstance(sharding, Mesh):
        sharding = NamedSharding(sharding, PartitionSpec(sharding.axis_names[0]))
    if not isinstance(sharding, jax.sharding.Sharding):
        raise ValueError(f"global_batch(sharding={sharding!r}) is not allowed; pass a "
                         "jax.sharding.Sharding or a Mesh")
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local)


def _leaves(data: Any) -> Sequence[Any]:
    if isinstance(data, dict):
        return list(data.values())
    if isinstance(data, (list, tuple)):
        return list(data)
    if hasattr(data, "shape") and hasattr(data, "__getitem__"):
        return [data]
    raise ValueError(f"iter_batches(data) takes an array, or a dict or tuple of arrays; got "
                     f"{type(data).__name__}")


def _map(data: Any, fn: Any) -> Any:
    if isinstance(data, dict):
        return {k: fn(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(fn(v) for v in data)
    return fn(data)
