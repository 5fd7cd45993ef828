"""What the training function calls: ``report`` and ``get_context``.

A worker process installs one session before it runs the training function; outside a worker
these functions raise a RuntimeError that says so.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any


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
    def __init__(self, client: Any, context: TrainContext) -> None:
        self.client = client
        self.context = context
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


def report(metrics: dict, checkpoint: Any = None, checkpoint_dir_name: str | None = None) -> None:
    """Reports one round of metrics from this worker.

    Every worker must call ``report`` the same number of times; rank 0's metrics become the
    run's (``Result.metrics``, ``result.jsonl``, ``progress.csv``). A metrics-only call does not
    wait for the controller.
    """
    session = _require("report")
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics) takes a dict; got {type(metrics).__name__}")
    if checkpoint is not None or checkpoint_dir_name is not None:
        raise NotImplementedError(
            "report(checkpoint=...) is not supported by this version of jaxtrain"
        )
    text = json.dumps(metrics, default=_to_json)
    with session.lock:
        session.round += 1
        session.client.report(session.round, text)


def get_context() -> TrainContext:
    """This worker's ranks, world size and experiment name."""
    return _require("get_context").context
