"""Result: what a run produced, from its records: those the controller's outcome carries (fit()) or
those of its run directory (Result.from_path)."""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from jaxtrain import records
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.errors import ControllerError, WorkerGroupError
from jaxtrain.goodput import Goodput, compute


@dataclass(repr=False)
class Result:
    """The outcome of ``JaxTrainer.fit()``, or of a run directory (``Result.from_path``).

    ``metrics``: rank 0's last reported metrics (None if nothing was reported); ``path``: the run
    directory; ``error``: the TrainingFailedError when the run failed; ``checkpoint``: the latest
    committed checkpoint (None if none); ``best_checkpoints``: every kept checkpoint with the
    metrics of its round, in Ray's order: by the run's CheckpointConfig score with the best
    last (oldest first without a score), so ``best_checkpoints[-1]`` is the best;
    ``filesystem``: the fsspec filesystem of a run on remote storage (``path`` and the
    checkpoints' paths are then paths on it), None for a local or shared directory;
    ``return_value``: what the training function returned on rank 0 (in local mode, in the
    driver), as Ray's: None when it returned nothing, or when the run did not finish (it failed,
    was stopped, or is still running after a resume); ``goodput``: where the run's wall time
    went, for the run and each attempt (jaxtrain.goodput.Goodput, docs/observability.md; a
    running run's up to when the Result was read).
    """

    metrics: dict[str, Any] | None
    path: str
    error: BaseException | None = None
    checkpoint: Checkpoint | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    filesystem: Any = None
    return_value: Any = None
    goodput: Goodput | None = None
    _rounds: list[dict] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        """Short, as Ray's: the error's type (when there is one), metrics, path, filesystem and
        checkpoint; the goodput, return value and best checkpoints are attributes to ask for."""
        shown = {"error": type(self.error).__name__} if self.error is not None else {}
        shown.update(metrics=self.metrics, path=self.path,
                     filesystem=_filesystem_name(self.filesystem), checkpoint=self.checkpoint)
        fields = ",\n".join(f"  {name}={value!r}" for name, value in shown.items())
        return f"{type(self).__name__}(\n{fields}\n)"

    @property
    def metrics_dataframe(self):
        """One row per report round: jaxtrain's columns ``jaxtrain/round`` and ``jaxtrain/time``
        (unix seconds), then rank 0's metrics (nested keys joined with '/'), so a metric named
        ``round`` or ``time`` is a column of its own. Needs pandas."""
        import pandas as pd

        return pd.DataFrame(records.flat_rounds(self.report_rounds()))

    @classmethod
    def from_path(cls, path: str | os.PathLike, storage_filesystem: Any = None) -> Result:
        """Rebuilds the Result of a run from its directory, finished or not: a local or shared
        path, or a URL / a path on ``storage_filesystem`` (fsspec or pyarrow) for remote storage."""
        from jaxtrain import storage

        path = os.fspath(path)
        remote = storage.remote_filesystem(path, storage_filesystem, field="Result.from_path path")
        if remote is None:
            return _from_local(os.path.abspath(path.removeprefix("file://")))
        view = storage.local_view(*remote)
        try:
            return _from_local(view, remote)
        finally:
            shutil.rmtree(view, ignore_errors=True)

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The kept checkpoint whose round has the highest (``mode="max"``) or lowest
        (``mode="min"``) ``metric`` (nested keys joined with '/'), as Ray's
        ``Result.get_best_checkpoint``. None when the run kept no checkpoint; a ValueError when
        no kept checkpoint's metrics have ``metric``."""
        if mode not in ("max", "min"):
            raise ValueError(
                f"Result.get_best_checkpoint mode={mode!r} is not allowed; use 'max' or 'min'")
        if not isinstance(metric, str):
            raise ValueError(
                f"Result.get_best_checkpoint metric={metric!r} is not allowed; it must be the "
                "name of a reported metric")
        if not self.best_checkpoints:
            return None
        scored = []
        for checkpoint, metrics in self.best_checkpoints:
            value = flatten(metrics).get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                scored.append((value, checkpoint))
        if not scored:
            names = sorted({k for _, m in self.best_checkpoints for k in flatten(m)})
            raise ValueError(
                f"Result.get_best_checkpoint metric={metric!r}: no kept checkpoint has a number "
                f"for it; its rounds reported {names}")
        pick = max if mode == "max" else min
        return pick(scored, key=lambda pair: pair[0])[1]  # of equal scores, the first, as Ray

    def plot(self, path: str | os.PathLike | None = None,
             metrics: list[str] | None = None) -> str:
        """Draws the reported metrics against the round as a PNG (needs matplotlib:
        ``pip install 'jaxtrain[plot]'``) and returns its path, ``<run>/metrics.png`` by
        default. ``metrics``: the metric names to draw (nested keys joined with '/'); default
        every numeric metric."""
        from jaxtrain.driver.plot import plot_metrics

        if path is None:
            if self.filesystem is not None:
                raise ValueError(
                    "Result.plot(path=None): the run is on remote storage; give a local path")
            path = os.path.join(self.path, "metrics.png")
        return plot_metrics(self.metrics_dataframe, os.fspath(path), metrics=metrics,
                            title=os.path.basename(self.path.rstrip("/")))

    def report_rounds(self) -> list[dict]:
        """The run's report rounds as result.jsonl records them: one ``{"round", "time",
        "metrics"}`` dict per round (rank 0's metrics), oldest first."""
        if self._rounds is None:
            self._rounds = records.read_rounds(self.path)
        return self._rounds


def _filesystem_name(fs: Any) -> str:
    """'local' for a local or shared run directory, else the filesystem's kind ('s3', 'gcs')."""
    if fs is None:
        return "local"
    name = getattr(fs, "type_name", None)  # pyarrow
    if name is None:
        protocol = getattr(fs, "protocol", None)  # fsspec: a name or a tuple of names
        name = protocol[0] if isinstance(protocol, (tuple, list)) and protocol else protocol
    return str(name or type(fs).__name__)


def _from_local(path: str, remote: tuple[Any, str] | None = None) -> Result:
    if not records.is_run_dir(path):
        raise FileNotFoundError(f"'{path}' is not a jaxtrain run directory: it has no run.json")
    state = records.read_state(path)
    error = None
    if state.get("status") == "ERRORED":
        failed = records.failed_attempts(state)
        if failed:
            f = failed[0]["failure"]
            logs = remote[1] if remote else path
            last = failed[-1]["failure"]
            kind = ControllerError if last.get("cause") == "start-up" else WorkerGroupError
            error = kind(
                f"Training failed: rank {f['rank']} (host {f['host'] or '?'}, attempt "
                f"{failed[0]['attempt']}): {f['message']}",
                rank=f["rank"], host=f["host"], attempt=failed[0]["attempt"],
                cause=f["cause"], exit_code=f.get("exit_code"), signal=f.get("signal"),
                status_code=f.get("status_code"),
                log_path=os.path.join(logs, "logs", f"rank-{f['rank']}.log"),
            )
    finished = state.get("status") == "FINISHED"
    return load(path, state, state.get("config", {}).get("checkpoint_config"), error,
                _read_pickled(path) if finished and error is None else None, remote,
                finished=finished)


def _read_pickled(path: str) -> bytes | None:
    """Rank 0's pickled return value in the run directory `path` (records.RETURN_VALUE_FILE);
    None without one."""
    try:
        with open(os.path.join(path, records.RETURN_VALUE_FILE), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _unpickle(data: bytes, path: str) -> Any:
    """Rank 0's return value `data` of the run directory `path`, unpickled. Raises ValueError
    when this Python cannot unpickle it."""
    import cloudpickle

    try:
        return cloudpickle.loads(data)
    except Exception as e:
        file = os.path.join(path, records.RETURN_VALUE_FILE)
        raise ValueError(
            f"Result.return_value: the training function's return value in '{file}' cannot be "
            f"unpickled in this Python ({type(e).__name__}: {e}); the driver needs the modules "
            "its type comes from") from e


def load(path: str, state: dict | None, checkpoint_config: dict | None,
         error: BaseException | None, pickled: bytes | None = None,
         remote: tuple[Any, str] | None = None, finished: bool = False) -> Result:
    """The Result of the run directory `path`, from its records: `state` is its run.json (None:
    none could be read, so no goodput) and `pickled` rank 0's pickled return value (None: none),
    as the controller's outcome carries them (fit()) or as read from `path`
    (Result.from_path); the rounds and checkpoints are read from `path`. With `remote`
    (filesystem, run directory), `path` is a local copy of that remote run directory, and the
    Result names the remote one. `finished`: the run ended FINISHED, so its return value is the
    Result's."""
    from jaxtrain import _core

    return_value = (_unpickle(pickled, path)
                    if finished and error is None and pickled is not None else None)
    if remote is None:  # the rounds stay in `path`: read when asked (Result.report_rounds)
        rounds = None
        marks, last = records.round_marks(path)
    else:  # `path` is a copy that goes away: read now
        rounds = marks = records.read_rounds(path)
        last = rounds[-1] if rounds else None
    goodput = compute(state, marks, now=time.time()) if state is not None else None
    cc = checkpoint_config or {}
    ranked = _core.ranked_checkpoints(
        path, cc.get("checkpoint_score_attribute"), cc.get("checkpoint_score_order", "max") == "max"
    )
    # The core ranks best first; Ray's checkpoint manager keeps the best last.
    best = [(Checkpoint(os.path.join(path, name)), json.loads(m)) for name, m in reversed(ranked)]
    latest = None
    index = records.read_index(path)
    if index is not None:
        name = index.get("latest")
        # The index is rewritten atomically before any deletion; trust only what still exists.
        if name and any(c.path == os.path.join(path, name) for c, _ in best):
            latest = Checkpoint(os.path.join(path, name))
    filesystem = None
    if remote is not None:
        filesystem, root = remote

        def rebase(c: Checkpoint) -> Checkpoint:
            return Checkpoint(posixpath.join(root, os.path.basename(c.path)), filesystem)

        best = [(rebase(c), m) for c, m in best]
        latest = rebase(latest) if latest is not None else None
        path = root
    return Result(
        metrics=last.get("metrics") if isinstance(last, dict) else None,
        path=path,
        error=error,
        checkpoint=latest,
        best_checkpoints=best,
        filesystem=filesystem,
        return_value=return_value,
        goodput=goodput,
        _rounds=rounds,
    )


def flatten(metrics: Any, prefix: str = "") -> dict[str, Any]:
    """Nested metrics as one level, keys joined with '/'."""
    if not isinstance(metrics, dict):
        return {prefix: metrics} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat
