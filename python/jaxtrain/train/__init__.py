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
from jaxtrain.session import (
    CheckpointUploadMode,
    TrainContext,
    get_all_reported_checkpoints,
    get_checkpoint,
    get_context,
    get_dataset_shard,
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
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "report",
]
