"""Benchmark: one commit of jaxtrain against another, start-up, report() and recovery, interleaved.

    bench/compare_commits.sh [A [B]] [--repeats 3] [--workers 4] [--short] [--keep] ...

A (old) defaults to HEAD's merge base with main, or HEAD~1 when HEAD is on main; B (new) to
HEAD. Commits, not the working tree: commit a change before comparing it. A compared with itself
shows the machine's noise.

1. Builds each commit in its own git worktree, build/compare/<short sha>/, with its own virtual
   environment: a copy of this checkout's .venv, the commit's jaxtrain installed into it through
   ccache (``pip install --no-build-isolation --no-deps .``). A build made earlier for the same
   commit is reused; the builds stay for the next run.
2. Runs the ``step`` and ``failure`` trials of bench/compare_trial.py (as bench/compare_ray.py
   --programs step,failure does; bench/trial_runner.py runs them and reads their figures)
   interleaved, old, new, old, new, ..., each in a fresh process with the commit's own
   interpreter and installed jaxtrain. Both sides run the trial script of the newer of the two
   commits, so that both are measured the same way. One unmeasured step trial per side first
   (--warmup).
3. Prints each figure, old and new, as median [min-max] over the repeats, new/old computed per
   pair (repeat) as median [min-max], and a verdict per figure: worse when the median ratio is
   above the threshold (--threshold, 1.05; report() p99: --p99-threshold, 1.2), better when below
   its inverse. The verdicts are printed, never asserted: the exit status is 0 when every build
   and trial ran, 1 when one failed.

Every figure is one where lower is better. Results, with every trial's figures, go to
build/compare/results-<A>-<B>.json (--out).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import trial_runner
from trial_runner import machine, spread

BENCH = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(BENCH)
COMPARE = os.path.join(ROOT, "build", "compare")
# In a build's .venv once it is complete: the commit installed there and the packages the copy
# had beside it; a build is reused only while both still match.
STAMP = ".compare-build.json"

# (key, program, title, format): the order of the table.
FIGURES = [
    ("ready_s", "step", "fit() -> ready, last rank (s)", ".2f"),
    ("report_median_us", "step", "report() median (us)", ".1f"),
    ("report_p99_us", "step", "report() p99 (us)", ".1f"),
    ("recovery_s", "failure", "SIGKILL -> group ready again (s)", ".2f"),
    ("orchestrator_mb", "step", "orchestrator peak PSS (MB)", ".1f"),
    ("workers_mb", "step", "workers peak PSS (MB)", ".0f"),
]
PROGRAMS = ("step", "failure")
SHORT_REPORTS = 2_000


class Failed(Exception):
    """A build or a trial failed; the message says which and what it printed."""


def say(message: str) -> None:
    print(f"compare_commits: {message}", flush=True)


def git(*args: str, cwd: str = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise Failed(f"git {' '.join(args)} failed ({done.returncode}):\n{done.stderr.strip()}")
    return done


def resolve(rev: str) -> str:
    done = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if done.returncode != 0:
        raise Failed(f"commit {rev!r} not found: give a commit, branch or tag of this repository")
    return done.stdout.strip()


def short(sha: str) -> str:
    return git("rev-parse", "--short", sha).stdout.strip()


def default_old(head: str) -> tuple[str, str]:
    """HEAD's merge base with main, or HEAD~1 when that is HEAD itself; and how it was chosen."""
    for main in ("main", "origin/main"):
        if git("rev-parse", "--verify", "--quiet", main, check=False).returncode == 0:
            base = git("merge-base", head, main).stdout.strip()
            if base != head:
                return base, f"the merge base of HEAD and {main}"
            break
    return resolve(f"{head}~1"), "HEAD~1"


def newer(a: str, b: str) -> str:
    """The later of two commits: by ancestry when one contains the other, else by commit date."""
    if git("merge-base", "--is-ancestor", a, b, check=False).returncode == 0:
        return b
    if git("merge-base", "--is-ancestor", b, a, check=False).returncode == 0:
        return a
    dates = {c: int(git("show", "-s", "--format=%ct", c).stdout) for c in (a, b)}
    return b if dates[b] >= dates[a] else a


def copy_venv(tree: str) -> None:
    """This checkout's .venv copied into ``tree``, its absolute paths pointed at the copy."""
    source = os.path.join(ROOT, ".venv")
    target = os.path.join(tree, ".venv")
    partial = target + ".partial"  # a copy cut short is never taken for a venv
    shutil.rmtree(partial, ignore_errors=True)
    say(f"copying {source} to {target}")
    copied = subprocess.run(["cp", "-a", source, partial], capture_output=True, text=True)
    if copied.returncode != 0:
        raise Failed(f"cp -a {source} {partial} failed:\n{copied.stderr.strip()}")
    old, new = source.encode(), target.encode()
    for top, dirs, files in os.walk(partial):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        for name in files:
            path = os.path.join(top, name)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                data = f.read()
            if b"\0" not in data and old in data:
                with open(path, "wb") as f:
                    f.write(data.replace(old, new))
    os.rename(partial, target)


def packages(venv: str) -> list[str]:
    """The distributions installed in ``venv`` besides jaxtrain, as name-version."""
    found = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "*.dist-info"))
    names = (os.path.basename(d).removesuffix(".dist-info") for d in found)
    return sorted(n for n in names if not n.startswith("jaxtrain-"))


def read_stamp(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def is_worktree_of(tree: str, sha: str) -> bool:
    """Whether ``tree`` is a worktree of its own (not just a folder of this one) at ``sha``."""
    top = git("rev-parse", "--show-toplevel", cwd=tree, check=False)
    head = git("rev-parse", "HEAD", cwd=tree, check=False)
    return (
        top.returncode == 0
        and os.path.realpath(top.stdout.strip()) == os.path.realpath(tree)
        and head.stdout.strip() == sha
    )


def build(sha: str) -> str:
    """Builds ``sha`` in build/compare/<short sha>/ (or finds it built); returns its python."""
    name = short(sha)
    tree = os.path.join(COMPARE, name)
    python = os.path.join(tree, ".venv", "bin", "python")
    stamp = os.path.join(tree, ".venv", STAMP)
    wanted = {"commit": sha, "packages": packages(os.path.join(ROOT, ".venv"))}
    found = read_stamp(stamp)
    if os.path.isdir(tree) and not is_worktree_of(tree, sha):
        say(f"{tree} is not a worktree of {name}: removing it")
        git("worktree", "remove", "--force", tree, check=False)
        shutil.rmtree(tree, ignore_errors=True)
        git("worktree", "prune")
    if not os.path.isdir(tree):
        say(f"{name}: git worktree add --detach {tree}")
        git("worktree", "prune")  # forgets a worktree whose folder was deleted by hand
        git("worktree", "add", "--detach", tree, sha)
    elif found == wanted:
        say(f"{name}: reusing the build in {tree}")
        return python
    elif found:
        say(f"{name}: the checkout's .venv has other packages than the build's copy: copying again")
        shutil.rmtree(os.path.join(tree, ".venv"))
    if not os.path.exists(python):
        copy_venv(tree)
    log = os.path.join(tree, "build", "compare-install.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    say(f"{name}: pip install --no-build-isolation --no-deps . (ccache; log: {log})")
    env = {
        **os.environ,
        "CMAKE_CXX_COMPILER_LAUNCHER": "ccache",
        "CMAKE_C_COMPILER_LAUNCHER": "ccache",
        "CCACHE_BASEDIR": tree,  # paths under the tree hash the same in every checkout
        "CCACHE_NOHASHDIR": "true",
    }
    env.pop("VIRTUAL_ENV", None)
    argv = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "."]
    begun = time.time()
    with open(log, "wb") as out:
        code = subprocess.run(argv, cwd=tree, env=env, stdout=out, stderr=out).returncode
    if code != 0:
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        raise Failed(f"the build of {name} failed ({code}); {log} ends:\n{tail}")
    with open(stamp, "w") as f:
        json.dump(wanted, f)
    say(f"{name}: built and installed in {time.time() - begun:.0f} s")
    return python


def lock() -> int:
    """Holds build/compare/.lock for the run: one comparison at a time builds and measures."""
    os.makedirs(COMPARE, exist_ok=True)
    fd = os.open(os.path.join(COMPARE, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise Failed(
            f"another compare_commits run (pid {holder}) holds {COMPARE}/.lock: wait for it to end"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def measure(args, pythons: dict, labels: dict, trial: str, tmp: str) -> dict:
    """Every trial, interleaved old, new, old, new; returns {program: {side: [figures]}}."""
    runs: dict = {p: {"old": [], "new": []} for p in PROGRAMS}

    def one(side: str, program: str) -> dict:
        return trial_runner.run_trial(
            pythons[side],
            "jaxtrain",
            program,
            args.workers,
            tmp,
            args.reports,
            trial=trial,
            keep=args.keep,
            timeout_s=args.trial_timeout,
            label=f"{side}-{labels[side]}",
        )

    try:
        for i in range(args.warmup):
            for side in ("old", "new"):
                one(side, "step")
            say(f"warm-up {i + 1}/{args.warmup} done (not counted)")
        for i in range(args.repeats):
            for program in PROGRAMS:
                line = []
                for side in ("old", "new"):
                    f = one(side, program)
                    runs[program][side].append(f)
                    shown = {k: round(v, 3) for k, v in f.items() if isinstance(v, float)}
                    line.append(f"{side} {labels[side]} {shown}")
                say(f"repeat {i + 1}/{args.repeats}, {program}: " + "; ".join(line))
    except trial_runner.TrialFailed as e:
        raise Failed(str(e)) from None
    return runs


def verdict(ratios: list[float], threshold: float) -> str:
    """One line: the median new/old against ``threshold`` (worse) and its inverse (better)."""
    med = statistics.median(ratios)

    def pairs(count: int, side: str) -> str:
        if len(ratios) == 1:
            return "one pair, so no spread: --repeats 3 or more before believing it"
        return f"{count} of {len(ratios)} pairs {side}"

    if med > threshold:
        above = sum(r > threshold for r in ratios)
        return f"WORSE: {med:.3f} x > {threshold:.3f} x ({pairs(above, 'above')})"
    if med < 1 / threshold:
        below = sum(r < 1 / threshold for r in ratios)
        return f"better: {med:.3f} x < {1 / threshold:.3f} x ({pairs(below, 'below')})"
    return f"same: {med:.3f} x, within {1 / threshold:.3f}-{threshold:.3f} x"


def summarise(runs: dict, args) -> dict:
    summary = {}
    for key, program, _, _ in FIGURES:
        old = [f[key] for f in runs[program]["old"]]
        new = [f[key] for f in runs[program]["new"]]
        ratios = [n / o for o, n in zip(old, new, strict=True) if o]
        threshold = args.p99_threshold if key == "report_p99_us" else args.threshold
        summary[key] = {
            "old": old,
            "new": new,
            "new/old": ratios,
            "threshold": threshold,
            "verdict": verdict(ratios, threshold) if ratios else "no ratio (an old figure is 0)",
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench/compare_commits.sh", description=__doc__.split("\n")[0]
    )
    parser.add_argument("old", nargs="?", help="commit A (default: merge base with main, HEAD~1)")
    parser.add_argument("new", nargs="?", default="HEAD", help="commit B (default: HEAD)")
    parser.add_argument("--repeats", type=int, default=3, help="measured pairs (default 3)")
    parser.add_argument("--workers", type=int, default=4, help="workers per trial (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured step pairs first (1)")
    parser.add_argument(
        "--reports", type=int, default=10_000, help="timed report() per rank (10000)"
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help=f"1 repeat, {SHORT_REPORTS} reports per rank (the form CI may run)",
    )
    parser.add_argument("--threshold", type=float, default=1.05, help="new/old worse above (1.05)")
    parser.add_argument("--p99-threshold", type=float, default=1.2, help="the same, p99 (1.2)")
    parser.add_argument(
        "--trial-timeout", type=float, default=600, help="seconds one trial may take (600)"
    )
    parser.add_argument("--keep", action="store_true", help="keep every trial's directory")
    parser.add_argument("--out", help="results file (default build/compare/results-A-B.json)")
    args = parser.parse_args()
    if args.short:
        args.repeats, args.reports = 1, SHORT_REPORTS
    for name in ("repeats", "workers", "reports"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be 0 or more")
    if args.threshold <= 1 or args.p99_threshold <= 1:
        parser.error("--threshold and --p99-threshold must be above 1 (a ratio new/old)")
    try:
        run(args)
    except Failed as e:
        sys.exit(f"compare_commits: {e}")


def run(args) -> None:
    lock_fd = lock()
    head = resolve("HEAD")
    if args.old is None:
        old, how = default_old(head)
        say(f"A (old) = {short(old)}, {how}")
    else:
        old = resolve(args.old)
    new = resolve(args.new)
    labels = {"old": short(old), "new": short(new)}
    say(f"comparing old {labels['old']} with new {labels['new']}")
    pythons = {"old": build(old)}
    pythons["new"] = pythons["old"] if new == old else build(new)
    later = newer(old, new)
    trial = os.path.join(COMPARE, short(later), "bench", "compare_trial.py")
    if not os.path.exists(trial):
        raise Failed(f"{short(later)}, the newer commit, has no bench/compare_trial.py to run")
    say(f"trials: {trial} (the newer commit's), {args.workers} workers, {args.repeats} repeats")
    begun = time.time()
    info = machine()
    if args.keep:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        tmp = os.path.join(COMPARE, f"trials-{labels['old']}-{labels['new']}-{stamp}")
        os.makedirs(tmp)
        runs = measure(args, pythons, labels, trial, tmp)
        say(f"every trial's directory is kept in {tmp}")
    else:
        with tempfile.TemporaryDirectory(prefix="jaxtrain-compare-commits-") as tmp:
            runs = measure(args, pythons, labels, trial, tmp)
    summary = summarise(runs, args)
    out = args.out or os.path.join(COMPARE, f"results-{labels['old']}-{labels['new']}.json")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "old": old,
        "new": new,
        "trial": f"bench/compare_trial.py of {later}",
        "options": {k: v for k, v in vars(args).items() if k not in ("old", "new", "out")},
        "duration_s": time.time() - begun,
        "runs": runs,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    os.close(lock_fd)

    print(
        f"\n{info['cores']} cores ({info['cpu']}), load average {info['load_average_at_start']:.2f}"
        f" at the start; {args.workers} workers, {args.repeats} pairs, {args.reports} report() "
        f"per rank; took {result['duration_s'] / 60:.1f} min; results: {out}"
    )
    print("median [min-max] over the pairs; new/old computed per pair; lower is better throughout")
    old_head, new_head = f"old {labels['old']}", f"new {labels['new']}"
    print(f"{'figure':<34}{old_head:<22}{new_head:<22}new/old")
    for key, _, title, fmt in FIGURES:
        s = summary[key]
        print(
            f"{title:<34}{spread(s['old'], fmt):<22}{spread(s['new'], fmt):<22}"
            f"{spread(s['new/old'])} x"
        )
    print(
        f"\nverdicts (median new/old against {args.threshold:g} x, report() p99 against "
        f"{args.p99_threshold:g} x; printed, not asserted):"
    )
    for key, _, title, _ in FIGURES:
        print(f"  {title:<34}{summary[key]['verdict']}")


if __name__ == "__main__":
    main()
