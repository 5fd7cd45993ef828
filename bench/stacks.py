"""Benchmark: what it costs to take every rank's stacks of a live run (``jaxtrain stack``), and
what the always-on part costs each report().

    .venv/bin/python bench/stacks.py [--workers 4] [--takes 10] [--reports 5000]

One run of N local CPU workers. Each rank times ``--reports`` calls of report(), then waits
until the benchmark is done. Meanwhile the benchmark asks the run's driver for every rank's
stacks ``--takes`` times, over its socket as the command does (jaxtrain.driver.live), each time
until every rank's file is written. Printed: the time to take the stacks, median [min-max], and
report()'s median, pooled over the ranks. What report() costs against the commit before is
bench/compare_commits.sh's to say.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig


def train_func(config: dict) -> None:
    from jaxtrain import get_context, report

    reports = []
    for step in range(config["reports"]):
        metrics = {"step": step, "loss": 1.0 / (step + 1)}
        start = time.perf_counter_ns()
        report(metrics)
        reports.append(time.perf_counter_ns() - start)
    rank = get_context().get_world_rank()
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"report_ns": reports}, f)
    while not os.path.exists(os.path.join(config["out"], "done")):
        time.sleep(0.01)  # the training thread's stack: here


def take_stacks(run_dir: str, out: str, workers: int, takes: int, times: list[float],
                errors: list[str]) -> None:
    from jaxtrain.driver import live

    try:
        deadline = time.monotonic() + 300
        while not all(os.path.exists(os.path.join(out, f"rank{r}.json"))
                      for r in range(workers)):
            if time.monotonic() > deadline:
                raise TimeoutError("the ranks did not finish their timed reports")
            time.sleep(0.05)
        for _ in range(takes):
            start = time.perf_counter()
            answer = live.request(run_dir, "stacks")
            times.append(time.perf_counter() - start)
            if "error" in answer:
                raise RuntimeError(answer["error"])
            files = os.listdir(answer["dir"])
            if len(files) != workers:
                raise RuntimeError(f"{answer['dir']} holds {files}")
    except Exception as e:  # said by the main thread, after the run
        errors.append(repr(e))
    finally:
        open(os.path.join(out, "done"), "w").close()


def spread(values: list[float], unit: str, scale: float) -> str:
    return (f"{statistics.median(values) * scale:.3g} [{min(values) * scale:.3g}-"
            f"{max(values) * scale:.3g}] {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--takes", type=int, default=10)
    parser.add_argument("--reports", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        os.mkdir(out)
        times: list[float] = []
        errors: list[str] = []
        asker = threading.Thread(
            target=take_stacks,
            args=(os.path.join(tmp, "runs", "stacks"), out, args.workers, args.takes, times,
                  errors))
        asker.start()
        JaxTrainer(train_func, train_loop_config={"reports": args.reports, "out": out},
                   scaling_config=ScalingConfig(num_workers=args.workers),
                   run_config=RunConfig(name="stacks", storage_path=os.path.join(tmp, "runs")),
                   ).fit()
        asker.join()
        if errors:
            sys.exit(f"taking the stacks failed: {errors[0]}")
        reports = []
        for r in range(args.workers):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                reports += json.load(f)["report_ns"]
    print(f"stacks of {args.workers} ranks (local), {args.takes} takes: "
          f"{spread(times, 's', 1.0)}")
    print(f"report() median {statistics.median(reports):.0f} ns, pooled over "
          f"{args.workers} x {args.reports} calls")


if __name__ == "__main__":
    main()
