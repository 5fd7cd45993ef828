"""jaxtrain: distributed JAX training on a C++ engine.

    from jaxtrain import JaxTrainer, ScalingConfig, RunConfig, report

The package never imports ``jax`` on the driver: only the worker processes do.

The public names below are imported on first use (PEP 562), so that a process imports only the
side it runs: a worker's ``import jaxtrain`` (``python -m jaxtrain.worker``) loads neither the
driver (``jaxtrain.driver``) nor cloudpickle until it asks for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from jaxtrain import collective, train
    from jaxtrain.callbacks import RunContext, UserCallback
    from jaxtrain.checkpoint import Checkpoint
    from jaxtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from jaxtrain.driver.trainer import JaxTrainer
    from jaxtrain.errors import (
        ControllerError,
        PreemptionError,
        TrainingFailedError,
        WorkerGroupError,
    )
    from jaxtrain.preemption import PreemptionInfo, get_preemption_info, on_preemption
    from jaxtrain.result import Result
    from jaxtrain.session import (
        CheckpointUploadMode,
        TrainContext,
        get_all_reported_checkpoints,
        get_checkpoint,
        get_context,
        report,
    )
    from jaxtrain.validation import (
        CheckpointConsistencyMode,
        ReportedCheckpoint,
        ReportedCheckpointStatus,
        ValidationConfig,
        ValidationFn,
        ValidationTaskConfig,
    )

# Each public name of __all__ (below) and the module that defines it.
_HOMES = {
    "Checkpoint": "jaxtrain.checkpoint",
    "CheckpointConfig": "jaxtrain.config",
    "CheckpointConsistencyMode": "jaxtrain.validation",
    "CheckpointUploadMode": "jaxtrain.session",
    "ControllerError": "jaxtrain.errors",
    "FailureConfig": "jaxtrain.config",
    "PreemptionError": "jaxtrain.errors",
    "PreemptionInfo": "jaxtrain.preemption",
    "JaxTrainer": "jaxtrain.driver.trainer",
    "ReportedCheckpoint": "jaxtrain.validation",
    "ReportedCheckpointStatus": "jaxtrain.validation",
    "Result": "jaxtrain.result",
    "RunConfig": "jaxtrain.config",
    "RunContext": "jaxtrain.callbacks",
    "ScalingConfig": "jaxtrain.config",
    "TrainContext": "jaxtrain.session",
    "TrainingFailedError": "jaxtrain.errors",
    "UserCallback": "jaxtrain.callbacks",
    "ValidationConfig": "jaxtrain.validation",
    "ValidationFn": "jaxtrain.validation",
    "ValidationTaskConfig": "jaxtrain.validation",
    "WorkerGroupError": "jaxtrain.errors",
    "get_all_reported_checkpoints": "jaxtrain.session",
    "get_checkpoint": "jaxtrain.session",
    "get_context": "jaxtrain.session",
    "get_preemption_info": "jaxtrain.preemption",
    "on_preemption": "jaxtrain.preemption",
    "report": "jaxtrain.session",
}
_SUBMODULES = ("collective", "train")

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ControllerError",
    "FailureConfig",
    "PreemptionError",
    "PreemptionInfo",
    "JaxTrainer",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "Result",
    "RunConfig",
    "RunContext",
    "ScalingConfig",
    "TrainContext",
    "TrainingFailedError",
    "UserCallback",
    "ValidationConfig",
    "ValidationFn",
    "ValidationTaskConfig",
    "WorkerGroupError",
    "collective",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_preemption_info",
    "on_preemption",
    "report",
    "train",
]
__version__ = "0.1.0"

# Ray's init/is_initialized/shutdown, for code that calls them after ``import jaxtrain as ray``
# (Ray's own JaxTrainer example does): jaxtrain has no cluster to connect to, so they do nothing
# but keep the state is_initialized() reports. Not in __all__: a star import must not bring an
# `init` or a `shutdown` into the user's namespace.
_RAY_NAMES = ("init", "is_initialized", "shutdown")
_initialized = False


def init(*args: Any, **kwargs: Any) -> None:
    """Ray's ``ray.init()``: does nothing, since jaxtrain needs no cluster (every argument is
    accepted and ignored), except ``runtime_env``, which is refused with where it goes instead:
    ``RunConfig(worker_runtime_env=...)``."""
    global _initialized
    if kwargs.get("runtime_env") is not None:
        raise ValueError(
            f"jaxtrain.init(runtime_env={kwargs['runtime_env']!r}) is not supported: jaxtrain "
            "has no Ray cluster; give the workers' environment as "
            "RunConfig(worker_runtime_env=...) (docs/ray-differences.md)")
    _initialized = True


def is_initialized() -> bool:
    """Ray's ``ray.is_initialized()``: whether ``init()`` was called, and ``shutdown()`` not
    since."""
    return _initialized


def shutdown(*args: Any, **kwargs: Any) -> None:
    """Ray's ``ray.shutdown()``: makes ``is_initialized()`` False, and ends at once the standby
    workers that earlier ``fit()`` calls left for a next one (docs/warm-workers.md); a run's own
    workers end with its ``fit()``."""
    global _initialized
    from jaxtrain import _core

    _core.end_idle_standbys()
    _initialized = False


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"jaxtrain.{name}")
    else:
        raise AttributeError(f"module 'jaxtrain' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return [*__all__, *_RAY_NAMES, "__version__"]
