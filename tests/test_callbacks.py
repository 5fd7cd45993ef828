"""Driver-side callbacks end to end: real workers, a real restart, and the TensorBoard logger's
real event files read back."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest

from conftest import wait_for
from jaxtrain import (
    Checkpoint,
    ControllerError,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    UserCallback,
)


class Recorder(UserCallback):
    """Keeps every hook call, in order (the callback lives in the driver: no pickling)."""

    def __init__(self):
        self.calls = []

    def on_run_start(self, run_context):
        self.calls.append(("start", run_context.name, run_context.world_size))

    def after_report(self, run_context, metrics, checkpoint):
        name = os.path.basename(checkpoint.path) if checkpoint else None
        if checkpoint is not None:
            assert Path(checkpoint.path, ".jaxtrain_manifest.json").exists()  # committed
        self.calls.append(("report", run_context.round, metrics[0]["step"], name))

    def after_exception(self, run_context, worker_exceptions):
        [(rank, error)] = worker_exceptions.items()
        self.calls.append(("failed", run_context.attempt, rank, "died on purpose" in str(error)))

    def on_restart(self, run_context):
        self.calls.append(("restart", run_context.attempt))

    def on_run_end(self, run_context, result):
        self.calls.append(("end", result.error is None, result.metrics["step"]))


def _train(config):
    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    start = 0
    if get_checkpoint() is not None:
        with get_checkpoint().as_directory() as d:
            start = int(Path(d, "step").read_text()) + 1
    for step in range(start, config["steps"]):
        if step == config.get("fail_at") and ctx.get_attempt() == 0:
            # Every rank has sent its earlier reports before rank 1 fails.
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("before rank 1 fails")
            if ctx.get_world_rank() == 1:
                raise RuntimeError("died on purpose")
        if step % 2 == 0 and ctx.get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as d:
                Path(d, "step").write_text(str(step))
                report({"step": step, "loss": 1.0 / (step + 1), "opt": {"lr": 0.1}},
                       checkpoint=Checkpoint.from_directory(d))
        else:
            report({"step": step, "loss": 1.0 / (step + 1), "opt": {"lr": 0.1}})


def _fit(storage, name, callbacks, **config):
    return JaxTrainer(
        _train, train_loop_config={"steps": 5, **config},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage, callbacks=callbacks,
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()


def test_callbacks_see_every_round_the_failure_the_restart_and_the_end(storage):
    recorder = Recorder()
    _fit(storage, "events", [recorder], fail_at=3)
    # Rounds 1-3 (steps 0-2), rank 1 fails at step 3, attempt 1 restarts from step 2's
    # checkpoint and reports steps 3 and 4 as rounds 4 and 5.
    assert recorder.calls == [
        ("start", "events", 2),
        ("report", 1, 0, "checkpoint_000001"),
        ("report", 2, 1, None),
        ("report", 3, 2, "checkpoint_000003"),
        ("failed", 0, 1, True),
        ("restart", 1),
        ("report", 4, 3, None),
        ("report", 5, 4, "checkpoint_000005"),
        ("end", True, 4),
    ]


def test_a_resumed_run_delivers_only_its_own_rounds(storage):
    _fit(storage, "again", [], steps=3)
    recorder = Recorder()
    _fit(storage, "again", [recorder], steps=5)
    assert [c[0:2] for c in recorder.calls if c[0] == "report"] == [("report", 4), ("report", 5)]
    assert ("restart", 1) not in recorder.calls


class Broken(UserCallback):
    def __init__(self, raise_on_error=False):
        self.raise_on_error = raise_on_error
        self.reports = 0

    def after_report(self, run_context, metrics, checkpoint):
        self.reports += 1
        raise KeyError("the logger's bug")


def test_a_failing_callback_is_reported_and_dropped_while_the_run_goes_on(storage, capfd):
    broken, recorder = Broken(), Recorder()
    result = _fit(storage, "broken", [broken, recorder])
    err = capfd.readouterr().err
    assert "jaxtrain: callback Broken.after_report failed; the run goes on without it" in err
    assert "KeyError: \"the logger's bug\"" in err
    assert broken.reports == 1  # not called again
    assert [c[1] for c in recorder.calls if c[0] == "report"] == [1, 2, 3, 4, 5]
    assert result.metrics["step"] == 4


def _report_then_block(config):
    from jaxtrain import report

    report({"step": 0})
    with open(config["fifo"]) as f:  # no writer ever comes: only stopping the run ends this
        f.read()


def test_a_callback_with_raise_on_error_stops_the_run(storage, tmp_path):
    os.mkfifo(tmp_path / "never")
    trainer = JaxTrainer(
        _report_then_block, train_loop_config={"fifo": str(tmp_path / "never")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="fatal", storage_path=storage,
                             callbacks=[Broken(raise_on_error=True)]))
    with pytest.raises(ControllerError) as e:
        trainer.fit()
    assert "callback Broken.after_report raised KeyError" in str(e.value)
    assert isinstance(e.value.controller_failure, KeyError)
    assert json.loads((Path(storage) / "fatal" / "run.json").read_text())["status"] == "ABORTED"


def _events(logdir: Path) -> list:
    """Every event of the TFRecord files in logdir: u64 length, u32 crc, data, u32 crc."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            out.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
            at += 12 + length + 4
    return out


def test_tensorboard_logger_writes_event_files_tensorboard_reads(storage):
    from jaxtrain.loggers import TensorBoardLogger

    result = _fit(storage, "tb", [TensorBoardLogger()], fail_at=3)
    points = [(e.step, v.tag, round(v.simple_value, 4))
              for e in _events(Path(result.path) / "tensorboard") for v in e.summary.value]
    assert [p for p in points if p[1] == "loss"] == [
        (1, "loss", 1.0), (2, "loss", 0.5), (3, "loss", 0.3333), (4, "loss", 0.25),
        (5, "loss", 0.2)]
    assert (5, "opt/lr", 0.1) in points and (5, "step", 4.0) in points


def test_tensorboard_logger_can_step_by_a_metric(storage, tmp_path):
    from jaxtrain.loggers import TensorBoardLogger

    _fit(storage, "tbstep", [TensorBoardLogger(tmp_path / "tb", step_metric="step")])
    steps = [e.step for e in _events(tmp_path / "tb") for v in e.summary.value if v.tag == "loss"]
    assert steps == [0, 1, 2, 3, 4]


def test_mlflow_logger_writes_a_local_store_that_the_mlflow_client_reads(storage):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from jaxtrain.loggers import MLflowLogger

    result = _fit(storage, "mlf", [MLflowLogger()], fail_at=3)
    run_dir = Path(result.path)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED" and run.info.run_name == "mlf"
    assert run.data.params == {"num_workers": "2", "steps": "5", "fail_at": "3"}
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(history) == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25), (5, 0.2)]
    assert client.get_metric_history(run.info.run_id, "opt/lr")[0].value == 0.1

    # Resumed by name: the same MLflow run goes on.
    JaxTrainer(_train, train_loop_config={"steps": 7}, scaling_config=ScalingConfig(num_workers=2),
               run_config=RunConfig(name="mlf", storage_path=storage,
                                    callbacks=[MLflowLogger()])).fit()
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps == [1, 2, 3, 4, 5, 6, 7]


def test_wandb_logger_writes_an_offline_run(storage):
    pytest.importorskip("wandb")
    from jaxtrain.loggers import WandbLogger

    result = _fit(storage, "wb", [WandbLogger(mode="offline")])
    run_dir = Path(result.path)
    run_id = (run_dir / "wandb_run_id").read_text()
    [offline] = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    records = offline / f"run-{run_id}.wandb"  # the records `wandb sync` uploads
    # wandb's service process writes them after finish() has returned; on a busy machine later.
    keys = (b"loss", b"opt/lr", b"num_workers", b"steps")

    def written() -> bytes | None:
        data = records.read_bytes()
        return data if all(key in data for key in keys) else None

    wait_for(f"the metrics {keys} in {records}", written)
