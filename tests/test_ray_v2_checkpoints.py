"""Ray Train V2 scripts of 2026 about reported checkpoints and asynchronous validation, run with
their imports changed to jaxtrain and nothing else: get_all_reported_checkpoints (after a
restart too, with metrics only, COMMITTED and VALIDATED), a validation function whose metric is
merged into the checkpoint's and drives top-k retention, and a validation that raises."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_driver


def _run(code: str, tmp_path: Path, storage: str) -> tuple[str, dict]:
    """Runs the script with STORAGE and OUT filled in; its stderr and what it wrote to
    OUT/result.json."""
    out = tmp_path / "out"
    out.mkdir()
    code = code.replace("STORAGE", repr(storage)).replace("OUT", repr(str(out)))
    proc = run_driver(code, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stderr, json.loads((out / "result.json").read_text())


REPORTED_AFTER_RESTART = """
import json
import os
import tempfile

import jaxtrain.train as train                       # was: import ray.train
from jaxtrain import JaxTrainer                      # was: from ray.train.jax import JaxTrainer
from jaxtrain.train import CheckpointConsistencyMode, FailureConfig, RunConfig, ScalingConfig


def train_func(config):
    ctx = train.get_context()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            start = json.load(open(os.path.join(d, "state.json")))["epoch"] + 1
    for epoch in range(start, 3):
        with tempfile.TemporaryDirectory() as d:
            if ctx.get_world_rank() == 0:
                json.dump({"epoch": epoch}, open(os.path.join(d, "state.json"), "w"))
            train.report({"epoch": epoch, "loss": 1.0 / (epoch + 1)},
                         checkpoint=train.Checkpoint.from_directory(d))
        if epoch == 1 and ctx.get_attempt() == 0:
            train.get_all_reported_checkpoints()  # both checkpoints are committed first
            raise RuntimeError("a node went away")
    train.report({"epoch": 3, "note": "metrics only"})
    reported = train.get_all_reported_checkpoints(
        consistency_mode=CheckpointConsistencyMode.COMMITTED)
    mine = [[os.path.basename(r.checkpoint.path), r.metrics] for r in reported]
    json.dump(mine, open(os.path.join(config["out"], f"rank-{ctx.get_world_rank()}.json"), "w"))


trainer = JaxTrainer(
    train_func,
    train_loop_config={"out": OUT},
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(name="reported", storage_path=STORAGE,
                         failure_config=FailureConfig(max_failures=1)),
)
result = trainer.fit()
json.dump({"ranks": [json.load(open(os.path.join(OUT, f"rank-{r}.json"))) for r in range(2)]},
          open(os.path.join(OUT, "result.json"), "w"))
"""


def test_reported_checkpoints_list_every_attempts_commits_on_every_rank(tmp_path, storage):
    _, out = _run(REPORTED_AFTER_RESTART, tmp_path, storage)
    rank0, rank1 = out["ranks"]
    assert rank0 == rank1
    assert [name for name, _ in rank0] == ["checkpoint_000001", "checkpoint_000002",
                                           "checkpoint_000003"]
    assert [m["epoch"] for _, m in rank0] == [0, 1, 2]
    assert rank0[2][1]["loss"] == 1.0 / 3


METRICS_ONLY = """
import json
import os

import jaxtrain.train as train                       # was: import ray.train
from jaxtrain import JaxTrainer                      # was: from ray.train.jax import JaxTrainer
from jaxtrain.train import RunConfig, ScalingConfig


def train_func():
    for step in range(3):
        train.report({"step": step})
    reported = train.get_all_reported_checkpoints()
    rank = train.get_context().get_world_rank()
    json.dump(reported, open(os.path.join(OUT, f"rank-{rank}.json"), "w"))


JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers=3),
           run_config=RunConfig(name="metrics", storage_path=STORAGE)).fit()
json.dump([json.load(open(os.path.join(OUT, f"rank-{r}.json"))) for r in range(3)],
          open(os.path.join(OUT, "result.json"), "w"))
"""


def test_with_only_metrics_reported_every_rank_gets_an_empty_list(tmp_path, storage):
    _, out = _run(METRICS_ONLY, tmp_path, storage)
    assert out == [[], [], []]


VALIDATION = """
import json
import os
import tempfile

import jaxtrain.train as train                       # was: import ray.train
from jaxtrain import JaxTrainer                      # was: from ray.train.jax import JaxTrainer
from jaxtrain.train import (CheckpointConfig, CheckpointConsistencyMode, ReportedCheckpointStatus,
                            RunConfig, ScalingConfig, ValidationConfig, ValidationTaskConfig)

WEIGHTS = [0.9, 0.1, 0.5, 0.2]


def validation_fn(checkpoint, scale):
    with checkpoint.as_directory() as d:
        weight = json.load(open(os.path.join(d, "model.json")))["weight"]
    return {"val_score": weight * scale, "loss": -1.0}


def train_func():
    rank = train.get_context().get_world_rank()
    seen = {}
    for epoch, weight in enumerate(WEIGHTS):
        with tempfile.TemporaryDirectory() as d:
            # Each rank saves its shard; rank 0 also the model's summary.
            json.dump(epoch, open(os.path.join(d, f"shard-{rank}.json"), "w"))
            if rank == 0:
                json.dump({"weight": weight}, open(os.path.join(d, "model.json"), "w"))
            validation = ValidationTaskConfig(fn_kwargs={"scale": 10.0}) if epoch == 1 else True
            train.report({"epoch": epoch, "loss": 1.0 + epoch},
                         checkpoint=train.Checkpoint.from_directory(d), validation=validation)
        if epoch == 0:
            first = train.get_all_reported_checkpoints(CheckpointConsistencyMode.COMMITTED)
            seen["committed"] = [[os.path.basename(r.checkpoint.path), r.status.name]
                                 for r in first]
    reported = train.get_all_reported_checkpoints()  # VALIDATED
    seen["validated"] = [[os.path.basename(r.checkpoint.path), r.status.name, r.metrics]
                         for r in reported]
    assert all(r.status is ReportedCheckpointStatus.VALIDATED for r in reported)
    json.dump(seen, open(os.path.join(OUT, f"rank-{rank}.json"), "w"))


trainer = JaxTrainer(
    train_func,
    scaling_config=ScalingConfig(num_workers=2),
    validation_config=ValidationConfig(
        fn=validation_fn, task_config=ValidationTaskConfig(fn_kwargs={"scale": 1.0})),
    run_config=RunConfig(
        name="validated", storage_path=STORAGE,
        checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val_score",
                                           checkpoint_score_order="max")),
)
result = trainer.fit()
json.dump({
    "ranks": [json.load(open(os.path.join(OUT, f"rank-{r}.json"))) for r in range(2)],
    "best": [[os.path.basename(c.path), m] for c, m in result.best_checkpoints],
    "best_one": os.path.basename(result.get_best_checkpoint("val_score", "max").path),
    "kept": sorted(n for n in os.listdir(result.path) if n.startswith("checkpoint_")),
}, open(os.path.join(OUT, "result.json"), "w"))
"""


def test_validation_metrics_are_merged_and_drive_top_k_retention(tmp_path, storage):
    stderr, out = _run(VALIDATION, tmp_path, storage)
    # val_score is the weight times the scale: round 2's report scales by 10 (its own
    # fn_kwargs), the others by the trainer's 1.0: rounds 1-4 score 0.9, 1.0, 0.5, 0.2. The top 2
    # are rounds 2 and 1; round 4 is the newest and is kept too.
    assert out["kept"] == ["checkpoint_000001", "checkpoint_000002", "checkpoint_000004"]
    best = out["best"]
    assert [name for name, _ in best] == ["checkpoint_000004", "checkpoint_000001",
                                          "checkpoint_000002"]
    assert [m["val_score"] for _, m in best] == [0.2, 0.9, 1.0]
    # A validation metric of a reported name wins; the others stay.
    assert all(m["loss"] == -1.0 and "epoch" in m for _, m in best)
    assert out["best_one"] == "checkpoint_000002"
    rank0, rank1 = out["ranks"]
    for rank in (rank0, rank1):
        [[name, status]] = rank["committed"]
        assert name == "checkpoint_000001"
        assert status in ("PENDING_VALIDATION", "VALIDATED")
        # At the end every checkpoint kept so far is validated, its score merged.
        names = [n for n, _, _ in rank["validated"]]
        assert names[-1] == "checkpoint_000004"
        assert all(s == "VALIDATED" and "val_score" in m for _, s, m in rank["validated"])
    assert [n for n, _, _ in rank0["validated"]] == [n for n, _, _ in rank1["validated"]]
    assert "validated checkpoint_000002" in stderr


FAILING_VALIDATION = """
import json
import os
import tempfile

import jaxtrain.train as train                       # was: import ray.train
from jaxtrain import JaxTrainer                      # was: from ray.train.jax import JaxTrainer
from jaxtrain.train import RunConfig, ScalingConfig, ValidationConfig


def validation_fn(checkpoint):
    with checkpoint.as_directory() as d:
        step = json.load(open(os.path.join(d, "step.json")))
    if step == 0:
        raise ValueError("the evaluation set is missing")
    return {"accuracy": 0.75}


def train_func():
    rank = train.get_context().get_world_rank()
    for step in range(2):
        with tempfile.TemporaryDirectory() as d:
            json.dump(step, open(os.path.join(d, "step.json" if rank == 0 else "rank-1.json"), "w"))
            train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(d),
                         validation=True)
    reported = train.get_all_reported_checkpoints()
    if rank == 0:
        json.dump([[r.status.name, r.validation_error, r.metrics] for r in reported],
                  open(os.path.join(OUT, "reported.json"), "w"))


result = JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                    validation_config=ValidationConfig(validation_fn),
                    run_config=RunConfig(name="failing", storage_path=STORAGE)).fit()
json.dump({
    "reported": json.load(open(os.path.join(OUT, "reported.json"))),
    "best": [m for _, m in result.best_checkpoints],
    "record": json.load(open(os.path.join(result.path, "validation.json"))),
}, open(os.path.join(OUT, "result.json"), "w"))
"""


def test_a_validation_that_raises_is_recorded_and_the_run_finishes(tmp_path, storage):
    stderr, out = _run(FAILING_VALIDATION, tmp_path, storage)
    assert "the validation of checkpoint_000001 failed" in stderr
    assert "ValueError: the evaluation set is missing" in stderr
    [(s1, error1, m1), (s2, error2, m2)] = out["reported"]
    assert s1 == s2 == "VALIDATED"
    assert "ValueError: the evaluation set is missing" in error1
    assert error2 is None
    assert m1 == {"step": 0} and m2 == {"step": 1, "accuracy": 0.75}
    assert out["best"] == [{"step": 0}, {"step": 1, "accuracy": 0.75}]
    record = out["record"]["checkpoints"]
    assert record["checkpoint_000001"]["status"] == "failed"
    assert "the evaluation set is missing" in record["checkpoint_000001"]["error"]
    assert record["checkpoint_000002"] == {"round": 2, "status": "validated",
                                           "metrics": {"accuracy": 0.75}}


RANK_ZERO_SAVES = """
import json
import os
import tempfile

import jaxtrain.train as train                       # was: import ray.train
from jaxtrain import JaxTrainer                      # was: from ray.train.jax import JaxTrainer
from jaxtrain.train import CheckpointConsistencyMode, RunConfig, ScalingConfig


def train_func(config):
    ctx = train.get_context()
    seen = []
    for epoch in range(4):
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if ctx.get_world_rank() == 0:                # Ray's usual pattern: rank 0 saves
                json.dump({"epoch": epoch}, open(os.path.join(d, "state.json"), "w"))
                checkpoint = train.Checkpoint.from_directory(d)
            train.report({"epoch": epoch}, checkpoint=checkpoint)
        reported = train.get_all_reported_checkpoints(
            consistency_mode=CheckpointConsistencyMode.COMMITTED)
        seen.append([os.path.basename(r.checkpoint.path) for r in reported])
    json.dump(seen, open(os.path.join(config["out"], f"rank-{ctx.get_world_rank()}.json"), "w"))


JaxTrainer(
    train_func,
    train_loop_config={"out": OUT},
    scaling_config=ScalingConfig(num_workers=3),
    run_config=RunConfig(name="rank-zero-saves", storage_path=STORAGE),
).fit()
json.dump({"ranks": [json.load(open(os.path.join(OUT, f"rank-{r}.json"))) for r in range(3)]},
          open(os.path.join(OUT, "result.json"), "w"))
"""


def test_ranks_that_pass_no_checkpoint_see_the_round_they_just_reported(tmp_path, storage):
    _, out = _run(RANK_ZERO_SAVES, tmp_path, storage)
    expected = [[f"checkpoint_{r:06d}" for r in range(1, epoch + 2)] for epoch in range(4)]
    assert out["ranks"] == [expected] * 3
