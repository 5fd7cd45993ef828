"""The run's lease (LEASE, src/storage/run_store.h): where file locks stay on each host (FUSE, NFS
`nolock`, Lustre `localflock`), a driver on another host is seen by the heartbeat it renews. The
leases here are written as if by a driver elsewhere; the lock itself is free throughout."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_checkpoint_memory import _hold

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, _core
from jaxtrain.driver import run_dir
from jaxtrain.driver.run_dir import LEASE_STALE_AFTER_S, lock_free_mount
from jaxtrain.worker import checkpoint_memory
from jaxtrain.worker.checkpoint_memory import HostMemory


def _lease(run_dir: Path, age_s: float, host: str = "other-host", pid: int = 4242) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    (run_dir / "LEASE").write_text(json.dumps(
        {"host": host, "pid": pid, "since": now - 3600, "heartbeat": now - age_s}))


def _report_one():
    from jaxtrain import report

    report({"done": 1})


def _fit(storage_path: Path, name: str = "leased"):
    return JaxTrainer(_report_one, scaling_config=ScalingConfig(num_workers=1),
                      run_config=RunConfig(name=name, storage_path=str(storage_path))).fit()


def test_a_fresh_lease_from_another_host_refuses_a_second_driver(tmp_path):
    _lease(tmp_path / "leased", age_s=1)
    assert "host other-host, pid 4242" in _core.run_lock_holder(str(tmp_path / "leased"))
    with pytest.raises(RuntimeError) as refused:
        _fit(tmp_path)
    message = str(refused.value)
    assert "in use by another driver (host other-host, pid 4242, since " in message, message
    assert "lease renewed" in message and "RunConfig.name" in message
    assert not (tmp_path / "leased" / "run.json").exists()  # nothing of the run was touched


def test_a_stale_lease_does_not_block_and_is_gone_when_the_run_ends(tmp_path):
    _lease(tmp_path / "leased", age_s=LEASE_STALE_AFTER_S + 5)
    assert _core.run_lock_holder(str(tmp_path / "leased")) is None
    assert _fit(tmp_path).metrics == {"done": 1}
    assert not (tmp_path / "leased" / "LEASE").exists()


def test_the_sweep_keeps_a_store_whose_run_has_a_fresh_lease(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    roots = {}
    for name, age in (("elsewhere", 1), ("stale", LEASE_STALE_AFTER_S + 5)):
        run_dir = tmp_path / name
        _lease(run_dir, age)
        (run_dir / "run.json").write_text(json.dumps({"status": "RUNNING"}))
        memory = HostMemory(str(run_dir), 0)
        _hold(memory, 0, 1, {"a": b"1"})
        roots[name] = Path(memory.root)
    checkpoint_memory.sweep(str(tmp_path / "own"))
    assert {name for name, root in roots.items() if root.exists()} == {"elsewhere"}


MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
gcs /mnt/gcs fuse.gcsfuse rw,nosuid,nodev,user_id=0,group_id=0 0 0
srv:/export /mnt/nfs nfs4 rw,vers=4.2,local_lock=none,addr=10.0.0.2 0 0
srv:/export /mnt/nfs-nolock nfs rw,vers=3,nolock,local_lock=all 0 0
lustre@tcp:/fs /lustre lustre rw,localflock 0 0
lustre@tcp:/fs /lustre-flock lustre rw,flock 0 0
/dev/sdb1 /mnt/with\\040space ext4 rw 0 0
"""


def test_mounts_whose_locks_stay_on_one_host_are_recognised(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)

    def kind(path):
        return lock_free_mount(path, str(mounts))

    assert kind("/mnt/gcs/runs/exp") == "fuse.gcsfuse at /mnt/gcs"
    assert kind("/mnt/nfs-nolock/runs") == "nfs at /mnt/nfs-nolock"
    assert kind("/lustre/runs") == "lustre at /lustre"
    assert kind("/mnt/nfs/runs") is None  # NFS with the lock manager: locks reach the server
    assert kind("/lustre-flock/runs") is None
    assert kind("/mnt/gcsfoo/runs") is None  # a prefix of a name is not a mount point above it
    assert kind("/mnt/with space/x") is None
    assert kind("/home/u/runs") is None


def test_fit_warns_when_the_run_directory_is_on_such_a_mount(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(run_dir, "lock_free_mount",
                        lambda path, mounts="/proc/mounts": "fuse.gcsfuse at /mnt/gcs")
    _fit(tmp_path, "warned")
    err = capfd.readouterr().err
    assert (f"jaxtrain: warning: the run directory {tmp_path / 'warned'} is on fuse.gcsfuse at "
            "/mnt/gcs, where a file lock does not reach other hosts") in err
    assert "only by the run's lease (LEASE, renewed every 10 s" in err
    assert os.path.exists(tmp_path / "warned" / "run.json")
