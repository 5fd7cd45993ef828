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

The data position goes into the checkpoint: a ``DataLoader`` (one pass over the data per
``iter()``, epochs shuffled by a seed) registers itself with the worker's session, and
``track(iterator)`` registers any iterator with ``get_state()`` / ``set_state()`` (a Grain
``DataLoader`` or ``DatasetIterator``). Every ``report(checkpoint=...)`` writes the position of
each registered iterator into that rank's part of the checkpoint (``.jaxtrain_data/``), so it is
committed with the rest; after a restart, or in a run resumed by name, each one is set back to
the position of ``get_checkpoint()`` when it registers, and goes on mid-epoch (docs/data.md).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import posixpath
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

DATA_AXIS = "data"
# The directory, in each rank's part of a checkpoint, that holds the positions of its iterators:
# one file per rank, rank-<world rank>.json.
POSITIONS_DIR = ".jaxtrain_data"


def process_index_and_count() -> tuple[int, int]:
    """This process's index and the number of processes: the worker's world rank and world
    size inside a jaxtrain worker, else ``jax.process_index()`` and ``jax.process_count()``."""
    from jaxtrain import session

    current = session.current()
    if current is not None:
        ctx = current.context
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
                 count: int | None = None, drop_last: bool = True, shuffle: bool = False,
                 seed: int = 0, epoch: int = 0) -> Iterator[Any]:
    """This process's rows of each global batch of ``data`` (an array, or a dict / tuple of
    arrays with equal first dimensions): for step t, rows ``t*B + index*b .. t*B + (index+1)*b -
    1`` with ``B = global_batch_size`` and ``b = B / count``. Assembled by ``global_batch``, step
    t is exactly rows ``t*B .. (t+1)*B - 1``. ``drop_last``: skip a last, short batch (a short
    batch would give the processes different shapes unless it divides; it is refused then).
    ``shuffle``: the rows are taken in the order of a permutation drawn from ``(seed, epoch)``,
    the same on every process and in every run, so that an epoch can be resumed mid-way."""
    return _batches(data, global_batch_size, index, count, drop_last, shuffle, seed, epoch, 0)


def _batches(data: Any, global_batch_size: int, index: int | None, count: int | None,
             drop_last: bool, shuffle: bool, seed: int, epoch: int, start: int) -> Iterator[Any]:
    """iter_batches from global batch `start` on; the arguments are checked before the first
    batch is asked for."""
    index, count = _where(index, count)
    _whole("global_batch_size", global_batch_size, 1)
    _whole("seed", seed, 0)
    _whole("epoch", epoch, 0)
    if global_batch_size % count:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not allowed with {count} processes; it "
            "must be a multiple of the number of processes")
    n = _rows(data)
    order = _permutation(n, seed, epoch) if shuffle else None
    return _cut(data, n, global_batch_size, index, count, drop_last, order, start)


def _cut(data: Any, n: int, global_batch_size: int, index: int, count: int, drop_last: bool,
         order: Any, start: int) -> Iterator[Any]:
    local = global_batch_size // count
    for first in range(start * global_batch_size, n, global_batch_size):
        size = min(global_batch_size, n - first)
        if size < global_batch_size:
            if drop_last:
                return
            if size % count:
                raise ValueError(
                    f"iter_batches: the last batch has {size} rows, which does not divide among "
                    f"{count} processes; pass drop_last=True or a size that divides")
            local = size // count
        lo = first + index * local
        if order is None:
            yield _map(data, lambda a, lo=lo, local=local: a[lo:lo + local])
        else:
            rows = order[lo:lo + local]
            yield _map(data, lambda a, rows=rows: a[rows])


def _whole(field: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{field}={value!r} is not allowed; it must be a whole number >= {least}")


def _rows(data: Any) -> int:
    rows = {leaf.shape[0] for leaf in _leaves(data)}
    if len(rows) != 1:
        raise ValueError(f"iter_batches(data): the arrays have different numbers of rows {rows}")
    return rows.pop()


def _permutation(n: int, seed: int, epoch: int) -> Any:
    """The order of the rows in epoch `epoch`: the same for a (seed, epoch) on every process,
    run and NumPy version (PCG64 and its permutation are stable)."""
    import numpy as np

    return np.random.default_rng([seed, epoch]).permutation(n)


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


# --- the data position in the checkpoint --------------------------------------------------------


class DataLoader:
    """The global batches of ``data`` epoch after epoch, whose position goes into every
    checkpoint: each ``iter(loader)`` is one pass (one epoch) that yields this process's rows of
    each global batch, as ``iter_batches`` does for that epoch, the rows in a fresh order drawn
    from ``(seed, epoch)`` when ``shuffle``.

    Created inside the training function, it registers itself with the worker's session
    (``track``): ``report(checkpoint=...)`` saves its position (the epoch and the batches of it
    already yielded), and after a restart, or in a run resumed by name, it starts at the
    position of ``get_checkpoint()``: the first pass then yields the rest of that epoch, so that
    every sample of the epoch is seen once across the restart. A pass left before its end is
    over: the next ``iter()`` starts the next epoch. ``name`` tells the loaders of one rank
    apart in the checkpoint (default: the order in which they were created)."""

    def __init__(self, data: Any, global_batch_size: int, *, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = True, name: str | None = None,
                 index: int | None = None, count: int | None = None) -> None:
        self._data = data
        self._args = (global_batch_size, index, count, drop_last, shuffle, seed)
        _batches(data, global_batch_size, index, count, drop_last, shuffle, seed, 0, 0)  # checks
        self._rows = _rows(data)
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._epoch = 0
        self._step = 0  # batches of the pass in progress already yielded
        self._resume = False  # set_state: the next pass goes on from _step
        track(self, name)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next one."""
        return self._epoch

    def __len__(self) -> int:
        """Global batches per epoch."""
        b = self.global_batch_size
        return self._rows // b if self._args[3] else -(-self._rows // b)

    def __iter__(self) -> Iterator[Any]:
        if self._resume:
            self._resume = False
        else:
            if self._step:  # a pass left before its end
                self._epoch += 1
            self._step = 0
        global_batch_size, index, count, drop_last, shuffle, seed = self._args
        epoch = self._epoch
        batches = _batches(self._data, global_batch_size, index, count, drop_last, shuffle, seed,
                           epoch, self._step)
        return self._pass(epoch, batches)

    def _pass(self, epoch: int, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            if self._epoch != epoch:
                return  # another pass has started: this one is over
            self._step += 1  # counted before the caller trains on it and reports
            yield batch
        if self._epoch == epoch:
            self._epoch, self._step = epoch + 1, 0

    def get_state(self) -> dict:
        """The position: the epoch and how many of its global batches were yielded (a pass
        yielded to its end is at the start of the next epoch)."""
        epoch, step = self._epoch, self._step
        if step >= len(self):
            epoch, step = epoch + 1, 0
        return {"epoch": epoch, "step": step, "rows": self._rows,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle,
                "seed": self.seed}

    def set_state(self, state: dict) -> None:
        """Goes to a position that get_state gave: the next pass yields the rest of its epoch.
        A position taken over other data (a different number of rows, batch size, shuffle or
        seed) is refused with a ValueError naming what differs."""
        mine = self.get_state()
        for field in ("rows", "global_batch_size", "shuffle", "seed"):
            if state.get(field) != mine[field]:
                raise ValueError(
                    f"data.DataLoader: the saved position is of {field}={state.get(field)!r}, "
                    f"and this loader has {field}={mine[field]!r}; the position is meaningless "
                    "for other data. Create it as it was, or under another name= to start afresh")
        self._epoch, self._step = int(state["epoch"]), int(state["step"])
        self._resume = self._step > 0


def track(iterator: Any, name: str | None = None) -> Any:
    """Registers an iterator whose position goes into every checkpoint of this worker: anything
    with ``get_state()`` and ``set_state(state)``, such as ``iter()`` of a Grain ``DataLoader``
    or of a Grain dataset (a ``DatasetIterator``); ``DataLoader`` registers itself. Returns the
    iterator, positioned as in ``get_checkpoint()`` when the attempt restored one.

    Each ``report(checkpoint=...)`` of this rank saves ``get_state()`` of every tracked iterator
    in its part of the checkpoint. ``name`` tells the iterators of one rank apart (default: the
    order of registration, which must then be the same in every attempt). Outside a jaxtrain
    worker it does nothing."""
    for method in ("get_state", "set_state"):
        if not callable(getattr(iterator, method, None)):
            raise TypeError(
                f"data.track(iterator): a {type(iterator).__name__} has no {method}(); pass an "
                "iterator with get_state() and set_state() (a Grain DataLoader's or dataset's "
                "iterator, a data.DataLoader)")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"data.track(name={name!r}) is not allowed; give a non-empty string")
    registry = _registry()
    if registry is None:
        return iterator
    key = name if name is not None else f"#{len(registry.tracked)}"
    if key in registry.tracked:
        raise ValueError(f"data.track(name={key!r}): an iterator of that name is tracked already "
                         "on this rank; give each one its own name")
    registry.tracked[key] = iterator
    registry.restore(key, iterator)
    return iterator


class _Registry:
    """The iterators tracked by one worker's session, and the positions its checkpoint holds."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.rank = session.context.world_rank
        self.world_size = session.context.world_size
        self.tracked: dict[str, Any] = {}
        self._saved: dict[str, dict] | None = None  # read from the checkpoint on first use
        self._from_rank: int | None = None
        self._from_world: int | None = None  # the world size the positions were saved in

    def restore(self, key: str, iterator: Any) -> None:
        checkpoint = self.session.checkpoint
        if checkpoint is None:
            return
        if self._saved is None:
            self._saved, self._from_rank, self._from_world = _read_positions(checkpoint,
                                                                             self.rank)
        entry = self._saved.get(key)
        if entry is None:
            _say(f"rank {self.rank}: the checkpoint {checkpoint.path} holds no data position "
                     f"of iterator {key!r}; it starts from the beginning")
            return
        if isinstance(iterator, DataLoader):
            iterator.set_state(_decode(entry))  # the same on every rank, at any world size
            return
        if self._from_world is not None and self._from_world != self.world_size:
            raise RuntimeError(
                f"data.track: the position of iterator {key!r} in the checkpoint "
                f"{checkpoint.path} is that of rank {self._from_rank}'s shard of "
                f"{self._from_world} processes, and this attempt has {self.world_size} (the "
                "run was resized, docs/elastic.md): a shard's position means nothing for another "
                "count. Use jaxtrain.data.DataLoader, whose position is the same at any process "
                "count, or make the sampler's shards from the new world and position it "
                "yourself from the global step")
        if self._from_rank != self.rank:
            raise RuntimeError(
                f"data.track: rank {self.rank} passed no part of the checkpoint "
                f"{checkpoint.path} in its round, so the position of its iterator {key!r} is not "
                f"in it (only rank {self._from_rank}'s is, and an iterator's position, a Grain "
                "one's say, differs by rank). Pass report(checkpoint=...) on every rank that "
                "tracks an iterator (a rank's directory may be empty: the position is added)")
        iterator.set_state(_decode(entry))

    def save(self, directory: str) -> None:
        """Writes the positions of the tracked iterators into `directory`, the files this rank
        passes to report(checkpoint=): POSITIONS_DIR holds this rank's file and no other (one
        left there by a restored copy of the checkpoint would clash with the other ranks')."""
        where = os.path.join(directory, POSITIONS_DIR)
        if os.path.lexists(os.path.join(directory, _manifest_name())):
            return  # a committed checkpoint, which report() refuses: never written into
        shutil.rmtree(where, ignore_errors=True)
        if not self.tracked:
            return
        positions = {}
        for key, iterator in self.tracked.items():
            state = iterator.get_state()
            try:
                positions[key] = _encode(state)
            except TypeError as e:
                raise TypeError(f"report(checkpoint=...) on rank {self.rank}: the position of the "
                                f"tracked iterator {key!r} cannot be saved: {e}") from None
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"rank-{self.rank}.json"), "w", encoding="utf-8") as f:
            json.dump({"version": 1, "rank": self.rank, "world_size": self.world_size,
                       "positions": positions}, f)


_current: _Registry | None = None


def _registry() -> _Registry | None:
    """The registry of this worker's session (a new one for each attempt's session)."""
    global _current
    from jaxtrain import session

    active = session.current()
    if active is None:
        return None
    if _current is None or _current.session is not active:
        _current = _Registry(active)
    return _current


def _save_positions(directory: str) -> None:
    """report(checkpoint=)'s hook: the positions of this rank's tracked iterators go into the
    directory whose files it is about to read (they are committed with the rest)."""
    registry = _registry()
    if registry is not None:
        try:
            registry.save(directory)
        except OSError as e:
            raise type(e)(f"report(checkpoint=...) on rank {registry.rank}: writing the data "
                          f"position into '{directory}' failed: {e}") from None


def _read_positions(checkpoint: Any, rank: int
                    ) -> tuple[dict[str, dict], int | None, int | None]:
    """The positions that `rank` saved in `checkpoint`, or when it saved none, those of the
    lowest rank that did; which rank's they are (None: no rank saved any); and the world size
    they were saved in (None where the file does not say)."""
    fs = checkpoint.filesystem
    where = posixpath.join(checkpoint.path, POSITIONS_DIR) if fs is not None else os.path.join(
        checkpoint.path, POSITIONS_DIR)
    try:
        if fs is not None:
            names = [posixpath.basename(p) for p in fs.ls(where, detail=False)]
        else:
            names = os.listdir(where)
    except FileNotFoundError:
        return {}, None, None
    ranks = sorted(int(n[5:-5]) for n in names
                   if n.startswith("rank-") and n.endswith(".json") and n[5:-5].isdigit())
    if not ranks:
        return {}, None, None
    chosen = rank if rank in ranks else ranks[0]
    path = f"{where}/rank-{chosen}.json"
    if fs is not None:
        text = fs.cat_file(path)
    else:
        with open(path, "rb") as f:
            text = f.read()
    saved = json.loads(text)
    return saved["positions"], chosen, saved.get("world_size")


def _encode(state: Any) -> dict:
    """A position as JSON: bytes (a Grain DataLoader's) in base64, else JSON itself."""
    if isinstance(state, bytes):
        return {"bytes": base64.b64encode(state).decode("ascii")}
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise TypeError(f"get_state() gave a {type(state).__name__}, which is neither bytes nor "
                        f"JSON ({e})") from None
    return {"json": state}


def _decode(entry: dict) -> Any:
    if "bytes" in entry:
        return base64.b64decode(entry["bytes"])
    return entry["json"]


def _manifest_name() -> str:
    from jaxtrain.storage import MANIFEST_NAME

    return MANIFEST_NAME


def _say(text: str) -> None:
    sys.stderr.write(f"jaxtrain worker: {text}\n")
    sys.stderr.flush()
