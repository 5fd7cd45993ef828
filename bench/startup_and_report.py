"""Benchmark: jaxtrain's start-up time and report() cost, each against a bare-JAX floor.

    .venv/bin/python bench/startup_and_report.py [--workers 4] [--repeats 5] [--reports 10000]

Each repeat runs, in turn (ABAB... so that machine noise hits both):

* jaxtrain: ``JaxTrainer(...).fit()`` on N local CPU workers. Every rank notes ``time.time()`` at
  the first line of the training function, then times ``report()`` of a small metrics dict.
* floor: N bare processes (bench/bare_worker.py) that import jax and call
  ``jax.distributed.initialize`` themselves, note ``time.time()`` on the next line, then time
  ``json.dumps`` + ``os.write`` of the same dict, one line to a file.

Start-up is measured from just before ``fit()`` (or just before the first ``Popen``) to the first
line on the LAST rank to get there. Both sides write their figures to per-rank files, because only
rank 0's metrics reach ``Result.metrics``. Unmeasured warm-up repeats (--warmup, 1) run first so the
first measured run does not pay for a cold page cache. The table printed last gives each figure
as median [min-max] over the repeats, and the ratio jaxtrain/floor (per repeat, then the median).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError

BARE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bare_worker.py")
# The environment jaxtrain gives its local CPU workers (src/placement/plan.cc).
BARE_ENV = {
    "JAX_PLATFORMS": "cpu",
    "JAX_NUM_CPU_DEVICES": "1",
    "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
}


@dataclass
class RunFigures:
    """One run (jaxtrain or floor) of one repeat."""

    startup_s: float  # fit()/Popen -> first line, max over ranks
    report_median_ns: float  # over every rank's samples pooled
    report_p99_ns: float


def train_func(config: dict) -> None:
    t_first = time.time()  # must stay the first line: this is what start-up measures
    from bare_worker import save_rank_result, time_calls  # after t_first: not part of start-up

    from jaxtrain import get_context, report

    samples = time_calls(report, config["reports"])
    save_rank_result(
        config["out_dir"], get_context().get_world_rank(), t_first - config["t0"], samples
    )


def read_figures(out_dir: str, workers: int) -> RunFigures:
    ranks = []
    for rank in range(workers):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {rank} wrote no figures ({path} is missing)")
        with open(path) as f:
            ranks.append(json.load(f))
    samples = sorted(ns for r in ranks for ns in r["report_ns"])
    return RunFigures(
        startup_s=max(r["startup_s"] for r in ranks),
        report_median_ns=statistics.median(samples),
        report_p99_ns=samples[min(len(samples) - 1, int(0.99 * len(samples)))],
    )


@contextlib.contextmanager
def console_to(log_path: str) -> Iterator[None]:
    """Sends this process's fd 1 and 2 to ``log_path`` (at the fd level, where jaxtrain echoes
    worker output), and restores them afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def run_jaxtrain(workers: int, reports: int, out_dir: str) -> RunFigures:
    log_path = os.path.join(out_dir, "console.log")
    try:
        with console_to(log_path):
            # t0 goes to the workers in the config, so it is taken before the (microseconds of)
            # JaxTrainer construction; fit() pickles the config.
            t0 = time.time()
            JaxTrainer(
                train_func,
                train_loop_config={"t0": t0, "out_dir": out_dir, "reports": reports},
                scaling_config=ScalingConfig(num_workers=workers),
                run_config=RunConfig(name="run", storage_path=out_dir),
            ).fit()
    except TrainingFailedError as e:
        sys.exit(f"jaxtrain fit() failed during the benchmark: {e}")
    return read_figures(out_dir, workers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_floor(workers: int, reports: int, out_dir: str) -> RunFigures:
    log_path = os.path.join(out_dir, "console.log")
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, **BARE_ENV}
    procs = []
    with open(log_path, "ab") as log:
        t0 = time.time()
        for rank in range(workers):
            argv = [
                sys.executable,
                BARE_WORKER,
                coordinator,
                str(workers),
                str(rank),
                str(t0),
                out_dir,
                str(reports),
            ]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        codes = [proc.wait() for proc in procs]
    if any(codes):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        sys.exit(f"bare JAX processes failed (exit codes {codes}); their output ends:\n{tail}")
    return read_figures(out_dir, workers)


def busy_cpu_s() -> float:
    """CPU seconds all cores have spent busy since boot, from /proc/stat (Linux)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds used by this process and its finished children (every worker, once waited)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )


def measure(run: Callable[[], RunFigures]) -> tuple[RunFigures, float]:
    """Runs one jaxtrain or floor run; also returns how many cores other processes kept busy
    meanwhile (steal included), since on a small machine that noise can swamp the figures."""
    busy, own, start = busy_cpu_s(), own_cpu_s(), time.monotonic()
    figures = run()
    elapsed = time.monotonic() - start
    return figures, ((busy_cpu_s() - busy) - (own_cpu_s() - own)) / elapsed


def spread(values: list[float], unit: str, scale: float = 1.0, digits: int = 2) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} {unit} [{min(v):.{digits}f}-{max(v):.{digits}f}]"


def main() -> None:
    # Cold starts, every fit() of its own processes: bench/warm_workers.py measures warm ones.
    os.environ.setdefault("JAXTRAIN_WARM_WORKERS", "0")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="measured jaxtrain/floor pairs (default 5)"
    )
    parser.add_argument(
        "--reports",
        type=int,
        default=10_000,
        help="report() calls timed per rank per run (default 10000)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured pairs run first (default 1)"
    )
    args = parser.parse_args()
    if min(args.workers, args.repeats, args.reports) < 1 or args.warmup < 0:
        parser.error("--workers, --repeats and --reports must be >= 1, --warmup >= 0")

    results: dict[str, list[RunFigures]] = {"jaxtrain": [], "floor": []}
    others: list[float] = []  # cores busy with other processes, per measured run
    runners = {"jaxtrain": run_jaxtrain, "floor": run_floor}
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as tmp:
        for i in range(args.warmup + args.repeats):
            if i < args.warmup:
                label = f"warm-up {i + 1}/{args.warmup}"
            else:
                label = f"repeat {i - args.warmup + 1}/{args.repeats}"
            line = []
            for name, runner in runners.items():
                out_dir = tempfile.mkdtemp(prefix=f"{name}-{i}-", dir=tmp)
                run = functools.partial(runner, args.workers, args.reports, out_dir)
                figures, other = measure(run)
                if i >= args.warmup:
                    results[name].append(figures)
                    others.append(other)
                line.append(
                    f"{name} {figures.startup_s:.2f} s, "
                    f"report {figures.report_median_ns / 1000:.2f} us, "
                    f"others busy {other:.1f} cores"
                )
            print(f"{label}: " + "; ".join(line), flush=True)

    rows = [
        ("start-up (last rank)", "s", 1.0, lambda f: f.startup_s),
        ("report() median", "us", 1e-3, lambda f: f.report_median_ns),
        ("report() p99", "us", 1e-3, lambda f: f.report_p99_ns),
    ]
    print(
        f"\n{args.workers} workers, {args.repeats} repeats, {args.reports} report() per rank; "
        "median [min-max] over repeats"
    )
    print(
        f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy during the "
        "runs; well above 0, the figures measure the machine's load more than jaxtrain"
    )
    print(
        "start-up: fit() (floor: first Popen) -> first line after jax.distributed.initialize\n"
        "report(): one metrics-only call (floor: json.dumps + os.write to a file)\n"
        "ratio > 1: jaxtrain costs more than the floor"
    )
    print(f"{'figure':<32}{'jaxtrain':<26}{'floor':<26}jaxtrain/floor")
    for title, unit, scale, get in rows:
        ours = [get(f) for f in results["jaxtrain"]]
        floor = [get(f) for f in results["floor"]]
        ratios = [a / b for a, b in zip(ours, floor, strict=True)]
        print(
            f"{title:<32}{spread(ours, unit, scale):<26}{spread(floor, unit, scale):<26}"
            f"{spread(ratios, 'x')}"
        )


if __name__ == "__main__":
    main()
