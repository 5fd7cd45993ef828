"""Benchmark: committing a 1 GiB checkpoint from 4 ranks, against cp + sync of the same files.

    .venv/bin/python bench/checkpoint_commit.py [--workers 4] [--shard-mib 256] [--repeats 3]

Before any run, the driver writes one shard per rank (``--shard-mib`` MiB of random bytes:
a 4 MiB random block repeated) under ``src/rank<r>/`` in a temporary directory, and fsyncs it,
so that both sides copy the very same files, clean and in the page cache. Each repeat then runs,
in turn (ABAB... so that machine noise hits both):

* jaxtrain: ``JaxTrainer(...).fit()`` on N local CPU workers. Every rank waits at a barrier
  (``sync_global_devices``), notes ``time.time()`` and calls
  ``report(..., checkpoint=Checkpoint.from_directory(src/rank<r>))``. The commit time is from the
  FIRST rank's call to the controller's timestamp of the round in ``result.jsonl``, which it takes
  after the checkpoint is committed: staged, merged, renamed into place, fsynced, indexed.
* floor: one ``cp`` of the same N files into a fresh directory on the same disk, then one
  ``sync`` of the copied files and that directory (fsync of each, which is what jaxtrain pays
  for durability; ``sync -f`` would flush the whole filesystem, other processes' writes too).
* bare cp (informational): the same ``cp`` without ``sync``; its dirty pages are flushed after
  the clock stops.

Training time blocked per checkpoint, from the same jaxtrain runs: each rank's ``report()`` call to
its return (the slowest rank's), against the baseline of a synchronous commit, which blocks each
rank from its call until the round's commit has ended: after ``report()`` returns, each rank waits
until its background stager has written and reported the checkpoint and the controller's notice
that the commit ended has come (what the next ``report(checkpoint=)`` waits for) and notes the
time. The background commit's time is the rest: the last rank's return to the
commit's end. Each run checkpoints the same files ``--rounds`` times (default 3), as a training
loop does: the first checkpoint of a worker process reads into fresh memory, the later ones into
the memory its last snapshot left (storage/checkpoint.h); both are printed, and the target is
judged on the later ones, what every checkpoint of a run after its first costs. The commit
figures are those of the first round.

After each jaxtrain run, restoring is measured on its committed checkpoint, as a resume does it
before handing the checkpoint to the workers: ``verify_checkpoint`` (every file's CRC-32C, files in
parallel) and the same on one thread, against the floor of reading the files (``cat`` of each, one
after the other, to /dev/null); the files are in the page cache, so these measure CPU and memory
bandwidth, which is what the parallel check divides.

All data are deleted as soon as they are measured (and the filesystem synced, outside the timed
regions), and the sources at the end. The table printed last gives each figure as median
[min-max] over the repeats, and the ratio jaxtrain/floor (per repeat, then the median).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from startup_and_report import console_to, measure, spread

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError, _core

BLOCK_BYTES = 4 << 20
TARGET_RATIO = 1.25  # commit <= 1.25 x (cp + sync)
TARGET_BLOCKED_RATIO = 0.1  # report(checkpoint=) blocks <= 0.1 x the synchronous commit


@dataclass
class CommitFigures:
    """One jaxtrain run, or one copy, of one repeat."""

    total_s: float  # jaxtrain: first report() call -> committed; floor: cp (+ sync)
    staged_s: float = 0.0  # jaxtrain: first report() call -> last rank's report() returned
    skew_s: float = 0.0  # jaxtrain: first to last rank's report() call
    verify_s: float = 0.0  # jaxtrain: verify_checkpoint of the committed checkpoint, parallel
    verify_1_s: float = 0.0  # the same on one thread
    read_s: float = 0.0  # cat of the checkpoint's files to /dev/null
    blocked_s: float = 0.0  # jaxtrain: the slowest rank's report() call -> return
    sync_s: float = 0.0  # jaxtrain: the slowest rank's report() call -> commit ended (notice)
    # The same for the rounds after the first (median over them): checkpoints of the same files.
    blocked_later_s: float = 0.0
    sync_later_s: float = 0.0
    # Every rank's files read at once into memory already touched, the slowest rank: the floor of
    # an in-memory snapshot (measured after the run, on the same page-cached sources).
    memory_floor_s: float = 0.0


def write_sources(src_root: str, workers: int, shard_bytes: int) -> list[str]:
    """Writes one shard per rank (``src_root/rank<r>/shard-<r>.bin``), fsynced; returns the
    directories, by rank."""
    dirs = []
    for rank in range(workers):
        rank_dir = os.path.join(src_root, f"rank{rank}")
        os.makedirs(rank_dir)
        block = random.Random(rank).randbytes(BLOCK_BYTES)
        with open(os.path.join(rank_dir, f"shard-{rank}.bin"), "wb") as f:
            for _ in range(shard_bytes // BLOCK_BYTES):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        dirs.append(rank_dir)
    return dirs


def sync_filesystem(path: str) -> None:
    """Flushes the filesystem of ``path`` (deleted files' metadata and discards included), so that
    one measurement's leftovers are not written back during the next one."""
    subprocess.run(["sync", "-f", path], check=True)


def train_func(config: dict) -> None:
    from jax.experimental import multihost_utils

    from jaxtrain import Checkpoint, get_context, report, session

    rank = get_context().get_world_rank()
    checkpoint = Checkpoint.from_directory(config["sources"][rank])
    rounds = []
    for round_ in range(config["rounds"]):
        multihost_utils.sync_global_devices(f"checkpoint_commit-{round_}")  # all call at once
        t_call = time.time()
        report({"rank": rank}, checkpoint=checkpoint)
        t_staged = time.time()
        # What a synchronous commit would block until: the controller's notice that it ended.
        session.require("report").wait_checkpoints_settled()
        rounds.append({"t_call": t_call, "t_staged": t_staged, "t_settled": time.time()})
    with open(os.path.join(config["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(rounds, f)


def run_jaxtrain(sources: list[str], shard_bytes: int, rounds: int, out_dir: str) -> CommitFigures:
    workers = len(sources)
    try:
        with console_to(os.path.join(out_dir, "console.log")):
            JaxTrainer(
                train_func,
                train_loop_config={"sources": sources, "out_dir": out_dir, "rounds": rounds},
                scaling_config=ScalingConfig(num_workers=workers),
                run_config=RunConfig(name="run", storage_path=out_dir),
            ).fit()
    except TrainingFailedError as e:
        sys.exit(f"jaxtrain fit() failed during the benchmark: {e}")
    run_dir = os.path.join(out_dir, "run")
    with open(os.path.join(run_dir, "result.jsonl")) as f:
        round_1 = json.loads(f.readline())
    with open(os.path.join(run_dir, "checkpoints.json")) as f:
        record = json.load(f)["checkpoints"][0]
    if round_1.get("checkpoint") != record["dir_name"] or record["bytes"] != workers * shard_bytes:
        sys.exit(f"round 1 did not commit a checkpoint of {workers * shard_bytes} bytes: {record}")
    by_rank = []
    for rank in range(workers):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            by_rank.append(json.load(f))
    ranks = [r[0] for r in by_rank]  # the first round
    first_call = min(r["t_call"] for r in ranks)

    def slowest(round_: int, start: str, end: str) -> float:
        return max(r[round_][end] - r[round_][start] for r in by_rank)

    later = range(1, rounds)
    figures = CommitFigures(
        total_s=round_1["time"] - first_call,
        staged_s=max(r["t_staged"] for r in ranks) - first_call,
        skew_s=max(r["t_call"] for r in ranks) - first_call,
        blocked_s=slowest(0, "t_call", "t_staged"),
        sync_s=slowest(0, "t_call", "t_settled"),
        blocked_later_s=statistics.median(slowest(i, "t_call", "t_staged") for i in later),
        sync_later_s=statistics.median(slowest(i, "t_call", "t_settled") for i in later),
    )
    figures.memory_floor_s = run_memory_floor(sources)
    ckpt = os.path.join(run_dir, record["dir_name"])
    figures.verify_s = timed(lambda: _core.verify_checkpoint(ckpt, True))
    figures.verify_1_s = timed(lambda: _core.verify_checkpoint(ckpt, True, 1))
    shards = [os.path.join(ckpt, name) for name in sorted(os.listdir(ckpt))
              if name.startswith("shard-")]
    figures.read_s = timed(lambda: subprocess.run(["cat", *shards], check=True,
                                                  stdout=subprocess.DEVNULL))
    shutil.rmtree(run_dir)
    sync_filesystem(out_dir)
    return figures


# One process per rank reads its shard into memory it has touched already, once told to go on its
# stdin, and prints how long the read took: what any in-memory snapshot of the files must pay.
READ_INTO_MEMORY = """
import os, sys, time
files = sys.argv[1:]
buffers = [bytearray(os.path.getsize(f)) for f in files]  # zero-filled: every page touched
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
for f, buffer in zip(files, buffers):
    with open(f, "rb", buffering=0) as src:
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            done += src.readinto(view[done:])
print(time.perf_counter() - start, flush=True)
"""


def run_memory_floor(sources: list[str]) -> float:
    """The slowest rank's copy of its files into touched memory, every rank at once."""
    procs = [subprocess.Popen(
        [sys.executable, "-c", READ_INTO_MEMORY,
         *[os.path.join(d, name) for name in sorted(os.listdir(d))]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for d in sources]
    for p in procs:  # every process has allocated and touched its buffers
        if p.stdout.readline().strip() != "ready":
            sys.exit("a reader of the memory floor did not start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    seconds = [float(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("the memory floor's readers failed")
    return max(seconds)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_copy(sources: list[str], durable: bool, out_dir: str) -> CommitFigures:
    files = [os.path.join(d, name) for d in sources for name in sorted(os.listdir(d))]
    dest = os.path.join(out_dir, "copy")
    os.mkdir(dest)
    copies = [os.path.join(dest, os.path.basename(f)) for f in files]
    start = time.perf_counter()
    subprocess.run(["cp", *files, dest], check=True)
    if durable:
        subprocess.run(["sync", *copies, dest], check=True)
    elapsed = time.perf_counter() - start
    shutil.rmtree(dest)
    sync_filesystem(out_dir)
    return CommitFigures(total_s=elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument(
        "--shard-mib", type=int, default=256, help="MiB each rank checkpoints (default 256)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured jaxtrain/floor pairs (default 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured pairs run first (default 1)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="checkpoints of the same files per run, the first into fresh memory (default 3)"
    )
    args = parser.parse_args()
    if min(args.workers, args.shard_mib, args.repeats) < 1 or args.warmup < 0 or args.rounds < 2:
        parser.error("--workers, --shard-mib and --repeats must be >= 1, --warmup >= 0, "
                     "--rounds >= 2")
    shard_bytes = args.shard_mib << 20
    if shard_bytes % BLOCK_BYTES:
        parser.error(f"--shard-mib must be a multiple of {BLOCK_BYTES >> 20}")

    names = ["jaxtrain", "cp + sync", "cp"]
    results: dict[str, list[CommitFigures]] = {name: [] for name in names}
    others: list[float] = []  # cores busy with other processes, per measured run
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as tmp:
        sources = write_sources(os.path.join(tmp, "src"), args.workers, shard_bytes)
        runners: dict[str, Callable[[str], CommitFigures]] = {
            "jaxtrain": functools.partial(run_jaxtrain, sources, shard_bytes, args.rounds),
            "cp + sync": functools.partial(run_copy, sources, True),
            "cp": functools.partial(run_copy, sources, False),
        }
        for i in range(args.warmup + args.repeats):
            if i < args.warmup:
                label = f"warm-up {i + 1}/{args.warmup}"
            else:
                label = f"repeat {i - args.warmup + 1}/{args.repeats}"
            line = []
            for name in names:
                out_dir = tempfile.mkdtemp(prefix=f"{name.replace(' ', '')}-{i}-", dir=tmp)
                figures, other = measure(functools.partial(runners[name], out_dir))
                if i >= args.warmup:
                    results[name].append(figures)
                    others.append(other)
                line.append(f"{name} {figures.total_s:.2f} s, others busy {other:.1f} cores")
            print(f"{label}: " + "; ".join(line), flush=True)

    total_gib = args.workers * shard_bytes / (1 << 30)
    print(
        f"\n{args.workers} workers x {args.shard_mib} MiB = {total_gib:.2f} GiB, "
        f"{args.repeats} repeats; median [min-max] over repeats"
    )
    print(
        f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy during the "
        "runs; well above 0, the figures measure the machine's load more than jaxtrain"
    )
    print(
        "jaxtrain commit: first rank's report(checkpoint=) call -> round committed (result.jsonl)\n"
        "floor: cp of the same files + sync (fsync) of the copies and their directory\n"
        "sources were fsynced and in the page cache on both sides; ratio > 1: jaxtrain costs more"
    )
    skews = [f.skew_s * 1000 for f in results["jaxtrain"]]
    print(f"ranks' report() calls spread over {spread(skews, 'ms')} after the barrier")
    floor = [f.total_s for f in results["cp + sync"]]
    commit = [f.total_s for f in results["jaxtrain"]]
    ratio = statistics.median(a / b for a, b in zip(commit, floor, strict=True))
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"target commit <= {TARGET_RATIO:.2f} x floor: {verdict} (median {ratio:.2f} x)")
    rows = [
        ("commit (jaxtrain)", commit),
        ("  of which staging", [f.staged_s for f in results["jaxtrain"]]),
        ("bare cp, no sync (info)", [f.total_s for f in results["cp"]]),
    ]
    print(f"{'figure':<28}{'value':<24}{'floor (cp + sync)':<24}value/floor")
    for title, values in rows:
        ratios = [a / b for a, b in zip(values, floor, strict=True)]
        print(f"{title:<28}{spread(values, 's'):<24}{spread(floor, 's'):<24}{spread(ratios, 'x')}")
    print_blocking(results["jaxtrain"])
    read = [f.read_s for f in results["jaxtrain"]]
    print("\nrestore check of the committed checkpoint (page cache); floor: cat of its files")
    print(f"{'figure':<28}{'value':<24}{'floor (cat)':<24}value/floor")
    for title, values in [("verify, parallel", [f.verify_s for f in results["jaxtrain"]]),
                          ("verify, one thread", [f.verify_1_s for f in results["jaxtrain"]])]:
        ratios = [a / b for a, b in zip(values, read, strict=True)]
        print(f"{title:<28}{spread(values, 's'):<24}{spread(read, 's'):<24}{spread(ratios, 'x')}")


def print_blocking(runs: list[CommitFigures]) -> None:
    sync = [f.sync_later_s for f in runs]
    blocked = [f.blocked_later_s for f in runs]
    ratio = statistics.median(a / b for a, b in zip(blocked, sync, strict=True))
    verdict = "met" if ratio <= TARGET_BLOCKED_RATIO else "NOT met"
    print(
        "\ntraining time blocked per checkpoint: report(checkpoint=) call -> return, slowest rank\n"
        "baseline (synchronous commit): report(checkpoint=) call -> the round's commit ended, "
        "slowest rank, same runs\n"
        "later checkpoints: rounds 2.. of a run (median), the same files again, read into the "
        "memory of the last snapshot; first: round 1, into fresh memory"
    )
    print(f"target blocked <= {TARGET_BLOCKED_RATIO:.2f} x synchronous (later checkpoints): "
          f"{verdict} (median {ratio:.3f} x)")
    print(f"{'figure':<32}{'value':<24}{'baseline (sync)':<24}value/baseline")
    rows = [("blocked, later checkpoints", blocked, sync),
            ("blocked, first checkpoint", [f.blocked_s for f in runs], [f.sync_s for f in runs]),
            ("background commit, first (info)", [f.total_s - f.staged_s for f in runs],
             [f.sync_s for f in runs])]
    for title, values, base in rows:
        ratios = [a / b for a, b in zip(values, base, strict=True)]
        print(f"{title:<32}{spread(values, 's'):<24}{spread(base, 's'):<24}{spread(ratios, 'x')}")
    floor = [f.memory_floor_s for f in runs]
    ratios = [a / b for a, b in zip(blocked, floor, strict=True)]
    print("floor of any in-memory snapshot: every rank's files read at once into memory already "
          "touched, slowest rank")
    print(f"{'blocked, later checkpoints':<32}{spread(blocked, 's'):<24}{spread(floor, 's'):<24}"
          f"{spread(ratios, 'x')} of the memory floor")


if __name__ == "__main__":
    main()
