"""The Kubernetes launcher: every rank a pod of one JobSet (src/launch/kubernetes_launcher.*). What
it asks of the cluster and the pods' own processes are in jaxtrain.kubernetes."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from jaxtrain import _core
from jaxtrain.launch.base import Launcher


class Kubernetes(Launcher):
    name = "kubernetes"
    preloads_task = False  # a new attempt's pods start afresh
    needs_shared_run_dir = False  # the pods mount the run directory, checked by options_json
    resizes = True  # by pods, one rank each, and TPU slices whole (docs/elastic.md)

    def plan(self, scaling_config: Any) -> Any:
        return _core.plan_kubernetes(scaling_config._core)

    def spans_hosts(self, plan: Any) -> bool:
        return True  # pods never share the driver's directories

    @contextlib.contextmanager
    def select_nodes(self, scaling_config: Any) -> Iterator[dict[str, str]]:
        yield {}  # the pod template gets the selector (options_json)

    def options_json(self, run_name: str, run_dir: str, scaling_config: Any,
                     failure_config: Any, store: dict | None) -> str:
        """Refused before the cluster is asked for anything (docs/kubernetes.md)."""
        from jaxtrain.kubernetes import launch

        return json.dumps(launch.launch_options(
            run_name, run_dir, needs_run_dir=store is None,
            node_labels=scaling_config.node_labels(),
            preemption_grace_s=failure_config.preemption_grace_s))

    def adjust_worker_env(self, env: dict[str, str]) -> None:
        env.pop("PYTHONPATH")  # the driver's paths mean nothing in the image


def place_worker(environ: dict[str, str] | Any = os.environ) -> None:
    """In a worker: each pod is one rank of the JobSet, its Job's index (a TPU slice) times the
    pods per Job, plus its completion index; one rank per pod and host."""
    if "JAXTRAIN_RANK" in environ or "JAXTRAIN_K8S_PODS_PER_JOB" not in environ:
        return
    rank = (_int(environ, "JAXTRAIN_K8S_JOB_INDEX") * _int(environ, "JAXTRAIN_K8S_PODS_PER_JOB")
            + _int(environ, "JOB_COMPLETION_INDEX"))
    environ["JAXTRAIN_RANK"] = str(rank)
    environ["JAXTRAIN_LOCAL_RANK"] = "0"
    environ["JAXTRAIN_NODE_RANK"] = str(rank)
    environ["JAXTRAIN_LOCAL_WORLD_SIZE"] = "1"


def _int(environ: Any, name: str) -> int:
    return int(environ[name])
