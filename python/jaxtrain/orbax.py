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

Needs ``orbax-checkpoint`` (``pip install 'jaxtrain[orbax]'``). On several hosts the run
directory must be shared (NFS), as for any multi-host run.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

from jaxtrain import session
from jaxtrain.checkpoint import Checkpoint

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
    s = session._require("orbax.save")
    ctx = s.context
    if not isinstance(item, str) or not item or "/" in item or item.startswith("."):
        raise ValueError(f"item={item!r} is not allowed; it must be a plain directory name")
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
    with checkpoint.as_directory() as d:
        path = os.path.join(d, item)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"checkpoint {checkpoint.path} has no Orbax item {item!r} (it holds "
                f"{sorted(os.listdir(d))}); was it saved with jaxtrain.orbax.save?")
        checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        args = ocp.args.StandardRestore(abstract_state) if abstract_state is not None \
            else ocp.args.StandardRestore()
        return checkpointer.restore(path, args=args)


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
