"""The room an elastic run's pods have on a Kubernetes cluster (jaxtrain.kubernetes.capacity,
docs/elastic.md), counted from nodes and pods as the API server lists them. The real cluster's
answers are checked by tests/test_kubernetes_elastic.py."""

from __future__ import annotations

from jaxtrain.kubernetes.capacity import pod_requests, room

RUN = "elastic-abc123"


def node(name: str, cpu: str = "2", *, cordoned: bool = False, ready: bool = True,
         labels: dict | None = None, taints: list | None = None) -> dict:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"unschedulable": cordoned, "taints": taints or []},
            "status": {"allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def pod(node_name: str, cpu: str, *, run: str = "other", rank: int = 0, phase: str = "Running",
        deleting: bool = False) -> dict:
    meta = {"labels": {"jaxtrain.dev/run": run, "jobset.sigs.k8s.io/job-index": "0"},
            "annotations": {"batch.kubernetes.io/job-completion-index": str(rank)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase},
            "spec": {"nodeName": node_name,
                     "containers": [{"resources": {"requests": {"cpu": cpu}}}]}}


def shape(cpu: str = "1500m", **spec) -> dict:
    return {"run": RUN, "pods_per_job": 2,
            "pod": {"containers": [{"resources": {"requests": {"cpu": cpu}}}], **spec}}


def test_a_pod_asks_for_its_requests_with_limits_standing_for_those_it_lacks():
    asked = pod_requests({"containers": [
        {"resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "2", "nvidia.com/gpu": 1}}},
        {"resources": {"limits": {"memory": "1Gi"}}}]})
    assert asked == {"cpu": 0.5, "nvidia.com/gpu": 1, "memory": 2**30, "pods": 1}


def test_each_node_holds_as_many_pods_as_its_free_requests_allow():
    assert room(shape(), [node("a"), node("b", cpu="4")], [])["room"] == 1 + 2
    # Another run's pods take their requests; this run's own do not (the room is its group's).
    busy = [pod("a", "1"), pod("b", "1", run=RUN), pod("b", "1", phase="Succeeded")]
    answer = room(shape(), [node("a"), node("b")], busy)
    assert answer["room"] == 1
    assert answer["why"] == {"a": "no room: cpu 1 free, a pod asks 1.5"}


def test_cordoned_unready_tainted_and_unmatched_nodes_have_no_room_and_say_why():
    nodes = [node("cordoned", cordoned=True), node("down", ready=False),
             node("tpu", labels={"pool": "tpu"}, taints=[
                 {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}]),
             node("soft", taints=[{"key": "x", "effect": "PreferNoSchedule"}])]
    answer = room(shape(), nodes, [])
    assert answer["room"] == 1  # only "soft": a PreferNoSchedule taint does not keep a pod off
    assert answer["why"] == {"cordoned": "cordoned", "down": "not Ready",
                             "tpu": "tainted google.com/tpu=present:NoSchedule"}
    tolerating = shape(tolerations=[{"key": "google.com/tpu", "operator": "Exists"}],
                       nodeSelector={"pool": "tpu"})
    answer = room(tolerating, nodes, [])
    assert answer["room"] == 1  # "tpu"; "soft" lacks the selected label
    assert answer["why"]["soft"] == "its labels do not match the pods' nodeSelector (pool=tpu)"


def test_the_runs_pods_on_cordoned_nodes_are_leaving_with_their_rank_and_node():
    pods = [pod("a", "1500m", run=RUN, rank=0), pod("b", "1500m", run=RUN, rank=1),
            pod("b", "1500m", run=RUN, rank=1, deleting=True), pod("b", "1")]
    answer = room(shape(), [node("a"), node("b", cordoned=True)], pods)
    assert answer == {"room": 1, "why": {"b": "cordoned"}, "leaving": [[1, "b"]]}


def test_a_tpu_runs_room_is_whole_slices_one_per_node_pool():
    def tpu_node(name: str, pool: str, **kw) -> dict:
        n = node(name, labels={"cloud.google.com/gke-nodepool": pool}, **kw)
        n["status"]["allocatable"]["google.com/tpu"] = "4"
        return n

    tpu = {"run": RUN, "pods_per_job": 2, "slice_pods": 2,
           "slice_domain": "cloud.google.com/gke-nodepool",
           "pod": {"containers": [{"resources": {"limits": {"google.com/tpu": "4"}}}]}}
    pools = [tpu_node("a1", "a"), tpu_node("a2", "a"), tpu_node("b1", "b"), tpu_node("b2", "b")]
    assert room(tpu, pools, [])["room"] == 4  # two slices of two hosts
    # A pool with a host cordoned cannot hold a slice; JobSet puts one slice in a pool.
    pools[3] = tpu_node("b2", "b", cordoned=True)
    assert room(tpu, pools, [])["room"] == 2
    assert room(tpu, [tpu_node("a1", "a"), tpu_node("a2", "a"), tpu_node("a3", "a"),
                      tpu_node("a4", "a")], [])["room"] == 2
