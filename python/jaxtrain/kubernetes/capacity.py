"""How many of an elastic run's worker pods the cluster has room for now (docs/elastic.md): the
Kubernetes launcher's answer to "which hosts can be had", asked before each attempt and every
resize monitor interval (src/launch/kubernetes_launcher.cc). And which of the run's pods are on
nodes being taken away (cordoned: ``kubectl cordon``, the first step of ``kubectl drain``).

    python -m jaxtrain.kubernetes supervise --capacity SHAPE_JSON

prints one JSON line: ``{"room": N, "why": {node: reason}, "leaving": [[rank, node], ...]}``, or
``{"error": "..."}`` when the cluster cannot be asked (no permission to list nodes and pods).

A node has room for ``min`` over the pod's requests of (allocatable − what the pods of other runs
on it request) // what one pod requests, counting only nodes that are Ready, not cordoned, whose
labels match the pod's nodeSelector and whose NoSchedule and NoExecute taints the pod tolerates.
The run's own pods are not counted against the room: the room is what the run's whole group can
have (a kept JobSet's pods are replaced when the group resizes). A TPU run's room is whole slices:
JobSet places each slice in a node pool of its own (exclusive placement), so a pool with room for
all of a slice's pods holds one slice. Affinity rules are not weighed:
the scheduler has the last word, and a pod it cannot place fails its attempt after
JAXTRAIN_K8S_PENDING_TIMEOUT_S as in a fixed-size run.
"""

from __future__ import annotations

import json
from collections import Counter
from decimal import Decimal
from typing import Any

from jaxtrain.kubernetes.api import COMPLETION_INDEX, JOB_INDEX_LABEL

_RUN_LABEL = "jaxtrain.dev/run"
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def _quantity(text: Any) -> Decimal:
    from kubernetes.utils import parse_quantity

    return Decimal(parse_quantity(text))


def _show(q: Decimal) -> str:
    return format(q.normalize(), "f")


def pod_requests(spec: dict) -> Counter:
    """What one pod of `spec` (a PodSpec as the API writes it) asks a node for: each container's
    requests (a limit stands for a request it lacks, as Kubernetes defaults it), and one pod."""
    total: Counter = Counter()
    for c in spec.get("containers") or []:
        resources = c.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in asked.items():
            total[name] += _quantity(value)
    total["pods"] += 1
    return total


def _tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (
                taint.get("value") or ""):
            return True
    return False


def _unusable(node: dict, spec: dict) -> str:
    """Why `node` takes no pod of `spec`; "" when it may."""
    if (node.get("spec") or {}).get("unschedulable"):
        return "cordoned"
    ready = next((c for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return "not Ready"
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return f"its labels do not match the pods' nodeSelector ({key}={value})"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in _BLOCKING_EFFECTS and \
                not _tolerated(taint, spec.get("tolerations") or []):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"tainted {taint.get('key')}{value}:{taint.get('effect')}"
    return ""


def _rank(pod: dict, pods_per_job: int) -> int | None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    try:
        job = int(labels[JOB_INDEX_LABEL])
        index = int(labels.get(COMPLETION_INDEX, annotations.get(COMPLETION_INDEX)))
    except (KeyError, TypeError, ValueError):
        return None
    return job * pods_per_job + index


def room(shape: dict, nodes: list[dict], pods: list[dict]) -> dict:
    """The room for the run's pods (`shape`: "run", the run's label value; "pod", one worker
    pod's spec; "pods_per_job"; for TPU slices "slice_pods" and "slice_domain", the node label
    of a slice's pool) among `nodes`, with `pods` running on them (API objects as JSON)."""
    spec = shape["pod"]
    one = pod_requests(spec)
    used: dict[str, Counter] = {}
    own: list[dict] = []
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        if ((pod.get("metadata") or {}).get("labels") or {}).get(_RUN_LABEL) == shape["run"]:
            own.append(pod)
            continue
        used.setdefault(node, Counter()).update(pod_requests(pod.get("spec") or {}))
    total, why, away = 0, {}, set()
    slice_pods, domain = int(shape.get("slice_pods") or 0), shape.get("slice_domain") or ""
    per_domain: Counter = Counter()
    for node in nodes:
        name = node["metadata"]["name"]
        reason = _unusable(node, spec)
        if reason:
            why[name] = reason
            away.add(name)
            continue
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        free = {r: _quantity(allocatable.get(r, 0)) - used.get(name, Counter())[r] for r in one}
        fits = min(int(free[r] // one[r]) for r in one if one[r] > 0)
        if fits <= 0:
            short = next(r for r in one if one[r] > 0 and free[r] < one[r])
            why[name] = (f"no room: {short} {_show(free[short])} free, "
                         f"a pod asks {_show(one[short])}")
        total += max(fits, 0)
        labels = node["metadata"].get("labels") or {}
        per_domain[labels.get(domain) or name] += max(fits, 0)
    if slice_pods:
        total = slice_pods * sum(1 for fits in per_domain.values() if fits >= slice_pods)
    leaving = []
    for pod in own:
        rank = _rank(pod, int(shape.get("pods_per_job", 1)))
        node = pod["spec"]["nodeName"]
        if rank is not None and node in away and \
                not (pod.get("metadata") or {}).get("deletionTimestamp"):
            leaving.append([rank, node])
    return {"room": total, "why": why, "leaving": sorted(leaving)}


def capacity(shape_json: str) -> int:
    """`supervise --capacity`: asks the API server and prints room()'s answer as one line."""
    from jaxtrain.kubernetes.api import Api, error_reason

    shape = json.loads(shape_json)
    try:
        api = Api()
        serialize = api.client.ApiClient().sanitize_for_serialization
        nodes = serialize(api.core.list_node(_request_timeout=20).items)
        pods = serialize(api.core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed",
            _request_timeout=20).items)
    except Exception as e:
        print(json.dumps({"error": f"cannot list the cluster's nodes and pods: "
                                   f"{error_reason(e)}"}), flush=True)
        return 0
    print(json.dumps(room(shape, nodes, pods)), flush=True)
    return 0
