"""Runs one trial of bench/compare_trial.py in a fresh process and reads back its figures.

The measurement that bench/compare_ray.py (jaxtrain against Ray and the floor) and
bench/compare_commits.py (one commit against another) share, so that both measure the same way:

* ``step``: ``ready_s`` (fit() to the last rank's first line with ``jax.distributed`` up),
  ``report_median_us`` and ``report_p99_us`` (every rank's report() samples pooled), and the
  peak PSS of the orchestrator (the trial's process tree but the workers) and of the workers,
  ``orchestrator_mb`` and ``workers_mb``, sampled every 0.2 s (the trial's own process, the
  driver, every 20 ms);
* ``failure``: ``recovery_s``, from the last rank's SIGKILL of itself to the restarted group's
  last rank being ready;
* every program: ``wall_s``, the trial process's wall clock.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import psutil

BENCH = os.path.dirname(os.path.abspath(__file__))
TRIAL = os.path.join(BENCH, "compare_trial.py")


class TrialFailed(Exception):
    """A trial exited non-zero or overran its deadline; the message ends with its output."""


class MemorySampler(threading.Thread):
    """Peak PSS of a process tree, split into workers and everything else: the whole tree every
    0.2 s, and the tree's root (the orchestrator's driver) every 20 ms between, so that a short
    peak of the driver (the end of fit(), reading the run's records) is seen on every run, not
    on some (reading one process's smaps_rollup costs ~0.3 ms)."""

    TREE_EVERY = 10  # root samples per whole-tree sample

    def __init__(self, pid: int, is_worker: Callable[[list[str]], bool]) -> None:
        super().__init__(daemon=True)
        self.root, self.is_worker = pid, is_worker
        self.peak = {"orchestrator": 0, "workers": 0}
        self.stop = threading.Event()

    @staticmethod
    def pss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def run(self) -> None:
        others = 0  # the orchestrator's processes but the root, at the last whole-tree sample
        tick = 0
        while not self.stop.wait(0.02):
            tick += 1
            if tick % self.TREE_EVERY:
                root = self.pss(self.root)
                self.peak["orchestrator"] = max(self.peak["orchestrator"], root + others)
                continue
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = {"orchestrator": 0, "workers": 0}
            others = 0
            for p in procs:
                try:
                    kind = "workers" if self.is_worker(p.cmdline()) else "orchestrator"
                except psutil.Error:
                    continue
                value = self.pss(p.pid)
                total[kind] += value
                if kind == "orchestrator" and p.pid != self.root:
                    others += value
            for kind, value in total.items():
                self.peak[kind] = max(self.peak[kind], value)


def is_worker(side: str) -> Callable[[list[str]], bool]:
    """Whether a command line is one of the side's worker processes (the rest orchestrate)."""
    if side == "jaxtrain":
        return lambda cmd: "jaxtrain.worker" in cmd
    if side == "floor":
        return lambda cmd: "floor-rank" in cmd
    return lambda cmd: bool(cmd) and cmd[0].startswith("ray::RayTrainWorker")


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def run_trial(
    python: str,
    side: str,
    program: str,
    workers: int,
    tmp: str,
    reports: int,
    *,
    trial: str = TRIAL,
    env: dict[str, str] | None = None,
    keep: bool = False,
    timeout_s: float | None = None,
    label: str = "",
) -> dict:
    """Runs ``trial`` (compare_trial.py) with ``python`` in a fresh process; returns its figures.

    The trial's directory is made under ``tmp`` and removed afterwards unless ``keep``; ``env``
    is added to this process's environment. Raises TrialFailed when the trial exits non-zero or
    runs past ``timeout_s`` (its process tree is then killed); ``label`` names it in the message.
    """
    out = tempfile.mkdtemp(prefix=f"{label or side}-{program}-{workers}-", dir=tmp)
    argv = [python, trial, side, program, out, str(workers), "--reports", str(reports)]
    log_path = os.path.join(out, "console.log")
    with open(log_path, "wb") as log:
        start = time.time()
        proc = subprocess.Popen(
            argv, stdout=log, stderr=log, env={**os.environ, **(env or {})}, cwd=out
        )
        sampler = MemorySampler(proc.pid, is_worker(side))
        if program == "step":
            sampler.start()
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            code = f"killed after {timeout_s:g} s"
            proc.wait()
        wall = time.time() - start
        sampler.stop.set()
    if code != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        kept = f"; its directory: {out}" if keep else ""
        raise TrialFailed(
            f"{label or side} {program}, {workers} workers, failed ({code}){kept}; output ends:\n"
            f"{tail}"
        )

    def ranks(prefix: str, attempt: int) -> list[dict]:
        found = []
        for r in range(workers):
            with open(os.path.join(out, f"{prefix}rank{r}-a{attempt}.json")) as f:
                found.append(json.load(f))
        return found

    with open(os.path.join(out, "driver.json")) as f:
        driver = json.load(f)
    figures: dict = {"wall_s": wall}
    if program == "step":
        done = ranks("", 0)
        samples = sorted(ns for r in done for ns in r["report_ns"])
        figures |= {
            "ready_s": max(r["t_ready"] for r in done) - driver["t0"],
            "report_median_us": statistics.median(samples) / 1e3,
            "report_p99_us": samples[min(len(samples) - 1, int(0.99 * len(samples)))] / 1e3,
            "report_calls": len(samples),
            "self_init": any(r["self_init"] for r in done),
            "orchestrator_mb": sampler.peak["orchestrator"] / 2**20,
            "workers_mb": sampler.peak["workers"] / 2**20,
        }
        if driver.get("t_fit"):
            figures["ray_init_s"] = driver["t_fit"] - driver["t0"]
    elif program == "failure":
        with open(os.path.join(out, "kill.json")) as f:
            t_kill = json.load(f)["time"]
        figures["recovery_s"] = max(r["t_ready"] for r in ranks("ready-", 1)) - t_kill
    if keep:
        figures["dir"] = out
    else:
        shutil.rmtree(out, ignore_errors=True)
    return figures


def spread(values: list[float], fmt: str = ".2f") -> str:
    """``median [min-max]``, or ``-`` for no values."""
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def machine() -> dict:
    """The machine a run's figures come from, and how busy it was at the start."""
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg()[0],
    }
