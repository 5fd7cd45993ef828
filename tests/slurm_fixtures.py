"""A real multi-node Slurm cluster on this machine for the Slurm tests (scripts/slurm_cluster.sh).

The session fixture ``slurm_cluster`` starts the cluster once (installing slurm-wlm and munge with
apt-get when they are missing) and stops it when the session ends. Where it cannot run (not root,
no network namespaces) every test that uses it is skipped with the reason, unless
JAXTRAIN_REQUIRE_SLURM=1 (CI sets it): then the tests fail instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from netns_hosts import namespace_hosts

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
STATE = Path(os.environ.get("JAXTRAIN_SLURM_TEST_STATE", "/var/tmp/jaxtrain-slurm"))
NODES = int(os.environ.get("JAXTRAIN_SLURM_TEST_NODES", "2"))


@dataclass
class SlurmCluster:
    conf: str  # SLURM_CONF for the clients
    shared: Path  # stands for an NFS mount seen by every node
    nodes: list[str] = field(default_factory=list)

    def namespace(self, node: str) -> str:
        """The network namespace of `node` (ip netns exec ...)."""
        return f"jtslurm-{node}"

    def env(self, **extra: str) -> dict[str, str]:
        """The driver's environment: the cluster's config, its shared directory declared shared,
        and nothing of an allocation the test process itself may run in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXTRAIN_"))}
        env.update(SLURM_CONF=self.conf, JAXTRAIN_SHARED_STORAGE=str(self.shared))
        env.update(extra)
        return env

    def restore(self) -> None:
        """Brings back a cluster a test has damaged (a node killed): stopped and started anew."""
        subprocess.run([str(SCRIPT), "start"], check=True, capture_output=True)

    def run(self, *argv: str) -> str:
        """A Slurm client command (squeue, scontrol, ...); its stdout."""
        return subprocess.run(argv, env=self.env(), check=True, capture_output=True,
                              text=True).stdout


@pytest.fixture(scope="session")
def slurm_cluster():
    with namespace_hosts(SCRIPT, what="the Slurm test cluster",
                         root_for="network namespaces, slurmd",
                         installed=shutil.which("slurmctld") is not None,
                         not_installed="Slurm is not installed and there is no apt-get to install "
                         "slurm-wlm and munge", require="JAXTRAIN_REQUIRE_SLURM"):
        yield SlurmCluster(
            conf=str(STATE / "etc" / "slurm.conf"),
            shared=STATE / "shared",
            nodes=[f"node{i}" for i in range(1, NODES + 1)],
        )


@pytest.fixture
def shared_dir(slurm_cluster: SlurmCluster) -> Path:
    """A fresh directory that every node sees: the working directory and storage of one test."""
    return Path(tempfile.mkdtemp(prefix="test-", dir=slurm_cluster.shared))
