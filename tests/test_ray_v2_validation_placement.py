"""Where a Ray Train V2 validation runs: ValidationConfig(ray_remote_kwargs={...}) as jaxtrain
maps it (num_cpus, num_gpus and memory the host must have; label_selector over a hostfile's
labels) and ValidationConfig(host=...) (jaxtrain's). A real run on the ssh test hosts validates on
a named host that runs no worker, on one that cannot be reached and on one with too few CPUs
(recorded, not fatal); refusals (an unknown host, more CPUs or GPUs than the host has, a Ray
option that cannot apply) before anything starts."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import run_command, run_driver
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig
from jaxtrain.driver import validator
from jaxtrain.driver.validator import Placement, place
from jaxtrain.hosts import join as hosts
from jaxtrain.validation import ValidationConfig

# ssh_hosts and ssh_shared_dir (the real run only; under flock /tmp/jaxtrain-clusters.lock)
pytest_plugins = ["ssh_fixtures"]

_HOST_ENV = ("JAXTRAIN_LAUNCHER", "JAXTRAIN_HOSTFILE", "JAXTRAIN_SSH_HOSTS", "JAXTRAIN_HOSTS",
             "SLURM_JOB_ID")


def _validate(checkpoint):
    return {"accuracy": 1.0}


@pytest.fixture
def no_hosts(monkeypatch):
    for name in _HOST_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- refused at construction: Ray's options that cannot apply --------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"max_retries": 3}, r"ray_remote_kwargs\['max_retries'\]=3 is not allowed: a validation "
                         r"runs once"),
    ({"resources": {"TPU": 4}}, r"ray_remote_kwargs\['resources'\]=\{'TPU': 4\} is not allowed: "
                                r"jaxtrain's hosts have no custom resources"),
    ({"runtime_env": {"pip": ["x"]}}, r"ray_remote_kwargs\['runtime_env'\]=.* is not allowed"),
    ({"placement_group": "pg"}, r"ray_remote_kwargs\['placement_group'\]='pg' is not allowed: it "
                                r"is an option of a Ray task.* jaxtrain takes num_cpus, num_gpus, "
                                r"memory, label_selector"),
    ({"num_gpus": 0.5}, r"ray_remote_kwargs\['num_gpus'\]=0.5 is not allowed; use a whole "
                        r"number of GPUs"),
    ({"num_cpus": -1}, r"ray_remote_kwargs\['num_cpus'\]=-1 is not allowed; use a number >= 0"),
    ({"label_selector": {"role": 3}}, r"ray_remote_kwargs\['label_selector'\]\['role'\]=3 is "
                                      r"not allowed"),
    ("num_cpus=2", r"ray_remote_kwargs='num_cpus=2' is not allowed; pass a dict"),
])
def test_a_ray_option_that_cannot_apply_is_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ValidationConfig(_validate, ray_remote_kwargs=kwargs)


def test_the_options_jaxtrain_maps_are_taken():
    config = ValidationConfig(_validate, ray_remote_kwargs={
        "num_cpus": 2, "num_gpus": 0, "memory": 2**20, "label_selector": {"role": "eval"},
        "resources": {}})
    assert config.ray_remote_kwargs["num_cpus"] == 2
    assert ValidationConfig(_validate, ray_remote_kwargs={}).ray_remote_kwargs == {}
    with pytest.raises(ValueError, match=r"ValidationConfig.host='' is not allowed"):
        ValidationConfig(_validate, host="")
    with pytest.raises(ValueError, match=r"names the host twice"):
        ValidationConfig(_validate, host="host2",
                         ray_remote_kwargs={"label_selector": {"role": "eval"}})


# --- refused at fit(): the host and what it has -----------------------------------------------


def _refused_at_fit(config: ValidationConfig, storage: str, message: str) -> None:
    """fit() with `config` raises ValueError matching `message` before the run directory is
    made."""
    trainer = JaxTrainer(_validate, validation_config=config,
                         scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="refused", storage_path=storage))
    with pytest.raises(ValueError, match=message):
        trainer.fit()
    assert not Path(storage, "refused").exists()


def test_more_cpus_or_gpus_than_the_drivers_host_has_are_refused_before_anything_starts(
        no_hosts, storage):
    has = validator.this_host()
    for key, value, what in (("num_cpus", has["cpus"] + 1, "CPUs"),
                             ("num_gpus", has["gpus"] + 1, "GPUs")):
        _refused_at_fit(ValidationConfig(_validate, ray_remote_kwargs={key: value}), storage,
                        rf"ray_remote_kwargs\['{key}'\]={value} is more than the driver's host "
                        rf"has \({has[key[4:]]} {what}\)")
    fits = place(ValidationConfig(_validate, ray_remote_kwargs={"num_cpus": has["cpus"]}),
                 "local")
    assert fits == Placement(None, {"num_cpus": has["cpus"]})


def test_a_named_host_needs_a_run_on_ssh_hosts(no_hosts, storage):
    _refused_at_fit(ValidationConfig(_validate, host="host2"), storage,
                    r"ValidationConfig.host='host2': this run starts its workers with the local "
                    r"launcher, which has no hosts to name")


def test_a_host_that_is_not_the_runs_is_refused_naming_the_hosts(no_hosts):
    no_hosts.setenv("JAXTRAIN_SSH_HOSTS", "host1,root@host2:4")
    with pytest.raises(ValueError, match=r"ValidationConfig.host='node-9' is not one of the run's "
                                         r"hosts \(JAXTRAIN_SSH_HOSTS=host1,root@host2:4: host1, "
                                         r"root@host2\)"):
        place(ValidationConfig(_validate, host="node-9"), "ssh")
    # A host is named by its ssh target, or by the target's host part.
    assert place(ValidationConfig(_validate, host="host2"), "ssh").target == "root@host2"


def test_a_host_that_cannot_see_the_run_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"the validation on host2 reads the checkpoints in the "
                                         r"run directory, which that host cannot see: .*"
                                         r"JAXTRAIN_SHARED_STORAGE"):
        validator.Validator(ValidationConfig(_validate), str(tmp_path), Placement("host2"))


def test_a_label_selector_picks_the_first_matching_host_of_the_whole_hostfile(no_hosts,
                                                                              tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("host1 slots=2 labels=role=train\nhost2 labels=role=eval,zone=b\n"
                        "host3 labels=role=eval\n")
    no_hosts.setenv("JAXTRAIN_HOSTFILE", str(hostfile))
    chosen = place(ValidationConfig(_validate, ray_remote_kwargs={
        "label_selector": {"role": "eval"}, "num_gpus": 1}), "ssh")
    assert chosen == Placement("host2", {"num_gpus": 1})
    assert place(ValidationConfig(_validate, ray_remote_kwargs={
        "label_selector": {"role": "eval", "zone": "!b"}}), "ssh").target == "host3"
    with pytest.raises(ValueError, match=r"\['label_selector'\]=\{'role': 'test'\} matches no "
                                         r"host of JAXTRAIN_HOSTFILE=.*hosts.txt \(host1: "
                                         r"\{'role': 'train'\}; host2: "):
        place(ValidationConfig(_validate, ray_remote_kwargs={"label_selector": {"role": "test"}}),
              "ssh")


def test_a_described_host_with_too_few_gpus_is_refused(no_hosts, tmp_path):
    described = tmp_path / "hosts.json"
    described.write_text(json.dumps({"hosts": [
        {"name": "gpu-0", "address": "10.0.2.1", "gpus": 8, "cpus": 64},
        {"name": "gpu-1", "address": "10.0.2.2", "gpus": 2}]}))
    no_hosts.setenv("JAXTRAIN_HOSTS", str(described))
    assert place(ValidationConfig(_validate, host="gpu-0", ray_remote_kwargs={"num_gpus": 8}),
                 "ssh").target == "gpu-0"
    with pytest.raises(ValueError, match=r"ray_remote_kwargs\['num_gpus'\]=4 is more than gpu-1 "
                                         r"has \(2 GPUs\)"):
        place(ValidationConfig(_validate, host="gpu-1", ray_remote_kwargs={"num_gpus": 4}),
              "ssh")
    with pytest.raises(ValueError, match=r"\['num_cpus'\]=65 is more than gpu-0 has \(64 CPUs\)"):
        place(ValidationConfig(_validate, host="gpu-0", ray_remote_kwargs={"num_cpus": 65}),
              "ssh")


def test_the_validation_reaches_a_host_as_the_ssh_launcher_does(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_SSH_COMMAND", "ssh -F /etc/conf")
    monkeypatch.delenv(hosts.AGENT_KEY_FD_ENV, raising=False)
    argv, fds = hosts.ssh_argv("host2", "exec python -m jaxtrain.validation")
    assert argv[:3] == ["ssh", "-F", "/etc/conf"]
    assert "BatchMode=yes" in argv and argv[-3:] == ["--", "host2",
                                                     "exec python -m jaxtrain.validation"]
    assert fds == ()


# --- a real validation with a placement, on the driver's host ---------------------------------

LOCAL_SCRIPT = """
import json
import os
import tempfile

import jaxtrain.train as train                       # was: import ray.train
from jaxtrain import JaxTrainer                      # was: from ray.train.jax import JaxTrainer
from jaxtrain.train import RunConfig, ScalingConfig, ValidationConfig


def validate(checkpoint):
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def train_func():
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "w"), "w").write("1")
        train.report({"loss": 1.0}, checkpoint=train.Checkpoint.from_directory(d),
                     validation=True)


result = JaxTrainer(
    train_func,
    validation_config=ValidationConfig(validate, ray_remote_kwargs={"num_cpus": 1,
                                                                    "num_gpus": 0}),
    scaling_config=ScalingConfig(num_workers=1),
    run_config=RunConfig(name="local", storage_path=STORAGE),
).fit()
print("METRICS", json.dumps(result.best_checkpoints[0][1]))
"""


def test_num_gpus_zero_hides_the_gpus_from_a_validation_on_the_drivers_host(no_hosts, tmp_path,
                                                                           storage):
    proc = run_driver(LOCAL_SCRIPT.replace("STORAGE", repr(storage)), tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.split("METRICS ", 1)[1])
    assert metrics["visible"] == "" and metrics["loss"] == 1.0


# --- a real run on the ssh test hosts ----------------------------------------------------------

RAY_SCRIPT = textwrap.dedent("""\
    import json
    import os
    import socket
    import sys
    import tempfile

    import jaxtrain.train as train                       # was: import ray.train
    from jaxtrain import JaxTrainer                      # was: from ray.train.jax import ...
    from jaxtrain.train import RunConfig, ScalingConfig, ValidationConfig

    def validate(checkpoint, split="val"):
        with checkpoint.as_directory() as d:
            step = json.load(open(os.path.join(d, "state.json")))["step"]
        print(f"validating step {step} on {socket.gethostname()}", flush=True)
        return {"nodename": os.uname().nodename, "hostname": socket.gethostname(),
                "split": split, "score": step * 10,
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def train_func():
        ctx = train.get_context()
        for step in range(2):
            with tempfile.TemporaryDirectory() as d:
                if ctx.get_world_rank() == 0:
                    json.dump({"step": step}, open(os.path.join(d, "state.json"), "w"))
                train.report({"step": step, "worker": socket.gethostname()},
                             checkpoint=train.Checkpoint.from_directory(d), validation=True)

    def fit(name, config):
        result = JaxTrainer(
            train_func,
            validation_config=config,
            scaling_config=ScalingConfig(num_workers=2, label_selector={"role": "train"}),
            run_config=RunConfig(name=name, storage_path=os.path.abspath("runs")),
        ).fit()
        return [m for _, m in sorted(result.best_checkpoints, key=lambda c: c[1]["step"])]

    out = {
        "named": fit("named", ValidationConfig(validate, ray_remote_kwargs={
            "num_cpus": 1, "num_gpus": 0}, host=sys.argv[1])),
        "down": fit("down", ValidationConfig(validate, ray_remote_kwargs={
            "label_selector": {"role": "down"}})),
        "small": fit("small", ValidationConfig(validate, ray_remote_kwargs={
            "num_cpus": 100000}, host=sys.argv[1])),
    }
    json.dump(out, open("out.json", "w"))
""")


def test_a_validation_runs_on_the_named_host_and_an_unreachable_one_is_recorded(ssh_hosts,
                                                                                ssh_shared_dir):
    cwd = ssh_shared_dir
    # host1 trains; host2 (named) validates and runs no worker; host3 runs no sshd.
    (cwd / "hosts.txt").write_text("host1 labels=role=train\nhost2 labels=role=eval\n"
                                   "host3 labels=role=down\n")
    (cwd / "train.py").write_text(RAY_SCRIPT)
    proc = run_command([sys.executable, str(cwd / "train.py"), "host2"], cwd=cwd,
                      env=ssh_hosts.env(HOME=str(cwd),
                                        JAXTRAIN_HOSTFILE=str(cwd / "hosts.txt")),
                      capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads((cwd / "out.json").read_text())
    host1 = ssh_hosts.run_on("host1", "hostname").stdout.strip()
    host2 = ssh_hosts.run_on("host2", "hostname").stdout.strip()
    assert host1 and host2 and host1 != host2
    named = out["named"]
    assert [m["step"] for m in named] == [0, 1]
    for m in named:
        assert m["worker"] == host1
        assert m["nodename"] == m["hostname"] == host2  # it ran there, not on a worker's host
        assert m["visible"] == ""  # num_gpus=0
        assert m["score"] == m["step"] * 10 and m["split"] == "val"
    # Its output came back to the driver's log.
    assert f"validating step 1 on {host2}" in proc.stderr
    # host3 cannot be reached: each validation failed, named, and the run went on.
    down = out["down"]
    assert [m["step"] for m in down] == [0, 1] and all("score" not in m for m in down)
    record = json.loads((cwd / "runs" / "down" / "validation.json").read_text())["checkpoints"]
    assert len(record) == 2
    for outcome in record.values():
        assert outcome["status"] == "failed"
        assert "the validation host host3 cannot be reached over ssh" in outcome["error"]
    assert "the validation of checkpoint_000001 failed (the run goes on" in proc.stderr
    # host2's CPUs are known only there: the process checks them, and the validation fails.
    record = json.loads((cwd / "runs" / "small" / "validation.json").read_text())["checkpoints"]
    assert [o["status"] for o in record.values()] == ["failed", "failed"]
    for outcome in record.values():
        assert "ray_remote_kwargs['num_cpus']=100000 is more than host2 has (" in outcome["error"]
