"""An elastic run on a real two-node Kubernetes cluster (tests/kubernetes_fixtures.py, with the
second node that `cluster.sh node2 start` adds; docs/elastic.md): ScalingConfig(num_workers=(1, 2))
with pods that each need most of a node's CPUs, so one pod runs on each node. node2 cordoned and its
pod deleted, as a node taken for maintenance would be: the run goes on with one pod from its
latest checkpoint; node2 uncordoned: it grows back to two pods at its next checkpoint and
finishes, each epoch's rows seen once. Real JAX collectives between the pods. The same with
node2 only cordoned, for a TPU v6e 2x2 run of one or two slices simulated on CPU pods, each node
labelled as a GKE TPU node pool of its own that offers one slice's 4 chips: the run leaves the
slice at its next checkpoint and comes back to two slices, each attempt's MEGASCALE_NUM_SLICES
made for its slices."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_elastic import ELASTIC_RUN, check_every_epoch_seen_once, rounds

from conftest import wait_for

if TYPE_CHECKING:
    from kubernetes_fixtures import KubernetesCluster

pytest_plugins = ["kubernetes_fixtures"]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "kubernetes" / "cluster.sh"

# ELASTIC_RUN (tests/test_elastic.py) as pods of 1.5 CPUs each on nodes of 2: one pod a node, a
# range of (1, 2) pods, and a step a second, so that the run outlasts two resizes of new JobSets.
K8S_ELASTIC_RUN = ELASTIC_RUN.replace(
    "ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=2)",
    'ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1.5}, '
    "elastic_resize_monitor_interval_s=2)",
).replace("time.sleep(0.3)", "time.sleep(1.0)").replace(
    '"attempt": ctx.get_attempt()}',
    '"attempt": ctx.get_attempt(), "slices": os.environ.get("MEGASCALE_NUM_SLICES")}').replace(
    'Path("ready")', "Path(READY)").replace(
    "EPOCHS = 6\n", 'EPOCHS = 6\nREADY = os.path.abspath("ready")  # the pods\' cwd is not it\n')

# The same as simulated TPU slices: one host of 4 chips each, one slice a node (a node pool).
TPU_ELASTIC_RUN = K8S_ELASTIC_RUN.replace(
    'resources_per_worker={"CPU": 1.5}',
    'use_tpu=True, topology="2x2", accelerator_type="TPU-V6E"')

TPU_LABELS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology",
              "cloud.google.com/gke-nodepool")


@contextlib.contextmanager
def tpu_node_pools(k: KubernetesCluster) -> Iterator[None]:
    """node1 and node2 labelled as two GKE TPU v6e 2x2 node pools, each offering 4 chips."""
    try:
        for node in ("node1", "node2"):
            k.kubectl("label", "node", node, "--overwrite",
                      "cloud.google.com/gke-tpu-accelerator=tpu-v6e-slice",
                      "cloud.google.com/gke-tpu-topology=2x2",
                      f"cloud.google.com/gke-nodepool=tpu-{node}")
            k.kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p",
                      json.dumps([{"op": "add", "path": "/status/capacity/google.com~1tpu",
                                   "value": "4"}]))
        # The kubelet makes the chips allocatable at its next status update (else the run would
        # rightly start on one slice and grow).
        for node in ("node1", "node2"):
            wait_for(f"{node}'s chips allocatable", lambda node=node: k.get("node", node)[
                "status"]["allocatable"].get("google.com/tpu") == "4", timeout=60)
        yield
    finally:
        for node in ("node1", "node2"):
            k.kubectl("label", "node", node, *(f"{label}-" for label in TPU_LABELS), check=False)
            k.kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p",
                      json.dumps([{"op": "remove", "path": "/status/capacity/google.com~1tpu"}]),
                      check=False)


@pytest.fixture(scope="module")
def two_nodes(kubernetes_cluster: KubernetesCluster) -> Iterator[KubernetesCluster]:
    """The cluster with node2 added for these tests, and taken away after them."""
    started = kubernetes_cluster.lock.run([str(SCRIPT), "node2", "start"], capture_output=True,
                                          text=True, timeout=600)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        yield kubernetes_cluster
    finally:
        kubernetes_cluster.lock.run([str(SCRIPT), "node2", "stop"], capture_output=True,
                                    timeout=300)


def _node_of_pods(k: KubernetesCluster, ns: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["spec"].get("nodeName", "")
            for p in k.get("pods", "-n", ns)["items"]
            if not p["metadata"].get("deletionTimestamp")}


@pytest.mark.parametrize("pod_deleted", [True, False], ids=["pod-deleted", "cordoned-only-tpu"])
def test_a_cordoned_node_shrinks_the_run_and_uncordoned_grows_it_back(two_nodes, tmp_path,
                                                                      pod_deleted):
    """Cordoned with its pod deleted, node2's pod fails its attempt, and the restart finds no
    room for it. Cordoned only (the first step of `kubectl drain`), the run leaves node2 at its
    next committed checkpoint, a planned resize that loses no work and counts no failure; this
    run is of TPU slices, which it leaves and gets back whole."""
    assert K8S_ELASTIC_RUN.count("num_workers=(1, 2)") == 1 and "sleep(1.0)" in K8S_ELASTIC_RUN \
        and "Path(READY)" in K8S_ELASTIC_RUN and "READY = " in K8S_ELASTIC_RUN \
        and '"slices": ' in K8S_ELASTIC_RUN and "use_tpu=True" in TPU_ELASTIC_RUN
    k = two_nodes
    ns = k.namespace()
    workdir = tmp_path / "runs"
    workdir.mkdir()
    (workdir / "train.py").write_text(K8S_ELASTIC_RUN if pod_deleted else TPU_ELASTIC_RUN)
    env = k.driver_env(ns, workdir, **({} if pod_deleted else {"JAXTRAIN_SIMULATE": "1"}))
    tpu = contextlib.nullcontext() if pod_deleted else tpu_node_pools(k)
    with tpu, open(tmp_path / "driver.err", "w") as err_file:
        driver = k.popen([sys.executable, "train.py"], env, workdir,
                         stdout=subprocess.PIPE, stderr=err_file, text=True)
        out, err = _shrink_and_grow(k, ns, driver, workdir, tmp_path, pod_deleted)

    assert driver.returncode == 0, out[-2000:] + err[-5000:]
    _check_shrunk_and_grown(k, ns, workdir / "elastic", out, err, pod_deleted)


def _shrink_and_grow(k: KubernetesCluster, ns: str, driver: subprocess.Popen, workdir: Path,
                     tmp_path: Path, pod_deleted: bool) -> tuple[str, str]:
    """node2 cordoned (and its pod deleted) once the run has trained a while, uncordoned once it
    has recorded a round on one worker; the driver's stdout and stderr once it ends."""
    run = workdir / "elastic"

    def said() -> str:
        return (tmp_path / "driver.err").read_text()[-5000:]

    out = ""
    try:
        wait_for("rank 0 past step 5", lambda: (workdir / "ready").exists() or
                 driver.poll() is not None, timeout=300)
        assert driver.poll() is None, said()
        placed = _node_of_pods(k, ns)
        assert sorted(placed.values()) == ["node1", "node2"], (placed, said())
        # node2 is taken for maintenance: cordoned, and its pod deleted.
        k.kubectl("cordon", "node2")
        if pod_deleted:
            victim = next(name for name, node in placed.items() if node == "node2")
            k.kubectl("delete", "pod", "-n", ns, victim, "--grace-period=0", "--force")
        wait_for("a round on one worker", lambda: driver.poll() is not None or any(
            r["world_size"] == 1 for r in rounds(run)), timeout=300)
        assert driver.poll() is None, said()
        assert set(_node_of_pods(k, ns).values()) <= {"node1"}
        k.kubectl("uncordon", "node2")
        out, _ = driver.communicate(timeout=600)
    finally:
        k.kubectl("uncordon", "node2", check=False)
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    return out, (tmp_path / "driver.err").read_text()


def _check_shrunk_and_grown(k: KubernetesCluster, ns: str, run: Path, out: str, err: str,
                            pod_deleted: bool) -> None:
    assert "jaxtrain: resizing the run from 2 to 1 workers" in err, err[-5000:]
    assert "jaxtrain: kubernetes: the cluster has room for 1 of the run's 2 worker pods " \
           "(node2: cordoned)" in err, err[-5000:]
    assert "jaxtrain: resizing the run from 1 to 2 workers (host pod-1 can be reached again" \
        in err, err[-5000:]
    record = json.loads((run / "run.json").read_text())
    sizes = [a["world_size"] for a in record["attempts"]]
    assert sizes[0] == 2 and sizes[-1] == 2 and 1 in sizes, sizes
    assert record["attempts"][-1]["resize"]["to"] == 2
    assert record["resizes"] == 2
    if not pod_deleted:
        assert [a["status"] for a in record["attempts"]] == ["RESIZED", "RESIZED", "FINISHED"]
        assert all(a.get("failure") is None for a in record["attempts"]), record["attempts"]
        assert re.search(r"jaxtrain: kubernetes: node node2, where rank \d's pod trains, is "
                         r"cordoned\n", err), err[-5000:]
        assert "jaxtrain: host pod-1 is being taken from the run; the run shrinks at its next " \
               "committed checkpoint" in err, err[-5000:]
    # Every attempt trained on the world it was given, JAX's included; no step lost; each
    # epoch's rows seen once.
    worlds = {i: {(s, s, 8 // s)} for i, s in enumerate(sizes)}
    check_every_epoch_seen_once(run, {a: w for a, w in worlds.items()
                                      if any(r["attempt"] == a for r in rounds(run))})
    assert json.loads(out.split("final ", 1)[1])["step"] == 47
    if not pod_deleted:  # TPU slices: each attempt's MEGASCALE for its slices, none for one
        slices = {(r["attempt"], r["slices"]) for r in rounds(run)}
        assert slices == {(0, "2"), (1, None), (2, "2")}, slices
    assert k.objects(ns) == []
