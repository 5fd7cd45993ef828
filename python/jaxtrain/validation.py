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

The validation function runs in a process of its own, one checkpoint at a time, while training
goes on: the driver places and runs it (jaxtrain.driver.validator).
"""

from __future__ import annotations

import enum
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaxtrain.checkpoint import Checkpoint

RECORD_NAME = "validation.json"
REQUESTS_DIR = "validation-requests"
# How often a worker waiting for validations, and the driver's Validator, look at the run dir.
POLL_S = 0.1


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
    the task, as far as it applies without a Ray cluster: ``num_cpus``, ``num_gpus`` (whole GPUs,
    given by CUDA_VISIBLE_DEVICES) and ``memory`` (bytes) that the host must have, and
    ``label_selector`` (the first host of the run's hostfile whose labels match); ``resources``
    only empty; any other key is refused naming it. ``host`` (jaxtrain's): a host of the run's
    ssh hosts to run it on (default: the driver's host). ``timeout_s`` (jaxtrain's): a
    validation running longer is stopped and recorded as failed."""

    fn: Callable[..., dict[str, Any]]
    task_config: ValidationTaskConfig | None = None
    ray_remote_kwargs: dict[str, Any] | None = None
    timeout_s: float | None = field(default=None, kw_only=True)
    host: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"ValidationConfig.fn={self.fn!r} is not allowed; pass the function "
                             "that validates a checkpoint: fn(checkpoint, **fn_kwargs) -> dict")
        if self.task_config is not None and not isinstance(self.task_config,
                                                           ValidationTaskConfig):
            raise ValueError(f"ValidationConfig.task_config={self.task_config!r} is not allowed; "
                             "pass a jaxtrain.ValidationTaskConfig or None")
        _check_remote_kwargs(self.ray_remote_kwargs)
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not isinstance(
                self.timeout_s, (int, float)) or not self.timeout_s > 0):
            raise ValueError(f"ValidationConfig.timeout_s={self.timeout_s!r} is not allowed; use "
                             "a number of seconds > 0, or None (no limit)")
        if self.host is not None and (not isinstance(self.host, str) or not self.host.strip()):
            raise ValueError(f"ValidationConfig.host={self.host!r} is not allowed; name a host "
                             "of the run's ssh hosts, or leave it None (the driver's host)")
        if self.host is not None and (self.ray_remote_kwargs or {}).get("label_selector"):
            raise ValueError(
                f"ValidationConfig(host={self.host!r}, ray_remote_kwargs={{'label_selector': "
                f"{self.ray_remote_kwargs['label_selector']!r}}}) names the host twice; give one")


# Ray's ray.remote() options that have no meaning without a Ray cluster, and why.
_NO_RAY_TASK = {
    "resources": "jaxtrain's hosts have no custom resources; name the host with "
                 "ValidationConfig(host=...) or ray_remote_kwargs['label_selector']",
    "accelerator_type": "jaxtrain does not place by accelerator type; name a host that has it "
                        "with ValidationConfig(host=...) or ray_remote_kwargs['label_selector']",
    "scheduling_strategy": "there are no Ray nodes or placement groups; name the host with "
                           "ValidationConfig(host=...) or ray_remote_kwargs['label_selector']",
    "runtime_env": "the validation process runs with the driver's Python and sys.path (on "
                   "another host, the variables the ssh launcher passes: JAXTRAIN_SSH_ENV)",
    "max_retries": "a validation runs once; a failed one is recorded on its checkpoint",
    "retry_exceptions": "a validation runs once; a failed one is recorded on its checkpoint",
}
_PLACEMENT_KEYS = ("num_cpus", "num_gpus", "memory", "label_selector")


def _check_remote_kwargs(kwargs: Any) -> None:
    """ValidationConfig.ray_remote_kwargs: the keys jaxtrain maps, each checked; anything else
    refused naming the key."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ValueError(f"ValidationConfig.ray_remote_kwargs={kwargs!r} is not allowed; pass a "
                         f"dict with keys among {', '.join(_PLACEMENT_KEYS)}, or None")
    for key, value in kwargs.items():
        where = f"ValidationConfig.ray_remote_kwargs[{key!r}]={value!r}"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in ("num_cpus", "memory"):
            if not number or value < 0:
                raise ValueError(f"{where} is not allowed; use a number >= 0 ("
                                 f"{'CPUs' if key == 'num_cpus' else 'bytes'} the host must have)")
        elif key == "num_gpus":
            if not number or value < 0 or value != int(value):
                raise ValueError(f"{where} is not allowed; use a whole number of GPUs >= 0 (a "
                                 "validation gets whole GPUs through CUDA_VISIBLE_DEVICES)")
        elif key == "label_selector":
            from jaxtrain.labels import check_one_selector

            check_one_selector("ValidationConfig.ray_remote_kwargs['label_selector']", value,
                                "it must be a dict of label -> value such as {'role': 'eval'}")
        elif key == "resources" and value in ({}, None):
            continue
        else:
            why = _NO_RAY_TASK.get(key, "it is an option of a Ray task, and jaxtrain runs a "
                                        "process, not a Ray task")
            raise ValueError(f"{where} is not allowed: {why}. jaxtrain takes "
                             f"{', '.join(_PLACEMENT_KEYS)}")


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
    write_json(path, {"round": round_, "fn_kwargs": kwargs})


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
        time.sleep(POLL_S)

def write_json(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
