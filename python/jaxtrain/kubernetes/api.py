"""Kubernetes: the API server as jaxtrain uses it (the official ``kubernetes`` client, which brings
kubeconfig files, in-cluster service accounts and exec credential plugins such as GKE's), the
names of what a run creates, and the permissions it needs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import string
from typing import Any

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_PENDING_TIMEOUT_S = 300.0
# Kueue (sigs.k8s.io/kueue): a JobSet with the queue-name label is a workload that Kueue admits
# (unsuspends) when its ClusterQueue has quota, and evicts (suspends again) for a higher-priority
# one. Its labels, and the API of its LocalQueues and Workloads.
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# How JobSet and Indexed Jobs number a run's pods: the Job's index in its replicatedJob, and the
# pod's index in its Job (a rank is the first times the pods per Job plus the second).
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError")
# What a run's driver and supervisors do in its namespace, all of it (docs/kubernetes-rbac.yaml's
# Role "jaxtrain" grants exactly this): (verb, group, resource, subresource). No Secret is ever
# read back.
_NEEDED = [("create", JOBSET_GROUP, "jobsets", ""), ("delete", JOBSET_GROUP, "jobsets", ""),
           ("get", JOBSET_GROUP, "jobsets", ""), ("list", JOBSET_GROUP, "jobsets", ""),
           ("create", "", "secrets", ""), ("patch", "", "secrets", ""),
           ("delete", "", "secrets", ""), ("get", "", "pods", ""), ("list", "", "pods", ""),
           ("watch", "", "pods", ""), ("delete", "", "pods", ""), ("get", "", "pods", "log")]
# And to restart in place (JAXTRAIN_K8S_IN_PLACE): a new attempt's worker is started in a kept pod
# through exec, which the API server authorizes as `create` (as `get` too before websockets).
_NEEDED_IN_PLACE = [("create", "", "pods", "exec"), ("get", "", "pods", "exec")]
# What a run reads beyond its namespace's Role where it may, saying so where it may not (the
# ClusterRole "jaxtrain-cluster"): the nodes, watched for GKE's impending-termination taint; the
# nodes and every namespace's pods, listed for an elastic run's room
# (python/jaxtrain/kubernetes/capacity.py); Kueue's objects, for their reasons and checks.
_NEEDED_CLUSTER = [("list", "", "nodes", ""), ("watch", "", "nodes", ""), ("list", "", "pods", ""),
                   ("get", KUEUE_GROUP, "workloadpriorityclasses", ""),
                   ("get", KUEUE_GROUP, "localqueues", ""),
                   ("list", KUEUE_GROUP, "localqueues", ""),
                   ("list", KUEUE_GROUP, "workloads", "")]
# What `jaxtrain submit`, `status` and `logs` do (the Role "jaxtrain-submit").
_NEEDED_TO_SUBMIT = [("create", "", "configmaps", ""), ("patch", "", "configmaps", ""),
                     ("create", "", "secrets", ""), ("patch", "", "secrets", ""),
                     ("create", "", "pods", ""), ("get", "", "pods", ""),
                     ("list", "", "pods", ""), ("get", "", "pods", "log")]


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

    def exec(self, namespace: str, pod: str, container: str, command: list[str],
             timeout_s: float = 60.0) -> tuple[int | None, str, str]:
        """Runs `command` in `pod`'s `container` through the API server (``pods/exec``): its
        exit status (None when unknown), stdout and stderr. A client of its own: the stream
        replaces its client's request method while it runs, which other threads share."""
        import websocket
        from kubernetes.stream import stream

        websocket.setdefaulttimeout(timeout_s)  # the connection's own reads and writes
        core = self.client.CoreV1Api(api_client=self.client.ApiClient())
        resp = stream(core.connect_get_namespaced_pod_exec, pod, namespace, container=container,
                      command=command, stdin=False, stdout=True, stderr=True, tty=False,
                      _preload_content=False, _request_timeout=timeout_s)
        try:
            resp.run_forever(timeout=timeout_s)
            if resp.is_open():
                return None, "", f"no answer within {timeout_s:.0f} s"
            out, err = resp.read_stdout(timeout=0) or "", resp.read_stderr(timeout=0) or ""
            try:
                code = resp.returncode
            except Exception:
                code = None
            return code, out, err
        finally:
            resp.close()

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
                f"cannot reach the Kubernetes API server at {self.host}: {error_reason(e)}"
            ) from None

    def denied(self, namespace: str, needed: list[tuple[str, str, str, str]]) -> list[str]:
        """Which of `needed` this identity may not do in `namespace`, as "verb resource"."""
        denied = []
        for verb, group, resource, sub in needed:
            review = self.client.V1SelfSubjectAccessReview(
                spec=self.client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=self.client.V1ResourceAttributes(
                        namespace=namespace, verb=verb, group=group, resource=resource,
                        subresource=sub or None)))
            status = self.authz.create_self_subject_access_review(review).status
            if not status.allowed:
                what = f"{resource}/{sub}" if sub else resource
                denied.append(f"{verb} {what}{'.' + group if group else ''}")
        return denied

    def may_restart_in_place(self, namespace: str) -> list[str]:
        """What of restarting in place (exec into the pods) this identity may not do."""
        return self.denied(namespace, _NEEDED_IN_PLACE)

    def check_access(self, namespace: str, in_place: bool = False) -> None:
        denied = self.denied(namespace, _NEEDED + (_NEEDED_IN_PLACE if in_place else []))
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
            body = error_reason(e)
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


def error_reason(e: BaseException) -> str:
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
