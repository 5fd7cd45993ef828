"""Ray Train V2's ScalingConfig(label_selector=...) (a dict of label -> value for every worker, or
a list of such dicts, one per worker; values "v", "!v", "in(a,b)", "!in(a,b)") mapped onto
jaxtrain's launchers: node selectors and node affinity of the JobSet's pods on Kubernetes, the
--constraint of the allocation and steps on Slurm, and the labels of a hostfile's hosts on ssh
runs (a real run on the ssh test hosts); refused with the reason where nothing can select (a
local run) and at construction for bad input."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import run_command
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, _core, launch
from jaxtrain.driver import trainer
from jaxtrain.hosts import join as hosts
from jaxtrain.kubernetes import launch as kubernetes
from jaxtrain.launch import slurm

# ssh_hosts and ssh_shared_dir (the real run only; under flock /tmp/jaxtrain-clusters.lock)
pytest_plugins = ["ssh_fixtures"]


@pytest.mark.parametrize("selector, message", [
    ("gpu=h100", r"ScalingConfig.label_selector='gpu=h100' is not allowed; it must be a dict"),
    ({"gpu": 100}, r"ScalingConfig.label_selector\['gpu'\]=100 is not allowed; a value is"),
    ({"gpu": "in()"}, r"ScalingConfig.label_selector\['gpu'\]='in\(\)' is not allowed"),
    ({"-gpu": "h100"}, r"ScalingConfig.label_selector label '-gpu' is not allowed"),
    ([{"gpu": "h100"}], r"a list gives one selector per worker: 2 \(num_workers\), not 1"),
    ([{"gpu": "h100"}, {"gpu": "a100"}], r"gives the workers different selectors"),
])
def test_a_bad_label_selector_is_refused_at_construction_naming_the_field(selector, message):
    with pytest.raises(ValueError, match=message):
        ScalingConfig(num_workers=2, label_selector=selector)


def test_a_selector_is_one_requirement_per_label_for_every_worker():
    config = ScalingConfig(num_workers=2, label_selector=[{"zone": "a"}, {"zone": "a"}])
    assert config.label_selector == [{"zone": "a"}, {"zone": "a"}]
    assert config.node_labels() == {"zone": ("in", ("a",))}
    config = ScalingConfig(num_workers=2, label_selector={
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "net": "in(ib, roce)",
        "spot": "!true", "pool": "!in(old,older)"})
    assert config.node_labels() == {
        "cloud.google.com/gke-accelerator": ("in", ("nvidia-h100-80gb",)),
        "net": ("in", ("ib", "roce")), "spot": ("notin", ("true",)),
        "pool": ("notin", ("old", "older"))}
    assert ScalingConfig(num_workers=2, label_selector={}).node_labels() == {}


# --- Kubernetes: the JobSet's pods ----------------------------------------------------------


def _jobset(config: ScalingConfig, template: dict | None) -> dict:
    """The JobSet the Kubernetes launcher creates for `config` (as `jaxtrain plan --kubernetes`
    builds it), with the pod template that launch_options gives it."""
    options = {"namespace": "default", "name": "labels", "image": "example/train:1",
               "request_dir": "/unused", "worker_command": ["python", "-m", "jaxtrain.worker"],
               "supervisor_argv": ["unused"],
               "pod_template": kubernetes.with_node_labels(template, config.node_labels())}
    plan = _core.plan_kubernetes(config._core)
    env = dict(plan.to_dict()["workers"][0]["env"])
    jobset = json.loads(_core.kubernetes_jobset(config._core, json.dumps(options), "labels-1",
                                                env))
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_kubernetes_pods_get_node_selectors_and_node_affinity():
    config = ScalingConfig(num_workers=2, label_selector={
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "net": "in(ib,roce)",
        "spot": "!true"})
    template = {"spec": {"nodeSelector": {"team": "ml"}, "tolerations": [
        {"key": "gpu", "operator": "Exists"}]}}
    pod = _jobset(config, template)
    assert pod["nodeSelector"] == {"team": "ml",
                                   "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [
        {"key": "net", "operator": "In", "values": ["ib", "roce"]},
        {"key": "spot", "operator": "NotIn", "values": ["true"]}]}]
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    # Without a selector the pods are as before.
    assert "affinity" not in _jobset(ScalingConfig(num_workers=2), None)


def test_each_term_of_a_templates_own_node_affinity_gets_the_selector():
    term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    template = {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term, {}]}}}}}
    pod = kubernetes.with_node_labels(template, {"spot": ("notin", ("true",))})
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    spot = {"key": "spot", "operator": "NotIn", "values": ["true"]}
    assert terms == [{"matchExpressions": [term["matchExpressions"][0], spot]},
                     {"matchExpressions": [spot]}]
    assert template["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][1] == {}


def test_a_selector_that_contradicts_the_pod_templates_node_selector_is_refused():
    with pytest.raises(ValueError, match=r"ScalingConfig.label_selector\['team'\]='ml' "
                                         r"contradicts the worker pod template's nodeSelector "
                                         r"team: 'infra'"):
        kubernetes.with_node_labels({"spec": {"nodeSelector": {"team": "infra"}}},
                                    {"team": ("in", ("ml",))})


# --- Slurm: the allocation's and steps' --constraint ----------------------------------------


def test_slurm_gets_the_label_values_as_node_features():
    labels = ScalingConfig(num_workers=2, label_selector={
        "gpu": "h100", "net": "in(ib,roce)"}).node_labels()
    assert slurm.constraint(labels) == "h100&(ib|roce)"
    with pytest.raises(ValueError, match=r"ScalingConfig.label_selector\['spot'\] excludes true, "
                                         r"which a Slurm --constraint cannot say"):
        slurm.constraint({"spot": ("notin", ("true",))})


def test_a_slurm_run_passes_the_constraint_anded_with_the_users_for_the_fit_only(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_LAUNCHER", "slurm")
    monkeypatch.setenv(slurm.CONSTRAINT_ENV, "bigmem")
    config = ScalingConfig(num_workers=2, label_selector={"gpu": "h100"})
    with trainer._select_nodes_by_labels(config, launch.choose()):
        assert os.environ[slurm.CONSTRAINT_ENV] == "(bigmem)&h100"
        # What the Slurm launcher then asks for (src/launch/slurm_launcher.cc, its own tests).
    assert os.environ[slurm.CONSTRAINT_ENV] == "bigmem"
    monkeypatch.delenv(slurm.CONSTRAINT_ENV)
    with trainer._select_nodes_by_labels(config, launch.choose()):
        assert os.environ[slurm.CONSTRAINT_ENV] == "h100"
    assert slurm.CONSTRAINT_ENV not in os.environ


# --- hosts of a hostfile ----------------------------------------------------------------------

HOSTFILE = """\
# the test hosts
host1 slots=1 labels=zone=a,gpu=h100
host2 labels=zone=b   # no slots: takes the workers
"""


def test_a_hostfile_gives_hosts_labels_and_the_selector_picks_the_matching_ones():
    assert hosts.hostfile_labels(HOSTFILE, "hosts.txt") == [
        ("host1 slots=1", "host1", {"zone": "a", "gpu": "h100"}),
        ("host2", "host2", {"zone": "b"})]
    assert hosts.select_hosts(HOSTFILE, "hosts.txt", {"zone": ("in", ("b",))}, 2) == "host2\n"
    assert hosts.select_hosts(HOSTFILE, "hosts.txt", {"gpu": ("notin", ("h100",))}, 2) == \
        "host2\n"
    assert hosts.select_hosts(HOSTFILE, "hosts.txt", {"zone": ("in", ("a", "b"))}, 2) == \
        "host1 slots=1\nhost2\n"


def test_too_few_matching_hosts_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"ScalingConfig.label_selector=\{'zone': 'c'\} matches "
                                         r"no host of hosts.txt \(host1: \{'zone': 'a', 'gpu': "
                                         r"'h100'\}; host2: \{'zone': 'b'\}\)"):
        hosts.select_hosts(HOSTFILE, "hosts.txt", {"zone": ("in", ("c",))}, 2)
    with pytest.raises(ValueError, match=r"matches only host1 \(slots=1\) of hosts.txt: 1 slots "
                                         r"for 2 workers \(num_workers\)"):
        hosts.select_hosts(HOSTFILE, "hosts.txt", {"gpu": ("in", ("h100",))}, 2)
    with pytest.raises(ValueError, match=r"hosts.txt line 1: 'labels=zone' is not allowed"):
        hosts.hostfile_labels("host1 labels=zone\n", "hosts.txt")


def test_hosts_listed_without_labels_are_refused_naming_the_field(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_LAUNCHER", "ssh")
    monkeypatch.setenv("JAXTRAIN_SSH_HOSTS", "host1,host2")
    monkeypatch.delenv("JAXTRAIN_HOSTFILE", raising=False)
    config = ScalingConfig(num_workers=2, label_selector={"zone": "b"})
    with pytest.raises(ValueError, match=r"ScalingConfig.label_selector=\{'zone': 'b'\}: the "
                                         r"hosts of this run .* have no labels to select by"):
        with trainer._select_nodes_by_labels(config, launch.choose()):
            pass


# --- local runs: nothing selects -------------------------------------------------------------


def _unused(config):
    raise AssertionError("never runs")


def test_a_local_run_refuses_a_selector_before_anything_starts(storage, monkeypatch):
    for name in ("JAXTRAIN_LAUNCHER", "JAXTRAIN_HOSTFILE", "JAXTRAIN_SSH_HOSTS", "JAXTRAIN_HOSTS",
                 "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"ScalingConfig.label_selector=\{'zone': 'b'\}: this "
                                         r"run starts its workers on this machine \(local "
                                         r"launcher\), which has no node labels to select by"):
        JaxTrainer(_unused, scaling_config=ScalingConfig(num_workers=2,
                                                         label_selector={"zone": "b"}),
                   run_config=RunConfig(name="local", storage_path=storage)).fit()
    assert not Path(storage, "local").exists()


# --- a real run on the ssh test hosts ----------------------------------------------------------

RAY_SCRIPT = textwrap.dedent("""\
    import socket

    import jaxtrain as ray                                  # was: import ray
    from jaxtrain import JaxTrainer                         # was: from ray.train.jax import ...
    from jaxtrain.train import RunConfig, ScalingConfig

    def train_func():
        context = ray.train.get_context()
        print(f"rank {context.get_world_rank()} runs on {socket.gethostname()}", flush=True)
        ray.train.report({"rank": context.get_world_rank()})

    trainer = JaxTrainer(
        train_func,
        scaling_config=ScalingConfig(num_workers=2, label_selector={"zone": "b"}),
        run_config=RunConfig(name="labels"),
    )
    print("finished", trainer.fit().metrics)
""")


def test_a_hostfile_label_selects_one_of_two_ssh_hosts_for_every_worker(ssh_hosts,
                                                                        ssh_shared_dir):
    cwd = ssh_shared_dir
    (cwd / "hosts.txt").write_text("host1 labels=zone=a\nhost2 labels=zone=b\n")
    (cwd / "train.py").write_text(RAY_SCRIPT)
    proc = run_command([sys.executable, str(cwd / "train.py")], cwd=cwd,
                      env=ssh_hosts.env(HOME=str(cwd),
                                        JAXTRAIN_HOSTFILE=str(cwd / "hosts.txt")),
                      capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    host2 = ssh_hosts.run_on("host2", "hostname").stdout.strip()
    host1 = ssh_hosts.run_on("host1", "hostname").stdout.strip()
    assert host1 != host2
    for rank in (0, 1):
        assert f"rank {rank} runs on {host2}" in proc.stdout, proc.stdout
    assert "finished {'rank': 0}" in proc.stdout
