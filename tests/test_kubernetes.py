"""JaxTrainer on a real Kubernetes cluster through JobSet (tests/kubernetes_fixtures.py).

Each test gets its own namespace. The drivers run on the node's network and talk to the API server
with the admin's kubeconfig (or, for jaxtrain submit, from a pod with its service account); the
workers are pods of the image built from this checkout, one per rank, that reach the driver's
controller at the node's address. Storage is a host directory mounted at the same path in every
pod (a hostPath volume from the pod template, as a ReadWriteMany volume would be), or a bucket on
an S3 server on the node's network that pods mounting no volume write to themselves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conftest import run_command, wait_for
from jaxtrain import ScalingConfig, _core
from seed_program import SEED, with_psum_first

if TYPE_CHECKING:
    from kubernetes_fixtures import KubernetesCluster

pytest_plugins = ["kubernetes_fixtures"]  # the fixtures kubernetes_cluster, node_s3

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _seen(cwd: Path, world_size: int) -> list[dict]:
    return [json.loads((cwd / f"seen-rank-{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture
def workdir(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    return d


@pytest.mark.parametrize("workers, in_place", [(2, "1"), (4, "1"), (2, "0")])
def test_the_seed_program_runs_on_cpu_pods_as_one_jax_job(kubernetes_cluster, workdir, workers,
                                                           in_place):
    k = kubernetes_cluster
    ns = k.namespace()
    (workdir / "driver.py").write_text(with_psum_first(workers))
    proc = k.run([PY, "driver.py"], k.driver_env(ns, workdir, JAXTRAIN_K8S_IN_PLACE=in_place),
                 workdir)

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"Training finished\. Final loss: \d+\.\d{4}", proc.stdout), proc.stdout
    seen = _seen(workdir, workers)
    assert [r["psum"] for r in seen] == [sum(range(workers))] * workers
    assert [r["process_count"] for r in seen] == [workers] * workers
    # One pod per rank, in completion-index order, each its own host.
    assert [r["pod_index"] for r in seen] == [str(r) for r in range(workers)]
    assert len({r["host"] for r in seen}) == workers
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"]) for r in seen] == [
        (r, 0, 1) for r in range(workers)]
    for r in range(workers):
        assert f"(rank={r}) " in proc.stdout
    # In place, each worker is the child of its pod's first process, the holder; else it is it.
    assert [(r["pid"] == 1, r["ppid"] == 1) for r in seen] == [
        (in_place == "0", in_place == "1")] * workers
    assert "jaxtrain pod:" not in proc.stdout + proc.stderr  # the holder's lines stay in the log
    assert k.objects(ns) == [], "the run's objects outlived it"


def _label_node_as_tpu_slice(k: KubernetesCluster, accelerator: str, topology: str, chips: int):
    k.kubectl("label", "node", "node1", "--overwrite",
              f"cloud.google.com/gke-tpu-accelerator={accelerator}",
              f"cloud.google.com/gke-tpu-topology={topology}", "cloud.google.com/gke-nodepool=tpu")
    # How extended resources are advertised for a node (as GKE's TPU device plugin does).
    k.kubectl("patch", "node", "node1", "--subresource=status", "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/status/capacity/google.com~1tpu", "value": str(chips)}]))


def _unlabel_node(k: KubernetesCluster):
    k.kubectl("label", "node", "node1", "cloud.google.com/gke-tpu-accelerator-",
              "cloud.google.com/gke-tpu-topology-", "cloud.google.com/gke-nodepool-")
    k.kubectl("patch", "node", "node1", "--subresource=status", "--type=json", "-p", json.dumps(
        [{"op": "remove", "path": "/status/capacity/google.com~1tpu"}]), check=False)


def test_the_seeds_tpu_config_becomes_the_pod_spec_gke_needs(kubernetes_cluster, workdir):
    """The seed's own ScalingConfig (TPU v6e 4x4, 4 workers), simulated on CPU pods: the JobSet
    and pods the API server stored carry GKE's TPU contract, and the run trains to the end."""
    k = kubernetes_cluster
    ns = k.namespace()
    _label_node_as_tpu_slice(k, "tpu-v6e-slice", "4x4", 16)
    try:
        (workdir / "driver.py").write_text(SEED)
        driver = k.popen([PY, "driver.py"], k.driver_env(ns, workdir, JAXTRAIN_SIMULATE="1"),
                         workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        jobset = wait_for("the JobSet", lambda: k.get("jobsets", "-n", ns)["items"])[0]
        pods = wait_for("4 pods", lambda: (lambda p: p if len(p) == 4 else None)(
            k.get("pods", "-n", ns)["items"]))
        out, err = driver.communicate(timeout=300)
    finally:
        _unlabel_node(k)

    assert driver.returncode == 0, out[-2000:] + err[-3000:]
    assert "Training finished. Final loss:" in out
    assert jobset["metadata"]["annotations"][
        "alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    job = jobset["spec"]["replicatedJobs"][0]
    assert (job["replicas"], job["template"]["spec"]["parallelism"]) == (1, 4)
    for pod in pods:
        spec = pod["spec"]
        selector = spec["nodeSelector"]
        assert selector["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
        assert selector["cloud.google.com/gke-tpu-topology"] == "4x4"
        if pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] != "0":
            # JobSet's exclusive placement pinned the slice's other pods to the first one's pool.
            assert selector["cloud.google.com/gke-nodepool"] == "tpu"
        container = spec["containers"][0]
        assert container["resources"]["limits"] == {"google.com/tpu": "4"}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["JAXTRAIN_WORLD_SIZE"] == "4"
        assert "JAXTRAIN_RUN_SECRET" not in env  # the key is only in the Secret volume
        assert all(len(v or "") != 64 or not re.fullmatch("[0-9a-f]+", v) for v in env.values())
        assert pod["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == \
            jobset["metadata"]["name"]
    assert k.objects(ns) == []


KILLABLE = textwrap.dedent('''
    import json, os, sys, tempfile, time
    from pathlib import Path
    from jaxtrain import (Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig,
                          get_checkpoint, get_context, report)

    def train(config):
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import multihost_utils
        ctx = get_context()
        step, x = 0, 1.0
        if get_checkpoint() is not None:
            with get_checkpoint().as_directory() as d:
                state = json.loads(Path(d, "state.json").read_text())
                step, x = state["step"] + 1, state["x"]
        while step < 6:
            total = float(multihost_utils.process_allgather(
                jnp.array([ctx.get_world_rank() + 1.0])).sum())
            x = x * 0.9 + total * 0.01
            if step == 3 and ctx.get_attempt() == 0 and config["kill"]:
                multihost_utils.sync_global_devices("ready to be killed")
                if ctx.get_world_rank() == 0:
                    Path(config["marker"]).write_text("go")
                time.sleep(3600)
            with tempfile.TemporaryDirectory() as d:
                if ctx.get_world_rank() == 0:
                    Path(d, "state.json").write_text(json.dumps({"step": step, "x": x}))
                report({"step": step, "x": round(x, 9)},
                       checkpoint=Checkpoint.from_directory(d) if ctx.get_world_rank() == 0
                       else None)
            step += 1

    result = JaxTrainer(train, train_loop_config={"kill": sys.argv[1] == "kill",
                                                  "marker": os.path.abspath("marker")},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=sys.argv[2], storage_path=os.path.abspath("."),
                                             failure_config=FailureConfig(max_failures=2))).fit()
    print("FINAL", json.dumps(result.metrics))
''')


TPU_ENVIRONMENT = """
import json, os, sys
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, get_context
name = sys.argv[1]
def train():
    rank = get_context().get_world_rank()
    seen = {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "MEGASCALE_"))}
    os.makedirs(os.path.join(os.getcwd(), "seen", name), exist_ok=True)
    with open(os.path.join(os.getcwd(), "seen", name, f"{rank}.json"), "w") as f:
        json.dump(seen, f)
JaxTrainer(train, scaling_config=ScalingConfig(num_workers=4, use_tpu=True, topology="4x4",
                                               accelerator_type="TPU-V6E"),
           run_config=RunConfig(name=name, storage_path=os.getcwd())).fit()
"""


def test_a_simulated_tpu_pod_sees_the_tpu_environment_of_a_local_simulated_worker(
        kubernetes_cluster, workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    (workdir / "driver.py").write_text(TPU_ENVIRONMENT)
    env = k.driver_env(ns, workdir, JAXTRAIN_SIMULATE="1")
    local = run_command([PY, "driver.py", "local"], cwd=workdir, capture_output=True, text=True,
                        timeout=300, env={**env, "JAXTRAIN_LAUNCHER": "local"})
    assert local.returncode == 0, local.stderr[-3000:]
    _label_node_as_tpu_slice(k, "tpu-v6e-slice", "4x4", 16)
    try:
        proc = k.run([PY, "driver.py", "pods"], env, workdir)
    finally:
        _unlabel_node(k)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    def seen(name: str) -> list[dict]:
        return [json.loads((workdir / "seen" / name / f"{r}.json").read_text()) for r in range(4)]

    on_pods, local_workers = seen("pods"), seen("local")
    for name in ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY"):
        assert [w.get(name) for w in on_pods] == [w.get(name) for w in local_workers], name
    assert [w["TPU_WORKER_ID"] for w in on_pods] == ["0", "1", "2", "3"]
    assert {w["TPU_ACCELERATOR_TYPE"] for w in on_pods} == {"v6e-16"}
    assert on_pods == local_workers  # and every other TPU_ or MEGASCALE_ variable alike
    assert k.objects(ns) == []


def _killable_until_marked(k: KubernetesCluster, ns: str,
                           workdir: Path) -> tuple[dict, subprocess.Popen]:
    """KILLABLE's final metrics undisturbed (local workers: the same math), and its driver on the
    cluster, started and waited for until its rank 0 is ready to be disturbed."""
    (workdir / "train.py").write_text(KILLABLE)
    local = run_command([PY, "train.py", "keep", "undisturbed"], cwd=workdir,
                        capture_output=True, text=True, timeout=300,
                        env={**k.driver_env(ns, workdir), "JAXTRAIN_LAUNCHER": "local"})
    assert local.returncode == 0, local.stderr[-3000:]
    driver = k.popen([PY, "train.py", "kill", "disturbed"], k.driver_env(ns, workdir), workdir,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for("the marker", lambda: (workdir / "marker").exists(), timeout=240)
    return json.loads(local.stdout.split("FINAL ", 1)[1]), driver


def test_a_deleted_pod_restarts_the_group_from_its_checkpoint(kubernetes_cluster, workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    expected, driver = _killable_until_marked(k, ns, workdir)
    pod = next(p for p in k.get("pods", "-n", ns)["items"]
               if p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == "1")
    k.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--grace-period=0", "--force")
    out, err = driver.communicate(timeout=300)

    assert driver.returncode == 0, out[-2000:] + err[-3000:]
    assert json.loads(out.split("FINAL ", 1)[1]) == expected
    run = json.loads((workdir / "disturbed" / "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    assert run["attempts"][0]["failure"]["rank"] == 1
    assert run["attempts"][1]["restored_from"] is not None
    assert "rank 1 on node1: " in out + err  # the supervisor said how rank 1 ended
    assert k.objects(ns) == []


def _worker_pid(pod_uid: str) -> int:
    """The pid, as this host sees it, of the running worker (not the holder, not the standby) in
    the pod of uid `pod_uid` (its cgroup names it): the cluster's containers share this host's
    process namespace."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cgroup = Path(f"/proc/{entry}/cgroup").read_text()
        except OSError:
            continue
        if (argv[1:3] == [b"-m", b"jaxtrain.worker"] and b"JAXTRAIN_STANDBY=1" not in environ
                and (pod_uid in cgroup or pod_uid.replace("-", "_") in cgroup)):
            return int(entry)
    raise AssertionError(f"no worker process in pod {pod_uid}")


def test_a_killed_worker_restarts_in_place_in_the_same_pods_from_their_standbys(
        kubernetes_cluster, workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    expected, driver = _killable_until_marked(k, ns, workdir)
    pods = k.get("pods", "-n", ns)["items"]
    uids = {p["metadata"]["uid"] for p in pods}
    seen: set[str] = set()

    def watch_pods() -> None:  # every pod the run has until it ends
        while driver.poll() is None:
            seen.update(p["metadata"]["uid"] for p in k.get("pods", "-n", ns)["items"])

    watcher = threading.Thread(target=watch_pods, daemon=True)
    watcher.start()
    index = "batch.kubernetes.io/job-completion-index"
    victim = next(p for p in pods if p["metadata"]["annotations"][index] == "1")
    os.kill(_worker_pid(victim["metadata"]["uid"]), 9)  # as an OOM kill would
    out, err = driver.communicate(timeout=300)
    watcher.join(timeout=30)

    assert driver.returncode == 0, out[-2000:] + err[-3000:]
    assert json.loads(out.split("FINAL ", 1)[1]) == expected
    run = json.loads((workdir / "disturbed" / "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    assert run["attempts"][0]["failure"]["rank"] == 1
    assert "killed by signal 9" in run["attempts"][0]["failure"]["message"]
    assert run["attempts"][1]["restored_from"] is not None
    # The second attempt ran in the first one's pods, from the standbys they held.
    assert "2 pods kept, 2 of their workers warm" in out + err, out[-2000:] + err[-3000:]
    assert len(uids) == 2 and seen <= uids, (uids, seen)
    assert k.objects(ns) == []


# KILLABLE with its run on a bucket, in pods that mount nothing of the driver's: the storage path
# from STORE, the pods' credentials and endpoint in HOST_ENV (the runtime env, which reaches them
# through the attempt's Secret), and rank 0 says on its output, not in a file, that it is ready.
KILLABLE_ON_A_BUCKET = KILLABLE.replace(
    'Path(config["marker"]).write_text("go")', 'print("ready to be killed", flush=True)'
).replace('storage_path=os.path.abspath("."),',
          'storage_path=os.environ["STORE"], worker_runtime_env={"env_vars": '
          'json.loads(os.environ["HOST_ENV"])},')


def test_pods_without_a_shared_volume_checkpoint_to_a_bucket_and_restart_from_it(
        kubernetes_cluster, node_s3, workdir):
    assert KILLABLE_ON_A_BUCKET.count("os.environ") == 2 and "marker\"]).write" not in \
        KILLABLE_ON_A_BUCKET  # every replacement took
    k = kubernetes_cluster
    ns = k.namespace()
    bucket = f"runs-{ns}"
    k.on_node(f"import boto3; boto3.client('s3').create_bucket(Bucket={bucket!r})",
              {**os.environ, **node_s3})
    (workdir / "train.py").write_text(KILLABLE_ON_A_BUCKET)
    # No pod template: the pods mount no volume; the driver's home, its copy of the run's records,
    # is on this machine only.
    env = k.driver_env(ns, workdir, mounted=False, STORE=f"s3://{bucket}/runs",
                       HOST_ENV=json.dumps(node_s3), **node_s3)
    staging = workdir / ".cache" / "jaxtrain" / "staging" / "s3" / bucket / "runs" / "disturbed"
    with open(workdir / "driver.err", "w") as err_file:
        driver = k.popen([PY, "train.py", "kill", "disturbed"], env, workdir,
                         stdout=subprocess.PIPE, stderr=err_file, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(driver.stdout), daemon=True)
    reader.start()
    try:
        wait_for("rank 0 to be ready", lambda: "(rank=0) ready to be killed\n" in out,
                  timeout=240)
        # A checkpoint is committed (its manifest on the bucket, then the index) before the kill.
        wait_for("a committed checkpoint", lambda: (staging / "checkpoints.json").exists() and
                  json.loads((staging / "checkpoints.json").read_text())["checkpoints"])
        pods = k.get("pods", "-n", ns)["items"]
        pod = next(p for p in pods if p["metadata"]["annotations"][
            "batch.kubernetes.io/job-completion-index"] == "1")
        k.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--grace-period=0",
                  "--force")
        driver.wait(timeout=300)
        reader.join(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    out_text, err = "".join(out), (workdir / "driver.err").read_text()

    assert driver.returncode == 0, out_text[-2000:] + err[-3000:]
    # The pods mounted their key's Secret (and their service account's token), no storage.
    for p in pods:
        kinds = {kind for v in p["spec"].get("volumes", []) for kind in v if kind != "name"}
        assert kinds <= {"secret", "projected"}, p["spec"]["volumes"]
    # The same arithmetic as an undisturbed run (KILLABLE: 6 steps of x * 0.9 + 3 * 0.01).
    x = 1.0
    for _ in range(6):
        x = x * 0.9 + 3.0 * 0.01
    assert json.loads(out_text.split("FINAL ", 1)[1]) == {"step": 5, "x": round(x, 9)}
    assert re.search(r"jaxtrain: restarting the worker group: attempt 1, from checkpoint "
                     r".*/disturbed/checkpoint_\d+", err), err[-3000:]
    run = json.loads((staging / "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    assert run["attempts"][0]["failure"]["rank"] == 1
    assert run["attempts"][1]["restored_from"] is not None
    # The checkpoints are on the bucket, each committed by its manifest; none is anywhere here.
    listed = json.loads(k.on_node(textwrap.dedent(f'''
        import json, s3fs
        fs = s3fs.S3FileSystem()
        root = "{bucket}/runs/disturbed"
        index = json.loads(fs.cat_file(root + "/checkpoints.json"))
        print(json.dumps({{"kept": [c["dir_name"] for c in index["checkpoints"]],
                          "files": sorted(p[len(root) + 1:] for p in fs.find(root)
                                          if "/checkpoint_" in p)}}))
    '''), {**os.environ, **node_s3}))
    assert listed["kept"], listed
    assert listed["files"] == sorted(f"{name}/{f}" for name in listed["kept"]
                                     for f in [".jaxtrain_manifest.json", "state.json"])
    assert sorted(p.name for p in workdir.rglob("state.json")) == []
    assert k.objects(ns) == []


def test_a_service_account_without_rbac_is_refused_with_what_it_lacks(kubernetes_cluster,
                                                                       workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    k.kubectl("create", "serviceaccount", "nobody", "-n", ns)
    token = k.kubectl("create", "token", "nobody", "-n", ns).strip()
    admin = Path(k.kubeconfig).read_text()
    server = re.search(r'server: "([^"]+)"', admin).group(1)
    ca = re.search(r"certificate-authority: (\S+?)[,}]", admin).group(1)
    config = workdir / "nobody.kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": "nobody", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "nobody",
                                                "namespace": ns}}],
        "current-context": "c"}))
    (workdir / "driver.py").write_text(with_psum_first(2))
    proc = k.run([PY, "driver.py"], k.driver_env(ns, workdir, KUBECONFIG=str(config)), workdir)

    assert proc.returncode != 0
    assert "PermissionError: Kubernetes RBAC: 'system:serviceaccount:" in proc.stderr
    assert "may not create jobsets.jobset.x-k8s.io" in proc.stderr
    assert f"in namespace '{ns}'" in proc.stderr
    assert k.get("jobsets", "-n", ns)["items"] == []


def test_an_unreachable_cluster_and_a_missing_image_are_named(kubernetes_cluster, workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    (workdir / "driver.py").write_text(with_psum_first(2))
    admin = Path(k.kubeconfig).read_text().replace("https://10.250.0.2:6443",
                                                   "https://127.0.0.1:1")
    (workdir / "gone.kubeconfig").write_text(admin)
    gone = k.run([PY, "driver.py"],
                 k.driver_env(ns, workdir, KUBECONFIG=str(workdir / "gone.kubeconfig")), workdir)
    assert gone.returncode != 0
    assert "ConnectionError: cannot reach the Kubernetes API server at https://127.0.0.1:1" in \
        gone.stderr

    missing = k.run([PY, "driver.py"],
                    k.driver_env(ns, workdir, JAXTRAIN_K8S_IMAGE="docker.io/nobody/absent:1"),
                    workdir)
    assert missing.returncode != 0
    assert "cannot start its container (ErrImageNeverPull" in missing.stdout + missing.stderr
    assert "docker.io/nobody/absent:1" in missing.stderr
    assert k.objects(ns) == []


def test_jaxtrain_submit_runs_the_driver_in_a_pod_and_finds_it_again(kubernetes_cluster,
                                                                      workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    # The driver pod's identity: allowed what a run needs (docs/kubernetes.md's Role).
    k.kubectl("create", "serviceaccount", "trainer", "-n", ns)
    k.kubectl("apply", "-n", ns, "-f", str(REPO / "docs" / "kubernetes-rbac.yaml"))
    k.kubectl("create", "rolebinding", "trainer", "-n", ns, "--role=jaxtrain",
              f"--serviceaccount={ns}:trainer")
    k.kubectl("apply", "-n", ns, "-f", str(REPO / "docs" / "kubernetes-networkpolicy.yaml"))
    (workdir / "script.py").write_text(textwrap.dedent('''
        import jax
        import jaxtrain
        print("process", jax.process_index(), "of", jax.process_count())
        jaxtrain.report({"world": jax.process_count()})
    '''))
    env = k.driver_env(ns, workdir)
    submit = k.run([PY, "-m", "jaxtrain", "submit", "--kubernetes", "--namespace", ns,
                    "--image", env["JAXTRAIN_K8S_IMAGE"], "--service-account", "trainer",
                    "--pod-template", env["JAXTRAIN_K8S_POD_TEMPLATE"],
                    "--env", "JAXTRAIN_K8S_IMAGE_PULL_POLICY=Never",
                    "--storage-path", str(workdir), "-n", "2", "script.py"], env, workdir)
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-3000:]
    assert "(rank=0) process 0 of 2" in submit.stdout
    assert "(rank=1) process 1 of 2" in submit.stdout
    name = re.search(rf"submitted {ns}/(\S+);", submit.stderr).group(1)

    status = k.run([PY, "-m", "jaxtrain", "status", "--kubernetes", "--namespace", ns], env,
                   workdir)
    assert status.returncode == 0, status.stderr
    assert re.search(rf"{name}\s+Succeeded\s+0\s+script\.py", status.stdout), status.stdout
    logs = k.run([PY, "-m", "jaxtrain", "logs", "--kubernetes", "--namespace", ns, name], env,
                 workdir)
    assert logs.returncode == 0, logs.stderr
    assert "(rank=1) process 1 of 2" in logs.stdout
    # The --env value reached the driver (its workers pulled no image) from a Secret, not the spec.
    env = {e["name"]: e for e in k.get("pod", name, "-n", ns)["spec"]["containers"][0]["env"]}
    assert env["JAXTRAIN_K8S_IMAGE_PULL_POLICY"]["valueFrom"]["secretKeyRef"] == {
        "name": name, "key": "JAXTRAIN_K8S_IMAGE_PULL_POLICY"}
    # The workers' objects went with the run; the driver pod stays until deleted, and its
    # ConfigMap and the Secret of its --env values go with it.
    assert [o for o in k.objects(ns) if not o.startswith(("pod/", "configmap/"))] == [
        f"secret/{name}"]
    owners = k.get("secret", name, "-n", ns)["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owners] == [("Pod", name)]


def _attempt_request(ns: str, name: str, env: dict[str, str], secret_env: dict[str, str],
                     command: list[str] | None = None, template: dict | None = None) -> dict:
    """The request the launcher hands its supervisor for one attempt of one CPU rank."""
    from kubernetes_fixtures import IMAGE  # after pytest_plugins has loaded it

    options = {"namespace": ns, "name": name, "image": IMAGE, "image_pull_policy": "Never",
               "request_dir": "/unused", "worker_command": command or ["python", "-c", "pass"],
               "supervisor_argv": ["unused"], "pod_template": template}
    jobset = json.loads(_core.kubernetes_jobset(ScalingConfig(num_workers=1)._core,
                                                json.dumps(options), f"{name}-1", env))
    return {"namespace": ns, "jobset": jobset, "ranks": 1,
            "secret": {"name": f"{name}-1", "key": "ab" * 32, "env": secret_env}}


def _supervise(k: KubernetesCluster, ns: str, workdir: Path, request: dict):
    path = workdir / f"{request['secret']['name']}.json"
    path.write_text(json.dumps(request))
    return k.run([PY, "-m", "jaxtrain.kubernetes", "supervise", str(path)],
                 k.driver_env(ns, workdir), workdir)


def test_objects_of_the_same_name_are_another_runs_and_left_untouched(kubernetes_cluster,
                                                                       workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    # A Secret of the name the attempt was to use, made by someone else.
    k.kubectl("create", "secret", "generic", "taken-1", "-n", ns, "--from-literal=secret=theirs")
    before = k.get("secret", "taken-1", "-n", ns)
    proc = _supervise(k, ns, workdir, _attempt_request(ns, "taken", {}, {}))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"cannot create Secret {ns}/taken-1: one of that name already exists" in proc.stdout
    after = k.get("secret", "taken-1", "-n", ns)
    assert (after["metadata"]["uid"], after["data"]) == (before["metadata"]["uid"],
                                                         before["data"])
    assert "ownerReferences" not in after["metadata"]
    assert k.get("jobsets", "-n", ns)["items"] == []

    # A JobSet of that name (suspended: no pods), made by someone else.
    theirs = _attempt_request(ns, "other", {}, {})["jobset"]
    theirs["metadata"]["name"] = "other-1"
    theirs["spec"]["suspend"] = True
    k.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(theirs))
    before = k.get("jobset", "other-1", "-n", ns)
    proc = _supervise(k, ns, workdir, _attempt_request(ns, "other", {}, {}))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"cannot create JobSet {ns}/other-1: one of that name already exists" in proc.stdout
    assert k.get("jobset", "other-1", "-n", ns)["metadata"]["uid"] == before["metadata"]["uid"]
    # The Secret this supervisor made went again; the other's JobSet stays.
    assert k.kubectl("get", "secret", "other-1", "-n", ns, check=False) == ""
    k.kubectl("delete", "jobset", "other-1", "-n", ns)


def test_a_non_root_worker_reads_the_key_and_its_variables_from_the_secret(kubernetes_cluster,
                                                                           workdir):
    k = kubernetes_cluster
    ns = k.namespace()
    show = ("import os; print('uid', os.getuid(), 'key', "
            "len(open(os.environ['JAXTRAIN_RUN_SECRET_FILE']).read().strip()), 'api', "
            "os.environ['API_KEY'], 'token', "
            "os.path.exists('/var/run/secrets/kubernetes.io/serviceaccount/token'))")
    request = _attempt_request(
        ns, "nonroot", {"JAXTRAIN_WORLD_SIZE": "1", "API_KEY": "from-the-secret"},
        {"env.API_KEY": "from-the-secret"}, command=["python", "-c", show],
        template={"spec": {"securityContext": {"runAsUser": 1000, "fsGroup": 1000}}})
    assert "from-the-secret" not in json.dumps(request["jobset"])
    proc = _supervise(k, ns, workdir, request)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "uid 1000 key 64 api from-the-secret token False" in proc.stdout
    assert k.objects(ns) == []
