"""The background commit of checkpoints, end to end with real JAX workers: report(checkpoint=)
returns once the rank's files are read into memory (or copied, above the snapshot budget), a
background stager writes them into staging and reports them in order, the controller commits the
round off its event loop, the next report(checkpoint=) waits for that commit (back-pressure), a
failure to stage fails the run, and what ends up committed is complete and holds the data as it
was when report() was called."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError, _core

SHARD_BYTES = 8 << 20


def _shard(rank: int, step: int) -> bytes:
    block = hashlib.sha256(f"{rank}-{step}".encode()).digest() * (1 << 10)  # 32 KiB
    return block * (SHARD_BYTES // len(block))


def _train(config):
    import shutil

    from jax.experimental import multihost_utils

    from jaxtrain import Checkpoint, get_context, report

    ctx = get_context()
    rank = ctx.get_world_rank()
    out = Path(config["out"])
    seen = {}
    for step in (1, 2):
        src = out / f"src-{rank}-{step}"
        src.mkdir()
        shard = src / f"shard-{rank}.bin"
        shard.write_bytes(_shard(rank, step))
        if step == 1 and rank == 1:
            # Rank 0's report() has returned: the round cannot have been committed yet.
            multihost_utils.sync_global_devices("rank 0 reported")
        report({"step": step}, checkpoint=Checkpoint.from_directory(str(src)))
        if step == 1 and rank == 0:
            seen["committed_when_returned"] = (Path(ctx.run_dir) / "checkpoint_000001").exists()
            multihost_utils.sync_global_devices("rank 0 reported")
        # The copy is a snapshot: the directory may change or go at once.
        with open(shard, "r+b") as f:
            f.write(b"changed after report()")
        shutil.rmtree(src)
        if step == 1:
            # Rounds that complete while the commit is in flight are recorded after it, in order.
            for extra in range(4):
                report({"step": step, "extra": extra})
        if step == 2:
            # Back-pressure: this report() waited for the commit of round 1, so it is whole.
            first = Path(ctx.run_dir) / "checkpoint_000001"
            _core.verify_checkpoint(str(first), True)
            index = json.loads((Path(ctx.run_dir) / "checkpoints.json").read_text())
            seen["indexed_after_second"] = [c["dir_name"] for c in index["checkpoints"]]
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


def test_report_returns_before_the_commit_and_the_next_waits_for_it(storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = JaxTrainer(
        _train,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="bg", storage_path=storage),
    ).fit()

    rank0 = json.loads((out / "rank0.json").read_text())
    assert rank0["committed_when_returned"] is False
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert "checkpoint_000001" in seen["indexed_after_second"], seen

    run_dir = Path(storage, "bg")
    assert result.checkpoint is not None
    assert Path(result.checkpoint.path) == run_dir / "checkpoint_000006"
    for step, name in ((1, "checkpoint_000001"), (2, "checkpoint_000006")):
        ckpt = run_dir / name
        _core.verify_checkpoint(str(ckpt), True)
        for rank in (0, 1):
            assert (ckpt / f"shard-{rank}.bin").read_bytes() == _shard(rank, step)
    rounds = [json.loads(line) for line in (run_dir / "result.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5, 6]
    assert [r.get("checkpoint") for r in rounds] == [
        "checkpoint_000001", None, None, None, None, "checkpoint_000006"]
    assert not (run_dir / ".staging").exists()


def _report_then_return(config):
    from jaxtrain import Checkpoint, get_context, report

    rank = get_context().get_world_rank()
    src = Path(config["out"]) / f"src-{rank}"
    src.mkdir()
    (src / f"shard-{rank}.bin").write_bytes(_shard(rank, 1))
    report({"step": 1}, checkpoint=Checkpoint.from_directory(str(src)))
    # Queued behind the checkpoint being staged; the worker says done only after all of them.
    for extra in range(3):
        report({"step": 1, "extra": extra})


def test_reports_queued_behind_a_checkpoint_reach_the_controller_in_order_before_done(
        storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = JaxTrainer(
        _report_then_return,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="queued", storage_path=storage),
    ).fit()
    run_dir = Path(storage, "queued")
    rounds = [json.loads(line) for line in (run_dir / "result.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    assert [r.get("checkpoint") for r in rounds] == ["checkpoint_000001", None, None, None]
    assert result.metrics["extra"] == 2
    ckpt = run_dir / "checkpoint_000001"
    _core.verify_checkpoint(str(ckpt), True)
    for rank in (0, 1):
        assert (ckpt / f"shard-{rank}.bin").read_bytes() == _shard(rank, 1)


def _stage_into_a_blocked_path(config):
    from jaxtrain import Checkpoint, get_context, report

    ctx = get_context()
    rank = ctx.get_world_rank()
    src = Path(config["out"]) / f"src-{rank}"
    src.mkdir()
    (src / f"shard-{rank}.bin").write_bytes(_shard(rank, 1))
    if rank == 1:
        # A file where rank 1's staging directory must go: writing it fails as a full disk would.
        staging = Path(ctx.run_dir, ".staging")
        staging.mkdir(exist_ok=True)
        (staging / "a0-r1-rank1").write_text("in the way")
    try:
        report({"step": 1}, checkpoint=Checkpoint.from_directory(str(src)))
    except Exception:  # the failure must not depend on the training function seeing it
        pass


def test_a_failure_to_stage_in_the_background_fails_the_run_naming_the_rank_and_path(
        storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(TrainingFailedError) as info:
        JaxTrainer(
            _stage_into_a_blocked_path,
            train_loop_config={"out": str(out)},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="blocked", storage_path=storage),
        ).fit()
    message = str(info.value)
    assert "rank 1" in message
    assert "in the background failed" in message
    assert str(Path(storage, "blocked", ".staging", "a0-r1-rank1")) in message
    assert not Path(storage, "blocked", "checkpoint_000001").exists()


def _two_checkpoints(config):
    from jaxtrain import Checkpoint, get_context, report

    rank = get_context().get_world_rank()
    for step in (1, 2):
        src = Path(config["out"]) / f"src-{rank}-{step}"
        src.mkdir()
        (src / f"shard-{rank}.bin").write_bytes(_shard(rank, step))
        report({"step": step}, checkpoint=Checkpoint.from_directory(str(src)))
        (src / f"shard-{rank}.bin").write_bytes(b"changed after report()")


def test_a_checkpoint_above_the_snapshot_budget_is_copied_at_once_and_said_once(
        storage, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB", "1")  # the shards hold 8 MiB
    out = tmp_path / "out"
    out.mkdir()
    result = JaxTrainer(
        _two_checkpoints,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="big", storage_path=storage),
    ).fit()
    run_dir = Path(storage, "big")
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert log.count("larger than the snapshot budget (1 MiB, "
                         "JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB)") == 1, log
    for step in (1, 2):
        ckpt = run_dir / f"checkpoint_00000{step}"
        _core.verify_checkpoint(str(ckpt), True)
        for rank in (0, 1):
            assert (ckpt / f"shard-{rank}.bin").read_bytes() == _shard(rank, step)
    assert result.checkpoint is not None


def test_checkpoints_within_the_budget_are_not_said_to_exceed_it(storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    JaxTrainer(
        _two_checkpoints,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="small", storage_path=storage),
    ).fit()
    for rank in (0, 1):
        log = Path(storage, "small", "logs", f"rank-{rank}.log").read_text()
        assert "snapshot budget" not in log


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_a_bad_snapshot_budget_is_refused_by_name_before_anything_starts(
        storage, monkeypatch, value):
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB", value)
    with pytest.raises(ValueError, match=f"JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB={value!r} is not "
                                         "allowed; use a whole number of MiB >= 0"):
        JaxTrainer(_two_checkpoints, scaling_config=ScalingConfig(num_workers=1),
                   run_config=RunConfig(name="bad", storage_path=storage)).fit()
    assert not Path(storage, "bad").exists()
