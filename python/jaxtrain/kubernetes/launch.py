"""Kubernetes launch options, decided at ``fit()`` in the driver before anything starts: which
cluster, namespace, image and pod template, which address the pods reach the driver at, and
whether this identity may do what a run needs. Every refusal is one clear error naming what to
fix. docs/kubernetes.md has the user's view."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from jaxtrain import _core
from jaxtrain.kubernetes.api import (
    DEFAULT_PENDING_TIMEOUT_S,
    Api,
    dns_name,
    load_pod_template,
    object_name,
)

# What a worker pod's terminationGracePeriodSeconds gives beyond FailureConfig.preemption_grace_s:
# a deleted or drained pod's workers save their just-in-time checkpoint before the kubelet's
# SIGKILL, and its upload and commit have this long after the notice's deadline.
_TERMINATION_GRACE_MARGIN_S = 15
_KUEUE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?")


def _mounts_covering(path: str, template: dict | None) -> bool:
    if not template:
        return False
    containers = template.get("spec", {}).get("containers") or [{}]
    for mount in containers[0].get("volumeMounts") or []:
        mount_path = mount.get("mountPath", "").rstrip("/")
        if mount_path and (path == mount_path or path.startswith(mount_path + "/")):
            return True
    return False


def _share_driver_volume(path: str, template: dict | None, pod: Any) -> dict | None:
    """The template with the driver pod's volume that holds ``path`` added to the workers."""
    if pod is None:
        return template
    container = pod.spec.containers[0]
    for mount in container.volume_mounts or []:
        mount_path = mount.mount_path.rstrip("/")
        if not (path == mount_path or path.startswith(mount_path + "/")):
            continue
        volume = next((v for v in pod.spec.volumes or [] if v.name == mount.name), None)
        if volume is None or volume.secret or volume.projected or volume.empty_dir:
            continue
        from kubernetes import client

        api = client.ApiClient()
        template = json.loads(json.dumps(template or {"spec": {}}))
        spec = template.setdefault("spec", {})
        spec.setdefault("volumes", []).append(api.sanitize_for_serialization(volume))
        containers = spec.setdefault("containers", [{}])
        containers[0].setdefault("volumeMounts", []).append(
            api.sanitize_for_serialization(mount))
        return template
    return template


def _listen_host(api: Api, pod: Any) -> str:
    chosen = os.environ.get("JAXTRAIN_LISTEN_HOST")
    if chosen:
        return chosen
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    if pod is not None and pod.status and pod.status.pod_ip:
        return pod.status.pod_ip
    raise ValueError(
        "the worker pods could not reach this driver: it does not run in a pod of the cluster; "
        "set JAXTRAIN_LISTEN_HOST to an address the pods reach this host at, or run the driver "
        "in the cluster (jaxtrain submit)"
    )


def with_node_labels(template: dict | None,
                     node_labels: dict[str, tuple[str, tuple[str, ...]]]) -> dict | None:
    """The worker pod template with ScalingConfig.label_selector (as ScalingConfig.node_labels
    gives it) added: a label of one value becomes a ``nodeSelector`` entry, any other
    requirement (``!v``, ``in(a,b)``, ``!in(a,b)``) a ``matchExpression`` of the required node
    affinity (NotIn, In, NotIn), which every term of a template's own affinity gets. A template
    whose nodeSelector names one of the labels with another value is refused with a
    ValueError naming both."""
    if not node_labels:
        return template
    pod = json.loads(json.dumps(template)) if template else {}
    spec = pod.setdefault("spec", {})
    selector = spec.setdefault("nodeSelector", {})
    expressions = []
    for key, (op, values) in node_labels.items():
        if op == "in" and len(values) == 1:
            if selector.get(key, values[0]) != values[0]:
                raise ValueError(
                    f"ScalingConfig.label_selector[{key!r}]={values[0]!r} contradicts the worker "
                    f"pod template's nodeSelector {key}: {selector[key]!r} "
                    "(JAXTRAIN_K8S_POD_TEMPLATE); keep one of them")
            selector[key] = values[0]
        else:
            expressions.append({"key": key, "operator": "In" if op == "in" else "NotIn",
                                "values": list(values)})
    if expressions:
        required = (spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
                    .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}))
        terms = required.setdefault("nodeSelectorTerms", []) or [{}]
        for term in terms:  # the terms are ORed: each must hold the selector
            term.setdefault("matchExpressions", []).extend(expressions)
        required["nodeSelectorTerms"] = terms
    return pod


def with_termination_grace(template: dict | None, preemption_grace_s: float) -> dict:
    """`template` with the worker pods' terminationGracePeriodSeconds, unless it names its own:
    a deleted pod's SIGTERM is a preemption notice (docs/preemption.md), and the pod must outlive
    the notice's deadline by a margin for the just-in-time checkpoint to be committed."""
    pod = dict(template or {})
    spec = dict(pod.get("spec") or {})
    if "terminationGracePeriodSeconds" not in spec:
        spec["terminationGracePeriodSeconds"] = (int(-(-preemption_grace_s // 1))
                                                 + _TERMINATION_GRACE_MARGIN_S)
    pod["spec"] = spec
    return pod


def launch_options(experiment_name: str, run_dir: str, needs_run_dir: bool = True,
                   node_labels: dict[str, tuple[str, tuple[str, ...]]] | None = None,
                   preemption_grace_s: float = 30.0) -> dict:
    """What the Kubernetes launcher needs for a run, after checking that it can be done. Without
    `needs_run_dir` (the workers upload their checkpoints to object storage themselves) the run
    directory need not be on a volume the worker pods mount. `node_labels`
    (ScalingConfig.node_labels()) select the nodes of the worker pods (with_node_labels);
    `preemption_grace_s` (FailureConfig's) sets their terminationGracePeriodSeconds
    (with_termination_grace)."""
    in_place = in_place_setting(os.environ)
    api = Api()
    api.check_reachable()
    namespace = api.namespace()
    if in_place and "JAXTRAIN_K8S_IN_PLACE" not in os.environ:
        # On by default: an identity that may not exec into its pods restarts with new JobSets.
        lacking = api.may_restart_in_place(namespace)
        if lacking:
            in_place = False
            sys.stderr.write(
                f"jaxtrain: kubernetes: restarts in place are off: {api.identity()} may not "
                f"{', '.join(lacking)} in namespace '{namespace}' (docs/kubernetes-rbac.yaml), so "
                "each attempt after a failure is a new JobSet; set JAXTRAIN_K8S_IN_PLACE=0 to "
                "choose that and not be told\n")
    api.check_access(namespace, in_place)
    api.check_jobset_installed(namespace)
    pod = api.own_pod(namespace)
    image = os.environ.get("JAXTRAIN_K8S_IMAGE") or (
        pod.spec.containers[0].image if pod is not None else "")
    if not image:
        raise ValueError(
            "JAXTRAIN_K8S_IMAGE is not set: name the image of the worker pods (one with jaxtrain "
            "and jax installed); a driver running in a pod lends its own image"
        )
    template = with_node_labels(load_pod_template(os.environ.get("JAXTRAIN_K8S_POD_TEMPLATE")),
                                node_labels or {})
    if needs_run_dir and not _mounts_covering(run_dir, template):
        template = _share_driver_volume(run_dir, template, pod)
    if needs_run_dir and not _mounts_covering(run_dir, template):
        raise ValueError(
            f"RunConfig.storage_path: the run directory '{run_dir}' is not on a volume the worker "
            "pods mount, and workers write their checkpoints there: mount shared storage (a "
            "ReadWriteMany PersistentVolumeClaim, a GCS FUSE volume) at the same path in the "
            "driver's pod or in JAXTRAIN_K8S_POD_TEMPLATE, or use s3:// or gs:// storage, "
            "which the worker pods write to themselves"
        )
    template = with_termination_grace(template, preemption_grace_s)
    queue_name, priority_class = kueue_settings(os.environ)
    if queue_name:
        api.check_kueue(namespace, queue_name, priority_class)
    owner = None
    if pod is not None:
        # The run's objects go with the driver's pod: nothing is left if the pod is deleted.
        owner = {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name,
                 "uid": pod.metadata.uid}
    import tempfile

    text = os.environ.get("JAXTRAIN_K8S_PENDING_TIMEOUT_S", str(DEFAULT_PENDING_TIMEOUT_S))
    try:
        timeout = float(text)
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise ValueError(f"JAXTRAIN_K8S_PENDING_TIMEOUT_S='{text}' is not allowed; it must be a "
                         "number of seconds > 0")
    return {
        "namespace": namespace,
        "name": object_name(experiment_name),
        "image": image,
        "image_pull_policy": os.environ.get("JAXTRAIN_K8S_IMAGE_PULL_POLICY", ""),
        "service_account": os.environ.get("JAXTRAIN_K8S_SERVICE_ACCOUNT", ""),
        "worker_command": worker_command(os.environ.get("JAXTRAIN_K8S_PYTHON", "python"),
                                         in_place, _core.warm_workers_requested()),
        "supervisor_argv": [sys.executable, "-m", "jaxtrain.kubernetes", "supervise"],
        # The launcher makes its own 0700 directory there, and removes it when the run ends.
        "request_dir": tempfile.gettempdir(),
        "pending_timeout_s": timeout,
        "pod_template": template,
        "owner": owner,
        "labels": {"jaxtrain.dev/experiment": dns_name(experiment_name, 63)},
        "listen_host": _listen_host(api, pod),
        "queue_name": queue_name,
        "priority_class": priority_class,
    }


def kueue_settings(environ: dict[str, str] | Any = os.environ) -> tuple[str, str]:
    """JAXTRAIN_K8S_QUEUE_NAME (a Kueue LocalQueue of the run's namespace) and
    JAXTRAIN_K8S_PRIORITY_CLASS (a Kueue WorkloadPriorityClass), checked: each names an object in
    a label (a DNS subdomain name of at most 63 characters), and a priority class needs a queue."""
    names = []
    for setting in ("JAXTRAIN_K8S_QUEUE_NAME", "JAXTRAIN_K8S_PRIORITY_CLASS"):
        value = environ.get(setting, "")
        if value and not _KUEUE_NAME.fullmatch(value):
            raise ValueError(
                f"{setting}='{value}' is not allowed: it names a Kueue object in a label, so it "
                "must be at most 63 characters of lower-case letters, digits, '-' and '.', "
                "starting and ending with a letter or digit")
        names.append(value)
    if names[1] and not names[0]:
        raise ValueError(
            f"JAXTRAIN_K8S_PRIORITY_CLASS='{names[1]}' is a Kueue WorkloadPriorityClass, which "
            "only a queued JobSet has: set JAXTRAIN_K8S_QUEUE_NAME to the LocalQueue too (a pod "
            "PriorityClass goes in the pod template's spec.priorityClassName)")
    return names[0], names[1]


def in_place_setting(environ: dict[str, str] | Any = os.environ) -> bool:
    """JAXTRAIN_K8S_IN_PLACE: whether a failed attempt's pods are kept and the next attempt's
    workers started in them (docs/kubernetes.md, "Restarts in place")."""
    value = environ.get("JAXTRAIN_K8S_IN_PLACE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"JAXTRAIN_K8S_IN_PLACE='{value}' is not allowed; it must be 1 (keep a "
                         "failed attempt's pods and restart the workers in them) or 0 (a new "
                         "JobSet for every attempt)")
    return value == "1"


def worker_command(python: str, in_place: bool, warm: bool = True) -> list[str]:
    """The worker container's command: the worker, or in place the holder that runs it
    (jaxtrain.kubernetes.pod), with a standby worker unless not `warm`."""
    worker = [python, "-m", "jaxtrain.worker"]
    if not in_place:
        return worker
    return [python, "-m", "jaxtrain.kubernetes", "hold", *([] if warm else ["--no-standby"]),
            "--", *worker]
