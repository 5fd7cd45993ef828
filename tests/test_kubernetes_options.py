"""The Kubernetes launcher's choices that need no cluster: names, pod templates, the JobSet that
`jaxtrain plan --kubernetes` prints, and the errors for what GKE cannot give."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxtrain import kubernetes


def test_run_names_become_dns_labels():
    assert kubernetes.dns_name("My_Run 2026.12", 30) == "my-run-2026-12"
    assert kubernetes.dns_name("42-answers", 30) == "r-42-answers"
    assert kubernetes.dns_name("x" * 80, 30) == "x" * 30
    assert kubernetes.dns_name("--", 30) == "r"


def test_a_pod_template_is_read_as_yaml_and_refused_when_not_a_pod(tmp_path):
    good = tmp_path / "pod.yaml"
    good.write_text("spec:\n  tolerations: [{key: tpu, operator: Exists}]\n")
    assert kubernetes.load_pod_template(str(good)) == {
        "spec": {"tolerations": [{"key": "tpu", "operator": "Exists"}]}}
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match=r"JAXTRAIN_K8S_POD_TEMPLATE='.*list.yaml' must hold a "
                                         r"Pod"):
        kubernetes.load_pod_template(str(bad))
    with pytest.raises(ValueError, match="cannot be read"):
        kubernetes.load_pod_template(str(tmp_path / "absent.yaml"))


def test_the_run_directory_must_be_on_a_volume_the_workers_mount():
    mount = {"name": "r", "mountPath": "/mnt/runs"}
    template = {"spec": {"containers": [{"volumeMounts": [mount]}]}}
    assert kubernetes._mounts_covering("/mnt/runs/my_run", template)
    assert kubernetes._mounts_covering("/mnt/runs", template)
    assert not kubernetes._mounts_covering("/mnt/runs2/x", template)
    assert not kubernetes._mounts_covering("/mnt/runs/x", None)


def _plan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", "plan", "--kubernetes", *args],
                          capture_output=True, text=True,
                          env={**os.environ, "JAXTRAIN_K8S_IMAGE": "example/train:1", **env})


def test_plan_prints_the_jobset_of_a_multislice_tpu_config():
    proc = _plan("-n", "4", "--use-tpu", "--topology", "2x2x2", "--accelerator-type", "TPU-V4")
    assert proc.returncode == 0, proc.stderr
    jobset = json.loads(proc.stdout)
    job = jobset["spec"]["replicatedJobs"][0]
    assert (job["name"], job["replicas"], job["template"]["spec"]["parallelism"]) == ("slice", 2, 2)
    container = job["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "example/train:1"
    assert {e["name"] for e in container["env"]} >= {"MEGASCALE_NUM_SLICES",
                                                     "MEGASCALE_SLICE_ID",
                                                     "MEGASCALE_COORDINATOR_ADDRESS"}


@pytest.mark.parametrize("args, message", [
    (["-n", "4", "--use-tpu", "--topology", "4x4", "--accelerator-type", "TPU-V3"],
     "TPU v3 is not offered on GKE"),
    (["-n", "8", "--use-tpu", "--topology", "2x2x2", "--accelerator-type", "TPU-V4",
      "--resources-per-worker", "TPU=2"], "one worker runs per TPU VM host"),
    (["-n", "2", "--use-gpu", "--resources-per-worker", "GPU=0.5"], "nvidia.com/gpu"),
    (["-n", "1", "--use-tpu"], "on Kubernetes a TPU ScalingConfig needs it"),
])
def test_plan_names_what_kubernetes_cannot_give(args, message):
    proc = _plan(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
