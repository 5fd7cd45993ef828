"""jaxtrain: distributed JAX training on a C++ engine.

    from jaxtrain import JaxTrainer, ScalingConfig, RunConfig, report

The package never imports ``jax`` on the driver: only the worker processes do.
"""

from jaxtrain import train
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
from jaxtrain.trainer import JaxTrainer

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointUploadMode",
    "ControllerError",
    "FailureConfig",
    "JaxTrainer",
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
    "train",
]
__version__ = "0.1.0"
