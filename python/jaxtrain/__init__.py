"""jaxtrain: distributed JAX training on a C++ engine.

    from jaxtrain import JaxTrainer, ScalingConfig, RunConfig, report

The package never imports ``jax`` on the driver: only the worker processes do.
"""

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
