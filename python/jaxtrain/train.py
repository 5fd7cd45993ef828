"""The ``ray.train``-shaped namespace: code that calls ``ray.train.report(...)`` runs unchanged
after ``import jaxtrain as ray``."""

from jaxtrain.checkpoint import Checkpoint
from jaxtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from jaxtrain.errors import TrainingFailedError
from jaxtrain.result import Result
from jaxtrain.session import TrainContext, get_checkpoint, get_context, report

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "TrainingFailedError",
    "get_checkpoint",
    "get_context",
    "report",
]
