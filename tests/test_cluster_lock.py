"""A test cluster belongs to the run that started it: a `start` or `stop` from elsewhere, while a
test session holds the cluster's lock, is refused before it touches anything
(scripts/lib/cluster_lock.sh, tests/cluster_lock.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cluster_lock
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("script,state_env,command", [
    ("ssh_hosts.sh", "JAXTRAIN_SSH_TEST_STATE", "stop"),
    ("slurm_cluster.sh", "JAXTRAIN_SLURM_TEST_STATE", "stop"),
    ("kubernetes/cluster.sh", "JAXTRAIN_K8S_STATE", "stop"),
    ("kubernetes/cluster.sh", "JAXTRAIN_K8S_STATE", "clean"),
])
def test_a_cluster_held_by_a_test_session_is_not_stopped_from_elsewhere(tmp_path, script,
                                                                        state_env, command):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != cluster_lock.FD_ENV}
    env[state_env] = str(state)
    with cluster_lock.held(str(state), "the test cluster"):
        other = subprocess.run([str(SCRIPTS / script), command], env=env, capture_output=True,
                               text=True, timeout=60)
    assert other.returncode == 1, other.stderr
    assert f"in use by the test run of pid {os.getpid()}" in other.stderr
    assert f"{state}.lock" in other.stderr


def test_a_second_session_is_told_who_holds_the_cluster(tmp_path):
    state = str(tmp_path / "state")
    with cluster_lock.held(state, "the test cluster"):
        second = subprocess.run(
            [sys.executable, "-c",
             f"import cluster_lock; cluster_lock.held({state!r}, 'the hosts').__enter__()"],
            cwd=Path(__file__).parent, capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    assert f"the hosts are in use by the test run of pid {os.getpid()}" in second.stderr
