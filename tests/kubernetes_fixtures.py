"""A real Kubernetes cluster on this machine for the Kubernetes tests (scripts/kubernetes/).

The session fixture ``kubernetes_cluster`` starts it once — etcd, the API server, scheduler,
controller manager, a kubelet with containerd and runc, kube-proxy, CoreDNS, the JobSet
controller and Kueue, built from the Go module proxy on first use (about 35 minutes, then
cached) — imports
the worker image built from this checkout's .venv, and stops the cluster when the session ends.
Where it cannot run (not root, no network namespaces, no Go) its tests are skipped with the reason,
unless JAXTRAIN_REQUIRE_KUBERNETES=1 (scripts/test.sh sets it): then they fail instead.

Drivers run on the node's network (``cluster.sh exec``), as a driver pod with host networking
would; the pods reach them at the node's address.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cluster_lock
import pytest

from conftest import run_command, start_driver

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "kubernetes" / "cluster.sh"
STATE = Path(os.environ.get("JAXTRAIN_K8S_STATE", "/tmp/jaxtrain-k8s"))
NODE_IP = "10.250.0.2"
IMAGE = "docker.io/jaxtrain/worker:test"


@dataclass
class KubernetesCluster:
    kubeconfig: str
    lock: cluster_lock.ClusterLock  # this session's hold on the cluster

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        proc = subprocess.run([str(SCRIPT), "kubectl", *args], capture_output=True, text=True,
                              input=input, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
        return proc.stdout

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def namespace(self) -> str:
        """A fresh namespace for one test."""
        name = f"t-{uuid.uuid4().hex[:8]}"
        self.kubectl("create", "namespace", name)
        return name

    def driver_env(self, namespace: str, storage: Path, *, mounted: bool = True,
                   **extra: str) -> dict[str, str]:
        """A driver's environment: the admin's kubeconfig, the test image, and a pod template that
        mounts `storage` (the runs' shared storage) at the same path in every worker pod; with
        `mounted` false no template, so the pods mount no volume of the driver's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXTRAIN_", "KUBE"))}
        env.update(KUBECONFIG=self.kubeconfig, JAXTRAIN_LAUNCHER="kubernetes",
                   JAXTRAIN_K8S_NAMESPACE=namespace, JAXTRAIN_K8S_IMAGE=IMAGE,
                   JAXTRAIN_K8S_IMAGE_PULL_POLICY="Never", JAXTRAIN_LISTEN_HOST=NODE_IP,
                   HOME=str(storage))
        if mounted:
            template = storage / ".pod-template.json"
            template.write_text(json.dumps({"spec": {
                "volumes": [{"name": "runs", "hostPath": {"path": str(storage),
                                                          "type": "DirectoryOrCreate"}}],
                "containers": [{"workingDir": str(storage),
                                "volumeMounts": [{"name": "runs", "mountPath": str(storage)}]}]}}))
            env["JAXTRAIN_K8S_POD_TEMPLATE"] = str(template)
        env.update(extra)
        return env

    def popen(self, argv: list[str], env: dict[str, str], cwd: Path, **kw) -> subprocess.Popen:
        """Starts the driver `argv` on the node's network (conftest.start_driver)."""
        return start_driver([str(SCRIPT), "exec", *argv], env=env, cwd=cwd, **kw)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """Runs the driver `argv` on the node's network (conftest.run_command)."""
        return run_command([str(SCRIPT), "exec", *argv], env=env, cwd=cwd,
                           capture_output=True, text=True, timeout=timeout)

    def objects(self, namespace: str) -> list[str]:
        """What is left in `namespace` of a run: JobSets, Jobs, pods, Secrets, Services."""
        out = self.kubectl("get", "jobsets,jobs,pods,secrets,services", "-n", namespace,
                           "-l", "app.kubernetes.io/managed-by=jaxtrain", "-o", "name")
        headless = self.kubectl("get", "services", "-n", namespace, "-o", "name")
        return sorted(set(out.split() + headless.split()))


    def on_node(self, code: str, env: dict[str, str], timeout: float = 120) -> str:
        """Runs Python `code` on the node's network (where the pods reach it); its stdout."""
        proc = subprocess.run([str(SCRIPT), "exec", sys.executable, "-c", code], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"on the node: {code}\n{proc.stderr[-3000:]}")
        return proc.stdout


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the Kubernetes test cluster needs root (namespaces, containerd, kubelet)"
    for tool in ("go", "unshare", "nsenter", "ip", "openssl"):
        if shutil.which(tool) is None:
            return f"the Kubernetes test cluster needs '{tool}'"
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"network namespaces are not available here: {probe.stderr.decode().strip()}"
    return None


@pytest.fixture(scope="session")
def kubernetes_cluster():
    why = _why_not()
    if why is not None:
        if os.environ.get("JAXTRAIN_REQUIRE_KUBERNETES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    with cluster_lock.held(str(STATE), "the Kubernetes test cluster") as lock:
        start = lock.run([str(SCRIPT), "start"], stdout=subprocess.DEVNULL, stderr=sys.stderr,
                         timeout=3600)
        if start.returncode != 0:
            lock.run([str(SCRIPT), "stop"], capture_output=True)
            pytest.fail(f"the Kubernetes test cluster did not start; see {STATE}/logs")
        try:
            yield KubernetesCluster(kubeconfig=str(STATE / "pki" / "admin.kubeconfig"),
                                    lock=lock)
        finally:
            lock.run([str(SCRIPT), "stop"], capture_output=True, timeout=300)


@pytest.fixture(scope="session")
def node_s3(kubernetes_cluster, tmp_path_factory) -> Iterator[dict[str, str]]:
    """moto's S3 server on the node's network, where the pods reach it (as they reach a driver
    there): the AWS_* variables of a client with credentials for it, endpoint included. The
    cluster's network is its own, so this machine's other test servers are out of the pods' reach;
    the server is made and asked (buckets, listings) from the node's network too."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    port = kubernetes_cluster.on_node(
        "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[1])",
        dict(os.environ)).strip()
    env["AWS_ENDPOINT_URL"] = endpoint = f"http://{NODE_IP}:{port}"
    log = tmp_path_factory.mktemp("node-s3") / "s3-server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([str(SCRIPT), "exec", sys.executable, "-m", "moto.server", "-H",
                                   NODE_IP, "-p", port], stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        answers = ("import urllib.error, urllib.request\ntry:\n"
                   f"    urllib.request.urlopen({endpoint!r}, timeout=1)\n"
                   "except urllib.error.HTTPError:\n    pass")  # it answers
        deadline = time.monotonic() + 60
        while subprocess.run([str(SCRIPT), "exec", sys.executable, "-c", answers],
                             capture_output=True).returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the S3 server on the node did not start: {log.read_text()}")
            time.sleep(0.5)
        yield env
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # cluster.sh and the server it started
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
