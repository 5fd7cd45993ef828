"""Benchmark: a restart restoring 1 GiB from 4 ranks out of host memory, against from storage.

    .venv/bin/python bench/restore_from_memory.py [--workers 4] [--shard-mib 256] [--repeats 3]

Each run is one ``fit()`` on N local CPU workers. In its first attempt every rank checkpoints a
shard of ``--shard-mib`` MiB (a 4 MiB random block repeated), waits until the checkpoint is
committed (and, with the switch on, until its copy is in host memory), and then, as a training
job that streams its dataset through the page cache would have it by the time a rank fails, the
committed files are dropped from the page cache (``posix_fadvise(DONTNEED)``; they were fsynced
by the commit, so nothing is lost). Rank 1 notes ``time.time()`` and raises; the group restarts
from that checkpoint (warm workers, as by default) and every rank reads its own shard in full from
``get_checkpoint()``, noting when it started and ended. Warm workers are off
(JAXTRAIN_WARM_WORKERS=0; ``--warm-workers`` keeps them): with them, the next attempt's standbys
start and import jax exactly while the restarted ranks read, which adds 0-0.5 s of noise to every
configuration's read. Three configurations, in turn within each repeat (ABCABC..., so that
machine noise hits all):

* memory: JAXTRAIN_CHECKPOINT_IN_MEMORY=1 (copies on /dev/shm; the controller checks the
  checkpoint's sizes only before a restart);
* storage: the default, what a user gets without the switch: the controller checks every file's
  CRC-32C before the restart (reading the checkpoint from the disk, which leaves it in the page
  cache), then the ranks read;
* storage, no check: JAXTRAIN_VERIFY_CHECKSUMS=0, so that the ranks themselves read the disk.

Figures: failure -> restored (rank 1's failure to the last rank's end of reading), and the restore
itself: from the first rank's start of reading to the last rank's end, plus, for memory, the
slowest rank's linking of its view (the worker's log says it). The target (>= 10 x faster than
from storage) is judged on the restore itself, memory against storage without the check (the
disk read in both other configurations); both end-to-end figures are printed beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from unittest import mock

from startup_and_report import console_to, measure, spread

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError

BLOCK_BYTES = 4 << 20
TARGET_RATIO = 0.1  # restore from memory <= 0.1 x restore from storage


@dataclass
class RestoreFigures:
    failure_to_restored_s: float  # rank 1 raised -> the last rank has read its shard
    restore_s: float  # the ranks' reads (first start -> last end) + the slowest view's linking
    link_s: float  # the slowest rank's linking of its view (memory only)


def train_func(config: dict) -> None:
    import shutil

    from jax.experimental import multihost_utils

    from jaxtrain import Checkpoint, get_checkpoint, get_context, report
    from jaxtrain.worker import checkpoint_memory

    ctx = get_context()
    rank = ctx.get_world_rank()
    out = config["out_dir"]
    start = get_checkpoint()
    if start is not None:
        began = time.time()
        with open(os.path.join(start.path, f"shard-{rank}.bin"), "rb") as f:
            data = f.read()
        ended = time.time()
        assert len(data) == config["shard_bytes"]
        with open(os.path.join(out, f"restored-{rank}.json"), "w") as f:
            json.dump({"began": began, "ended": ended}, f)
        return
    src = os.path.join(out, f"src-{rank}")
    os.makedirs(src)
    block = random.Random(rank).randbytes(BLOCK_BYTES)
    with open(os.path.join(src, f"shard-{rank}.bin"), "wb") as f:
        for _ in range(config["shard_bytes"] // BLOCK_BYTES):
            f.write(block)
    report({"step": 1}, checkpoint=Checkpoint.from_directory(src))
    shutil.rmtree(src)
    committed = os.path.join(ctx.run_dir, "checkpoint_000001")
    while not os.path.exists(committed):
        time.sleep(0.01)
    if config["in_memory"]:
        held = os.path.join(checkpoint_memory.store_path(ctx.run_dir), f"rank{rank}", "a0-r1.json")
        while not os.path.exists(held):
            time.sleep(0.01)
    multihost_utils.sync_global_devices("committed")
    for name in os.listdir(committed):  # as if the page cache had served other data since
        fd = os.open(os.path.join(committed, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    multihost_utils.sync_global_devices("evicted")
    if rank == 1:
        with open(os.path.join(out, "failed.json"), "w") as f:
            json.dump({"at": time.time()}, f)
        raise RuntimeError("the benchmark's failure")


def run(workers: int, shard_bytes: int, env: dict[str, str], out_dir: str) -> RestoreFigures:
    try:
        with mock.patch.dict(os.environ, env), console_to(os.path.join(out_dir, "console.log")):
            JaxTrainer(
                train_func,
                train_loop_config={"out_dir": out_dir, "shard_bytes": shard_bytes,
                                   "in_memory": env.get("JAXTRAIN_CHECKPOINT_IN_MEMORY") == "1"},
                scaling_config=ScalingConfig(num_workers=workers),
                run_config=RunConfig(name="run", storage_path=out_dir,
                                     failure_config=FailureConfig(max_failures=1)),
            ).fit()
    except TrainingFailedError as e:
        sys.exit(f"jaxtrain fit() failed during the benchmark: {e}")
    failed = json.load(open(os.path.join(out_dir, "failed.json")))["at"]
    reads = [json.load(open(os.path.join(out_dir, f"restored-{r}.json"))) for r in range(workers)]
    links = []
    for r in range(workers):
        with open(os.path.join(out_dir, "run", "logs", f"rank-{r}.log")) as f:
            links += [float(s) for s in re.findall(r"linked in ([0-9.]+) s", f.read())]
    link = max(links, default=0.0)
    ended = max(x["ended"] for x in reads)
    return RestoreFigures(failure_to_restored_s=ended - failed,
                          restore_s=ended - min(x["began"] for x in reads) + link, link_s=link)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--shard-mib", type=int, default=256,
                        help="MiB each rank checkpoints (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    parser.add_argument("--warm-workers", action="store_true",
                        help="keep warm workers on (their start-up then overlaps the reads)")
    args = parser.parse_args()
    if min(args.workers, args.shard_mib, args.repeats) < 1 or args.warmup < 0:
        parser.error("--workers, --shard-mib and --repeats must be >= 1, --warmup >= 0")
    if args.workers < 2:
        parser.error("--workers must be >= 2 (rank 1 fails)")
    shard_bytes = args.shard_mib << 20
    if shard_bytes % BLOCK_BYTES:
        parser.error(f"--shard-mib must be a multiple of {BLOCK_BYTES >> 20}")

    common = {} if args.warm_workers else {"JAXTRAIN_WARM_WORKERS": "0"}
    configs = {
        "memory": {**common, "JAXTRAIN_CHECKPOINT_IN_MEMORY": "1"},
        "storage": common,
        "storage, no check": {**common, "JAXTRAIN_VERIFY_CHECKSUMS": "0"},
    }
    results: dict[str, list[RestoreFigures]] = {name: [] for name in configs}
    others: list[float] = []
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as tmp:
        for i in range(args.warmup + args.repeats):
            label = (f"warm-up {i + 1}/{args.warmup}" if i < args.warmup
                     else f"repeat {i - args.warmup + 1}/{args.repeats}")
            line = []
            for name, env in configs.items():
                out_dir = tempfile.mkdtemp(prefix=f"{name.split(',')[0]}-{i}-", dir=tmp)
                figures, other = measure(functools.partial(run, args.workers, shard_bytes, env,
                                                           out_dir))
                if i >= args.warmup:
                    results[name].append(figures)
                    others.append(other)
                line.append(f"{name} {figures.restore_s:.2f} s")
            print(f"{label}: " + "; ".join(line), flush=True)

    gib = args.workers * shard_bytes / (1 << 30)
    print(f"\n{args.workers} workers x {args.shard_mib} MiB = {gib:.2f} GiB, {args.repeats} "
          "repeats; median [min-max] over repeats")
    print(f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy during the "
          f"runs; warm workers {'on' if args.warm_workers else 'off'}")
    floor = [f.restore_s for f in results["storage, no check"]]
    print(f"{'configuration':<20}{'restore':<24}{'ratio to storage':<22}"
          f"{'failure -> restored':<24}{'view linked'}")
    for name, runs in results.items():
        restore = [f.restore_s for f in runs]
        ratios = [a / b for a, b in zip(restore, floor, strict=True)]
        link = spread([f.link_s for f in runs], "s") if name == "memory" else "-"
        print(f"{name:<20}{spread(restore, 's'):<24}{spread(ratios, 'x'):<22}"
              f"{spread([f.failure_to_restored_s for f in runs], 's'):<24}{link}")
    ratio = statistics.median(
        a.restore_s / b.restore_s
        for a, b in zip(results["memory"], results["storage, no check"], strict=True))
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"target restore from memory <= {TARGET_RATIO} x from storage: {verdict} "
          f"(median {ratio:.3f} x, {1 / ratio:.1f} times faster)")


if __name__ == "__main__":
    main()
