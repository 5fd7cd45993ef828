"""Benchmark: recovering from a killed worker, against a fresh start of the same group.

    .venv/bin/python bench/failure_recovery.py [--workers 4] [--repeats 3] [--warmup 1]

Each repeat runs, in turn (ABAB... so that machine noise hits both):

* jaxtrain with a failure: ``JaxTrainer(...).fit()`` on N local CPU workers with
  ``FailureConfig(max_failures=1)``. Every rank notes ``time.time()`` at the first line of the
  training function, reports once with a small checkpoint, then reports every ``--interval-ms``.
  On attempt 0, rank ``--kill-rank`` writes ``time.time()`` to a file at its ``--kill-step``-th
  report and SIGKILLs itself at once. The controller stops the group and restarts it from the
  checkpoint; attempt 1 reports a few times and returns.
* floor: a fresh start of the same group, as in startup_and_report.py: ``time.time()`` just
  before ``fit()`` (passed to the workers in ``train_loop_config``) to the first line of the same
  training function (without the kill), on the last rank to get there.

Figures, all differences of ``time.time()`` (one clock for the driver, the controller and the
workers on one machine):

* detection + teardown: the kill to attempt 0's ``end_time`` in ``<run>/run.json``, which the
  controller records once every process of the group is reaped and its output drained.
* restart: the kill to the first line of the training function of attempt 1, on the last rank
  to get there; it includes detection + teardown.

The table printed last gives each figure as median [min-max] over the repeats, and the ratio
restart / fresh start (per repeat, then the median).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from startup_and_report import console_to, measure, spread

from jaxtrain import (
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)

DETECTION_TARGET_S = 0.5
RESTART_TARGET_RATIO = 1.10
STEPS_AFTER_START = 5  # reports of a run, or attempt, that is not killed


@dataclass
class RecoveryFigures:
    """One jaxtrain run with a failure."""

    detection_s: float  # kill -> attempt 0 ended (every process reaped)
    restart_s: float  # kill -> first line of attempt 1, last rank


def write_time(path: str, t: float) -> None:
    with open(path, "w") as f:
        json.dump({"time": t}, f)


def read_time(path: str) -> float:
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing: a rank did not get as far as the benchmark needs")
    with open(path) as f:
        return json.load(f)["time"]


def _kill_now(config: dict, step: int) -> bool:
    """Whether the killing rank dies at `step`: its ``kill_step``-th report, or, with a
    ``kill_file`` (warm_workers.py), the first report after that file appeared."""
    if config.get("kill_file"):
        return os.path.exists(config["kill_file"])
    return step == config["kill_step"]


def train_func(config: dict) -> None:
    t_first = time.time()  # must stay the first line: this is what start-up and restart measure
    from jaxtrain import Checkpoint, get_checkpoint, get_context, report

    ctx = get_context()
    rank, attempt, out_dir = ctx.get_world_rank(), ctx.get_attempt(), config["out_dir"]
    write_time(os.path.join(out_dir, f"first-a{attempt}-rank{rank}.json"), t_first)
    if attempt == 0:
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"state-rank{rank}.json"), "w") as f:
                json.dump({"step": 0}, f)
            report({"step": 0}, checkpoint=Checkpoint.from_directory(d))
    elif get_checkpoint() is None:
        raise RuntimeError(f"attempt {attempt} started without the checkpoint of attempt 0")

    killing = config["kill"] and attempt == 0
    steps = sys.maxsize if killing else STEPS_AFTER_START  # the other ranks run until stopped
    for step in range(1, steps + 1):
        time.sleep(config["interval_s"])
        if killing and rank == config["kill_rank"] and _kill_now(config, step):
            with open(os.path.join(out_dir, "kill.json"), "w") as f:
                f.write(json.dumps({"time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        report({"step": step})


def fit(out_dir: str, workers: int, config: dict) -> dict:
    """Runs one fit() with worker output in a log file; returns run.json."""
    try:
        with console_to(os.path.join(out_dir, "console.log")):
            JaxTrainer(
                train_func,
                train_loop_config={**config, "out_dir": out_dir},
                scaling_config=ScalingConfig(num_workers=workers),
                run_config=RunConfig(
                    name="run",
                    storage_path=out_dir,
                    failure_config=FailureConfig(max_failures=1),
                ),
            ).fit()
    except TrainingFailedError as e:
        sys.exit(f"jaxtrain fit() failed during the benchmark: {e}")
    with open(os.path.join(out_dir, "run", "run.json")) as f:
        return json.load(f)


def last_first_line(out_dir: str, workers: int, attempt: int) -> float:
    return max(
        read_time(os.path.join(out_dir, f"first-a{attempt}-rank{rank}.json"))
        for rank in range(workers)
    )


def run_failure(workers: int, config: dict, out_dir: str) -> RecoveryFigures:
    state = fit(out_dir, workers, {**config, "kill": True})
    attempts = state["attempts"]
    failure = attempts[0].get("failure") or {}
    if len(attempts) != 2 or failure.get("rank") != config["kill_rank"]:
        sys.exit(f"expected rank {config['kill_rank']} to fail once, then a restart: {attempts}")
    if not attempts[1].get("restored_from"):
        sys.exit(f"attempt 1 did not restore the checkpoint of attempt 0: {attempts[1]}")
    t_kill = read_time(os.path.join(out_dir, "kill.json"))
    return RecoveryFigures(
        detection_s=attempts[0]["end_time"] - t_kill,
        restart_s=last_first_line(out_dir, workers, attempt=1) - t_kill,
    )


def run_fresh(workers: int, config: dict, out_dir: str) -> float:
    t0 = time.time()
    fit(out_dir, workers, {**config, "kill": False})
    return last_first_line(out_dir, workers, attempt=0) - t0


def main() -> None:
    # Cold starts, every fit() of its own processes: bench/warm_workers.py measures warm ones.
    os.environ.setdefault("JAXTRAIN_WARM_WORKERS", "0")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured failure/fresh pairs (default 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured pairs run first (default 1)"
    )
    parser.add_argument(
        "--interval-ms", type=float, default=50.0, help="ms between reports (default 50)"
    )
    parser.add_argument(
        "--kill-step", type=int, default=20, help="the report at which a rank dies (default 20)"
    )
    parser.add_argument(
        "--kill-rank", type=int, default=1, help="the rank that kills itself (default 1)"
    )
    args = parser.parse_args()
    if min(args.workers, args.repeats, args.kill_step) < 1 or args.warmup < 0:
        parser.error("--workers, --repeats and --kill-step must be >= 1, --warmup >= 0")
    if not 0 <= args.kill_rank < args.workers or args.interval_ms < 0:
        parser.error("--kill-rank must be a rank (0 to --workers - 1), --interval-ms >= 0")
    config = {
        "interval_s": args.interval_ms / 1000,
        "kill_step": args.kill_step,
        "kill_rank": args.kill_rank,
    }

    recoveries: list[RecoveryFigures] = []
    fresh: list[float] = []
    others: list[float] = []  # cores busy with other processes, per measured run
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as tmp:
        for i in range(args.warmup + args.repeats):
            if i < args.warmup:
                label = f"warm-up {i + 1}/{args.warmup}"
            else:
                label = f"repeat {i - args.warmup + 1}/{args.repeats}"
            out_dir = tempfile.mkdtemp(prefix=f"failure-{i}-", dir=tmp)
            recovery, other_a = measure(
                functools.partial(run_failure, args.workers, config, out_dir)
            )
            out_dir = tempfile.mkdtemp(prefix=f"fresh-{i}-", dir=tmp)
            start, other_b = measure(functools.partial(run_fresh, args.workers, config, out_dir))
            if i >= args.warmup:
                recoveries.append(recovery)
                fresh.append(start)
                others += [other_a, other_b]
            print(
                f"{label}: detection {recovery.detection_s:.3f} s, "
                f"restart {recovery.restart_s:.2f} s, others busy {other_a:.1f} cores; "
                f"fresh start {start:.2f} s, others busy {other_b:.1f} cores",
                flush=True,
            )

    detection = [r.detection_s for r in recoveries]
    restart = [r.restart_s for r in recoveries]
    relaunch = [r.restart_s - r.detection_s for r in recoveries]
    print(
        f"\n{args.workers} workers, rank {args.kill_rank} SIGKILLs itself at report "
        f"{args.kill_step} (every {args.interval_ms:g} ms), {args.repeats} repeats; "
        "median [min-max] over repeats"
    )
    print(
        f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy during the "
        "runs; well above 0, the figures measure the machine's load more than jaxtrain"
    )
    print(
        "detection + teardown: kill -> attempt 0 ended, every process reaped (run.json)\n"
        "restart: kill -> first line of attempt 1, last rank (includes detection + teardown)\n"
        "floor: fresh start, fit() -> first line, last rank; ratio > 1: restart costs more"
    )
    median_detection = statistics.median(detection)
    median_ratio = statistics.median(a / b for a, b in zip(restart, fresh, strict=True))
    verdicts = [
        ("detection + teardown", median_detection, DETECTION_TARGET_S, "s"),
        ("restart / fresh start", median_ratio, RESTART_TARGET_RATIO, "x"),
    ]
    for title, value, target, unit in verdicts:
        verdict = "met" if value <= target else "NOT met"
        print(f"target {title} <= {target:.2f} {unit}: {verdict} (median {value:.2f} {unit})")
    print(f"{'figure':<32}{'jaxtrain':<26}{'fresh start':<26}jaxtrain/fresh start")
    print(f"{'detection + teardown':<32}{spread(detection, 'ms', 1000)}")
    for title, values in [("restart (last rank)", restart), ("  of which relaunch", relaunch)]:
        ratios = [a / b for a, b in zip(values, fresh, strict=True)]
        print(f"{title:<32}{spread(values, 's'):<26}{spread(fresh, 's'):<26}{spread(ratios, 'x')}")


if __name__ == "__main__":
    main()
