"""Benchmark: an elastic run on the ssh test hosts losing a host and getting it back, against the
same run's cold start; with ``--launcher slurm``, on the Slurm test cluster, a node drained and
resumed; with ``--launcher kubernetes``, on the two-node Kubernetes test cluster, a node cordoned
with its pod deleted, then uncordoned.

    .venv/bin/python bench/elastic.py [--interval 5] [--host-timeout 5]
                                      [--launcher ssh|slurm|kubernetes]

The hosts are the tests' (tests/ssh_fixtures.py, scripts/ssh_hosts.sh): they use fixed
machine-wide names, so the benchmark takes ``/tmp/jaxtrain-clusters.lock`` itself (do not run it
under ``flock``: it would wait for itself), starts the hosts, runs one driver and stops them.

One ``fit()`` of ``ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=--interval)``
on host1 and host2 (2 workers each) with ``FailureConfig(max_failures=1,
unreachable_host_timeout_s=--host-timeout)``: a data-parallel step (a psum over every process)
and a ``report`` with a checkpoint every 0.2 s. Once attempt 0 has reported 10 rounds the benchmark
cuts host2's link (as a pulled cable), and restores it once a round of the 2-worker attempt is
recorded; the 4-worker attempt then runs 10 rounds and returns. The times are result.jsonl's (when
a round was recorded: every rank had reported it) and the benchmark's own, on one clock.

Figures (each printed as a ratio to the cold start):

* cold start: ``fit()`` -> the first round of attempt 0 (4 workers).
* shrink: the cut -> the first round on 2 workers. Its parts from run.json: detect (-> attempt
  0's failure), stop (-> its end), wait and probe (-> attempt 1's start: the elastic deadline,
  min(unreachable_host_timeout_s, interval), which also bounds each probe, at least 5 s), relaunch
  (-> every rank registered), first round.
* grow: the link restored -> the first round on 4 workers. Its parts: notice (-> the resize
  request, at most one interval plus a probe), drain (-> attempt 1's end: its next committed
  checkpoint, then the stop), relaunch (-> every rank registered), first round.

``--launcher slurm``: the same run in an allocation of jaxtrain's own on the Slurm test cluster
(tests/slurm_fixtures.py, scripts/slurm_cluster.sh; ``--nodes=1-2 --ntasks-per-node=2``), node2
drained (``scontrol update state=drain``) where host2 is cut and resumed where it is restored.
Slurm lets a drained node's tasks go on, so the shrink is a planned resize (docs/elastic.md):
shrink's parts are notice and drain (-> attempt 0's end at its next committed checkpoint), probe
(-> attempt 1's start), relaunch, first round; the cold start includes Slurm's grant.

``--launcher kubernetes``: ``num_workers=(1, 2)`` with pods of 1.5 CPUs on the test cluster's two
nodes of 2 (tests/kubernetes_fixtures.py, ``cluster.sh start`` and ``cluster.sh node2 start``), one
pod on each; node2 cordoned and its pod deleted (``--grace-period=0 --force``) where host2 is cut,
uncordoned where it is restored. The shrink is a failure (the pod deleted) or, when the monitor
sees the cordon first, a planned resize; the figures say which. Each attempt is a new JobSet, so
the cold start and each relaunch include the pods' creation and scheduling.

Results are printed and written to bench/results/elastic.json, elastic-slurm.json or
elastic-kubernetes.json (with the load average before and after: the machine is shared).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = "/tmp/jaxtrain-clusters.lock"
RESULTS = {"ssh": REPO / "bench" / "results" / "elastic.json",
           "slurm": REPO / "bench" / "results" / "elastic-slurm.json",
           "kubernetes": REPO / "bench" / "results" / "elastic-kubernetes.json"}
ROUNDS_BEFORE_CUT = 10
ROUNDS_AFTER_GROW = 10

DRIVER = """
import json, os, sys, tempfile, time
from pathlib import Path
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import (Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig,
                      get_checkpoint, get_context, report)

INTERVAL, HOST_TIMEOUT, AFTER_GROW = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
LEAST, MOST, RESOURCES = int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6])


def train():
    ctx = get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    mesh = Mesh(np.array(jax.devices()), ("workers",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    step = 0
    if (checkpoint := get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            step = json.loads(Path(d, "step.json").read_text())["step"] + 1
    done = 0
    while not (world == MOST and ctx.get_attempt() > 0 and done >= AFTER_GROW):
        total(jax.make_array_from_process_local_data(NamedSharding(mesh, P("workers")),
                                                     np.array([1.0]))).block_until_ready()
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                Path(d, "step.json").write_text(json.dumps({"step": step}))
            report({"step": step, "world_size": world, "attempt": ctx.get_attempt()},
                   checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
        step, done = step + 1, done + 1
        time.sleep(0.2)


Path("fit.json").write_text(json.dumps({"time": time.time()}))
JaxTrainer(train, scaling_config=ScalingConfig(num_workers=(LEAST, MOST),
                                               resources_per_worker=RESOURCES,
                                               elastic_resize_monitor_interval_s=INTERVAL),
           run_config=RunConfig(name="run", storage_path=os.getcwd(),
                                failure_config=FailureConfig(
                                    max_failures=1, unreachable_host_timeout_s=HOST_TIMEOUT))).fit()
"""


def loadavg() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


def rounds(out: Path) -> list[dict]:
    path = out / "run" / "result.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(what: str, condition, driver: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if driver.poll() is not None:
            raise RuntimeError(f"the driver ended (exit {driver.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def first_round(out: Path, world: int, attempt_min: int = 0) -> dict | None:
    for r in rounds(out):
        m = r["metrics"]
        if m["world_size"] == world and m["attempt"] >= attempt_min:
            return r
    return None


@contextlib.contextmanager
def drained(cluster, node: str):
    """`node` drained for the block, resumed after it."""
    cluster.run("scontrol", "update", f"nodename={node}", "state=drain", "reason=bench")
    try:
        yield
    finally:
        cluster.run("scontrol", "update", f"nodename={node}", "state=resume")


@contextlib.contextmanager
def cordoned(cluster, namespace: str, node: str):
    """`node` cordoned and the run's pod on it deleted for the block, uncordoned after it."""
    cluster.kubectl("cordon", node)
    try:
        pods = cluster.get("pods", "-n", namespace)["items"]
        for pod in pods:
            if pod["spec"].get("nodeName") == node:
                cluster.kubectl("delete", "pod", "-n", namespace, pod["metadata"]["name"],
                                "--grace-period=0", "--force")
        yield
    finally:
        cluster.kubectl("uncordon", node, check=False)


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    least, most, resources = (1, 2, {"CPU": 1.5}) if args.launcher == "kubernetes" else (2, 4, {})
    if args.launcher == "kubernetes":
        from kubernetes_fixtures import SCRIPT, STATE, KubernetesCluster

        cluster = KubernetesCluster(kubeconfig=str(STATE / "pki" / "admin.kubeconfig"))
        shared = Path(tempfile.gettempdir())
    elif args.launcher == "slurm":
        from slurm_fixtures import SCRIPT, STATE, SlurmCluster

        cluster = SlurmCluster(conf=str(STATE / "etc" / "slurm.conf"), shared=STATE / "shared")
        shared, lose = cluster.shared, lambda: drained(cluster, "node2")
    else:
        from ssh_fixtures import SCRIPT, STATE, SshHosts

        cluster = SshHosts(ssh_command=f"ssh -F {STATE / 'ssh_config'}", shared=STATE / "shared",
                           state=STATE)
        shared, lose = cluster.shared, lambda: cluster.cut("host2")
    print(f"{args.launcher} cluster: starting", flush=True)
    subprocess.run([str(SCRIPT), "start"], check=True, stdout=subprocess.DEVNULL, timeout=3600)
    if args.launcher == "kubernetes":
        subprocess.run([str(SCRIPT), "node2", "start"], check=True, stdout=subprocess.DEVNULL,
                       timeout=600)
    try:
        out = Path(tempfile.mkdtemp(prefix="bench-elastic-", dir=shared))
        (out / "driver.py").write_text(DRIVER)
        argv = [sys.executable, "driver.py", str(args.interval), str(args.host_timeout),
                str(ROUNDS_AFTER_GROW), str(least), str(most), json.dumps(resources)]
        if args.launcher == "kubernetes":
            namespace = cluster.namespace()
            env = cluster.driver_env(namespace, out)
            argv = [str(SCRIPT), "exec", *argv]
            lose = lambda: cordoned(cluster, namespace, "node2")  # noqa: E731
        elif args.launcher == "ssh":
            env = cluster.env(HOME=str(out), JAXTRAIN_SSH_HOSTS="host1,host2")
        else:
            env = cluster.env(HOME=str(out), JAXTRAIN_LAUNCHER="slurm",
                              JAXTRAIN_SLURM_TASKS_PER_NODE="2")
        with open(out / "driver.log", "w") as log:
            driver = subprocess.Popen(argv, cwd=out, env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
            try:
                wait_for("attempt 0's rounds", lambda: len(rounds(out)) >= ROUNDS_BEFORE_CUT,
                         driver)
                t_cut = time.time()  # before: losing a host may take a while (kubectl)
                with lose():
                    print("host2 lost", flush=True)
                    wait_for(f"a round on {least} workers",
                             lambda: first_round(out, least) is not None, driver)
                t_back = time.time()
                print("host2 back", flush=True)
                driver.wait(timeout=600)
            finally:
                if driver.poll() is None:
                    driver.terminate()
                    driver.wait()
        if driver.returncode != 0:
            raise RuntimeError(f"the driver failed; {out}/driver.log:\n"
                               + (out / "driver.log").read_text()[-4000:])
        return figures(out, t_cut, t_back, least, most,
                       planned={"slurm": True, "ssh": False}.get(args.launcher))
    finally:
        subprocess.run([str(SCRIPT), "stop"], capture_output=True, check=False, timeout=300)
        print(f"{args.launcher} cluster: stopped", flush=True)


def figures(out: Path, t_cut: float, t_back: float, least: int, most: int,
            planned: bool | None) -> dict:
    """`planned`: the shrink is a planned resize (a Slurm node drained), not a failure; None:
    either (a Kubernetes node cordoned with its pod deleted)."""
    state = json.loads((out / "run" / "run.json").read_text())
    attempts = state["attempts"]
    if planned is None and attempts:
        planned = attempts[0]["status"] == "RESIZED"
    expected = [("RESIZED" if planned else "ERRORED", most), ("RESIZED", least),
                ("FINISHED", most)]
    if [(a["status"], a["world_size"]) for a in attempts] != expected:
        raise RuntimeError(f"expected a shrink and a grow ({expected}): {attempts}")
    a0, a1, a2 = attempts
    t_fit = json.loads((out / "fit.json").read_text())["time"]
    cold = first_round(out, most)["time"] - t_fit
    shrunk = first_round(out, least)["time"]
    grown = first_round(out, most, attempt_min=a2["attempt"])["time"]
    log = (out / "driver.log").read_text()

    def parts(start: float, marks: list[tuple[str, float]]) -> dict:
        split, before = {}, start
        for name, t in marks:
            split[name] = t - before
            before = t
        return split

    return {
        "shrink_planned": planned,
        "cold_start_s": cold,
        "shrink_s": shrunk - t_cut,
        "shrink_ratio": (shrunk - t_cut) / cold,
        "grow_s": grown - t_back,
        "grow_ratio": (grown - t_back) / cold,
        "shrink_parts_s": parts(t_cut, [
            ("notice and drain", a0["end_time"]), ("probe", a1["start_time"]),
            ("relaunch", a1["ready_time"]), ("first round", shrunk)]) if planned else parts(t_cut, [
            ("detect", a0["failure"]["time"]), ("stop", a0["end_time"]),
            ("wait and probe", a1["start_time"]), ("relaunch", a1["ready_time"]),
            ("first round", shrunk)]),
        "grow_parts_s": parts(t_back, [
            ("notice and drain", a1["end_time"]), ("probe", a2["start_time"]),
            ("relaunch", a2["ready_time"]), ("first round", grown)]),
        "resize_lines": [line for line in log.splitlines() if "resiz" in line or "grows" in line],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=5,
                        help="ScalingConfig.elastic_resize_monitor_interval_s (default 5)")
    parser.add_argument("--host-timeout", type=float, default=5,
                        help="FailureConfig.unreachable_host_timeout_s (default 5)")
    parser.add_argument("--launcher", choices=("ssh", "slurm", "kubernetes"), default="ssh",
                        help="ssh: the ssh test hosts, host2 cut (default); slurm: the Slurm test "
                        "cluster, node2 drained; kubernetes: the Kubernetes test cluster with a "
                        "second node, node2 cordoned and its pod deleted")
    args = parser.parse_args()
    with open(LOCK, "w") as lock:
        print(f"waiting for {LOCK}", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = loadavg()
        f = run(args)
        f.update(load_before=before, load_after=loadavg(), interval_s=args.interval,
                 launcher=args.launcher,
                 host_timeout_s=args.host_timeout, machine=platform.node(),
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    where, least, most = {
        "ssh": ("ssh hosts", 2, 4), "slurm": ("Slurm, node2 drained", 2, 4),
        "kubernetes": ("Kubernetes, node2 cordoned and its pod deleted", 1, 2)}[args.launcher]
    print(f"\n{where}, ({least}, {most}) workers, interval {args.interval} s, "
          f"unreachable_host_timeout_s {args.host_timeout} s; load average {f['load_before']} "
          f"before, {f['load_after']} after")
    print(f"  cold start (fit() -> first round on {most})  {f['cold_start_s']:8.2f} s")
    print(f"  shrink (host2 lost -> first round on {least}) {f['shrink_s']:8.2f} s   "
          f"{f['shrink_ratio']:.2f} x the cold start"
          + (" (a planned resize)" if f["shrink_planned"] else ""))
    for name, s in f["shrink_parts_s"].items():
        print(f"    {name:<17}{s:8.2f} s")
    print(f"  grow (host2 back -> first round on {most})   {f['grow_s']:8.2f} s   "
          f"{f['grow_ratio']:.2f} x the cold start")
    for name, s in f["grow_parts_s"].items():
        print(f"    {name:<17}{s:8.2f} s")
    results = RESULTS[args.launcher]
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(f, indent=2) + "\n")
    print(f"written to {results.relative_to(REPO)}")


if __name__ == "__main__":
    main()
