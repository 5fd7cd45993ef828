"""The ``ray.train``-shaped namespace: code that calls ``ray.train.report(...)`` runs unchanged
after ``import jaxtrain as ray``."""

from jaxtrain.callbacks import RunContext, UserCallback
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from jaxtrain.errors import (
    ControllerError,
    PreemptionError,
    TrainingFailedError,
    WorkerGroupError,
)
from jaxtrain.preemption import PreemptionInfo, get_preemption_info
from jaxtrain.result import Result
from jaxtrain.session import TrainContext, get_checkpoint, get_context, report

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "ControllerError",
    "FailureConfig",
    "PreemptionError",
    "PreemptionInfo",
    "Result",
    "RunConfig",
    "RunContext",
    "ScalingConfig",
    "TrainContext",
    "TrainingFailedError",
    "UserCallback",
    "WorkerGroupError",
    "get_checkpoint",
    "get_context",
    "get_preemption_info",
    "report",
]
