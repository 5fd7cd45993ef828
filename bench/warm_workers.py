"""Benchmark: warm workers (docs/warm-workers.md), a restart and a second fit() from standbys.

    .venv/bin/python bench/warm_workers.py [--workers 4] [--repeats 3] [--warmup 1]

Every repeat runs, in this one driver process and in turn:

* cold: ``JAXTRAIN_WARM_WORKERS=0``, one fit() of failure_recovery.py's training function with
  a failure (N local CPU workers, ``FailureConfig(max_failures=1)``, rank ``--kill-rank``
  SIGKILLs itself at its ``--kill-step``-th report). Gives the fresh start (``time.time()`` just
  before fit() to the first line of the training function, last rank) and the cold restart (the
  kill to the first line of attempt 1, last rank).
* warm: the same fit() with warm workers on, after an earlier warm fit() of the same processes
  (the warm-up makes the first). Its attempt 0 is a second fit() in the same driver, served by the
  standbys the earlier fit() left in the pool; its attempt 1 a restart served by the standbys
  started once attempt 0's group was ready. The rank dies once those standbys are idle (past
  import jax), as they are when a failure comes minutes or hours into training: the restart
  measured is the one a long run gets.
* warm, early failure: the same, with the rank dying at its ``--kill-step``-th report (1 s into
  training by default), while the standbys are still importing jax at low priority: what a
  failure in the first seconds of a run gets.
* floor: bare processes (bench/bare_worker.py: import jax, ``jax.distributed.initialize``), as
  in startup_and_report.py: the first ``subprocess.Popen`` to the line after the initialize, last
  rank.

Before each measured fit() the benchmark waits until every standby of this driver is idle (its
CPU time no longer grows), so that no standby still importing jax slows the run measured.

Printed: (a) warm restart / fresh start (target <= 0.25 x), with the cold and the early restart
beside it; (b) second fit() / bare floor (target <= 0.5 x); and an idle standby's memory (RSS and
PSS).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

from failure_recovery import fit, last_first_line, read_time
from startup_and_report import measure, run_floor, spread

RESTART_TARGET = 0.25  # warm restart -> group ready, against a fresh start
SECOND_FIT_TARGET = 0.5  # second fit() -> group ready, against bare processes


def standbys() -> list[int]:
    """This driver's standby workers: its children started with JAXTRAIN_STANDBY=1, not yet
    activated (an activated one has connected to a controller: JAXTRAIN_CONTROLLER_ADDR)."""
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"JAXTRAIN_STANDBY=1" in env:
            found.append(int(pid))
    return found


def cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def idle(pids: list[int], window_s: float = 0.5) -> bool:
    """True when none of `pids` used CPU over `window_s` (they have finished importing jax)."""
    before = [cpu_ticks(p) for p in pids]
    time.sleep(window_s)
    return [cpu_ticks(p) for p in pids] == before


def settle(timeout_s: float = 120) -> None:
    """Waits until the standbys have finished importing (no CPU used over 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not idle(standbys()):
        pass


def kill_when_standbys_idle(kill_file: str, workers: int, taken: set[int],
                            timeout_s: float = 120) -> threading.Thread:
    """Creates `kill_file` once the standbys that the running fit() started for its next attempt
    (those not in `taken`, the ones it was started from) are `workers` and idle."""

    def wait() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fresh = [p for p in standbys() if p not in taken]
            if len(fresh) >= workers and idle(fresh):
                break
            time.sleep(0.05)
        else:
            print(f"warning: the next attempt's standbys were not idle within {timeout_s:g} s",
                  flush=True)
        with open(kill_file, "w"):
            pass

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def memory_mb(pid: int) -> tuple[float, float]:
    """RSS and PSS of `pid`, in MB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = {line.split(":")[0]: line.split()[1] for line in f if ":" in line}
    return int(fields["Rss"]) / 1024, int(fields["Pss"]) / 1024


def run_killed(workers: int, config: dict, out_dir: str, warm: bool,
               kill_when_idle: bool = False) -> tuple[float, float]:
    """One fit() with a failure: fit() -> first line of attempt 0, and kill -> first line of
    attempt 1 (both on the last rank). `kill_when_idle`: the rank dies once the standbys of the
    next attempt are idle, not at its kill_step-th report."""
    if warm:
        os.environ.pop("JAXTRAIN_WARM_WORKERS", None)
    else:
        os.environ["JAXTRAIN_WARM_WORKERS"] = "0"
    trigger = None
    if kill_when_idle:
        config = {**config, "kill_file": os.path.join(out_dir, "kill-now")}
        trigger = kill_when_standbys_idle(config["kill_file"], workers, set(standbys()))
    t0 = time.time()
    state = fit(out_dir, workers, {**config, "kill": True})
    if trigger is not None:
        trigger.join()
    if len(state["attempts"]) != 2 or not state["attempts"][1].get("restored_from"):
        sys.exit(f"expected one failure, then a restart from the checkpoint: {state['attempts']}")
    with open(os.path.join(out_dir, "console.log")) as f:
        used = "started from standby workers" in f.read()
    if used != warm:
        sys.exit(f"{out_dir}: standby workers {'not ' if warm else ''}used where expected")
    t_kill = read_time(os.path.join(out_dir, "kill.json"))
    return (last_first_line(out_dir, workers, 0) - t0,
            last_first_line(out_dir, workers, 1) - t_kill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="measured repeats (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repeats (default 1)")
    parser.add_argument("--kill-step", type=int, default=20,
                        help="the report at which a rank dies (default 20, every 50 ms)")
    parser.add_argument("--kill-rank", type=int, default=1, help="the rank that dies (default 1)")
    args = parser.parse_args()
    if min(args.workers, args.repeats, args.kill_step) < 1 or args.warmup < 0:
        parser.error("--workers, --repeats and --kill-step must be >= 1, --warmup >= 0")
    if not 0 <= args.kill_rank < args.workers:
        parser.error("--kill-rank must be a rank (0 to --workers - 1)")
    config = {"interval_s": 0.05, "kill_step": args.kill_step, "kill_rank": args.kill_rank}

    rows: dict[str, list[float]] = {k: [] for k in (
        "fresh", "cold_restart", "warm_restart", "early_restart", "second_fit", "floor")}
    others: list[float] = []
    memory: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as tmp:
        # The first warm fit() of the driver: it leaves the standbys the first repeat takes.
        settle()
        run_killed(args.workers, config, tempfile.mkdtemp(dir=tmp), warm=True)
        for i in range(args.warmup + args.repeats):
            measured = i >= args.warmup
            settle()
            if measured and not memory:
                memory = [memory_mb(p) for p in standbys()]
            (fresh, cold_restart), other_a = measure(
                lambda: run_killed(args.workers, config, tempfile.mkdtemp(dir=tmp), warm=False))
            settle()
            (second_fit, warm_restart), other_b = measure(
                lambda: run_killed(args.workers, config, tempfile.mkdtemp(dir=tmp), warm=True,
                                   kill_when_idle=True))
            settle()
            (_, early_restart), other_c = measure(
                lambda: run_killed(args.workers, config, tempfile.mkdtemp(dir=tmp), warm=True))
            settle()
            floor, other_d = measure(
                lambda: run_floor(args.workers, 1, tempfile.mkdtemp(dir=tmp)))
            print(f"{'repeat' if measured else 'warm-up'} {i + 1}: fresh {fresh:.2f} s, cold "
                  f"restart {cold_restart:.2f} s, warm restart {warm_restart:.2f} s, early warm "
                  f"restart {early_restart:.2f} s, second fit() {second_fit:.2f} s, bare floor "
                  f"{floor.startup_s:.2f} s", flush=True)
            if measured:
                for k, v in (("fresh", fresh), ("cold_restart", cold_restart),
                             ("warm_restart", warm_restart), ("early_restart", early_restart),
                             ("second_fit", second_fit), ("floor", floor.startup_s)):
                    rows[k].append(v)
                others += [other_a, other_b, other_c, other_d]

    restart_ratio = [w / f for w, f in zip(rows["warm_restart"], rows["fresh"], strict=True)]
    cold_ratio = [c / f for c, f in zip(rows["cold_restart"], rows["fresh"], strict=True)]
    early_ratio = [e / f for e, f in zip(rows["early_restart"], rows["fresh"], strict=True)]
    second_ratio = [s / b for s, b in zip(rows["second_fit"], rows["floor"], strict=True)]
    print(f"\n{args.workers} workers, rank {args.kill_rank} SIGKILLs itself once the next "
          f"attempt's standbys are idle (early failure, and cold: at report {args.kill_step}), "
          f"{args.repeats} repeats; median [min-max]")
    print(f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy")
    print("group ready = the first line of the training function on the last rank")
    targets = (("(a) warm restart / fresh start", restart_ratio, RESTART_TARGET),
               ("(b) second fit() / bare floor", second_ratio, SECOND_FIT_TARGET))
    for label, ratio, target in targets:
        verdict = "met" if statistics.median(ratio) <= target else "missed"
        print(f"target {label} <= {target:.2f} x: {verdict} (median "
              f"{statistics.median(ratio):.2f} x)")
    print(f"{'figure':40}{'seconds':28}ratio")
    print(f"{'fresh start (warm workers off)':40}{spread(rows['fresh'], 's'):28}")
    print(f"{'restart, cold (kill -> group ready)':40}{spread(rows['cold_restart'], 's'):28}"
          f"{spread(cold_ratio, 'x')} of fresh start")
    print(f"{'restart, warm (kill -> group ready)':40}{spread(rows['warm_restart'], 's'):28}"
          f"{spread(restart_ratio, 'x')} of fresh start")
    print(f"{'restart, warm, early failure':40}{spread(rows['early_restart'], 's'):28}"
          f"{spread(early_ratio, 'x')} of fresh start")
    print(f"{'bare floor (import jax + initialize)':40}{spread(rows['floor'], 's'):28}")
    print(f"{'second fit(), warm (fit() -> ready)':40}{spread(rows['second_fit'], 's'):28}"
          f"{spread(second_ratio, 'x')} of bare floor")
    if memory:
        rss = [m[0] for m in memory]
        pss = [m[1] for m in memory]
        print(f"idle standby, each of {len(memory)}: RSS {spread(rss, 'MB')}, "
              f"PSS {spread(pss, 'MB')}")


if __name__ == "__main__":
    main()
