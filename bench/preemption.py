"""Benchmark: a preemption notice, against the same run's fresh start.

    .venv/bin/python bench/preemption.py [--workers 4] [--repeats 3] [--warmup 1]

Each repeat is one ``JaxTrainer(...).fit()`` on N local CPU workers with
``FailureConfig(max_failures=0)``, whose training function is Ray Train V2's documented pattern:
a step of ``--step-ms`` (a sleep standing for the compute), ``get_preemption_info()`` and a
report every step, a periodic checkpoint every ``--every`` steps, and on a notice one
just-in-time checkpoint. On attempt 0, rank ``--rank`` notes ``time.time()`` and sends itself a
SIGTERM (as a spot VM's shutdown does) at step ``--at``. The group goes on until the just-in-time
checkpoint is committed, is stopped and restarted from it, and finishes.

Figures, all differences of ``time.time()`` (one clock for the driver, the controller and the
workers on one machine):

* notice -> committed: the SIGTERM to the just-in-time checkpoint's commit (its ``time`` in
  ``<run>/checkpoints.json``).
* notice -> training again: the SIGTERM to the first report() of attempt 1 returning, on the last
  rank to get there: the whole cost of a preemption in time.
* steps lost: the steps of attempt 0 after the notice until the just-in-time checkpoint (the
  notice's latency in steps: trained, saved, not lost) and the steps attempt 1 did again (after
  the checkpoint it restored: lost). The pattern's promise is none lost.
* fresh start, the floor: ``fit()`` to the first report() of attempt 0 returning, last rank, in
  the same run.

The table printed last gives each figure as median [min-max] over the repeats, and the ratio
notice -> training again / fresh start (per repeat, then the median): below 1, a preemption costs
less than starting the run did. Warm workers (the default, ``JAXTRAIN_WARM_WORKERS=1``) restart
from standbys; ``JAXTRAIN_WARM_WORKERS=0`` measures a cold restart.
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

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError

STEPS = 60  # of the whole run


@dataclass
class PreemptionFigures:
    fresh_start_s: float  # fit() -> first report of attempt 0, last rank
    committed_s: float  # notice -> the just-in-time checkpoint committed
    training_again_s: float  # notice -> first report of attempt 1, last rank
    steps_to_checkpoint: int  # steps after the notice's until the just-in-time checkpoint's
    steps_redone: int  # steps attempt 1 did again


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing: a rank did not get as far as the benchmark needs")
    with open(path) as f:
        return json.load(f)


def train_func(config: dict) -> None:
    from jaxtrain import Checkpoint, get_checkpoint, get_context, get_preemption_info, report

    ctx = get_context()
    rank, attempt, out_dir = ctx.get_world_rank(), ctx.get_attempt(), config["out_dir"]
    start = 0
    if (checkpoint := get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            start = read_json(os.path.join(d, "step.json"))["step"] + 1
    saved_on_preemption = False
    for step in range(start, STEPS):
        time.sleep(config["step_s"])
        if attempt == 0 and step == config["at"] and rank == config["rank"]:
            write_json(os.path.join(out_dir, "notice.json"), {"time": time.time(), "step": step})
            os.kill(os.getpid(), signal.SIGTERM)
        info = get_preemption_info()
        due = (step + 1) % config["every"] == 0
        if info is not None and not saved_on_preemption:
            saved_on_preemption = due = True
        if due:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    write_json(os.path.join(d, "step.json"), {"step": step})
                report({"step": step, "attempt": attempt}, checkpoint=Checkpoint.from_directory(d))
        else:
            report({"step": step, "attempt": attempt})
        if step == start:
            write_json(os.path.join(out_dir, f"first-a{attempt}-rank{rank}.json"),
                       {"time": time.time()})


def run_preempted(workers: int, config: dict, out_dir: str) -> PreemptionFigures:
    t_fit = time.time()
    try:
        with console_to(os.path.join(out_dir, "console.log")):
            JaxTrainer(
                train_func,
                train_loop_config={**config, "out_dir": out_dir},
                scaling_config=ScalingConfig(num_workers=workers),
                run_config=RunConfig(name="run", storage_path=out_dir,
                                     failure_config=FailureConfig(max_failures=0)),
            ).fit()
    except TrainingFailedError as e:
        sys.exit(f"jaxtrain fit() failed during the benchmark: {e}")
    run = os.path.join(out_dir, "run")
    attempts = read_json(os.path.join(run, "run.json"))["attempts"]
    if [a.get("failure", {}).get("cause") for a in attempts[:-1]] != ["preemption"]:
        sys.exit(f"expected one preemption, then a finished attempt: {attempts}")
    restored = os.path.basename(attempts[1]["restored_from"] or "")
    checkpoint = next((c for c in read_json(os.path.join(run, "checkpoints.json"))["checkpoints"]
                       if c["dir_name"] == restored), None)
    if checkpoint is None:
        sys.exit(f"attempt 1 did not restore a checkpoint of attempt 0: {attempts[1]}")
    with open(os.path.join(run, "result.jsonl")) as f:
        rows = [json.loads(line)["metrics"] for line in f]
    notice = read_json(os.path.join(out_dir, "notice.json"))

    def last_first_report(attempt: int) -> float:
        return max(read_json(os.path.join(out_dir, f"first-a{attempt}-rank{rank}.json"))["time"]
                   for rank in range(workers))

    saved_step = checkpoint["metrics"]["step"]
    return PreemptionFigures(
        fresh_start_s=last_first_report(0) - t_fit,
        committed_s=checkpoint["time"] - notice["time"],
        training_again_s=last_first_report(1) - notice["time"],
        steps_to_checkpoint=saved_step - notice["step"],
        steps_redone=sum(1 for r in rows if r["attempt"] == 0 and r["step"] > saved_step),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first (default 1)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="ms per step (default 20)")
    parser.add_argument("--every", type=int, default=25,
                        help="steps between periodic checkpoints (default 25)")
    parser.add_argument("--at", type=int, default=30,
                        help="the step of attempt 0 at which the SIGTERM comes (default 30)")
    parser.add_argument("--rank", type=int, default=1, help="the rank it comes to (default 1)")
    args = parser.parse_args()
    if min(args.workers, args.repeats, args.every) < 1 or args.warmup < 0 or args.step_ms < 0:
        parser.error("--workers, --repeats and --every must be >= 1, --warmup and --step-ms >= 0")
    if not 0 <= args.rank < args.workers or not 0 <= args.at < STEPS - 2:
        parser.error(f"--rank must be a rank (0 to --workers - 1), --at a step of 0..{STEPS - 3}")
    config = {"step_s": args.step_ms / 1000, "every": args.every, "at": args.at,
              "rank": args.rank}

    figures: list[PreemptionFigures] = []
    others: list[float] = []  # cores busy with other processes, per measured run
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as tmp:
        for i in range(args.warmup + args.repeats):
            warm = i < args.warmup
            label = (f"warm-up {i + 1}/{args.warmup}" if warm
                     else f"repeat {i - args.warmup + 1}/{args.repeats}")
            out_dir = tempfile.mkdtemp(prefix=f"preempted-{i}-", dir=tmp)
            f, other = measure(functools.partial(run_preempted, args.workers, config, out_dir))
            if not warm:
                figures.append(f)
                others.append(other)
            print(f"{label}: notice -> committed {f.committed_s * 1000:.0f} ms, -> training "
                  f"again {f.training_again_s:.2f} s; fresh start {f.fresh_start_s:.2f} s; "
                  f"steps to the checkpoint {f.steps_to_checkpoint}, redone {f.steps_redone}; "
                  f"others busy {other:.1f} cores", flush=True)

    warm_workers = os.environ.get("JAXTRAIN_WARM_WORKERS", "1") != "0"
    print(f"\n{args.workers} workers, {args.step_ms:g} ms steps, SIGTERM to rank {args.rank} at "
          f"step {args.at}, periodic checkpoints every {args.every} steps, warm workers "
          f"{'on' if warm_workers else 'off'}; {args.repeats} repeats, median [min-max]")
    print(f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy during the "
          "runs; well above 0, the figures measure the machine's load more than jaxtrain")
    print("notice -> committed: SIGTERM -> the just-in-time checkpoint committed\n"
          "notice -> training again: SIGTERM -> first report() of attempt 1, last rank\n"
          "floor: the same run's fresh start, fit() -> first report() of attempt 0, last rank; "
          "ratio < 1: a preemption costs less than the start did")
    fresh = [f.fresh_start_s for f in figures]
    print(f"{'figure':<28}{'jaxtrain':<28}{'fresh start':<26}jaxtrain/fresh start")
    print(f"{'notice -> committed':<28}{spread([f.committed_s for f in figures], 'ms', 1000)}")
    again = [f.training_again_s for f in figures]
    ratios = [a / b for a, b in zip(again, fresh, strict=True)]
    print(f"{'notice -> training again':<28}{spread(again, 's'):<28}{spread(fresh, 's'):<26}"
          f"{spread(ratios, 'x')}")
    to_checkpoint = [f.steps_to_checkpoint for f in figures]
    redone = [f.steps_redone for f in figures]
    print(f"steps from the notice to the just-in-time checkpoint: median "
          f"{statistics.median(to_checkpoint):g} [{min(to_checkpoint)}-{max(to_checkpoint)}] "
          "(trained and saved)")
    print(f"steps lost (redone) per preemption: median {statistics.median(redone):g} "
          f"[{min(redone)}-{max(redone)}]")


if __name__ == "__main__":
    main()
