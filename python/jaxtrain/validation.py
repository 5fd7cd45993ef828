"""Asynchronous validation of committed checkpoints, and the run's reported checkpoints, as Ray
Train V2 names them: ``ValidationConfig``, ``ValidationTaskConfig``, ``report(validation=...)``,
``get_all_reported_checkpoints``, ``ReportedCheckpoint``, ``CheckpointConsistencyMode`` and
``ReportedCheckpointStatus`` (docs/checkpoints.md).

The run directory holds what they share (storage/checkpoint.h draws the layout):

* ``validation-requests/<round>.json`` — written by rank 0 of a ``report(checkpoint=...,
  validation=...)`` before the report is sent: ``{"round", "fn_kwargs"}``. A request exists
  before its checkpoint commits, so retention (in the controller) never deletes a checkpoint whose
  validation is still to run.
* ``validation.json`` — written by the driver's Validator only: ``{"version": 1, "checkpoints":
  {dir_name: {"round", "status" ("validated" or "failed"), "metrics", "error"}}}``. Its metrics
  replace the reported ones of the same name wherever a checkpoint's metrics are read (Result,
  retention, get_all_reported_checkpoints).

The validation function runs in a process of its own on the driver's host (``python -m
jaxtrain.validation``), one checkpoint at a time, while training goes on.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaxtrain.checkpoint import Checkpoint

RECORD_NAME = "validation.json"
REQUESTS_DIR = "validation-requests"
# How often a worker waiting for validations, and the driver's Validator, look at the run dir.
_POLL_S = 0.1


class CheckpointConsistencyMode(enum.Enum):
    """Read semantics of ``get_all_reported_checkpoints`` during a run (Ray's names).

    COMMITTED: returns once the checkpoints of this rank's reports so far have committed.
    VALIDATED: also waits until their validations have ended."""

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(enum.Enum):
    """COMMITTED: saved, no validation requested. PENDING_VALIDATION: saved, its validation
    still to end. VALIDATED: saved and its validation ended (``validation_error`` says when it
    failed)."""

    COMMITTED = "COMMITTED"
    PENDING_VALIDATION = "PENDING_VALIDATION"
    VALIDATED = "VALIDATED"


@dataclass
class ReportedCheckpoint:
    """A committed checkpoint and its metrics: rank 0's reported metrics, with what its
    validation returned merged in. ``status`` and ``validation_error`` are jaxtrain's."""

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED
    validation_error: str | None = None


class ValidationFn(Protocol):
    """A function that validates a checkpoint: ``fn(checkpoint, **fn_kwargs) -> dict``."""

    def __call__(self, checkpoint: Checkpoint, **kwargs: Any) -> dict[str, Any]: ...


@dataclass
class ValidationTaskConfig:
    """Per-report options of a validation: ``fn_kwargs`` (JSON-serialisable) are passed to the
    validation function after the checkpoint; they override the trainer's ValidationConfig's."""

    fn_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_kwargs(self.fn_kwargs, "ValidationTaskConfig.fn_kwargs")


@dataclass
class ValidationConfig:
    """The validation function of a trainer (``JaxTrainer(validation_config=...)``): ``fn(
    checkpoint, **fn_kwargs)`` returns a dict of metrics, merged into the checkpoint's.
    ``task_config``: the default ValidationTaskConfig. ``ray_remote_kwargs``: Ray's placement of
    the task; jaxtrain runs it in a process on the driver's host, so only None or {} is taken.
    ``timeout_s`` (jaxtrain's): a validation running longer is stopped and recorded as failed."""

    fn: Callable[..., dict[str, Any]]
    task_config: ValidationTaskConfig | None = None
    ray_remote_kwargs: dict[str, Any] | None = None
    timeout_s: float | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"ValidationConfig.fn={self.fn!r} is not allowed; pass the function "
                             "that validates a checkpoint: fn(checkpoint, **fn_kwargs) -> dict")
        if self.task_config is not None and not isinstance(self.task_config,
                                                           ValidationTaskConfig):
            raise ValueError(f"ValidationConfig.task_config={self.task_config!r} is not allowed; "
                             "pass a jaxtrain.ValidationTaskConfig or None")
        if self.ray_remote_kwargs:
            raise ValueError(
                f"ValidationConfig.ray_remote_kwargs={self.ray_remote_kwargs!r} is not allowed: "
                "jaxtrain runs the validation in a process on the driver's host, with no Ray "
                "task to place; leave it None")
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not isinstance(
                self.timeout_s, (int, float)) or not self.timeout_s > 0):
            raise ValueError(f"ValidationConfig.timeout_s={self.timeout_s!r} is not allowed; use "
                             "a number of seconds > 0, or None (no limit)")


def _check_kwargs(kwargs: Any, where: str) -> None:
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"{where}={kwargs!r} is not allowed; pass a dict of keyword arguments")
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}={kwargs!r} is not allowed: it must be JSON-serialisable "
                         f"({e}); create other objects in the validation function") from None


# --- the workers' side -------------------------------------------------------------------------


def request_path(run_dir: str, round_: int) -> str:
    return os.path.join(run_dir, REQUESTS_DIR, f"{round_}.json")


def write_request(run_dir: str, round_: int, validation: Any) -> None:
    """Rank 0's record that round `round_` asks for validation (`validation` True or a
    ValidationTaskConfig), or, when it does not, the removal of a request an earlier attempt left
    for the same round. Written atomically before the round's report is sent."""
    path = request_path(run_dir, round_)
    if not validation:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    kwargs = validation.fn_kwargs if isinstance(validation, ValidationTaskConfig) else None
    _write_json(path, {"round": round_, "fn_kwargs": kwargs})


def check_validation_arg(validation: Any, configured: bool) -> None:
    """report(validation=...) as Ray takes it: a bool or a ValidationTaskConfig, and only in a
    run whose trainer has a validation_config."""
    if validation is False or validation is None:
        return
    if validation is not True and not isinstance(validation, ValidationTaskConfig):
        raise TypeError(f"report(validation={validation!r}) takes True, False or a "
                        "jaxtrain.ValidationTaskConfig")
    if not configured:
        raise ValueError(f"report(validation={validation!r}) needs a validation function: pass "
                         "JaxTrainer(validation_config=jaxtrain.ValidationConfig(fn=...))")


def read_record(run_dir: str) -> dict[str, dict]:
    """validation.json's outcomes by checkpoint name ({} when there is none yet)."""
    try:
        with open(os.path.join(run_dir, RECORD_NAME), encoding="utf-8") as f:
            record = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    checkpoints = record.get("checkpoints") if isinstance(record, dict) else None
    return checkpoints if isinstance(checkpoints, dict) else {}


def reported_checkpoints(run_dir: str) -> list[ReportedCheckpoint]:
    """The run's committed checkpoints still kept, oldest first, with their merged metrics and
    the status of their validations."""
    from jaxtrain import _core

    outcomes = read_record(run_dir)
    out = []
    # Without a score attribute the core ranks newest first; its metrics are merged already.
    for name, metrics_json in reversed(_core.ranked_checkpoints(run_dir, None, True)):
        metrics = json.loads(metrics_json)
        with open(os.path.join(run_dir, name, ".jaxtrain_manifest.json"), encoding="utf-8") as f:
            round_ = json.load(f).get("round")
        outcome = outcomes.get(name)
        status, error = ReportedCheckpointStatus.COMMITTED, None
        if isinstance(outcome, dict) and outcome.get("round") == round_:
            status, error = ReportedCheckpointStatus.VALIDATED, outcome.get("error")
        elif os.path.exists(request_path(run_dir, round_)):
            status = ReportedCheckpointStatus.PENDING_VALIDATION
        out.append(ReportedCheckpoint(Checkpoint(os.path.join(run_dir, name)), metrics, status,
                                      error))
    return out


def wait_validated(run_dir: str) -> list[ReportedCheckpoint]:
    """reported_checkpoints() once none of them is pending validation."""
    while True:
        reported = reported_checkpoints(run_dir)
        if all(r.status is not ReportedCheckpointStatus.PENDING_VALIDATION for r in reported):
            return reported
        time.sleep(_POLL_S)


# --- the driver's side -------------------------------------------------------------------------


class Validator:
    """Runs the validations a run's checkpoints ask for, on the driver's host, while fit() waits.

    One thread looks for committed checkpoints with a request and no outcome (those of an earlier
    driver of the run too), and runs the validation function on each in a process of its own, one
    at a time, oldest first; it records each outcome in validation.json. A validation that raises,
    crashes or passes ``timeout_s`` is said on stderr and recorded as failed; the run goes on."""

    def __init__(self, config: ValidationConfig, run_dir: str) -> None:
        import cloudpickle

        self._config = config
        self._run_dir = run_dir
        self._fn = cloudpickle.dumps(config.fn)  # refused at fit(), before anything starts
        self._outcomes = read_record(run_dir)
        self._stop = threading.Event()
        self._ending = threading.Event()
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="jaxtrain-validator",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        """Returns once every committed checkpoint's requested validation has ended; says in the
        log how many it waits for."""
        waiting = len(self._todo())
        if waiting:
            sys.stderr.write(f"jaxtrain: training has ended; waiting for {waiting} pending "
                             f"validation{'s' if waiting > 1 else ''} of checkpoints\n")
            sys.stderr.flush()
        self._ending.set()
        self._thread.join()

    def stop(self) -> None:
        """Ends the validation running (the driver was interrupted) and the thread."""
        self._stop.set()
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                self._process.kill()
        self._thread.join()

    def _todo(self) -> list[tuple[str, int]]:
        """(dir_name, round) of the committed checkpoints whose requested validation has not
        ended, oldest first."""
        try:
            index_path = os.path.join(self._run_dir, "checkpoints.json")
            with open(index_path, encoding="utf-8") as f:
                records = json.load(f).get("checkpoints", [])
        except (FileNotFoundError, json.JSONDecodeError):
            return []
        todo = []
        for r in records:
            name, round_ = r.get("dir_name"), r.get("round")
            outcome = self._outcomes.get(name)
            if isinstance(outcome, dict) and outcome.get("round") == round_:
                continue
            if os.path.exists(request_path(self._run_dir, round_)):
                todo.append((name, round_))
        return todo

    def _loop(self) -> None:
        while not self._stop.is_set():
            ending = self._ending.is_set()  # read before the scan: nothing commits after it
            todo = self._todo()
            if not todo:
                if ending:
                    return
                time.sleep(_POLL_S)
                continue
            name, round_ = todo[0]
            self._validate(name, round_)

    def _validate(self, name: str, round_: int) -> None:
        with open(request_path(self._run_dir, round_), encoding="utf-8") as f:
            request = json.load(f)
        kwargs = dict((self._config.task_config or ValidationTaskConfig()).fn_kwargs or {})
        kwargs.update(request.get("fn_kwargs") or {})
        began = time.monotonic()
        metrics, error = self._run(os.path.join(self._run_dir, name), kwargs)
        if self._stop.is_set():
            return  # interrupted: the next driver of the run validates it again
        outcome: dict[str, Any] = {"round": round_}
        if error is None:
            outcome.update(status="validated", metrics=metrics)
            sys.stderr.write(f"jaxtrain: validated {name} in {time.monotonic() - began:.1f} s: "
                             f"{json.dumps(metrics)}\n")
        else:
            outcome.update(status="failed", error=error)
            sys.stderr.write(f"jaxtrain: the validation of {name} failed (the run goes on; "
                             f"recorded in {RECORD_NAME}): {error.splitlines()[-1]}\n")
        sys.stderr.flush()
        self._outcomes[name] = outcome
        _write_json(os.path.join(self._run_dir, RECORD_NAME),
                    {"version": 1, "checkpoints": self._outcomes})

    def _run(self, path: str, kwargs: dict) -> tuple[dict | None, str | None]:
        """Runs the function on the checkpoint at `path` in a process of its own: its metrics, or
        None and why it failed."""
        with tempfile.TemporaryDirectory(prefix="jaxtrain-validation-") as tmp:
            task, result = os.path.join(tmp, "task.pkl"), os.path.join(tmp, "result.json")
            with open(task, "wb") as f:
                f.write(self._fn)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
            argv = [sys.executable, "-m", "jaxtrain.validation", task, path, json.dumps(kwargs),
                    result]
            with self._lock:
                if self._stop.is_set():
                    return None, "interrupted"
                self._process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
            try:
                code = self._process.wait(timeout=self._config.timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
                return None, (f"TimeoutError: it ran longer than ValidationConfig.timeout_s="
                              f"{self._config.timeout_s} s and was stopped")
            try:
                with open(result, encoding="utf-8") as f:
                    outcome = json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
                return None, f"its process {how} before it returned metrics"
            return outcome.get("metrics"), outcome.get("error")


def _write_json(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _main(argv: list[str]) -> None:
    """The validation process: runs the pickled function on one checkpoint and writes {"metrics"}
    or {"error": traceback} as JSON."""
    import cloudpickle

    from jaxtrain.session import _to_json

    task, path, kwargs, result = argv
    try:
        with open(task, "rb") as f:
            fn = cloudpickle.loads(f.read())
        metrics = fn(Checkpoint(path), **json.loads(kwargs))
        if not isinstance(metrics, dict):
            raise TypeError(f"the validation function returned {type(metrics).__name__}, not a "
                            "dict of metrics")
        outcome = {"metrics": json.loads(json.dumps(metrics, default=_to_json))}
    except BaseException:
        outcome = {"error": traceback.format_exc()}
        sys.stderr.write(outcome["error"])
    _write_json(result, outcome)


if __name__ == "__main__":
    _main(sys.argv[1:])
