"""Peer copies of checkpoints held in host memory, across two hosts of two ranks each, with real
JAX workers: the program and its checks, shared by the ssh and Slurm tests (test_ssh.py,
test_slurm.py), whose hosts each have a /dev/shm of their own.

Each rank checkpoints 1 MiB of its own a round, with its copies in host memory: its host's, and
its peer's on the other host (rank + 2). Attempt 0 loses the second host's memory after round 2
and fails; attempt 1 loses both hosts' memory after round 3 and fails; attempt 2 finishes. Each
rank notes what its restore read: a file linked into host memory, or one linked to storage.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

PROGRAM = """
import json, os, shutil, socket, tempfile, time
from pathlib import Path
import numpy as np
from jaxtrain import (
    Checkpoint,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    get_checkpoint,
    get_context,
    report,
)
from jaxtrain.worker import checkpoint_memory


def shard(rank, step):
    return np.full(1 << 18, rank * 1000 + step, dtype=np.float32)


def train():
    ctx = get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    store = Path(checkpoint_memory.store_path(ctx.run_dir))
    first = 1
    if (ckpt := get_checkpoint()) is not None:
        own = Path(ckpt.path, f"shard-{rank}.npy")
        step = json.loads(Path(ckpt.path, f"step-{rank}.json").read_text())["step"]
        assert (np.load(own) == shard(rank, step)).all()
        Path(f"a{attempt}-rank{rank}.json").write_text(json.dumps(
            {"host": socket.gethostname(), "step": step, "path": ckpt.path,
             "own_from_storage": own.is_symlink()}))
        first = step + 1
    last = {0: 2, 1: 3}.get(attempt, 4)
    for step in range(first, last + 1):
        with tempfile.TemporaryDirectory() as d:
            np.save(os.path.join(d, f"shard-{rank}.npy"), shard(rank, step))
            Path(d, f"step-{rank}.json").write_text(json.dumps({"step": step}))
            report({"step": step}, checkpoint=Checkpoint.from_directory(d))
    if attempt == 2:
        return
    while not Path(ctx.run_dir, f"checkpoint_{last:06d}").exists():
        time.sleep(0.01)
    # The commit came after every rank's copies were kept, here and at its peer's.
    Path(f"a{attempt}-held-{rank}.json").write_text(json.dumps(sorted(
        {p.parent.name for p in store.glob(f"rank*/a{attempt}-r*.json")})))
    while len(list(Path().glob(f"a{attempt}-held-*.json"))) < 4:
        time.sleep(0.01)
    if attempt == 0 and rank == 2:
        shutil.rmtree(store)  # the second host's memory lost
        raise RuntimeError("the second host lost its memory")
    if attempt == 1 and rank == 0:
        shutil.rmtree(store)  # the first host's memory lost
        Path("first-host-lost").write_text("")
    if attempt == 1 and rank == 2:
        while not Path("first-host-lost").exists():
            time.sleep(0.01)
        shutil.rmtree(store)  # and the second host's
        raise RuntimeError("both hosts lost their memory")
    time.sleep(60)


result = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=4),
                    run_config=RunConfig(name="peers", storage_path=os.getcwd(),
                                         failure_config=FailureConfig(max_failures=2))).fit()
print("final", json.dumps(result.metrics))
"""


def check(proc: subprocess.CompletedProcess, cwd: Path, hosts: list[str]) -> None:
    """What PROGRAM's run in ``cwd`` must show; ``hosts``: each rank's host, in rank order."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'final {"step": 4}' in proc.stdout
    # Each host held its own ranks' copies and its donors': the first host ranks 2 and 3's, the
    # second 0 and 1's.
    for attempt in (0, 1):
        for rank in range(4):
            held = json.loads((cwd / f"a{attempt}-held-{rank}.json").read_text())
            assert held == ["rank0", "rank1", "rank2", "rank3"], (attempt, rank, held)
    logs = [(cwd / "peers" / "logs" / f"rank-{r}.log").read_text() for r in range(4)]
    # Attempt 1: the first host's ranks restore from their own copies; the second host's fetch
    # theirs from the first.
    first = [json.loads((cwd / f"a1-rank{r}.json").read_text()) for r in range(4)]
    assert [a["host"] for a in first] == hosts
    assert all(a["step"] == 2 and "/dev/shm/" in a["path"] for a in first), first
    assert not any(a["own_from_storage"] for a in first), first
    for rank in (2, 3):
        assert (f"rank {rank}: fetched its part of 'checkpoint_000002' from the memory of its "
                f"peer's host (rank {rank - 2}): 1.0 MiB") in logs[rank], logs[rank][-2000:]
    assert "restoring 'checkpoint_000002' from host memory: 8 of 8 files" in logs[0]
    # Attempt 2: neither copy is left anywhere, so every rank reads storage.
    second = [json.loads((cwd / f"a2-rank{r}.json").read_text()) for r in range(4)]
    assert all(a["step"] == 3 and a["own_from_storage"] is False and
               "/dev/shm/" not in a["path"] for a in second), second
    for rank in range(4):
        assert (f"rank {rank}: this host's memory holds no copy of its part of "
                "'checkpoint_000003', nor could its peer's host send it") in logs[rank]
