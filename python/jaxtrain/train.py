"""The ``ray.train``-shaped namespace: code that calls ``ray.train.report(...)`` runs unchanged
after ``import jaxtrain as ray``."""

from jaxtrain.callbacks import RunContext, UserCallback
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from jaxtrain.errors import ControllerError, TrainingFailedError, WorkerGroupError
from jaxtrain.result import Result
from jaxtrain.session import (
    CheckpointUploadMode,
    TrainContext,
    get_checkpoint,
    get_context,
    report,
)

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointUploadMode",
    "ControllerError",
    "FailureConfig",
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
    "report",
]
