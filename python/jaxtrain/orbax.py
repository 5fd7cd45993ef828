"""Sharded checkpoints with ``orbax.checkpoint``, committed by jaxtrain (docs/orbax.md).

Inside the training function, on every rank::

    from jaxtrain import orbax as jt_orbax

    state = jt_orbax.restore(abstract_state) or init_state()   # None on a fresh start
    ...
    jt_orbax.save(state, {"step": step, "loss": loss})          # instead of report(...)

``save`` has Orbax write ``state`` (a pytree of ``jax.Array``, sharded any way) into one
directory of the round that every rank can see, under the run directory: each process writes only
the shards it owns (``state/ocdbt.process_<i>``), and the primary process the metadata. Then
every rank hands jaxtrain its own files of it through ``report(metrics, checkpoint=...)``, so
jaxtrain commits them together, with its manifest, as the round's checkpoint, or not at all.
``restore`` reads the latest committed checkpoint (``get_checkpoint()``) back with the
shardings of ``abstract_state`` (e.g. ``jax.eval_shape`` of the init function, with shardings),
each process reading what it needs.

In a run whose hosts write their checkpoints to object storage themselves
(checkpoint_store.py), Orbax saves from every process straight into the round's directory on the
store, ``gs://<run>/<dir_name>/<item>``, and each rank then reads its own files back once to
describe them (size, CRC-32C, SHA-256) for jaxtrain's manifest: nothing is copied again.
``restore`` reads such a checkpoint straight from the store. Orbax writes straight to ``gs://``
only; a run on any other object store is refused with the reason (docs/orbax.md).

Needs ``orbax-checkpoint`` (``pip install 'jaxtrain[orbax]'``). On several hosts the run
directory must be shared (NFS), or be on ``gs://``.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
from collections.abc import Callable
from typing import Any

from jaxtrain import session, storage
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.worker.checkpoint_store import Store, StoreError, status_code

ITEM = "state"
_PROCESS_DIR = re.compile(r"ocdbt\.process_(\d+)$")


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError("jaxtrain.orbax needs orbax-checkpoint: pip install "
                          "'jaxtrain[orbax]' (or orbax-checkpoint)") from None
    return ocp


def _sync(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def save(state: Any, metrics: dict, *, checkpoint_dir_name: str | None = None,
         item: str = ITEM) -> None:
    """Saves ``state`` with Orbax from every rank and reports it with ``metrics`` as this round's
    checkpoint (``<checkpoint>/<item>``). Every rank must call it, as with ``report``."""
    ocp = _ocp()
    s = session.require("orbax.save")
    ctx = s.context
    _check_item(item)
    if s.store is not None:
        _save_to_store(ocp, s, state, metrics, checkpoint_dir_name, item)
        return
    # One directory per attempt and round, that every rank names alike without talking.
    shared = os.path.join(ctx.run_dir, ".staging", f"orbax-a{ctx.attempt}-r{s.round + 1}")
    view = f"{shared}.rank{ctx.world_rank}"
    if ctx.world_rank == 0:
        os.makedirs(shared, exist_ok=True)
    _sync(f"jaxtrain-orbax-mkdir-{ctx.attempt}-{s.round}")
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    checkpointer.save(os.path.join(shared, item), args=ocp.args.StandardSave(state))
    # Orbax has finished on every process; each rank's share: its own ocdbt.process_<i>, and,
    # for the primary, everything that is no process's.
    _link_share(shared, view, ctx.world_rank)
    _sync(f"jaxtrain-orbax-shared-{ctx.attempt}-{s.round}")
    if ctx.world_rank == 0:
        shutil.rmtree(shared, ignore_errors=True)  # the views hold links to every file
    try:
        if any(files for _, _, files in os.walk(view)):
            session.report(metrics, checkpoint=Checkpoint.from_directory(view),
                           checkpoint_dir_name=checkpoint_dir_name)
        else:  # a process that owns no shard (all replicated) has nothing to hand over
            session.report(metrics)
    finally:
        shutil.rmtree(view, ignore_errors=True)


def save_on_preemption(state_fn: Callable[[], Any] | None, *, item: str = ITEM) -> None:
    """Registers Orbax's just-in-time save of ``state_fn()`` for a preemption notice, as
    ``jaxtrain.on_preemption`` does for a function that writes files (docs/preemption.md,
    "Automatic save"): at the agreed ``report(metrics)`` call, every rank runs
    ``save(state_fn(), metrics, item=item)`` instead, so the state of that step is the
    just-in-time checkpoint, committed before ``report`` returns; ``restore`` reads it back after
    the restart. ``state_fn`` returns the current state (e.g. ``lambda: state`` inside the
    training function, which sees each new value of ``state``). Every rank must register it
    (Orbax saves from every process); ``None`` takes the registration back."""
    s = session.require("orbax.save_on_preemption")
    _check_item(item)
    if state_fn is None:
        s.preemption_save = None
        return
    if not callable(state_fn):
        raise TypeError(
            f"jaxtrain.orbax.save_on_preemption(state_fn={state_fn!r}) is not allowed: state_fn "
            "must be a function () -> state (the pytree to save, e.g. lambda: state), or None "
            "to take the registration back")
    _ocp()  # refused now, not at the notice, where orbax-checkpoint is missing
    s.preemption_save = lambda metrics, dir_name: save(
        state_fn(), metrics, checkpoint_dir_name=dir_name, item=item)


def _check_item(item: Any) -> None:
    if not isinstance(item, str) or not item or "/" in item or item.startswith("."):
        raise ValueError(f"item={item!r} is not allowed; it must be a plain directory name")


def restore(abstract_state: Any = None, *, checkpoint: Checkpoint | None = None,
            item: str = ITEM) -> Any:
    """The state saved by ``save`` in ``checkpoint`` (default: ``get_checkpoint()``), restored
    with the shapes, dtypes and shardings of ``abstract_state`` (a pytree of
    ``jax.ShapeDtypeStruct`` with ``sharding``, or of arrays); None when there is no checkpoint.
    """
    ocp = _ocp()
    if checkpoint is None:
        checkpoint = session.get_checkpoint()
    if checkpoint is None:
        return None
    args = ocp.args.StandardRestore(abstract_state) if abstract_state is not None \
        else ocp.args.StandardRestore()
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    fs = checkpoint.filesystem
    if fs is not None and _writes_straight(fs):  # Orbax reads the store itself: no download
        path = posixpath.join(checkpoint.path, item)
        if not fs.exists(path):
            raise FileNotFoundError(
                f"checkpoint {storage.url(fs, checkpoint.path)} has no Orbax item {item!r} (it "
                f"holds {sorted(posixpath.basename(p) for p in fs.ls(checkpoint.path))}); was it "
                "saved with jaxtrain.orbax.save?")
        _point_tensorstore_at_emulator()
        return checkpointer.restore(storage.url(fs, path), args=args)
    with checkpoint.as_directory() as d:
        path = os.path.join(d, item)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"checkpoint {checkpoint.path} has no Orbax item {item!r} (it holds "
                f"{sorted(os.listdir(d))}); was it saved with jaxtrain.orbax.save?")
        return checkpointer.restore(path, args=args)


def _save_to_store(ocp: Any, s: Any, state: Any, metrics: dict,
                   checkpoint_dir_name: str | None, item: str) -> None:
    """save() in a run whose hosts write to object storage themselves: Orbax writes the round's
    directory on the store from every process, then each rank describes its own files of it,
    read back from the store, and reports them as its part already in place."""
    store: Store = s.store
    rank = s.context.world_rank
    if not _writes_straight(store.fs):
        raise ValueError(
            f"jaxtrain.orbax.save(): this run keeps its checkpoints on {store.url}, where each "
            "host writes its own files, but Orbax writes straight only to gs:// (orbax-checkpoint "
            "hands tensorstore any other URL as a local path); use a gs:// storage_path, or "
            "storage that every host shares (NFS), for Orbax checkpoints (docs/orbax.md)")
    # The same name on every rank, without talking: the round's, or the one asked for.
    dir_name = store.dir_name(s.round + 1, checkpoint_dir_name)
    _point_tensorstore_at_emulator()
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    checkpointer.save(storage.url(store.fs, posixpath.join(store.root, dir_name, item)),
                      args=ocp.args.StandardSave(state))
    try:
        files = store.describe(dir_name, _store_share(store, dir_name, item, rank))
    except StoreError as e:
        if s.fail_storage is None:
            raise
        s.fail_storage(f"jaxtrain.orbax.save() on rank {rank}: the checkpoint of round "
                       f"{s.round + 1}: {e}", status_code(e.__cause__))
    if files:
        session.report_in_store(metrics, dir_name, files)
    else:  # a process that owns no shard (all replicated) has nothing to hand over
        session.report(metrics)


def _store_share(store: Store, dir_name: str, item: str, rank: int) -> list[str]:
    """This rank's files of the Orbax item just saved on the store, relative to the checkpoint:
    its own ``ocdbt.process_<rank>`` tree, and for rank 0 also every file that is no process's.
    Orbax has finished writing them on every process (rank 0 is its primary, which writes
    last)."""
    top = posixpath.join(store.root, dir_name)
    where = posixpath.join(top, item) if rank == 0 else posixpath.join(
        top, item, f"ocdbt.process_{rank}")
    store.fs.invalidate_cache(where)
    try:
        found = store.fs.find(where)
    except Exception as e:  # noqa: BLE001 - any backend's failure, named the same way
        raise StoreError(f"listing {storage.url(store.fs, where)} failed: "
                         f"{type(e).__name__}: {e}") from e
    mine = []
    for path in sorted(found):
        rel = posixpath.relpath(path, top)
        owner = _owner(posixpath.dirname(rel))
        if owner == rank or (owner is None and rank == 0):
            mine.append(rel)
    return mine


def _writes_straight(fs: Any) -> bool:
    """Whether Orbax reads and writes the object store of `fs` itself (tensorstore's gcs driver:
    gs:// URLs only)."""
    return storage.url(fs, "").startswith("gs://")


def _point_tensorstore_at_emulator() -> None:
    """Where STORAGE_EMULATOR_HOST points gcsfs (and Google's clients) at a GCS emulator,
    points tensorstore's gcs driver, which Orbax writes with, at the same server
    (TENSORSTORE_GCS_HTTP_URL), unless that is set already: both must see one store."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator and not os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = (
            emulator if "://" in emulator else f"http://{emulator}")


def _link_share(shared: str, view: str, rank: int) -> None:
    """Hard links (copies where links fail) of this rank's files of ``shared`` into ``view``."""
    shutil.rmtree(view, ignore_errors=True)
    os.makedirs(view)
    for root, _, files in os.walk(shared):
        rel = os.path.relpath(root, shared)
        owner = _owner(rel)
        if owner != rank and not (owner is None and rank == 0):
            continue
        for name in files:
            dst = os.path.join(view, rel, name)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                os.link(os.path.join(root, name), dst)
            except OSError:
                shutil.copy2(os.path.join(root, name), dst)


def _owner(rel: str) -> int | None:
    """The process whose directory ``rel`` is in, or None for shared metadata."""
    for part in rel.split(os.sep):
        m = _PROCESS_DIR.match(part)
        if m:
            return int(m.group(1))
    return None
