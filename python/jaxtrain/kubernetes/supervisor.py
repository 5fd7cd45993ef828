"""Kubernetes: the glue between the C++ Kubernetes launcher and the API server.

Three parts, all on the official ``kubernetes`` client (``pip install jaxtrain[kubernetes]``), which
brings kubeconfig files, in-cluster service accounts and exec credential plugins such as GKE's:

* ``launch_options()`` — at ``fit()``, before anything starts: which cluster, namespace, image and
  pod template, which address the pods reach the driver at, and whether this identity may do what a
  run needs. Every refusal is one clear error naming what to fix.
* the supervisor — ``python -m jaxtrain.kubernetes supervise REQUEST``, started by the launcher for
  each attempt (src/launch/kubernetes_launcher.h): creates the attempt's Secret and JobSet, watches
  its pods, streams their logs as ``<rank>: `` lines, says how each rank ended, and deletes the
  JobSet — waiting until its pods are gone — when a pod fails, when all have succeeded, or when it
  is told to stop (SIGTERM: with the pods' grace period; SIGUSR1: at once). It dies with the driver.
* ``submit``/``status``/``logs`` for the ``jaxtrain`` command: a driver pod in the cluster.

docs/kubernetes.md has the user's view.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import secrets
import signal
import string
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
MANAGED_BY = {"app.kubernetes.io/managed-by": "jaxtrain"}
SUBMIT_LABEL = "jaxtrain.dev/submitted"
_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
_JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_DEFAULT_PENDING_TIMEOUT_S = 300.0
# What a worker pod's terminationGracePeriodSeconds gives beyond FailureConfig.preemption_grace_s:
# a deleted or drained pod's workers save their just-in-time checkpoint before the kubelet's
# SIGKILL, and its upload and commit have this long after the notice's deadline.
_TERMINATION_GRACE_MARGIN_S = 15
_TEARDOWN_TIMEOUT_S = 60.0
# Kueue (sigs.k8s.io/kueue): a JobSet with the queue-name label is a workload that Kueue admits
# (unsuspends) when its ClusterQueue has quota, and evicts (suspends again) for a higher-priority
# one. Its labels, and the API of its LocalQueues and Workloads.
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
_KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
_KUEUE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?")
# How often the supervisor of a queued JobSet asks whether Kueue admitted (or evicted) it.
_JOBSET_POLL_S = 1.0
# GKE's taint on a node about to be reclaimed (a spot or preemptible VM's preemption, a host
# maintenance that terminates it), put by its node termination handler with effect NoSchedule; a
# spot or preemptible VM goes 30 s after the notice (k8s-node-termination-handler's
# preemptibleNodeTerminationDuration, GCE's preemption notice).
GKE_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
_GKE_SPOT_LABELS = ("cloud.google.com/gke-spot", "cloud.google.com/gke-preemptible")
_GKE_SPOT_NOTICE_S = 30.0
_IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError")
# What a run's driver and supervisors do in its namespace, all of it (docs/kubernetes-rbac.yaml's
# Role "jaxtrain" grants exactly this): (verb, group, resource, subresource). No Secret is ever
# read back.
_NEEDED = [("create", JOBSET_GROUP, "jobsets", ""), ("delete", JOBSET_GROUP, "jobsets", ""),
           ("get", JOBSET_GROUP, "jobsets", ""), ("list", JOBSET_GROUP, "jobsets", ""),
           ("create", "", "secrets", ""), ("patch", "", "secrets", ""),
           ("delete", "", "secrets", ""), ("get", "", "pods", ""), ("list", "", "pods", ""),
           ("watch", "", "pods", ""), ("delete", "", "pods", ""), ("get", "", "pods", "log")]
# What `jaxtrain submit`, `status` and `logs` do (the Role "jaxtrain-submit").
_NEEDED_TO_SUBMIT = [("create", "", "configmaps", ""), ("patch", "", "configmaps", ""),
                     ("create", "", "secrets", ""), ("patch", "", "secrets", ""),
                     ("create", "", "pods", ""), ("get", "", "pods", ""),
                     ("list", "", "pods", ""), ("get", "", "pods", "log")]
# The longest line the supervisor buffers, as the controller's (RankOutput::kLineCap): a longer
# one is passed on in pieces.
_LINE_CAP = 64 << 10
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")


def _client():
    try:
        import kubernetes  # noqa: F401
        from kubernetes import client, config
    except ImportError:
        raise ImportError(
            "JAXTRAIN_LAUNCHER=kubernetes needs the Kubernetes client: "
            "pip install 'jaxtrain[kubernetes]'"
        ) from None
    return client, config


class Api:
    """One API server connection: in-cluster (a pod's service account) or a kubeconfig."""

    def __init__(self) -> None:
        client, config = _client()
        self.in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(
            f"{_SA_DIR}/token")
        self.context_namespace = None
        try:
            if self.in_cluster:
                config.load_incluster_config()
            else:
                config.load_kube_config()
                _, context = config.list_kube_config_contexts()
                self.context_namespace = (context or {}).get("context", {}).get("namespace")
        except Exception as e:  # config.ConfigException and file errors
            raise ValueError(
                "no Kubernetes cluster is configured for this driver: it is not in a pod and has "
                f"no usable kubeconfig ({e}); set KUBECONFIG or run the driver in the cluster "
                "(jaxtrain submit)"
            ) from None
        self.host = client.Configuration.get_default_copy().host
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()
        self.authz = client.AuthorizationV1Api()
        self.version = client.VersionApi()
        self.client = client

    def namespace(self) -> str:
        chosen = os.environ.get("JAXTRAIN_K8S_NAMESPACE")
        if chosen:
            return chosen
        if self.in_cluster:
            try:
                with open(f"{_SA_DIR}/namespace") as f:
                    return f.read().strip()
            except OSError:
                pass
        return self.context_namespace or "default"

    def check_reachable(self) -> None:
        try:
            self.version.get_code(_request_timeout=10)
        except Exception as e:
            raise ConnectionError(
                f"cannot reach the Kubernetes API server at {self.host}: {_reason(e)}"
            ) from None

    def check_access(self, namespace: str) -> None:
        denied = []
        for verb, group, resource, sub in _NEEDED:
            review = self.client.V1SelfSubjectAccessReview(
                spec=self.client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=self.client.V1ResourceAttributes(
                        namespace=namespace, verb=verb, group=group, resource=resource,
                        subresource=sub or None)))
            status = self.authz.create_self_subject_access_review(review).status
            if not status.allowed:
                what = f"{resource}/{sub}" if sub else resource
                denied.append(f"{verb} {what}{'.' + group if group else ''}")
        if denied:
            raise PermissionError(
                f"Kubernetes RBAC: {self.identity()} may not {', '.join(denied)} in namespace "
                f"'{namespace}'; a run needs them all: bind it to a Role like the one in "
                "docs/kubernetes.md (kubectl create rolebinding ...)"
            )

    def identity(self) -> str:
        try:
            review = self.client.V1SelfSubjectReview()
            user = self.client.AuthenticationV1Api().create_self_subject_review(review)
            return f"'{user.status.user_info.username}'"
        except Exception:
            return "this identity"

    def check_jobset_installed(self, namespace: str) -> None:
        try:
            self.custom.list_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, limit=1)
        except self.client.ApiException as e:
            if e.status == 404:
                raise ValueError(
                    "JobSet is not installed in this cluster (no jobsets.jobset.x-k8s.io "
                    "resource); install its controller: see docs/kubernetes.md"
                ) from None
            raise

    def check_kueue(self, namespace: str, queue_name: str, priority_class: str) -> None:
        """Kueue is installed, the LocalQueue is in the namespace and the priority class exists
        (where this identity may read them: a refusal of the read is not the run's)."""
        try:
            self.custom.get_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, "localqueues", queue_name)
            if priority_class:
                self.custom.get_cluster_custom_object(
                    KUEUE_GROUP, KUEUE_VERSION, "workloadpriorityclasses", priority_class)
        except self.client.ApiException as e:
            if e.status == 403:
                return
            if e.status != 404:
                raise
            try:
                self.custom.list_namespaced_custom_object(
                    KUEUE_GROUP, KUEUE_VERSION, namespace, "localqueues", limit=1)
            except self.client.ApiException as e2:
                if e2.status == 404:
                    raise ValueError(
                        f"JAXTRAIN_K8S_QUEUE_NAME='{queue_name}': Kueue is not installed in this "
                        "cluster (no localqueues.kueue.x-k8s.io resource); install it (see "
                        "docs/kubernetes.md) or leave JAXTRAIN_K8S_QUEUE_NAME unset") from None
            body = _reason(e)
            if "workloadpriorityclasses" in body:
                raise ValueError(
                    f"JAXTRAIN_K8S_PRIORITY_CLASS='{priority_class}': no Kueue "
                    "WorkloadPriorityClass of that name (kubectl get workloadpriorityclasses)"
                ) from None
            raise ValueError(
                f"JAXTRAIN_K8S_QUEUE_NAME='{queue_name}': no Kueue LocalQueue of that name in "
                f"namespace '{namespace}' (kubectl get localqueues -n {namespace})") from None

    def own_pod(self, namespace: str) -> Any | None:
        """The driver's own pod, when it runs in one (its name is the host name)."""
        if not self.in_cluster:
            return None
        name = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME", "")
        try:
            return self.core.read_namespaced_pod(name, namespace)
        except Exception:
            return None


def _reason(e: BaseException) -> str:
    status = getattr(e, "status", None)
    reason = getattr(e, "reason", None)
    body = getattr(e, "body", None)
    if status:
        try:
            message = json.loads(body).get("message") if body else None
        except (TypeError, ValueError):
            message = None
        return f"HTTP {status} {reason or ''}: {message or body or ''}".strip()
    text = str(e)
    return text.splitlines()[-1] if text else type(e).__name__


def dns_name(text: str, limit: int) -> str:
    """A DNS-1035 label made of ``text``: lower case, [a-z0-9-], starting with a letter."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = "r-" + name
    return name[:limit].rstrip("-")


def _random_suffix(n: int = 6) -> str:
    """From the operating system's randomness: user code seeding ``random`` does not repeat it."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(n))


def object_name(text: str, limit: int = 30) -> str:
    """The unique base of a run's object names: ``text`` as a DNS label of at most ``limit``
    characters — ending in a hash of the whole of ``text`` when it had to be cut, so that names
    differing only past the cut stay apart — and a random suffix."""
    name = dns_name(text, 63)
    if len(name) > limit:
        digest = hashlib.sha256(text.encode()).hexdigest()[:4]
        name = f"{dns_name(text, limit - 5)}-{digest}"
    return f"{name}-{_random_suffix()}"


def load_pod_template(path: str | None) -> dict | None:
    """The worker pod template (YAML or JSON of a Pod: metadata and spec) named by ``path``."""
    if not path:
        return None
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"JAXTRAIN_K8S_POD_TEMPLATE='{path}' cannot be read: {e}") from None
    try:
        import yaml

        template = yaml.safe_load(text)
    except Exception as e:
        raise ValueError(f"JAXTRAIN_K8S_POD_TEMPLATE='{path}' is not valid YAML: {e}") from None
    if not isinstance(template, dict) or not isinstance(template.get("spec", {}), dict):
        raise ValueError(
            f"JAXTRAIN_K8S_POD_TEMPLATE='{path}' must hold a Pod: a mapping with 'metadata' "
            "and 'spec' (spec.containers[0] is the worker's container)"
        )
    return template


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
    api = Api()
    api.check_reachable()
    namespace = api.namespace()
    api.check_access(namespace)
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

    text = os.environ.get("JAXTRAIN_K8S_PENDING_TIMEOUT_S", str(_DEFAULT_PENDING_TIMEOUT_S))
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
        "worker_command": [os.environ.get("JAXTRAIN_K8S_PYTHON", "python"), "-m",
                           "jaxtrain.worker"],
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


# ---- the supervisor -------------------------------------------------------------------------


class _Lines:
    r"""A log stream cut into whole lines, as the controller cuts a worker's output
    (src/controller/rank_output.h): a line ends at ``\n``, at ``\r`` (a progress bar redraws its
    line after one; ``\r\n`` ends one line), or after ``_LINE_CAP`` bytes without an end, so that
    output without newlines never grows a buffer without bound. A ``\r`` at the end of a chunk
    waits for the next one, which may hold its ``\n``."""

    _END = re.compile(rb"\r\n|\r(?!\Z)|\n")

    def __init__(self, cap: int = _LINE_CAP) -> None:
        self._cap = cap
        self._partial = b""

    def take(self, chunk: bytes) -> list[bytes]:
        r"""The lines that ``chunk`` ends, each with its end (a line cut at the cap: ``\n``)."""
        data = self._partial + chunk
        lines = []
        start = 0
        for end in self._END.finditer(data):
            lines.append(data[start:end.end()])
            start = end.end()
        while len(data) - start >= self._cap:
            lines.append(data[start:start + self._cap] + b"\n")
            start += self._cap
        self._partial = data[start:]
        return lines

    def close(self) -> list[bytes]:
        """The rest, an unended line, taken as ended."""
        return self.take(b"\n") if self._partial else []


class _Output:
    """Whole lines to stdout from several threads; ``<rank>: `` labels when there are several."""

    def __init__(self, labelled: bool) -> None:
        self._lock = threading.Lock()
        self._labelled = labelled

    def rank_lines(self, rank: int, lines: list[bytes]) -> None:
        r"""Writes `lines` (_Lines's) of `rank`. Labelled, a line that a lone ``\r`` ended ends in
        ``\n`` instead: the controller splits labelled output at ``\n`` only."""
        if self._labelled:
            label = f"{rank}: ".encode()
            lines = [label + (line[:-1] + b"\n" if line.endswith(b"\r") else line)
                     for line in lines if line != b"\r"]
        if lines:
            self._write(b"".join(lines))

    def say(self, line: str) -> None:
        self._write(f"jaxtrain kubernetes: {line}\n".encode())

    def _write(self, data: bytes) -> None:
        with self._lock:
            view = memoryview(data)
            while view:
                try:
                    n = os.write(1, view)
                except InterruptedError:
                    continue
                view = view[n:]


def _die_with_parent() -> None:
    """SIGTERM when the driver dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    # The driver may already be gone (and this process re-parented) before prctl took effect. The
    # driver may itself be PID 1 (jaxtrain submit's pod), so compare with its pid, not with 1.
    if os.getppid() != int(os.environ.get("JAXTRAIN_DRIVER_PID", os.getppid())):
        os.kill(os.getpid(), signal.SIGTERM)


class ObjectExists(Exception):
    """An object the supervisor was to create is already there: another's, left as it is."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        super().__init__(
            f"cannot create {kind} {namespace}/{name}: one of that name already exists and is "
            "not this run's, so it was left as it is; this attempt created nothing that is left "
            "(if the object is a leftover of an earlier run, delete it)")


class _Pod:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.uid = ""
        self.node = "?"
        self.deleted_for_taint = False
        self.logs: threading.Thread | None = None
        self.ended = False
        self.pending_since: float | None = None
        self.pending_message = ""


class Supervisor:
    def __init__(self, api: Api, request: dict, out: _Output) -> None:
        self.api = api
        self.namespace = request["namespace"]
        self.jobset = request["jobset"]
        self.name = self.jobset["metadata"]["name"]
        self.secret = request["secret"]
        self.ranks = int(request["ranks"])
        self.pending_timeout = float(request.get("pending_timeout_s", _DEFAULT_PENDING_TIMEOUT_S))
        job = self.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
        self.pods_per_job = int(job["parallelism"])
        self.container = job["template"]["spec"]["containers"][0]["name"]
        self.out = out
        self.events: queue.Queue = queue.Queue()
        self.pods: dict[str, _Pod] = {}
        self.succeeded: set[int] = set()
        self.stop_requested: str | None = None  # "grace" or "now"
        self.secret_uid: str | None = None  # what this supervisor created
        self.jobset_uid: str | None = None
        # Kueue: the LocalQueue of a queued JobSet; admitted once Kueue has unsuspended it.
        self.queue_name = request.get("queue_name") or ""
        self.admitted = not self.queue_name
        self.queued_since = time.monotonic()
        self.queue_reason = ""
        self.evicted = False
        # GKE's impending-termination taint: the nodes of the pods, watched; those that have it
        # (node -> (when it was seen, a spot or preemptible node)).
        self.watched_nodes: set[str] = set()
        self.tainted: dict[str, tuple[float, bool]] = {}
        self.cannot_watch_nodes = False

    # -- objects --

    def create(self) -> None:
        """Creates the attempt's Secret, then its JobSet, keeping the uid of each. An object of
        the same name that is already there is not this run's (names end in a random suffix): it
        is left as it is, and ObjectExists names it."""
        client = self.api.client
        meta = self.jobset["metadata"]
        secret = client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=self.secret["name"], namespace=self.namespace, labels=meta.get("labels"),
                owner_references=meta.get("ownerReferences")),
            string_data={**(self.secret.get("env") or {}), "secret": self.secret["key"]},
            type="Opaque")
        try:
            made = self.api.core.create_namespaced_secret(self.namespace, secret)
        except client.ApiException as e:
            if e.status == 409:
                raise ObjectExists("Secret", self.namespace, self.secret["name"]) from None
            raise
        self.secret_uid = made.metadata.uid
        try:
            created = self.api.custom.create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.jobset)
        except client.ApiException as e:
            if e.status == 409:
                raise ObjectExists("JobSet", self.namespace, self.name) from None
            raise
        self.jobset_uid = created["metadata"]["uid"]
        # The Secret now goes with the JobSet. Its uid in the patch: only this Secret is changed.
        owner = {"apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}", "kind": "JobSet",
                 "name": self.name, "uid": self.jobset_uid}
        self.api.core.patch_namespaced_secret(
            self.secret["name"], self.namespace,
            {"metadata": {"uid": self.secret_uid,
                          "ownerReferences": [owner, *(meta.get("ownerReferences") or [])]}})

    def _delete_options(self, uid: str, **kw: Any) -> Any:
        """Deletion of the object whose uid is `uid` only (a precondition the server checks)."""
        client = self.api.client
        return client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid), **kw)

    def delete(self, grace: bool) -> None:
        """Deletes what this supervisor created — the JobSet and its Secret, each by its uid, so
        that an object of the same name made by another is never touched; returns once no pod of
        the JobSet is left."""
        client = self.api.client
        if self.jobset_uid is not None:
            body = self._delete_options(self.jobset_uid, propagation_policy="Foreground",
                                        grace_period_seconds=None if grace else 0)
            try:
                self.api.custom.delete_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name,
                    body=body)
            except client.ApiException as e:
                if e.status not in (404, 409):  # 409: the uid differs, ours is gone
                    self.out.say(f"error: cannot delete JobSet {self.namespace}/{self.name}: "
                                 f"{_reason(e)}")
        if self.secret_uid is not None:
            try:
                self.api.core.delete_namespaced_secret(
                    self.secret["name"], self.namespace,
                    body=self._delete_options(self.secret_uid))
            except client.ApiException:
                pass
        if self.jobset_uid is None:
            return
        deadline = time.monotonic() + _TEARDOWN_TIMEOUT_S
        forced = not grace
        while time.monotonic() < deadline:
            try:
                left = self.api.core.list_namespaced_pod(
                    self.namespace, label_selector=f"{_JOBSET_NAME_LABEL}={self.name}").items
            except Exception as e:
                self.out.say(f"error: cannot list the pods of {self.name}: {_reason(e)}")
                left = [None]
            if not left and self._jobset_gone():
                return
            if not forced and self.stop_requested == "now":
                forced = True
                for pod in left:
                    if pod is not None:
                        self._delete_pod_now(pod)
            time.sleep(0.2)
        self.out.say(f"error: pods of JobSet {self.namespace}/{self.name} were still there "
                     f"{_TEARDOWN_TIMEOUT_S:.0f} s after it was deleted")

    def _jobset_gone(self) -> bool:
        try:
            jobset = self.api.custom.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name)
        except self.api.client.ApiException as e:
            return e.status == 404
        except Exception:
            return False
        return jobset["metadata"]["uid"] != self.jobset_uid

    def _delete_pod_now(self, pod: Any) -> None:
        try:
            self.api.core.delete_namespaced_pod(
                pod.metadata.name, self.namespace,
                body=self._delete_options(pod.metadata.uid, grace_period_seconds=0))
        except Exception:
            pass

    # -- pods --

    def _rank_of(self, pod: Any) -> int | None:
        try:
            job = int(pod.metadata.labels[_JOB_INDEX_LABEL])
            index = int(pod.metadata.annotations[_COMPLETION_INDEX])
        except (KeyError, TypeError, ValueError):
            return None
        return job * self.pods_per_job + index

    def _follow_logs(self, name: str, state: _Pod) -> None:
        for _ in range(3):
            try:
                stream = self.api.core.read_namespaced_pod_log(
                    name, self.namespace, container=self.container, follow=True,
                    _preload_content=False)
                lines = _Lines()
                for chunk in stream.stream(65536):
                    self.out.rank_lines(state.rank, lines.take(chunk))
                self.out.rank_lines(state.rank, lines.close())
                return
            except Exception:
                time.sleep(0.5)  # the container may not have started yet

    def _watch(self) -> None:
        from kubernetes import watch

        version = None
        while True:
            try:
                stream = watch.Watch().stream(
                    self.api.core.list_namespaced_pod, self.namespace,
                    label_selector=f"{_JOBSET_NAME_LABEL}={self.name}", resource_version=version,
                    timeout_seconds=300)
                for event in stream:
                    version = event["object"].metadata.resource_version
                    self.events.put(event)
            except Exception as e:
                if getattr(e, "status", None) == 410:
                    version = None
                self.events.put({"type": "WATCH-ERROR", "error": _reason(e)})
                time.sleep(1.0)

    def _handle(self, event: dict) -> tuple[int, str] | None:
        """An event's consequence: (exit status, why) when the group must end, else None."""
        if event["type"] == "WATCH-ERROR":
            return None
        pod = event["object"]
        rank = self._rank_of(pod)
        if rank is None:
            return None
        state = self.pods.setdefault(pod.metadata.name, _Pod(rank))
        state.node = pod.spec.node_name or state.node
        state.uid = pod.metadata.uid or state.uid
        if state.ended:
            return None
        if pod.spec.node_name and pod.spec.node_name not in self.watched_nodes:
            self.watched_nodes.add(pod.spec.node_name)
            threading.Thread(target=self._watch_node, args=(pod.spec.node_name,),
                             daemon=True).start()
        if state.node in self.tainted and event["type"] != "DELETED":
            self._leave_tainted_node(state.node)
        if (pod.metadata.deletion_timestamp and self.queue_name and self.admitted
                and not self.evicted and self._suspended()):
            self._say_evicted()  # at once: the group may be stopped before the next poll
        statuses = pod.status.container_statuses or []
        main = next((s for s in statuses if s.name == self.container), None)
        if event["type"] == "DELETED":
            state.ended = True
            why = pod.status.reason or "its pod was deleted or its node was lost"
            self.out.say(f"rank {rank} on {state.node}: deleted ({why})")
            return 137, "deleted"
        if pod.status.phase == "Failed" and (main is None or main.state.terminated is None):
            state.ended = True
            self.out.say(f"rank {rank} on {state.node}: {pod.status.reason or 'failed'} "
                         f"({pod.status.message or 'its pod failed'})")
            return 137, "failed"
        if main is not None and main.state.waiting and main.state.waiting.reason in _IMAGE_ERRORS:
            state.ended = True
            image = self.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
                "spec"]["containers"][0].get("image")
            self.out.say(f"error: rank {rank}'s pod {pod.metadata.name} cannot start its "
                         f"container ({main.state.waiting.reason}: "
                         f"{main.state.waiting.message or ''}); image '{image}'")
            return 3, "image"
        if main is not None and (main.state.running or main.state.terminated) and not state.logs:
            state.logs = threading.Thread(target=self._follow_logs, args=(pod.metadata.name,
                                                                          state), daemon=True)
            state.logs.start()
        if main is not None and main.state.terminated:
            t = main.state.terminated
            state.ended = True
            if t.exit_code == 0:
                self.succeeded.add(rank)
                return (0, "succeeded") if len(self.succeeded) == self.ranks else None
            if t.reason == "OOMKilled":
                how = "killed by signal 9 (OOMKilled)"
            elif t.signal:
                how = f"killed by signal {t.signal}"
            elif t.exit_code > 128:
                how = f"killed by signal {t.exit_code - 128}"
            else:
                how = f"exited with status {t.exit_code}"
            self.out.say(f"rank {rank} on {state.node}: {how}")
            return t.exit_code, "failed"
        if pod.status.phase == "Pending" and not pod.spec.node_name:
            unschedulable = next((c for c in pod.status.conditions or []
                                  if c.type == "PodScheduled" and c.status == "False"), None)
            if unschedulable is not None and state.pending_since is None:
                state.pending_since = time.monotonic()
                state.pending_message = unschedulable.message
        else:
            state.pending_since = None
        return None

    # -- Kueue --

    def _poll_jobset(self) -> None:
        """Puts a JOBSET event whenever the JobSet's suspension changes: Kueue admitting it
        (unsuspended) or evicting it (suspended again)."""
        suspended = True
        while True:
            try:
                jobset = self.api.custom.get_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name)
            except Exception as e:
                if getattr(e, "status", None) == 404:
                    return
                time.sleep(_JOBSET_POLL_S)
                continue
            if jobset["metadata"].get("uid") != self.jobset_uid:
                return
            now = bool(jobset.get("spec", {}).get("suspend"))
            if now != suspended:
                suspended = now
                self.events.put({"type": "JOBSET", "suspended": now})
            elif now and not self.admitted:
                reason = self._workload_condition("QuotaReserved", "False")
                if reason and reason != self.queue_reason:
                    self.events.put({"type": "QUEUED", "reason": reason})
            time.sleep(_JOBSET_POLL_S)

    def _workload_condition(self, kind: str, status: str = "True") -> str:
        """The message of the JobSet's Kueue Workload's condition `kind` when its status is
        `status` ("" if none can be read: an identity may not read Workloads)."""
        try:
            workloads = self.api.custom.list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, self.namespace, "workloads",
                label_selector=f"{_KUEUE_JOB_UID_LABEL}={self.jobset_uid}")["items"]
        except Exception:
            return ""
        for workload in workloads:
            for c in workload.get("status", {}).get("conditions") or []:
                if c.get("type") == kind and c.get("status") == status:
                    return c.get("message") or c.get("reason") or ""
        return ""

    def _on_jobset(self, event: dict) -> None:
        if event["type"] == "QUEUED":
            self.queue_reason = event["reason"]
            self.out.say(f"queued: {event['reason']}")
        elif not event["suspended"] and not self.admitted:
            self.admitted = True
            self.out.say(f"admitted by Kueue from LocalQueue '{self.queue_name}' after "
                         f"{time.monotonic() - self.queued_since:.0f} s queued")
        elif event["suspended"] and self.admitted:
            self._say_evicted()

    def _say_evicted(self) -> None:
        if self.evicted:
            return
        self.evicted = True
        why = self._workload_condition("Evicted") or "suspended by Kueue"
        self.out.say(f"evicted by Kueue ({why}): the pods of JobSet {self.namespace}/"
                     f"{self.name} are deleted, and their SIGTERM is the workers' preemption "
                     "notice; the next attempt is queued again")

    def _suspended(self) -> bool:
        try:
            return bool(self.api.custom.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL,
                self.name).get("spec", {}).get("suspend"))
        except Exception:
            return False

    # -- GKE's impending node termination --

    def _watch_node(self, node: str) -> None:
        """Puts a TAINT event when `node` gets GKE's impending-termination taint."""
        from kubernetes import watch

        version = None
        while node not in self.tainted:
            try:
                stream = watch.Watch().stream(
                    self.api.core.list_node, field_selector=f"metadata.name={node}",
                    resource_version=version, timeout_seconds=300)
                for event in stream:
                    obj = event["object"]
                    version = obj.metadata.resource_version
                    if any(t.key == GKE_TERMINATION_TAINT for t in obj.spec.taints or []):
                        labels = obj.metadata.labels or {}
                        spot = any(labels.get(k) == "true" for k in _GKE_SPOT_LABELS)
                        self.events.put({"type": "TAINT", "node": node, "spot": spot})
                        return
            except Exception as e:
                status = getattr(e, "status", None)
                if status in (401, 403):
                    if not self.cannot_watch_nodes:
                        self.cannot_watch_nodes = True
                        self.out.say(f"cannot watch node {node} ({_reason(e)}): GKE's "
                                     f"{GKE_TERMINATION_TAINT} taint is not seen in this attempt "
                                     "(a ClusterRole with get, list and watch of nodes lets it "
                                     "be; docs/kubernetes.md)")
                    return
                if status == 410:
                    version = None
                time.sleep(1.0)

    def _leave_tainted_node(self, node: str) -> None:
        """Deletes the pods on `node`, which GKE is about to reclaim: their workers' SIGTERM is
        a preemption notice, and a spot node's pods get the grace period its 30 s notice leaves
        (others, their own terminationGracePeriodSeconds)."""
        seen, spot = self.tainted[node]
        grace = max(1, int(_GKE_SPOT_NOTICE_S - (time.monotonic() - seen))) if spot else None
        leaving = [(name, state) for name, state in self.pods.items()
                   if state.node == node and not state.ended and not state.deleted_for_taint]
        if not leaving:
            return
        ranks = ", ".join(str(state.rank) for _, state in sorted(leaving, key=lambda p: p[1].rank))
        self.out.say(f"node {node} has GKE's {GKE_TERMINATION_TAINT} taint: deleting its pods "
                     f"(rank{'s' if len(leaving) > 1 else ''} {ranks}) with "
                     + (f"a grace period of {grace} s" if grace else "their grace period")
                     + "; their SIGTERM is the workers' preemption notice")
        for name, state in leaving:
            state.deleted_for_taint = True
            try:
                self.api.core.delete_namespaced_pod(
                    name, self.namespace,
                    body=self._delete_options(state.uid, grace_period_seconds=grace))
            except Exception as e:
                self.out.say(f"cannot delete pod {name} on {node}: {_reason(e)}")

    def _pending_too_long(self) -> tuple[int, str] | None:
        if not self.admitted:
            return None  # queued in Kueue: a wait for quota, not a pod that cannot be scheduled
        now = time.monotonic()
        for name, state in self.pods.items():
            if state.pending_since is not None and now - state.pending_since > self.pending_timeout:
                self.out.say(
                    f"error: rank {state.rank}'s pod {name} could not be scheduled for "
                    f"{self.pending_timeout:.0f} s (JAXTRAIN_K8S_PENDING_TIMEOUT_S): "
                    f"{state.pending_message or 'Pending'}")
                return 3, "pending"
        return None

    def run(self) -> int:
        def on_signal(signum, frame):
            self.stop_requested = "now" if signum == signal.SIGUSR1 else (
                self.stop_requested or "grace")
            self.events.put({"type": "STOP"})

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGUSR1, on_signal)
        try:
            self.create()
        except ObjectExists as e:
            self.out.say(f"error: {e}")
            self.delete(grace=False)
            return 3
        except Exception as e:
            self.out.say(f"error: cannot create JobSet {self.namespace}/{self.name}: {_reason(e)}")
            self.delete(grace=False)
            return 3
        if self.queue_name:
            # Created suspended: Launch() waits for the "admitted" line (kubernetes_launcher.h).
            self.out.say(f"queued: JobSet {self.namespace}/{self.name} waits for Kueue to admit "
                         f"it from LocalQueue '{self.queue_name}'")
            threading.Thread(target=self._poll_jobset, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()
        ended: tuple[int, str] | None = None
        while ended is None and self.stop_requested is None:
            try:
                event = self.events.get(timeout=1.0)
            except queue.Empty:
                ended = self._pending_too_long()
                continue
            if event["type"] in ("JOBSET", "QUEUED"):
                self._on_jobset(event)
            elif event["type"] == "TAINT":
                self.tainted.setdefault(event["node"], (time.monotonic(), event["spot"]))
                self._leave_tainted_node(event["node"])
            elif event["type"] != "STOP":
                ended = self._handle(event)
        self.delete(grace=self.stop_requested != "now")
        for state in self.pods.values():
            if state.logs is not None:
                state.logs.join(timeout=5.0)
        if self.stop_requested is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM if self.stop_requested == "grace"
                    else signal.SIGKILL)
        return ended[0] if ended else 0


def supervise(request_path: str) -> int:
    _die_with_parent()
    with open(request_path) as f:
        request = json.load(f)
    os.unlink(request_path)  # it holds the run's key
    out = _Output(labelled=int(request["ranks"]) > 1)
    try:
        api = Api()
    except Exception as e:
        out.say(f"error: {e}")
        return 3
    return Supervisor(api, request, out).run()


# ---- a driver pod: jaxtrain submit / status / logs ------------------------------------------


def submit(script: str, script_args: list[str], run_args: list[str], image: str,
           namespace: str | None, service_account: str | None, name: str | None,
           pod_template: str | None, env: dict[str, str], follow: bool,
           say: Callable[[str], None]) -> int:
    """Runs ``jaxtrain run RUN_ARGS script SCRIPT_ARGS`` in a driver pod; streams its output."""
    api = Api()
    api.check_reachable()
    namespace = namespace or api.namespace()
    client = api.client
    pod_name = object_name(name or os.path.splitext(os.path.basename(script))[0], 40)
    for key in env:
        if not _SECRET_KEY.fullmatch(key):
            raise ValueError(f"--env '{key}=...' is not allowed: its value travels in a Secret, "
                             "whose keys are letters, digits, '-', '_' and '.'")
    with open(script, "rb") as f:
        source = f.read()
    if len(source) > 900_000:
        raise ValueError(f"the script '{script}' is {len(source)} bytes; jaxtrain submit ships "
                         "scripts up to 900 kB in a ConfigMap (put larger code in the image)")
    script_dir = "/var/run/jaxtrain/job"
    labels = {**MANAGED_BY, SUBMIT_LABEL: pod_name}
    template = load_pod_template(pod_template) or {}
    driver_template = json.loads(json.dumps(template))
    # The workers mount the script too: `jaxtrain run` starts it in every worker.
    worker_template = json.loads(json.dumps(template)) if template else {"spec": {}}
    volume = {"name": "jaxtrain-job", "configMap": {"name": pod_name}}
    mount = {"name": "jaxtrain-job", "mountPath": script_dir, "readOnly": True}
    for t in (driver_template, worker_template):
        spec = t.setdefault("spec", {})
        spec.setdefault("volumes", []).append(volume)
        spec.setdefault("containers", [{}])
        spec["containers"][0].setdefault("volumeMounts", []).append(mount)
    config_map = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=pod_name, namespace=namespace, labels=labels),
        data={"script.py": source.decode("utf-8", "replace"),
              "worker-pod.json": json.dumps(worker_template)})
    # The --env values (API keys, often) are in a Secret that the pod spec only names.
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(name=pod_name, namespace=namespace, labels=labels),
        string_data=env, type="Opaque") if env else None
    container_env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": pod_name, "key": k}}}
                     for k in env] + [
        {"name": "JAXTRAIN_LAUNCHER", "value": "kubernetes"},
        {"name": "JAXTRAIN_K8S_POD_TEMPLATE", "value": f"{script_dir}/worker-pod.json"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    spec = driver_template.setdefault("spec", {})
    container = spec["containers"][0]
    container.setdefault("name", "driver")
    container["image"] = image
    container["command"] = ["jaxtrain", "run", "--no-status-line", *run_args,
                            f"{script_dir}/script.py", *script_args]
    container["env"] = (container.get("env") or []) + container_env
    spec["restartPolicy"] = "Never"
    if service_account:
        spec["serviceAccountName"] = service_account
    meta = driver_template.setdefault("metadata", {})
    meta["name"] = pod_name
    meta["namespace"] = namespace
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["annotations"] = {**(meta.get("annotations") or {}),
                           "jaxtrain.dev/script": os.path.basename(script)}
    driver_template["apiVersion"] = "v1"
    driver_template["kind"] = "Pod"
    api.core.create_namespaced_config_map(namespace, config_map)
    if secret is not None:
        api.core.create_namespaced_secret(namespace, secret)
    created = api.core.create_namespaced_pod(namespace, driver_template)
    # The ConfigMap and the Secret go with the driver pod.
    owned = {"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": created.metadata.uid}]}}
    api.core.patch_namespaced_config_map(pod_name, namespace, owned)
    if secret is not None:
        api.core.patch_namespaced_secret(pod_name, namespace, owned)
    say(f"submitted {namespace}/{pod_name}; 'jaxtrain status --kubernetes {pod_name}' and "
        f"'jaxtrain logs --kubernetes {pod_name} -f' find it again")
    if not follow:
        return 0
    return follow_driver(api, namespace, pod_name, say)


def _driver_phase(api: Api, namespace: str, name: str) -> tuple[str, int | None, str]:
    pod = api.core.read_namespaced_pod(name, namespace)
    code = None
    detail = ""
    statuses = pod.status.container_statuses or []
    for s in statuses:
        if s.state.terminated is not None:
            code = s.state.terminated.exit_code
        elif s.state.waiting is not None:
            detail = f"{s.state.waiting.reason}: {s.state.waiting.message or ''}".strip(": ")
    phase = pod.status.phase or "Unknown"
    if phase == "Running" and statuses and all(s.state.terminated for s in statuses):
        # The driver pod never restarts its container: the phase the kubelet is about to set.
        failed = any(s.state.terminated.exit_code for s in statuses)
        phase = "Failed" if failed else "Succeeded"
    return phase, code, detail


def follow_driver(api: Api, namespace: str, name: str, say: Callable[[str], None]) -> int:
    """Streams a driver pod's output until it ends; its exit status."""
    while True:
        phase, code, detail = _driver_phase(api, namespace, name)
        if phase != "Pending":
            break
        if any(r in detail for r in _IMAGE_ERRORS):
            say(f"the driver pod {namespace}/{name} cannot start: {detail}")
            return 1
        time.sleep(0.5)
    stream = api.core.read_namespaced_pod_log(name, namespace, follow=True,
                                              _preload_content=False)
    for chunk in stream.stream(65536):
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
    for _ in range(100):
        phase, code, _ = _driver_phase(api, namespace, name)
        if code is not None:
            return code
        time.sleep(0.2)
    return 1


def status(namespace: str | None, name: str | None) -> list[dict]:
    """The submitted driver pods (all, or one), newest last."""
    api = Api()
    namespace = namespace or api.namespace()
    selector = f"{SUBMIT_LABEL}={name}" if name else SUBMIT_LABEL
    pods = api.core.list_namespaced_pod(namespace, label_selector=selector).items
    rows = []
    for pod in sorted(pods, key=lambda p: p.metadata.creation_timestamp):
        phase, code, detail = _driver_phase(api, namespace, pod.metadata.name)
        rows.append({"name": pod.metadata.name, "namespace": namespace, "phase": phase,
                     "exit_code": code, "detail": detail,
                     "script": (pod.metadata.annotations or {}).get("jaxtrain.dev/script", ""),
                     "created": pod.metadata.creation_timestamp.isoformat()})
    if name and not rows:
        raise LookupError(f"no submitted run '{name}' in namespace '{namespace}'")
    return rows


def logs(namespace: str | None, name: str, follow: bool, say: Callable[[str], None]) -> int:
    api = Api()
    namespace = namespace or api.namespace()
    status(namespace, name)
    if follow:
        return follow_driver(api, namespace, name, say)
    sys.stdout.write(api.core.read_namespaced_pod_log(name, namespace))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "supervise":
        return supervise(argv[1])
    sys.stderr.write("python -m jaxtrain.kubernetes is started by jaxtrain's Kubernetes "
                     "launcher; it is not run by hand\n")
    return 2

