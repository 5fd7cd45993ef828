"""Preemption notices from the real clusters (tests/slurm_fixtures.py, kubernetes_fixtures.py):
`scancel --signal=TERM` of the step and Slurm's time limit signal (--signal=USR1@<s>), and
`kubectl delete pod` of one worker pod with its terminationGracePeriodSeconds. As in
tests/test_preemption.py: the run finishes with max_failures=0, every rank saw the notice at the
same step, the group restarted from the just-in-time checkpoint, and the final metrics equal an
undisturbed run's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes_fixtures import IMAGE

from conftest import run_command

pytest_plugins = ["slurm_fixtures", "kubernetes_fixtures"]

PY = sys.executable
WAIT_AT = 5  # the step at which attempt 0 waits for the notice

# The driver: python train.py NAME NUM_WORKERS WAIT_AT TRIGGER. On attempt 0, at step WAIT_AT,
# rank 0 writes "ready" (and runs TRIGGER, when not empty), and every rank calls
# get_preemption_info() until the notice comes: the step at which it is seen does not depend on
# when the cluster delivers it. On the notice, one just-in-time checkpoint; a periodic one every
# 4 steps. Each step takes $STEP_S seconds (default 0).
TRAIN = '''
import json, os, subprocess, sys, tempfile, time
from pathlib import Path

from jaxtrain import Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig

STEPS = 12


def train(config):
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxtrain as train

    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    Path(config["out"], f"job-{attempt}-{rank}").write_text(os.environ.get("SLURM_JOB_ID", ""))
    state, start = 1.0, 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = json.loads(Path(d, "state.json").read_text())
            state, start = saved["state"], saved["step"] + 1
    saved_on_preemption = False
    for step in range(start, STEPS):
        share = multihost_utils.process_allgather(jnp.asarray([rank + 1.0]))
        state = float(state * 0.9 + np.sum(np.asarray(share)) / (step + 1))
        metrics = {"step": step, "state": state, "attempt": attempt}
        info = train.get_preemption_info()
        if step == config["wait_at"] and attempt == 0:
            if rank == 0:
                Path(config["out"], "ready").write_text("go")
                if config["trigger"]:
                    # Not checked: scancel is in the task's process group, which it signals.
                    subprocess.run(config["trigger"], shell=True)
            deadline = time.monotonic() + 240
            while info is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("no preemption notice came")
                time.sleep(0.2)
                info = train.get_preemption_info()
        time.sleep(config["step_s"])
        due = (step + 1) % 4 == 0
        if info is not None and not saved_on_preemption:
            Path(config["out"], f"seen-{attempt}-{rank}").write_text(json.dumps(
                {"step": step, "ranks": info.preempted_ranks, "nodes": info.preempted_node_ids,
                 "deadline_ms": info.deadline_ms}))
            saved_on_preemption = due = True
        if due:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    Path(d, "state.json").write_text(json.dumps({"state": state, "step": step}))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)


name, workers, wait_at, trigger = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
result = JaxTrainer(
    train,
    train_loop_config={"out": os.path.abspath("."), "wait_at": wait_at, "trigger": trigger,
                       "step_s": float(os.environ.get("STEP_S", "0"))},
    scaling_config=ScalingConfig(num_workers=workers, placement_strategy="SPREAD"),
    run_config=RunConfig(name=name, storage_path=os.path.abspath("."),
                         failure_config=FailureConfig(max_failures=0)),
).fit()
print("FINAL", json.dumps(result.metrics))
'''


def _final(stdout: str) -> dict:
    return json.loads(stdout.split("FINAL ", 1)[1].splitlines()[0])


def _undisturbed(cwd: Path, env: dict[str, str], workers: int) -> dict:
    """The final metrics of the same training without a notice, on local workers (same math)."""
    proc = run_command([PY, "train.py", "undisturbed", str(workers), "-1", ""], cwd=cwd,
                       env={**env, "JAXTRAIN_LAUNCHER": "local"}, capture_output=True, text=True,
                       timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _final(proc.stdout)


def _check_preempted_run(cwd: Path, name: str, stdout: str, undisturbed: dict,
                         workers: int, source: str) -> dict:
    """What every cluster's preempted run must show; returns attempt 0's failure."""
    run = json.loads((cwd / name / "run.json").read_text())
    attempts = run["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"], attempts
    failure = attempts[0]["failure"]
    assert failure["cause"] == "preemption", failure
    assert f"by {source}" in failure["message"], failure
    assert failure["decision"]["action"] == "retry", failure

    # Every rank saw the notice at the same step, with the same content.
    seen = [json.loads((cwd / f"seen-0-{rank}").read_text()) for rank in range(workers)]
    assert all(s == seen[0] for s in seen), seen
    jit_step = seen[0]["step"]
    assert jit_step <= WAIT_AT and seen[0]["deadline_ms"] > 0, seen
    assert not list(cwd.glob("seen-1-*"))

    # The restart resumed from the just-in-time checkpoint: nothing redone, nothing past it.
    restored = json.loads(Path(attempts[1]["restored_from"], "state.json").read_text())
    assert restored["step"] == jit_step, attempts[1]
    rows = [json.loads(line)["metrics"]
            for line in (cwd / name / "result.jsonl").read_text().splitlines()]
    first = [r["step"] for r in rows if r["attempt"] == 0]
    second = [r["step"] for r in rows if r["attempt"] == 1]
    assert first == list(range(jit_step + 1)) and second[0] == jit_step + 1, (first, second)
    assert _final(stdout)["state"] == pytest.approx(undisturbed["state"], rel=1e-12)
    failure["jit_step"] = jit_step
    return failure


# --- Slurm -----------------------------------------------------------------------------------


@pytest.fixture
def slurm_dir(slurm_shared_dir: Path) -> Path:
    (slurm_shared_dir / "train.py").write_text(TRAIN)
    return slurm_shared_dir


def _slurm_drive(cluster, cwd: Path, name: str, trigger: str, **env: str):
    return run_command([PY, "train.py", name, "2", str(WAIT_AT), trigger], cwd=cwd,
                       env=cluster.env(HOME=str(cwd), JAXTRAIN_LAUNCHER="slurm", **env),
                       capture_output=True, text=True, timeout=300)


def test_scancel_signal_term_of_the_step_is_a_notice_on_every_node(slurm_cluster, slurm_dir):
    undisturbed = _undisturbed(slurm_dir, slurm_cluster.env(HOME=str(slurm_dir)), 2)
    # As an administrator, or a site's preemption script, signals the job step's tasks.
    proc = _slurm_drive(slurm_cluster, slurm_dir, "scancelled",
                        "scancel --signal=TERM $SLURM_JOB_ID.$SLURM_STEP_ID")

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    failure = _check_preempted_run(slurm_dir, "scancelled", proc.stdout, undisturbed, 2,
                                   "SIGTERM")
    assert failure["jit_step"] == WAIT_AT  # the step at which the signal was sent
    # Every task got the signal; the notice names the node (or both) whose notice came first,
    # with its rank (a notice after the agreement is part of the same preemption).
    ranks = failure["preemption"]["preempted_node_to_ranks"]
    assert ranks and ranks.items() <= {"node1": [0], "node2": [1]}.items(), ranks
    assert failure["preemption"]["drain_timed_out"] is False
    assert "jaxtrain: restarting the worker group: attempt 1" in proc.stderr


def test_after_the_time_limit_notice_the_run_goes_on_in_a_new_allocation(slurm_cluster,
                                                                        slurm_dir):
    undisturbed = _undisturbed(slurm_dir, slurm_cluster.env(HOME=str(slurm_dir)), 2)
    # jaxtrain's own allocation, with a 2-minute time limit: --signal=USR1@100 comes in the first
    # 20 s (Slurm may send it up to 60 s early), while the workers start or attempt 0 trains or
    # waits for it at step WAIT_AT; the restart then finds the allocation within its notice's
    # reach of the limit. Each new allocation is the same request, so it may be noticed again
    # before its attempt finishes: a run of more than two attempts is right too.
    started_ms = time.time() * 1000
    proc = _slurm_drive(slurm_cluster, slurm_dir, "renewed", "", SALLOC_TIMELIMIT="2",
                        JAXTRAIN_SLURM_SIGNAL_S="100")

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    attempts = json.loads((slurm_dir / "renewed" / "run.json").read_text())["attempts"]
    assert attempts[-1]["status"] == "FINISHED" and len(attempts) >= 2, attempts
    # Every restart was a time limit's notice, counted as a preemption (max_failures=0), and
    # each attempt ran in an allocation of its own: the same request, made again.
    for attempt in attempts[:-1]:
        failure = attempt["failure"]
        assert failure["cause"] == "preemption", failure
        assert "by SIGUSR1 (Slurm time limit)" in failure["message"], failure
        assert failure["decision"]["action"] == "retry", failure
    jobs = [[(slurm_dir / f"job-{i}-{rank}").read_text() for rank in range(2)]
            for i in range(len(attempts))]
    assert all(a == b and a for a, b in jobs), jobs
    assert len({a for a, _ in jobs}) == len(jobs), jobs
    first_job, second_job = jobs[0][0], jobs[1][0]
    assert (f"Slurm job {first_job}, this run's allocation, reaches its time limit in"
            in proc.stderr), proc.stderr[-3000:]
    assert "asking Slurm for a new allocation of the same shape" in proc.stderr
    assert f"Slurm granted job {second_job}" in proc.stderr
    state = subprocess.run(["squeue", "--noheader", f"--jobs={first_job}", "--format=%T"],
                           env=slurm_cluster.env(), capture_output=True, text=True).stdout
    assert "RUNNING" not in state, state  # released, not left to its time limit

    # Each restart resumed from the just-in-time checkpoint: nothing redone, nothing skipped.
    restored = json.loads(Path(attempts[1]["restored_from"], "state.json").read_text())
    rows = [json.loads(line)["metrics"]
            for line in (slurm_dir / "renewed" / "result.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(12)), rows
    by_attempt = [[r["step"] for r in rows if r["attempt"] == i] for i in range(len(attempts))]
    assert by_attempt[0][-1] == restored["step"], (by_attempt, restored)
    seen = json.loads((slurm_dir / "seen-0-0").read_text())
    assert seen["step"] == restored["step"], (seen, restored)
    # The notice names the ranks of the nodes it reached; its deadline is the sooner of the time
    # limit's (100 s away) and preemption_grace_s (30).
    ranks = attempts[0]["failure"]["preemption"]["preempted_node_to_ranks"]
    assert ranks and ranks.items() <= {"node1": [0], "node2": [1]}.items(), ranks
    assert started_ms < seen["deadline_ms"] < time.time() * 1000 + 30_000
    assert _final(proc.stdout)["state"] == pytest.approx(undisturbed["state"], rel=1e-12)


def test_sigusr1_is_a_notice_where_the_slurm_setting_is_given(tmp_path):
    """The worker's side of the time limit signal without a cluster: local workers given
    JAXTRAIN_SLURM_SIGNAL_S, rank 0 sending itself SIGUSR1."""
    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXTRAIN_"))}
    env.update(HOME=str(tmp_path), JAXTRAIN_LAUNCHER="local")
    undisturbed = _undisturbed(tmp_path, env, 2)
    proc = run_command([PY, "train.py", "usr1", "2", str(WAIT_AT), "kill -USR1 $PPID"],
                       cwd=tmp_path, env={**env, "JAXTRAIN_SLURM_SIGNAL_S": "100"},
                       capture_output=True, text=True, timeout=300)

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    failure = _check_preempted_run(tmp_path, "usr1", proc.stdout, undisturbed, 2,
                                   "SIGUSR1 (Slurm time limit)")
    assert failure["jit_step"] == WAIT_AT and failure["rank"] == 0, failure


# A batch job that asks for its own requeue at step WAIT_AT of its first run, as a preemption with
# PreemptMode=REQUEUE ends it, and resumes by name when Slurm runs it again.
REQUEUE = """#!/bin/bash
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then trigger='scontrol requeue $SLURM_JOB_ID'; fi
exec "$PYTHON" train.py requeued 2 WAIT_AT "${trigger:-}"
""".replace("WAIT_AT", str(WAIT_AT))


def test_a_requeued_batch_job_resumes_the_run_by_name(slurm_cluster, slurm_dir):
    undisturbed = _undisturbed(slurm_dir, slurm_cluster.env(HOME=str(slurm_dir)), 2)
    (slurm_dir / "job.sh").write_text(REQUEUE)
    # Steps of 1 s: the first run cannot finish in the KillWait (5 s) that the requeue leaves it.
    env = slurm_cluster.env(HOME=str(slurm_dir), PYTHON=PY, STEP_S="1")
    job = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "-N2", "-n2", "--open-mode=append",
         f"--output={slurm_dir}/job.out", f"--chdir={slurm_dir}", str(slurm_dir / "job.sh")],
        env=env, capture_output=True, text=True, check=True).stdout.strip()
    deadline = time.monotonic() + 280
    state = ""
    while "JobState=COMPLETED" not in state and "JobState=FAILED" not in state:
        assert time.monotonic() < deadline, state
        time.sleep(1)
        state = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                               text=True).stdout
    out = (slurm_dir / "job.out").read_text()
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, state + out[-3000:]

    run = json.loads((slurm_dir / "requeued" / "run.json").read_text())
    attempts = run["attempts"]
    # The requeue ended the first run's driver too; the second resumed from a committed checkpoint.
    assert attempts[0]["status"] != "FINISHED" and attempts[-1]["status"] == "FINISHED", attempts
    restored = json.loads(Path(attempts[-1]["restored_from"], "state.json").read_text())
    rows = [json.loads(line)["metrics"]
            for line in (slurm_dir / "requeued" / "result.jsonl").read_text().splitlines()]
    # The rerun went on from the step after its checkpoint's (the periodic one of step 3, or one
    # committed between the notice the workers got and the driver's end), nothing before it
    # redone.
    assert 3 <= restored["step"] < 11, (restored, rows)
    resumed = [r["step"] for r in rows[len(rows) - (11 - restored["step"]):]]
    assert resumed == list(range(restored["step"] + 1, 12)), (restored, rows)
    assert rows[len(rows) - len(resumed) - 1]["step"] >= restored["step"], rows
    assert _final(out)["state"] == pytest.approx(undisturbed["state"], rel=1e-12)


# --- Kubernetes ------------------------------------------------------------------------------


def _wait_for(what: str, check, driver: subprocess.Popen, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline and driver.poll() is None, (what,
                                                                       driver.communicate())
        time.sleep(0.2)
    return found


def _supervisor_said(workdir: Path, name: str, out: str, err: str) -> str:
    """The driver's output and the ranks' logs, where the supervisor's own lines go."""
    return out + err + (workdir / name / "logs" / "rank-0.log").read_text()


def _k8s_run(k, ns: str, tmp_path: Path, name: str, cpu: str | None = None,
             **env: str) -> tuple[Path, dict, subprocess.Popen]:
    """Starts the driver of a 2-worker run `name` in namespace `ns` (worker pods requesting
    `cpu`, when given) and returns once attempt 0 waits for the notice at step WAIT_AT: its
    directory, the undisturbed run's final metrics and the driver."""
    workdir = tmp_path / "runs"
    workdir.mkdir()
    (workdir / "train.py").write_text(TRAIN)
    driver_env = k.driver_env(ns, workdir, **env)
    if cpu is not None:  # what Kueue's quota counts
        template = Path(driver_env["JAXTRAIN_K8S_POD_TEMPLATE"])
        pod = json.loads(template.read_text())
        pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": cpu}}
        template.write_text(json.dumps(pod))
    undisturbed = _undisturbed(workdir, driver_env, 2)
    driver = k.popen([PY, "train.py", name, "2", str(WAIT_AT), ""], driver_env, workdir,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for("attempt 0 at the step that waits", (workdir / "ready").exists, driver)
    return workdir, undisturbed, driver


def test_a_deleted_worker_pod_is_a_notice_and_the_group_restarts_from_its_checkpoint(
        kubernetes_cluster, tmp_path):
    k = kubernetes_cluster
    ns = k.namespace()
    workdir, undisturbed, driver = _k8s_run(k, ns, tmp_path, "deleted")
    pods = k.get("pods", "-n", ns)["items"]
    pod = next(p for p in pods
               if p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == "1")
    # preemption_grace_s (30) and the margin: time to commit the checkpoint before the SIGKILL.
    assert pod["spec"]["terminationGracePeriodSeconds"] == 45
    # With its grace period, as a drain or a reclaimed node deletes it: the worker, the
    # container's PID 1, gets SIGTERM.
    k.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--wait=false")
    out, err = driver.communicate(timeout=300)

    assert driver.returncode == 0, out[-2000:] + err[-3000:]
    failure = _check_preempted_run(workdir, "deleted", out, undisturbed, 2, "SIGTERM")
    assert failure["rank"] == 1, failure
    ranks = failure["preemption"]["preempted_node_to_ranks"]
    assert list(ranks.values()) == [[1]], ranks  # the deleted pod's host, and only its rank
    # The restarted group runs in new pods: none of attempt 0's is left.
    names = {p["metadata"]["name"] for p in pods}
    assert not names & {p["metadata"]["name"] for p in k.get("pods", "-n", ns)["items"]}
    assert k.objects(ns) == []


def test_termination_grace_follows_preemption_grace_unless_the_template_names_one():
    from jaxtrain.kubernetes import launch as kubernetes

    assert kubernetes.with_termination_grace(None, 30.0) == {
        "spec": {"terminationGracePeriodSeconds": 45}}
    assert kubernetes.with_termination_grace({"spec": {"hostNetwork": True}}, 2.5) == {
        "spec": {"hostNetwork": True, "terminationGracePeriodSeconds": 18}}
    mine = {"spec": {"terminationGracePeriodSeconds": 600}}
    assert kubernetes.with_termination_grace(mine, 30.0) == mine



# --- Kubernetes: Kueue and GKE's impending node termination -----------------------------------

# A ClusterQueue whose CPU quota fits one run (two pods of 500m), preempting lower priorities.
KUEUE_OBJECTS = """
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: jaxtrain-test}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: jaxtrain-test}
spec:
  namespaceSelector: {}
  preemption: {withinClusterQueue: LowerPriority}
  resourceGroups:
  - coveredResources: [cpu]
    flavors: [{name: jaxtrain-test, resources: [{name: cpu, nominalQuota: "1"}]}]
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata: {name: jaxtrain-low}
value: 10
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata: {name: jaxtrain-high}
value: 1000
"""


def test_a_kueue_eviction_is_a_notice_and_the_run_waits_queued_until_readmitted(
        kubernetes_cluster, tmp_path):
    k = kubernetes_cluster
    k.kubectl("apply", "-f", "-", input=KUEUE_OBJECTS)
    ns = k.namespace()
    k.kubectl("apply", "-n", ns, "-f", "-", input=(
        "apiVersion: kueue.x-k8s.io/v1beta2\nkind: LocalQueue\nmetadata: {name: team}\n"
        "spec: {clusterQueue: jaxtrain-test}\n"))
    workdir, undisturbed, driver = _k8s_run(k, ns, tmp_path, "kueued", cpu="500m",
                                            JAXTRAIN_K8S_QUEUE_NAME="team",
                                            JAXTRAIN_K8S_PRIORITY_CLASS="jaxtrain-low")
    jobsets = k.get("jobsets", "-n", ns)["items"]
    assert [j["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] for j in jobsets] == ["team"]
    # A higher-priority workload that the quota cannot hold beside the run: Kueue evicts the run.
    high = {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "high", "labels": {"kueue.x-k8s.io/queue-name": "team",
                                                    "kueue.x-k8s.io/priority-class":
                                                        "jaxtrain-high"}},
            "spec": {"template": {"spec": {
                "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "c", "image": IMAGE, "imagePullPolicy": "Never",
                                "command": ["python", "-c", "import time; time.sleep(900)"],
                                "resources": {"requests": {"cpu": "500m"}}}]}}}}
    k.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(high))

    def queued_again():
        items = k.get("jobsets", "-n", ns)["items"]
        return [j for j in items if j["metadata"]["name"].endswith("-2")
                and j["spec"].get("suspend")]

    # The restarted attempt's JobSet waits, suspended, while the other workload holds the quota.
    _wait_for("attempt 1 queued", queued_again, driver)
    _wait_for("the other workload admitted",
              lambda: k.get("job", "high", "-n", ns)["spec"].get("suspend") is False, driver)
    assert queued_again()
    # While its launch waits for Kueue the driver's loop waits too: run.json says it is queued,
    # and so does `jaxtrain show` on the live run.
    live = json.loads((workdir / "kueued" / "run.json").read_text())
    assert [a.get("phase") for a in live["attempts"]] == [None, "queued"], live["attempts"]
    shown = _show(workdir / "kueued")
    assert "queued: attempt 1 waits to be admitted" in shown, shown
    assert re.search(r"\n  1  queued ", shown), shown
    k.kubectl("delete", "job", "high", "-n", ns, "--wait=false")
    out, err = driver.communicate(timeout=300)

    assert driver.returncode == 0, out[-2000:] + err[-3000:]
    _check_preempted_run(workdir, "kueued", out, undisturbed, 2, "SIGTERM")
    said = _supervisor_said(workdir, "kueued", out, err)
    assert "jaxtrain kubernetes: evicted by Kueue (" in said, said[-3000:]
    assert "jaxtrain: kubernetes: queued: JobSet" in err, err[-3000:]
    assert "jaxtrain: kubernetes: admitted by Kueue from LocalQueue 'team'" in err, err[-3000:]
    # Attempt 1 waited for the other workload: its queue wait is recorded, shown, and counted
    # in goodput's queue part rather than its start-up.
    attempts = json.loads((workdir / "kueued" / "run.json").read_text())["attempts"]
    assert attempts[1]["queue_wait_s"] > 0 and "phase" not in attempts[1], attempts
    shown = _show(workdir / "kueued")
    assert re.search(r"\n  1  FINISHED .*  queued \d+\.\d s", shown), shown
    from jaxtrain import goodput

    g = goodput.from_run_dir(str(workdir / "kueued"))
    assert g.attempts[1].queue == pytest.approx(attempts[1]["queue_wait_s"]), g.to_dict()
    assert k.objects(ns) == []


def _show(run_dir: Path) -> str:
    """`jaxtrain show RUN_DIR`'s output."""
    shown = subprocess.run([PY, "-m", "jaxtrain", "show", str(run_dir)], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_gkes_impending_termination_taint_is_a_notice_for_the_ranks_on_its_node(
        kubernetes_cluster, tmp_path):
    k = kubernetes_cluster
    ns = k.namespace()
    workdir, undisturbed, driver = _k8s_run(k, ns, tmp_path, "tainted")
    taint = "cloud.google.com/impending-node-termination"
    try:
        pods = {p["metadata"]["name"] for p in k.get("pods", "-n", ns)["items"]}
        # As GKE marks a spot node that is about to be reclaimed.
        k.kubectl("label", "node", "node1", "cloud.google.com/gke-spot=true", "--overwrite")
        k.kubectl("taint", "node", "node1", f"{taint}:NoSchedule")

        def leaving():
            return all(p["metadata"].get("deletionTimestamp")
                       for p in k.get("pods", "-n", ns)["items"]
                       if p["metadata"]["name"] in pods)

        _wait_for("the node's pods deleted", leaving, driver)
    finally:
        # The node "comes back" (a replacement): the restarted group's pods can be scheduled.
        k.kubectl("taint", "node", "node1", f"{taint}:NoSchedule-", check=False)
        k.kubectl("label", "node", "node1", "cloud.google.com/gke-spot-", check=False)
    out, err = driver.communicate(timeout=300)

    assert driver.returncode == 0, out[-2000:] + err[-3000:]
    failure = _check_preempted_run(workdir, "tainted", out, undisturbed, 2, "SIGTERM")
    # Both ranks ran on the tainted node: the notice names their hosts and nothing else.
    ranks = failure["preemption"]["preempted_node_to_ranks"]
    assert {r for rs in ranks.values() for r in rs} <= {0, 1} and ranks, ranks
    said = _supervisor_said(workdir, "tainted", out, err)
    assert f"node node1 has GKE's {taint} taint: deleting its pods (ranks 0, 1) with a " \
           "grace period of" in said, said[-3000:]
    assert k.objects(ns) == []
