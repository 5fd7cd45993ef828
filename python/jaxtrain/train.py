"""The ``ray.train``-shaped namespace: code that calls ``ray.train.report(...)`` runs unchanged
after ``import jaxtrain as ray``."""

from jaxtrain.config import RunConfig, ScalingConfig
from jaxtrain.errors import TrainingFailedError
from jaxtrain.result import Result
from jaxtrain.session import TrainContext, get_context, report

__all__ = [
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "TrainingFailedError",
    "get_context",
    "report",
]
