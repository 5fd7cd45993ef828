"""The background commit of checkpoints, end to end with real JAX workers: report(checkpoint=)
returns once the rank's files are copied, the controller commits the round off its event loop,
the next report(checkpoint=) waits for that commit (back-pressure), and what ends up committed is
complete and holds the data as it was when report() was called."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, _core

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
