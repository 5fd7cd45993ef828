"""Built-in logger callbacks for ``RunConfig(callbacks=[...])``. Each writes rank 0's numeric
metrics (nested keys joined with '/') once per report round, from the driver, with its library
installed as an extra: ``pip install 'jaxtrain[tensorboard]'``.

The step of a point is the report round (it keeps counting across restarts and resumed runs), or
the value of the metric named by ``step_metric``.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

from jaxtrain.callbacks import RunContext, UserCallback
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.result import _flatten


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric values of ``metrics``, nested keys joined with '/' (booleans left out)."""
    return {k: float(v) for k, v in _flatten(metrics).items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool)}


class _MetricsLogger(UserCallback):
    def __init__(self, step_metric: str | None) -> None:
        if step_metric is not None and not isinstance(step_metric, str):
            raise ValueError(f"{type(self).__name__}(step_metric={step_metric!r}) is not "
                             "allowed; it must be the name of a reported metric, or None")
        self.step_metric = step_metric

    def _step(self, run_context: RunContext, values: dict[str, float]) -> int:
        if self.step_metric is None:
            return run_context.round
        if self.step_metric not in values:
            raise ValueError(f"step_metric={self.step_metric!r} is not among the metrics of "
                             f"round {run_context.round}: {sorted(values)}")
        return int(values[self.step_metric])


class TensorBoardLogger(_MetricsLogger):
    """Writes TensorBoard event files with tensorboardX, into ``logdir`` (default
    ``<run directory>/tensorboard``); ``tensorboard --logdir`` shows them. A resumed run adds a
    new event file to the same directory."""

    def __init__(self, logdir: str | os.PathLike | None = None, *,
                 step_metric: str | None = None) -> None:
        super().__init__(step_metric)
        if logdir is not None and not isinstance(logdir, (str, os.PathLike)):
            raise ValueError(f"TensorBoardLogger(logdir={logdir!r}) is not allowed; it must be "
                             "a directory path, or None for <run directory>/tensorboard")
        try:
            import tensorboardX  # noqa: F401 -- checked now, not after the run has started
        except ImportError:
            raise ImportError("TensorBoardLogger needs tensorboardX: pip install "
                              "'jaxtrain[tensorboard]' (or tensorboardX)") from None
        self.logdir = None if logdir is None else os.fspath(logdir)
        self._writer: Any = None

    def on_run_start(self, run_context: RunContext) -> None:
        from tensorboardX import SummaryWriter

        if self.logdir is None:
            self.logdir = os.path.join(run_context.path, "tensorboard")
        self._writer = SummaryWriter(logdir=self.logdir)

    def after_report(self, run_context: RunContext, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        values = scalars(metrics[0])
        step = self._step(run_context, values)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # readable while the run goes on

    def on_run_end(self, run_context: RunContext, result: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
