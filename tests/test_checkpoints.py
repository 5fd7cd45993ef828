"""Checkpoints end to end: committed atomically, kept by policy, resumed by name, verified on
restore; real JAX workers, real files."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
from pathlib import Path

import pytest

from jaxtrain import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    JaxTrainer,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    _core,
)


def _train_with_checkpoints(config):
    """Each rank saves its own shard every `every` steps; rank 0 also saves the step."""
    import jax  # noqa: F401
    import numpy as np

    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    rank = ctx.get_world_rank()
    start = 0
    restored = get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            start = int(Path(d, "step.txt").read_text()) + 1
            assert np.load(Path(d, f"shard-{rank}.npy"))[0] == start - 1
    if rank == 0:
        Path(config["out"], f"started-attempt-{ctx.get_attempt()}").write_text(
            restored.path if restored else "")
    for step in range(start, config["steps"]):
        metrics = {"step": step, "score": config["scores"][step]}
        if step == config.get("die_at") and ctx.get_attempt() == 0:
            # Every rank has sent its earlier reports before rank 1 dies.
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("before rank 1 dies")
        if step == config.get("die_at") and ctx.get_attempt() == 0 and rank == 1:
            if config.get("mid_checkpoint"):
                # Half of this rank's checkpoint is written when it dies.
                Path(config["out"], "partial").mkdir(exist_ok=True)
                np.save(Path(config["out"], "partial", f"shard-{rank}.npy"), np.zeros(3))
            os.kill(os.getpid(), signal.SIGKILL)
        if step % config["every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                np.save(Path(d, f"shard-{rank}.npy"), np.full(3, step))
                if rank == 0:
                    Path(d, "step.txt").write_text(str(step))
                report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            report(metrics)


def _trainer(storage, tmp_path, name, *, steps=6, every=2, keep=None, score=None, order="max",
             scores=None, max_failures=0, **extra):
    config = {"out": str(tmp_path), "steps": steps, "every": every,
              "scores": scores or list(range(steps)), **extra}
    return JaxTrainer(
        _train_with_checkpoints,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=name, storage_path=storage,
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=score,
                                               checkpoint_score_order=order),
        ),
    )


def committed(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if (p / ".jaxtrain_manifest.json").exists())


def test_keeps_the_newest_two_and_indexes_them(storage, tmp_path):
    result = _trainer(storage, tmp_path, "keep2", steps=9, every=2, keep=2).fit()
    run = Path(result.path)
    # Rounds 1, 3, 5, 7, 9 carried checkpoints (steps 0, 2, 4, 6, 8).
    assert committed(run) == ["checkpoint_000007", "checkpoint_000009"]
    index = json.loads((run / "checkpoints.json").read_text())
    assert [c["dir_name"] for c in index["checkpoints"]] == ["checkpoint_000007",
                                                            "checkpoint_000009"]
    assert index["latest"] == "checkpoint_000009"
    assert [c["round"] for c in index["checkpoints"]] == [7, 9]
    assert index["checkpoints"][1]["metrics"] == {"step": 8, "score": 8}
    assert result.checkpoint == Checkpoint(str(run / "checkpoint_000009"))
    # Both ranks' files merged into one checkpoint, plus the manifest.
    assert sorted(os.listdir(run / "checkpoint_000009")) == [
        ".jaxtrain_manifest.json", "shard-0.npy", "shard-1.npy", "step.txt"]
    for name in committed(run):
        _core.verify_checkpoint(str(run / name), True)
    assert not (run / ".staging").exists()
    lines = [json.loads(x) for x in (run / "result.jsonl").read_text().splitlines()]
    assert [x.get("checkpoint") for x in lines] == [
        "checkpoint_000001", None, "checkpoint_000003", None, "checkpoint_000005", None,
        "checkpoint_000007", None, "checkpoint_000009"]


def test_running_again_by_name_says_it_resumes_and_counts_this_fit_apart(storage, tmp_path,
                                                                          capfd):
    _trainer(storage, tmp_path, "again", steps=4, every=1).fit()
    first = capfd.readouterr().err
    assert "resumes" not in first and "this fit()" not in first
    assert re.search(r"^jaxtrain: goodput [0-9.]+ %", first, re.M), first
    _trainer(storage, tmp_path, "again", steps=6, every=1).fit()
    second = capfd.readouterr().err
    said = ("jaxtrain: run 'again' exists (FINISHED after 4 report round(s) in 1 attempt(s)): "
            "this fit() resumes it from its latest checkpoint, checkpoint_000004; choose another "
            "RunConfig.name to start a new run\n")
    assert second.count(said) == 1, second
    assert re.search(r"^jaxtrain: this fit\(\): 2 report round\(s\) in 1 attempt\(s\), "
                     r"goodput [0-9.]+ %", second, re.M), second
    assert re.search(r"^jaxtrain: the whole run, with the fit\(\)s before it resumed: 6 report "
                     r"round\(s\), goodput [0-9.]+ %", second, re.M), second
    assert second.index(said) < second.index("this fit():")


def test_best_checkpoints_are_ranked_by_score_and_the_latest_is_always_kept(storage, tmp_path):
    # Scores per step: the best (lowest) is at step 2; the last checkpoint (step 6) is worst.
    result = _trainer(storage, tmp_path, "best", steps=7, every=2, keep=2, score="score",
                      order="min", scores=[5, 9, 1, 9, 3, 9, 8]).fit()
    ranked = [(Path(c.path).name, m["score"]) for c, m in result.best_checkpoints]
    # Ray's order: the best last.
    assert ranked == [("checkpoint_000007", 8), ("checkpoint_000005", 3),
                      ("checkpoint_000003", 1)]
    assert committed(Path(result.path)) == ["checkpoint_000003", "checkpoint_000005",
                                            "checkpoint_000007"]
    assert result.checkpoint.path.endswith("checkpoint_000007")


def test_running_again_by_name_resumes_from_the_latest_checkpoint(storage, tmp_path):
    first = _trainer(storage, tmp_path, "resume", steps=4, every=1).fit()
    assert first.metrics == {"step": 3, "score": 3}
    second = _trainer(storage, tmp_path, "resume", steps=6, every=1).fit()
    # The second run started from step 3's checkpoint on its first attempt ...
    assert (tmp_path / "started-attempt-1").read_text().endswith("checkpoint_000004")
    # ... and its rounds continue the first run's numbering.
    frame = second.metrics_dataframe
    assert list(frame["jaxtrain/round"]) == [1, 2, 3, 4, 5, 6]
    assert list(frame["step"]) == [0, 1, 2, 3, 4, 5]
    assert second.checkpoint.path.endswith("checkpoint_000006")
    run = json.loads(Path(second.path, "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["FINISHED", "FINISHED"]


def test_a_rank_killed_while_writing_a_checkpoint_never_exposes_it(storage, tmp_path):
    result = _trainer(storage, tmp_path, "midway", steps=6, every=1, die_at=3,
                      mid_checkpoint=True, max_failures=1).fit()
    run = Path(result.path)
    # Attempt 1 restarted from round 3 (step 2): round 4 was never complete, so never committed.
    assert (tmp_path / "started-attempt-1").read_text() == str(run / "checkpoint_000003")
    assert result.metrics == {"step": 5, "score": 5}
    # Rank 0's staged half of the dead round was swept; no directory of it is visible.
    lines = [json.loads(x) for x in (run / "result.jsonl").read_text().splitlines()]
    assert [x["metrics"]["step"] for x in lines] == [0, 1, 2, 3, 4, 5]
    for name in committed(run):
        _core.verify_checkpoint(str(run / name), True)
    assert not (run / ".staging").exists()
    assert Result.from_path(run).checkpoint.path.endswith(lines[-1]["checkpoint"])


def test_a_corrupted_checkpoint_is_refused_on_restore_and_the_previous_one_used(
        storage, tmp_path, capfd):
    _trainer(storage, tmp_path, "corrupt", steps=2, every=1).fit()
    shard = Path(storage, "corrupt", "checkpoint_000002", "shard-1.npy")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    _trainer(storage, tmp_path, "corrupt", steps=3, every=1).fit()
    err = capfd.readouterr().err
    assert "not restoring checkpoint checkpoint_000002" in err
    assert str(shard) in err
    assert (tmp_path / "started-attempt-1").read_text().endswith("checkpoint_000001")


def _missing_checkpoint_dir():
    from jaxtrain import Checkpoint, get_context, report

    rank = get_context().get_world_rank()
    report({"x": 1}, checkpoint=Checkpoint.from_directory(f"/nonexistent/ckpt-{rank}")
           if rank == 1 else None)


def test_a_checkpoint_directory_that_does_not_exist_fails_in_report_on_that_rank(storage):
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(_missing_checkpoint_dir, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="missing", storage_path=storage)).fit()
    assert e.value.rank == 1
    assert "report(checkpoint=...) on rank 1" in str(e.value)
    assert "'/nonexistent/ckpt-1' does not exist" in str(e.value)


def _same_file_on_two_ranks(config):
    from jaxtrain import Checkpoint, get_context, report

    rank = get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        Path(d, "params.npy").write_bytes(config["params"][rank].encode())
        Path(d, f"shard-{rank}").write_text(f"rank {rank}")
        report({"x": 1}, checkpoint=Checkpoint.from_directory(d))


def _fit_same_file(storage, name, params):
    return JaxTrainer(_same_file_on_two_ranks, train_loop_config={"params": params},
                      scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=name, storage_path=storage,
                                           failure_config=FailureConfig(max_failures=3))).fit()


def test_two_ranks_writing_one_file_alike_commit_it_once(storage):
    result = _fit_same_file(storage, "alike", ["same params", "same params"])
    assert result.error is None
    with result.checkpoint.as_directory() as d:
        assert Path(d, "params.npy").read_text() == "same params"
        assert Path(d, "shard-0").read_text() == "rank 0"
        assert Path(d, "shard-1").read_text() == "rank 1"


def test_two_ranks_writing_one_file_differently_is_an_error_naming_both(storage):
    with pytest.raises(TrainingFailedError) as e:
        _fit_same_file(storage, "clash", ["rank 0's params", "rank 1's"])
    assert e.value.cause == "checkpoint"
    message = str(e.value)
    assert ("rank 0 and rank 1 both wrote 'params.npy' to the checkpoint of round 1 with "
            "different contents (rank 0's: 15 bytes") in message, message
    # Neither rank is blamed (nor its empty log shown): the commit of their parts failed.
    assert e.value.rank == -1
    assert message.startswith("Training failed: the checkpoint commit (host "), message
    assert "log:" not in message
    # Retrying cannot help, so the budget was not spent on it.
    run = json.loads(Path(storage, "clash", "run.json").read_text())
    assert len(run["attempts"]) == 1
    assert not Path(storage, "clash", "checkpoint_000001").exists()


def test_checkpoint_round_trips_through_to_directory(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("hello")
    (src / ".jaxtrain_manifest.json").write_text("{}")
    target = Checkpoint.from_directory(src).to_directory(tmp_path / "dst")
    assert Path(target, "sub", "a.txt").read_text() == "hello"
    assert not Path(target, ".jaxtrain_manifest.json").exists()
    with Checkpoint.from_directory(src).as_directory() as d:
        assert Path(d, "sub", "a.txt").exists()
