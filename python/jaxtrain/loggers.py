"""Built-in logger callbacks for ``RunConfig(callbacks=[...])``. Each writes rank 0's numeric
metrics (nested keys joined with '/') once per report round, from the driver, with its library
installed as an extra: ``pip install 'jaxtrain[tensorboard]'`` or ``'jaxtrain[mlflow]'``.

The step of a point is the report round (it keeps counting across restarts and resumed runs), or
the value of the metric named by ``step_metric``.
"""

from __future__ import annotations

import numbers
import os
import time
from typing import Any

from jaxtrain.callbacks import RunContext, UserCallback
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.result import flatten


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric values of ``metrics``, nested keys joined with '/' (booleans left out)."""
    return {k: float(v) for k, v in flatten(metrics).items()
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


class MLflowLogger(_MetricsLogger):
    """Logs to MLflow through ``mlflow.MlflowClient`` (``pip install 'jaxtrain[mlflow]'``: the
    light ``mlflow-skinny`` with SQLAlchemy): rank 0's metrics per round, the
    ``train_loop_config`` and the worker count as params, and the run's end as FINISHED or
    FAILED.

    ``tracking_uri`` defaults to MLflow's local store, a SQLite file ``<run directory>/mlflow.db``;
    ``experiment_name`` to the jaxtrain run's name, ``run_name`` too. A run resumed by name goes
    on logging into the same MLflow run (its id is kept in ``<run directory>/mlflow_run_id``).
    """

    def __init__(self, tracking_uri: str | None = None, experiment_name: str | None = None,
                 run_name: str | None = None, *, step_metric: str | None = None) -> None:
        super().__init__(step_metric)
        for field, value in (("tracking_uri", tracking_uri), ("experiment_name", experiment_name),
                             ("run_name", run_name)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"MLflowLogger({field}={value!r}) is not allowed; it must be a "
                                 "string, or None")
        try:
            import mlflow  # noqa: F401 -- checked now, not after the run has started
        except ImportError:
            raise ImportError("MLflowLogger needs MLflow: pip install 'jaxtrain[mlflow]' (or "
                              "mlflow-skinny)") from None
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.run_id: str | None = None
        self._client: Any = None

    def on_run_start(self, run_context: RunContext) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        if self.tracking_uri is None:
            self.tracking_uri = "sqlite:///" + os.path.join(run_context.path, "mlflow.db")
        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        id_file = os.path.join(run_context.path, "mlflow_run_id")
        if os.path.exists(id_file):
            with open(id_file, encoding="utf-8") as f:
                self.run_id = f.read().strip()
            client.update_run(self.run_id, status="RUNNING")
            return
        name = self.experiment_name or run_context.name
        experiment = client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(name))
        run = client.create_run(experiment_id, run_name=self.run_name or run_context.name,
                                tags={"jaxtrain.run_dir": run_context.path})
        self.run_id = run.info.run_id
        params = {"num_workers": run_context.world_size}
        params.update(flatten(run_context.train_loop_config or {}))
        client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        with open(id_file, "w", encoding="utf-8") as f:
            f.write(self.run_id)

    def after_report(self, run_context: RunContext, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        from mlflow.entities import Metric

        values = scalars(metrics[0])
        step = self._step(run_context, values)
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            Metric(name, value, now, step) for name, value in values.items()])

    def on_run_end(self, run_context: RunContext, result: Any) -> None:
        if self._client is not None:
            self._client.set_terminated(
                self.run_id, status="FINISHED" if result.error is None else "FAILED")


class WandbLogger(_MetricsLogger):
    """Logs to Weights & Biases (``pip install 'jaxtrain[wandb]'``): rank 0's metrics per round,
    the ``train_loop_config`` and the worker count as the run's config, and its end.

    ``project`` defaults to the jaxtrain run's name, ``name`` too; ``mode`` is wandb's
    ("online", "offline" -- files only, for ``wandb sync`` later -- or "disabled"; None: wandb's
    default, from ``WANDB_MODE``); ``dir`` defaults to the run directory (files go to its
    ``wandb/``). Other keyword arguments go to ``wandb.init``. A run resumed by name goes on
    logging into the same W&B run (its id is kept in ``<run directory>/wandb_run_id``).
    """

    def __init__(self, project: str | None = None, name: str | None = None, *,
                 mode: str | None = None, dir: str | os.PathLike | None = None,
                 step_metric: str | None = None, **init_kwargs: Any) -> None:
        super().__init__(step_metric)
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"WandbLogger(mode={mode!r}) is not allowed; use 'online', "
                             "'offline', 'disabled' or None")
        try:
            import wandb  # noqa: F401 -- checked now, not after the run has started
        except ImportError:
            raise ImportError("WandbLogger needs wandb: pip install 'jaxtrain[wandb]' (or "
                              "wandb)") from None
        self.project, self.name, self.mode = project, name, mode
        self.dir = None if dir is None else os.fspath(dir)
        self.init_kwargs = init_kwargs
        self._run: Any = None

    def on_run_start(self, run_context: RunContext) -> None:
        import wandb

        id_file = os.path.join(run_context.path, "wandb_run_id")
        run_id = None
        if os.path.exists(id_file):
            with open(id_file, encoding="utf-8") as f:
                run_id = f.read().strip()
        config = {"num_workers": run_context.world_size}
        config.update(flatten(run_context.train_loop_config or {}))
        self._run = wandb.init(
            project=self.project or run_context.name, name=self.name or run_context.name,
            dir=self.dir or run_context.path, mode=self.mode, id=run_id, resume="allow",
            config=config, **self.init_kwargs)
        with open(id_file, "w", encoding="utf-8") as f:
            f.write(self._run.id)

    def after_report(self, run_context: RunContext, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        values = scalars(metrics[0])
        self._run.log(values, step=self._step(run_context, values))

    def on_run_end(self, run_context: RunContext, result: Any) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if result.error is None else 1)
            self._run = None
