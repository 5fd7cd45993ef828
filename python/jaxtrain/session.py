"""What the training function calls: ``report``, ``get_context`` and ``get_checkpoint``.

A worker process installs one session before it runs the training function; outside a worker
these functions raise a RuntimeError that says so.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from jaxtrain.checkpoint import Checkpoint


@dataclass(frozen=True)
class TrainContext:
    """The position of this worker in the run (names as in Ray Train)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    attempt: int
    run_dir: str

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_attempt(self) -> int:
        """How many times the worker group has been restarted before this one (0 at first)."""
        return self.attempt


class _Session:
    def __init__(self, client: Any, context: TrainContext, checkpoint: Checkpoint | None):
        self.client = client
        self.context = context
        self.checkpoint = checkpoint  # the committed checkpoint this attempt started from
        self.round = 0
        self.lock = threading.Lock()


_session: _Session | None = None


def _install(session: _Session | None) -> None:
    global _session
    _session = session


def _require(what: str) -> _Session:
    if _session is None:
        raise RuntimeError(
            f"jaxtrain.{what}() works only inside the training function that "
            "JaxTrainer.fit() runs on its workers"
        )
    return _session


def _to_json(value: Any) -> Any:
    # numpy and JAX scalars and arrays, which training code reports all the time.
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(
        f"report() metrics must be JSON-serialisable; a value of type "
        f"{type(value).__name__} is not (convert it with float(), int() or str())"
    )


def report(
    metrics: dict,
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
) -> None:
    """Reports one round of metrics from this worker, and optionally its part of a checkpoint.

    Every worker must call ``report`` the same number of times; rank 0's metrics become the
    run's (``Result.metrics``, ``result.jsonl``, ``progress.csv``). A metrics-only call does not
    wait for the controller. With ``checkpoint``, this rank's files are copied before ``report``
    returns, so the directory may be changed or deleted right after; when every rank has reported
    the round, the controller commits the files of all the ranks that passed a checkpoint together
    as one checkpoint, named ``checkpoint_dir_name`` or ``checkpoint_<round>``, in the background
    (fsync, manifest, atomic rename) while training goes on. At most one commit is in flight: a
    ``report`` with a checkpoint first waits until the commit of this rank's previous one has
    ended. Ranks must write different file names into one checkpoint.
    """
    session = _require("report")
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics) takes a dict; got {type(metrics).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(
            f"report(checkpoint=...) takes a jaxtrain.Checkpoint; got {type(checkpoint).__name__} "
            "(use Checkpoint.from_directory(path))"
        )
    if checkpoint_dir_name is not None and not isinstance(checkpoint_dir_name, str):
        raise TypeError(f"report(checkpoint_dir_name={checkpoint_dir_name!r}) takes a string")
    text = json.dumps(metrics, default=_to_json)
    with session.lock:
        session.round += 1
        if checkpoint is None:
            session.client.report(session.round, text)
            return
        from jaxtrain import _core

        ctx = session.context
        staging = os.path.join(
            ctx.run_dir, ".staging", f"a{ctx.attempt}-r{session.round}-rank{ctx.world_rank}"
        )
        # Back-pressure: the previous checkpoint's commit ends before this one is copied.
        session.client.wait_checkpoints_settled()
        try:
            files = _core.stage_directory(checkpoint.path, staging, durable=False)
        except (FileNotFoundError, ValueError, PermissionError) as e:
            raise type(e)(f"report(checkpoint=...) on rank {ctx.world_rank}: {e}") from None
        description = {"staging": staging, "files": files, "dir_name": checkpoint_dir_name}
        session.client.report_checkpoint(session.round, json.dumps(description), text)


def get_checkpoint() -> Checkpoint | None:
    """The latest committed checkpoint of this run when this worker group started (after a
    restart, or when a run is resumed by name), or None."""
    return _require("get_checkpoint").checkpoint


def get_context() -> TrainContext:
    """This worker's ranks, world size and experiment name."""
    return _require("get_context").context
