"""Benchmark: a rank's failure to every rank training again, on the ssh test hosts, the Slurm test
cluster and the Kubernetes test cluster, against the same run's cold start.

    .venv/bin/python bench/cluster_restart.py [--launcher ssh|slurm|kubernetes|all] [--layers 2]

The clusters are the tests' (tests/ssh_fixtures.py, tests/slurm_fixtures.py,
tests/kubernetes_fixtures.py): they use fixed machine-wide names, so the benchmark takes
``/tmp/jaxtrain-clusters.lock`` itself (do not run it under ``flock``: it would wait for itself),
starts each cluster with its script, runs one driver on it and stops it again.

Each launcher runs one ``fit()`` of 4 ranks with ``FailureConfig(max_failures=1)``: 2 ssh hosts x
2 workers (host1, host2), 2 Slurm nodes x 2 tasks (``salloc -N2 -n4``), 4 pods on the Kubernetes
test cluster's node. The training function is bench/compile_cache.py's model (a small Flax
transformer, ``--layers`` blocks, AdamW, data-parallel over the ranks, one jit), whose first step
compiles for several seconds, so that JAX's persistent compilation cache (jaxtrain's default, in
the run directory) has something to save. Every rank writes its own ``time.time()`` (one clock:
hosts, nodes and pods are namespaces of this machine) at: the first line of the training function;
before and after restoring the checkpoint (attempt 1; attempt 0 initialises the model); before and
after the first step (``block_until_ready``); after the attempt's first ``report()``, which carries
rank 0's parameters as a checkpoint. At report ``--kill-step`` of attempt 0 the last rank (on host2,
node2, the fourth pod) writes the time and SIGKILLs itself (a pod's worker, the pod's first process,
ignores its own SIGKILL: it asks, and the benchmark sends the signal from this machine's namespaces
at once and notes the time); the others block in the next step's collective until the group is
stopped. Attempt 1 restores the checkpoint, runs 3 steps, returns.

Figures, each on the last rank to get there:

* cold start: ``time.time()`` before ``fit()`` in the driver -> every rank's first report of
  attempt 0 (the baseline of the same run).
* restart: the kill -> every rank's first report of attempt 1. Target <= 0.25 x the cold start.
* first step: attempt 1's first step against attempt 0's (the compilation cache). Target <= 0.2 x.
  Each is also printed in its stages (``jit``'s ahead-of-time API, the same work as the call:
  trace, lower, compile or load from the cache, run), with what the cache cannot save: the
  restarted step's tracing, lowering and run against the cold first step.
* the restart's parts, from run.json's attempt times and the workers' timestamps: detect (kill ->
  attempt 0's ``failure.time``), stop (-> attempt 0's ``end_time``: every process reaped), relaunch
  (-> attempt 1's ``ready_time``: its processes started on the hosts, every rank registered; the
  gap between attempt 0's end and attempt 1's ``start_time`` is in it and printed), rendezvous
  (-> the training function's first line: ``import jax``, ``jax.distributed.initialize``, the
  function unpickled),
  imports (flax, optax), model (-> restore begins: the model and optimiser state initialised by
  jit, their programs loaded from the cache), restore (reading the checkpoint onto the devices
  with ``jax.make_array_from_callback``), first step, first report.

Results are printed and written to bench/results/cluster_restart.json (one entry per launcher,
with the load average before and after it: the machine is shared).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = "/tmp/jaxtrain-clusters.lock"
RESULTS = REPO / "bench" / "results" / "cluster_restart.json"
LAUNCHERS = ("ssh", "slurm", "kubernetes")
RESTART_TARGET_RATIO = 0.25
FIRST_STEP_TARGET_RATIO = 0.2
WORKERS = 4
STEPS_AFTER_RESTART = 3


# --- the training function (runs on the hosts; pickled by value from __main__) -------------------

def train_func(config: dict) -> None:
    t_first = time.time()  # must stay the first line: the rendezvous ends here
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import Checkpoint, get_checkpoint, get_context, report

    ctx = get_context()
    rank, world, attempt = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_attempt()
    width, seq, batch = config["width"], 32, 4 * world
    out = config["out_dir"]
    times = {"first": t_first, "imported": time.time()}

    def note() -> None:
        with open(os.path.join(out, f"times-a{attempt}-rank{rank}.json"), "w") as f:
            json.dump(times, f)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            x = x + nn.SelfAttention(num_heads=4)(nn.LayerNorm()(x))
            h = nn.Dense(4 * width)(nn.LayerNorm()(x))
            return x + nn.Dense(width)(nn.gelu(h)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(width)(x)
            layers = config["layers"]
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=layers, unroll=layers)()(x, None)
            return nn.Dense(1)(nn.LayerNorm()(x))

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model, optimizer = Model(), optax.adamw(1e-3)
    rows = np.random.default_rng(rank).normal(size=(batch // world, seq, 8)).astype(np.float32)
    x = jax.make_array_from_process_local_data(split, rows)
    y = jax.make_array_from_process_local_data(split, rows[..., :1] * 2.0)
    params = jax.jit(model.init, out_shardings=replicated)(
        jax.random.key(0), np.zeros((1, seq, 8), np.float32))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)  # shapes only
    jax.block_until_ready((params, opt_state))
    times["restore_start"] = time.time()
    checkpoint = get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d, np.load(os.path.join(d, "params.npz")) as saved:
            # Not jax.device_put: onto a sharding across processes it costs ~35 ms a leaf here
            # (JAX 0.10), a second for this model; docs/checkpoints.md says so.
            leaves = [jax.make_array_from_callback(
                saved[f"p{i}"].shape, replicated, lambda index, a=saved[f"p{i}"]: a[index])
                for i in range(len(leaves))]
        params = jax.tree_util.tree_unflatten(treedef, leaves)
    elif attempt > 0:
        raise RuntimeError(f"attempt {attempt} started without the checkpoint of attempt 0")
    jax.block_until_ready(params)
    times["restore_end"] = time.time()

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    killing = attempt == 0
    steps = 1_000_000 if killing else STEPS_AFTER_RESTART
    compiled = None
    for i in range(1, steps + 1):
        if i == 1:
            # The same work as the first step(...) call, in its stages, each timed: tracing the
            # Python function, lowering it to StableHLO, compiling (or loading from the cache),
            # and running it (the first run, and the collective's wait for the other ranks).
            times["step_start"] = time.time()
            traced = step.trace(params, opt_state, x, y)
            times["traced"] = time.time()
            lowered = traced.lower()
            times["lowered"] = time.time()
            compiled = lowered.compile()
            times["compiled"] = time.time()
        params, opt_state, loss = compiled(params, opt_state, x, y)
        loss.block_until_ready()
        if i == 1:
            times["step_end"] = time.time()
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    np.savez(os.path.join(d, "params.npz"), **{
                        f"p{j}": np.asarray(leaf)
                        for j, leaf in enumerate(jax.tree_util.tree_leaves(params))})
                report({"step": i, "loss": float(loss)},
                       checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
            times["report"] = time.time()
            note()
        else:
            time.sleep(0.5)  # time for attempt 0's checkpoint to commit before the kill
            report({"step": i, "loss": float(loss)})
        if killing and i == config["kill_step"] and rank == world - 1:
            if os.getpid() == 1:
                # A pod's first process ignores its own SIGKILL: the benchmark sends it from
                # outside the pod's namespaces, at once (run_driver), and notes the time.
                with open(os.path.join(out, "kill-request.json"), "w") as f:
                    json.dump({"pid_namespace": os.readlink("/proc/self/ns/pid")}, f)
                time.sleep(3600)
            with open(os.path.join(out, "kill.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)


def driver(out_dir: str, layers: int, width: int, kill_step: int, launcher: str) -> None:
    """The driver: one fit() on the cluster whose settings are in the environment."""
    from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

    scaling = ScalingConfig(num_workers=WORKERS)
    t_fit = time.time()
    with open(os.path.join(out_dir, "fit.json"), "w") as f:
        json.dump({"time": t_fit}, f)
    JaxTrainer(
        train_func,
        train_loop_config={"out_dir": out_dir, "layers": layers, "width": width,
                           "kill_step": kill_step},
        scaling_config=scaling,
        run_config=RunConfig(name="run", storage_path=out_dir,
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    print(f"{launcher}: fit() returned", flush=True)


# --- the clusters (started and stopped as the tests' fixtures do) --------------------------------

def loadavg() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


@contextlib.contextmanager
def cluster(script: Path, what: str, timeout: float):
    print(f"{what}: starting ({script.relative_to(REPO)} start)", flush=True)
    t0 = time.monotonic()
    started = subprocess.run([str(script), "start"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, timeout=timeout)
    if started.returncode != 0:
        subprocess.run([str(script), "stop"], capture_output=True, check=False, timeout=300)
        raise RuntimeError(f"{what} did not start:\n{started.stderr[-3000:]}")
    print(f"{what}: started in {time.monotonic() - t0:.0f} s", flush=True)
    try:
        yield
    finally:
        subprocess.run([str(script), "stop"], capture_output=True, check=False, timeout=300)
        print(f"{what}: stopped", flush=True)


def driver_argv(out_dir: Path, args: argparse.Namespace, launcher: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--driver", str(out_dir),
            "--layers", str(args.layers), "--width", str(args.width),
            "--kill-step", str(args.kill_step), "--launcher", launcher]


def _ns_pid(proc: Path) -> str:
    """The process's pid in its own (innermost) PID namespace."""
    status = (proc / "status").read_text()
    return status.split("NSpid:", 1)[1].split("\n", 1)[0].split()[-1]


def kill_on_request(out: Path) -> bool:
    """SIGKILLs the first process of the pod that asked for it (kill-request.json: its PID
    namespace), from this machine's, and notes the time in kill.json; whether that is done."""
    request = out / "kill-request.json"
    if not request.exists() or (out / "kill.json").exists():
        return (out / "kill.json").exists()
    try:
        namespace = json.loads(request.read_text())["pid_namespace"]
    except (ValueError, KeyError):
        return False  # still being written
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and os.readlink(proc / "ns" / "pid") == namespace
                    and _ns_pid(proc) == "1"):
                (out / "kill.json").write_text(json.dumps({"time": time.time()}))
                os.kill(int(proc.name), signal.SIGKILL)
                return True
        except (OSError, IndexError):
            continue  # ended meanwhile, or not ours to read
    return False  # not visible yet: asked again on the next poll


def run_driver(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> None:
    deadline, killed = time.monotonic() + timeout, False
    with open(cwd / "driver.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout)
                if not killed:
                    killed = kill_on_request(cwd)
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if proc.returncode != 0:
        tail = (cwd / "driver.log").read_text()[-4000:]
        raise RuntimeError(f"the driver failed (exit {proc.returncode}); {cwd}/driver.log:\n{tail}")


def on_ssh(args: argparse.Namespace) -> Path:
    from ssh_fixtures import SCRIPT, STATE, SshHosts

    with cluster(SCRIPT, "ssh hosts", 600):
        hosts = SshHosts(ssh_command=f"ssh -F {STATE / 'ssh_config'}", shared=STATE / "shared",
                         state=STATE)
        out = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=hosts.shared))
        env = hosts.env(HOME=str(out), JAXTRAIN_SSH_HOSTS="host1,host2")
        run_driver(driver_argv(out, args, "ssh"), env, out, args.timeout)
        return keep(out, "ssh")


def on_slurm(args: argparse.Namespace) -> Path:
    from slurm_fixtures import SCRIPT, STATE, SlurmCluster

    with cluster(SCRIPT, "Slurm cluster", 900):
        slurm = SlurmCluster(conf=str(STATE / "etc" / "slurm.conf"), shared=STATE / "shared",
                             nodes=["node1", "node2"])
        out = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=slurm.shared))
        env = slurm.env(HOME=str(out))
        run_driver(["salloc", "-N2", f"-n{WORKERS}", *driver_argv(out, args, "slurm")], env, out,
                   args.timeout)
        return keep(out, "slurm")


def on_kubernetes(args: argparse.Namespace) -> Path:
    from kubernetes_fixtures import SCRIPT, STATE, KubernetesCluster

    with cluster(SCRIPT, "Kubernetes cluster", 3600):
        k = KubernetesCluster(kubeconfig=str(STATE / "pki" / "admin.kubeconfig"))
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        k.kubectl("create", "namespace", ns)
        out = Path(tempfile.mkdtemp(prefix="jaxtrain-bench-restart-"))
        env = k.driver_env(ns, out)
        run_driver([str(SCRIPT), "exec", *driver_argv(out, args, "kubernetes")], env, out,
                   args.timeout)
        return keep(out, "kubernetes")


def keep(out: Path, launcher: str) -> Path:
    """A copy of the run's records outside the cluster's state (which its stop may wipe)."""
    kept = Path(tempfile.mkdtemp(prefix=f"jaxtrain-bench-restart-{launcher}-"))
    shutil.copytree(out, kept, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("compilation-cache", "checkpoint_*", ".staging"))
    return kept


# --- the figures ----------------------------------------------------------------------------------

def read(path: Path) -> dict:
    if not path.exists():
        raise RuntimeError(f"{path} is missing: a rank did not get as far as the benchmark needs")
    return json.loads(path.read_text())


def figures(out: Path) -> dict:
    state = read(out / "run" / "run.json")
    attempts = state["attempts"]
    if len(attempts) != 2 or [a["status"] for a in attempts] != ["ERRORED", "FINISHED"]:
        raise RuntimeError(f"expected one failure, then a finished restart: {attempts}")
    if not attempts[1].get("restored_from"):
        raise RuntimeError(f"attempt 1 did not restore attempt 0's checkpoint: {attempts[1]}")
    a0, a1 = attempts
    t_fit, t_kill = read(out / "fit.json")["time"], read(out / "kill.json")["time"]
    ranks = [[read(out / f"times-a{a}-rank{r}.json") for r in range(WORKERS)] for a in (0, 1)]

    def last(attempt: int, key: str) -> float:
        return max(t[key] for t in ranks[attempt])

    def step(attempt: int) -> float:  # the step ends in a collective: the slowest rank's
        return max(t["step_end"] - t["step_start"] for t in ranks[attempt])

    def stages(attempt: int) -> dict:  # each stage of the first step: the slowest rank's
        marks = [("trace", "step_start", "traced"), ("lower", "traced", "lowered"),
                 ("compile or load", "lowered", "compiled"), ("run", "compiled", "step_end")]
        return {name: max(t[b] - t[a] for t in ranks[attempt]) for name, a, b in marks}

    cold_stages, restarted_stages = stages(0), stages(1)
    cold = last(0, "report") - t_fit
    restart = last(1, "report") - t_kill
    marks = [("detect", a0["failure"]["time"]), ("stop", a0["end_time"]),
             ("relaunch", a1["ready_time"]), ("rendezvous", last(1, "first")),
             ("imports", last(1, "imported")), ("model", last(1, "restore_start")),
             ("restore", last(1, "restore_end")), ("first step", last(1, "step_end")),
             ("first report", last(1, "report"))]
    parts, before = {}, t_kill
    for name, t in marks:
        parts[name] = t - before
        before = t
    return {
        "cold_start_s": cold,
        "restart_s": restart,
        "restart_ratio": restart / cold,
        "first_step_s": step(0),
        "restarted_first_step_s": step(1),
        "first_step_ratio": step(1) / step(0),
        "first_step_stages_s": cold_stages,
        "restarted_first_step_stages_s": restarted_stages,
        "first_step_floor_ratio": sum(v for k, v in restarted_stages.items()
                                      if k != "compile or load") / step(0),
        "parts_s": parts,
        "between_attempts_s": a1["start_time"] - a0["end_time"],
        "cold_parts_s": {
            "to ready (start, register)": a0["ready_time"] - t_fit,
            "rendezvous": last(0, "first") - a0["ready_time"],
            "imports": last(0, "imported") - last(0, "first"),
            "model": last(0, "restore_start") - last(0, "imported"),
            "first step": last(0, "step_end") - last(0, "restore_start"),
            "first report": last(0, "report") - last(0, "step_end"),
        },
        "failure": {k: a0["failure"].get(k) for k in ("rank", "host", "reason", "message")
                    if k in a0["failure"]},
        "hosts": a1.get("hosts"),
    }


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "NOT met"


def show(launcher: str, f: dict) -> None:
    print(f"\n{launcher}: 4 ranks, load average {f['load_before']} before, {f['load_after']} after")
    print(f"  cold start (fit() -> every rank's first report) {f['cold_start_s']:8.2f} s")
    print(f"  restart (kill -> every rank's first report)     {f['restart_s']:8.2f} s   "
          f"{f['restart_ratio']:.2f} x  target <= {RESTART_TARGET_RATIO} x: "
          f"{verdict(f['restart_ratio'], RESTART_TARGET_RATIO)}")
    print(f"  first step, attempt 0 (cold compile)            {f['first_step_s']:8.2f} s")
    print(f"  first step after the restart (cache)            {f['restarted_first_step_s']:8.2f} s"
          f"   {f['first_step_ratio']:.2f} x  target <= {FIRST_STEP_TARGET_RATIO} x: "
          f"{verdict(f['first_step_ratio'], FIRST_STEP_TARGET_RATIO)}")
    cold, warm = f["first_step_stages_s"], f["restarted_first_step_stages_s"]
    print("  the first step's stages (slowest rank), attempt 0 -> after the restart:")
    for name in cold:
        ratio = warm[name] / cold[name]
        print(f"    {name:<16}{cold[name]:8.2f} s -> {warm[name]:6.2f} s  {ratio:5.2f} x")
    print(f"    the restarted step's stages but its compile or load, against the cold first step: "
          f"{f['first_step_floor_ratio']:.2f} x (what no cache can save)")
    print("  the restart's parts (last rank):")
    for name, s in f["parts_s"].items():
        print(f"    {name:<14}{s:8.2f} s  {s / f['restart_s']:5.0%}")
    print(f"    (attempt 0 end -> attempt 1 start, in relaunch: {f['between_attempts_s']:.2f} s)")
    print("  the cold start's parts: " + ", ".join(
        f"{name} {s:.2f} s" for name, s in f["cold_parts_s"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launcher", choices=[*LAUNCHERS, "all"], default="all")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--kill-step", type=int, default=3,
                        help="the report of attempt 0 at which the last rank dies (default 3)")
    parser.add_argument("--timeout", type=float, default=900, help="per driver, s (default 900)")
    parser.add_argument("--driver", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.layers, args.width, args.kill_step) < 1:
        parser.error("--layers, --width and --kill-step must be >= 1")
    if args.driver:
        driver(args.driver, args.layers, args.width, args.kill_step, args.launcher)
        return
    sys.path.insert(0, str(REPO / "tests"))
    launchers = LAUNCHERS if args.launcher == "all" else (args.launcher,)
    run = {"ssh": on_ssh, "slurm": on_slurm, "kubernetes": on_kubernetes}
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    with open(LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {LOCK}: another run uses the test clusters (this benchmark takes "
                  "the lock itself; do not run it under flock)", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        failed = []
        for launcher in launchers:
            load_before = loadavg()
            try:
                out = run[launcher](args)
                f = figures(out)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"\n{launcher}: FAILED: {e}", flush=True)
                failed.append(launcher)
                continue
            f.update(load_before=load_before, load_after=loadavg(), records=str(out))
            show(launcher, f)
            results[launcher] = {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "machine": platform.machine(), "cpus": os.cpu_count(),
                "args": {k: v for k, v in vars(args).items() if k != "driver"}, **f}
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwritten to {RESULTS.relative_to(REPO)}")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
