"""Benchmark: jaxtrain against Ray Train V2 and against bare processes (the floor), on local CPUs.

    bench/compare_ray.sh [--workers 1,2,4] [--repeats 2] [--reports 10000] [--skip-scale] ...

(compare_ray.sh makes bench/.venv-ray with Ray from PyPI and builds the scale benchmark; this
script runs under that environment.) For each worker count, each repeat runs the three sides in
turn (ABCABC..., so that noise on the machine hits all three), every trial in a fresh process
(bench/compare_trial.py, which describes the sides and the training function; bench/trial_runner.py
runs it and reads its figures, as for bench/compare_commits.py):

1. ready: fit() (the floor: its first Popen; Ray: ray.init, which fit() would otherwise do) to
   the first line of the training function with ``jax.distributed`` initialised, on the last rank;
2. seed program: the whole seed linear-regression program (100 epochs, one report() each),
   wall clock of its process, from start to exit;
3. report(): median and p99 of metrics-only report() calls, every rank's samples pooled
   (--reports per rank; Ray: --ray-reports, since each of its calls waits for its controller);
4. memory: peak proportional set size (PSS: shared pages split between the processes that map
   them) of the driver plus everything it starts except the workers ("orchestrator"), and of
   the workers, sampled every 0.2 s over the process tree during the ready/report trial;
5. recovery: the last rank SIGKILLs itself at its 20th report (every 50 ms); the time from the
   kill to the restarted group's last rank being ready again.

Then the scale simulation (bench/scale_controller.cc): the C++ controller alone with 1,024 and
4,096 fake workers. Each figure is printed as median [min-max] over the repeats, with the ratios
jaxtrain/floor and Ray/jaxtrain computed per repeat; the table comes last. Results go to
bench/results/compare_ray.json and compare_ray.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import trial_runner
from trial_runner import machine, spread

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")
SCALE_BUILD = os.path.join(ROOT, "build", "bench", "bench")
SIDES = ("jaxtrain", "ray", "floor")
TARGETS = {
    "ready jaxtrain/floor": "<= 1.2 x",
    "ready ray/jaxtrain": ">= 5 x",
    "report median": "< 50 us",
    "orchestrator memory": "< 50 MB",
    "rendezvous 4096": "< 2 s",
    "reports/s on one core": ">= 100000",
}


def run_trial(args, side: str, program: str, workers: int, tmp: str) -> dict:
    python = args.ray_python if side == "ray" else args.python
    reports = args.ray_reports if side == "ray" else args.reports
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(args.ray_poll_s)}
    try:
        return trial_runner.run_trial(
            python, side, program, workers, tmp, reports, env=env, keep=args.keep
        )
    except trial_runner.TrialFailed as e:
        sys.exit(str(e))


def run_scale(args) -> list[dict]:
    rows = []
    for ranks in args.scale_ranks:
        argv = [args.scale_binary, "--ranks", str(ranks), "--rate", str(args.scale_rate)]
        argv += ["--seconds", str(args.scale_seconds)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            sys.exit(f"scale_controller --ranks {ranks} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"scale {ranks} fake workers: rendezvous {row['rendezvous_s']:.3f} s, "
            f"{row['reports_per_s']:.0f} reports/s processed ({row['offered_per_s']:.0f} "
            f"offered), controller "
            f"{row['report_cpu_cores']:.2f} cores, {row['cpu_us_per_report']:.2f} us CPU/report, "
            f"peak RSS {row['peak_rss_mb']:.1f} MB",
            flush=True,
        )
        rows.append(row)
    return rows


def summarise(runs: dict, figure: str, workers: int) -> dict:
    """Per side: the figure's values over repeats; ratios per repeat."""
    values = {s: [r[figure] for r in runs[s][workers]] for s in SIDES}
    ours, ray, floor = values["jaxtrain"], values["ray"], values["floor"]
    return {
        "values": values,
        "jaxtrain/floor": [a / b for a, b in zip(ours, floor, strict=True) if b],
        "ray/jaxtrain": [b / a for a, b in zip(ours, ray, strict=True) if a],
    }


FIGURES = [
    ("ready_s", "step", "1. fit() -> ready, last rank (s)"),
    ("wall_s", "seed", "2. seed program, wall clock (s)"),
    ("report_median_us", "step", "3. report() median (us)"),
    ("report_p99_us", "step", "3. report() p99 (us)"),
    ("orchestrator_mb", "step", "4. orchestrator peak PSS (MB)"),
    ("workers_mb", "step", "4. workers peak PSS (MB)"),
    ("recovery_s", "failure", "5. SIGKILL -> group ready again (s)"),
]
FORMATS = {"report_median_us": ".1f", "report_p99_us": ".1f", "orchestrator_mb": ".1f"}
FORMATS["workers_mb"] = ".0f"


def plot(summary: dict, scale: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [f for f in FIGURES if f[0] in summary]
    panels = len(shown) + (1 if scale else 0)
    cols = 3
    rows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    colors = {"jaxtrain": "tab:blue", "ray": "tab:orange", "floor": "tab:gray"}
    for ax, (key, _, title) in zip(axes.flat, shown, strict=False):
        per_n = summary[key]
        ns = sorted(per_n, key=int)
        for i, side in enumerate(SIDES):
            med, lo, hi = [], [], []
            for n in ns:
                v = per_n[n]["values"][side]
                med.append(statistics.median(v))
                lo.append(statistics.median(v) - min(v))
                hi.append(max(v) - statistics.median(v))
            xs = [j + (i - 1) * 0.27 for j in range(len(ns))]
            ax.bar(xs, med, 0.27, yerr=[lo, hi], label=side, color=colors[side], capsize=3)
        ax.set_xticks(range(len(ns)), [f"{n} workers" for n in ns])
        ax.set_title(title, fontsize=10)
        if key != "workers_mb":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    used = len(shown)
    if scale:
        ax = axes.flat[used]
        labels = [str(r["ranks"]) for r in scale]
        ax.bar(labels, [r["reports_per_s"] / 1e3 for r in scale], color="tab:blue")
        for i, r in enumerate(scale):
            ax.annotate(
                f"rdv {r['rendezvous_s']:.2f} s\n{r['report_cpu_cores']:.2f} cores\n"
                f"{r['peak_rss_mb']:.0f} MB",
                (i, r["reports_per_s"] / 1e3),
                ha="center",
                va="top",
                fontsize=8,
                color="white",
            )
        ax.set_title("scale: controller, fake workers (k reports/s)", fontsize=10)
        ax.set_xlabel("fake workers")
        used += 1
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle("jaxtrain vs Ray Train V2 vs bare processes (median, bars min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4)")
    parser.add_argument("--repeats", type=int, default=2, help="measured rounds (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (1)")
    parser.add_argument("--reports", type=int, default=10_000, help="timed report() per rank")
    parser.add_argument(
        "--ray-reports", type=int, default=30, help="timed report() per Ray rank (default 30)"
    )
    parser.add_argument(
        "--ray-poll-s",
        type=float,
        default=0.1,
        help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for Ray (default 0.1; Ray's own default is 2)",
    )
    parser.add_argument(
        "--programs", default="step,seed,failure", help="which trials (default all three)"
    )
    parser.add_argument("--skip-scale", action="store_true", help="no scale simulation")
    parser.add_argument("--scale-ranks", default="1024,4096", help="fake workers (1024,4096)")
    parser.add_argument("--scale-rate", type=int, default=100_000, help="reports/s offered")
    parser.add_argument("--scale-seconds", type=float, default=5.0, help="report phase length")
    parser.add_argument("--scale-binary", default=os.path.join(SCALE_BUILD, "scale_controller"))
    parser.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    parser.add_argument("--ray-python", default=sys.executable)
    parser.add_argument("--out", default=os.path.join(RESULTS, "compare_ray"))
    parser.add_argument("--keep", action="store_true", help="keep every trial's directory")
    args = parser.parse_args()
    args.workers = [int(n) for n in args.workers.split(",")]
    args.scale_ranks = [int(n) for n in args.scale_ranks.split(",")]
    programs = args.programs.split(",")
    begun = time.time()
    info = machine()

    runs: dict = {p: {s: {n: [] for n in args.workers} for s in SIDES} for p in programs}
    with tempfile.TemporaryDirectory(prefix="jaxtrain-compare-") as tmp:
        for i in range(args.warmup):
            for side in SIDES:
                run_trial(args, side, "step", min(args.workers), tmp)
            print(f"warm-up {i + 1}/{args.warmup} done", flush=True)
        for n in args.workers:
            for i in range(args.repeats):
                for program in programs:
                    line = []
                    for side in SIDES:
                        f = run_trial(args, side, program, n, tmp)
                        runs[program][side][n].append(f)
                        shown = {k: round(v, 3) for k, v in f.items() if isinstance(v, float)}
                        line.append(f"{side} {shown}")
                    print(f"{n} workers, repeat {i + 1}, {program}: " + "; ".join(line), flush=True)
    ray_steps = runs.get("step", {}).get("ray", {})
    ray_self_init = any(f.get("self_init") for n in args.workers for f in ray_steps.get(n, []))
    scale = [] if args.skip_scale else run_scale(args)

    summary = {}
    for key, program, _ in FIGURES:
        if program in runs:
            summary[key] = {str(n): summarise(runs[program], key, n) for n in args.workers}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "options": {k: v for k, v in vars(args).items() if k not in ("python", "ray_python")},
        "duration_s": time.time() - begun,
        "ray_mode": "JaxTrainer(use_tpu=False); the function initialises jax.distributed"
        if ray_self_init
        else "JaxTrainer(use_tpu=False); its backend initialised jax.distributed",
        "runs": runs,
        "summary": summary,
        "scale": scale,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(summary, scale, args.out + ".png")

    print(
        f"\n{info['cores']} cores ({info['cpu']}), load average {info['load_average_at_start']:.2f}"
        f" at the start; repeats: {args.repeats}; took {result['duration_s'] / 60:.1f} min"
    )
    print(
        f"Ray: ray.train.v2.jax.JaxTrainer, use_tpu=False, ray.init(num_cpus=workers + 1), "
        f"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={args.ray_poll_s:g} (its default 2 s makes each "
        "report() wait up to 2 s for the controller's poll);"
    )
    print(
        "  its JAX backend does not initialise jax.distributed on CPU, so the training function "
        "does"
        if ray_self_init
        else "  its JAX backend initialised jax.distributed"
    )
    print(
        f"report(): {args.reports} calls per rank (Ray: {args.ray_reports}); the floor writes "
        "one JSON line to a file;\nmemory is PSS; orchestrator = the driver and all it starts "
        "but the workers"
    )
    print(f"results: {args.out}.json, {args.out}.png; median [min-max] over repeats")
    head = f"{'figure':<38}{'N':>2}  {'jaxtrain':<24}{'ray':<34}{'floor':<24}"
    print(head + f"{'jaxtrain/floor':<22}ray/jaxtrain")
    for key, _, title in FIGURES:
        for n, s in summary.get(key, {}).items():
            fmt = FORMATS.get(key, ".2f")
            v = s["values"]
            print(
                f"{title:<38}{n:>2}  {spread(v['jaxtrain'], fmt):<24}{spread(v['ray'], fmt):<34}"
                f"{spread(v['floor'], fmt):<24}{spread(s['jaxtrain/floor']) + ' x':<22}"
                f"{spread(s['ray/jaxtrain'], '.1f') + ' x'}"
            )
    for r in scale:
        print(
            f"scale: {r['ranks']} fake workers in {r['processes']} processes: rendezvous "
            f"{r['rendezvous_s']:.3f} s; {r['reports_per_s']:.0f} reports/s processed "
            f"({r['offered_per_s']:.0f} offered) using {r['report_cpu_cores']:.2f} cores of the "
            f"controller ({r['cpu_us_per_report']:.2f} us CPU each, so "
            f"{1e6 / r['cpu_us_per_report']:.0f}/s per core); controller peak RSS "
            f"{r['peak_rss_mb']:.1f} MB"
        )


if __name__ == "__main__":
    main()
