"""``jaxtrain submit``, ``status`` and ``logs`` (the ``jaxtrain`` command): a driver pod in the
cluster. docs/kubernetes.md has the user's view."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable

from jaxtrain.kubernetes.api import IMAGE_ERRORS, Api, load_pod_template, object_name

MANAGED_BY = {"app.kubernetes.io/managed-by": "jaxtrain"}
SUBMIT_LABEL = "jaxtrain.dev/submitted"
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")


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
        if any(r in detail for r in IMAGE_ERRORS):
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
