"""A real multi-node Slurm cluster on this machine for the Slurm tests (scripts/slurm_cluster.sh).

The session fixture ``slurm_cluster`` starts the cluster once (installing slurm-wlm and munge with
apt-get when they are missing) and stops it when the session ends. Where it cannot run (not root,
no network namespaces) every test that uses it is skipped with the reason, unless
JAXTRAIN_REQUIRE_SLURM=1 (CI sets it): then the tests fail instead of skipping.

What each node has of its own, as a real host: its address, hostname and /etc/hosts, and its
/dev/shm, /tmp, /var/tmp and ~/.cache (root's: the user that runs the tests): tmpfs's that no
other node sees, nor the driver, and that live as long as the node (every task on a node sees
the same ones). A task's HOME is the driver's, which srun passes on: the tests' drivers run with
HOME in the shared directory, so that the default storage_path (~/jaxtrain_results) is shared,
as a home directory on NFS is. What every node shares, as a cluster shares an installation: the
rest of this machine's filesystems (the checkout, its virtual environment and the Python it runs
on, at the same paths; munged's socket), and the cluster's state directory (STATE, under
/var/tmp but kept visible: slurm.conf, slurmd's spool and logs): its `shared/` stands for an NFS
mount, the one directory that the nodes and the driver share for writing. A test's working
directory and storage on the nodes belong there (``slurm_shared_dir``); the driver's tmp_path is on
no node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cluster_lock import ClusterLock
from netns_hosts import link_cut, link_slowed, namespace_hosts

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
STATE = Path(os.environ.get("JAXTRAIN_SLURM_TEST_STATE", "/var/tmp/jaxtrain-slurm"))
NODES = int(os.environ.get("JAXTRAIN_SLURM_TEST_NODES", "2"))


@dataclass
class SlurmCluster:
    conf: str  # SLURM_CONF for the clients
    shared: Path  # stands for an NFS mount seen by every node
    lock: ClusterLock  # this session's hold on the cluster (cluster_lock.py)
    nodes: list[str] = field(default_factory=list)

    def namespace(self, node: str) -> str:
        """The network namespace of `node` (ip netns exec ...)."""
        return f"jtslurm-{node}"

    def veth(self, node: str) -> str:
        """`node`'s link to the bridge, in the root namespace."""
        return f"jtslurm-v{node.removeprefix('node')}"

    def cut(self, node: str) -> contextlib.AbstractContextManager[None]:
        """`node`'s network link down for the block (as a cable pulled), up again after it."""
        return link_cut(self.veth(node))

    def slow(self, node: str, delay_ms: float,
             loss: float) -> contextlib.AbstractContextManager[None]:
        """`node`'s link slow and lossy for the block (netns_hosts.link_slowed)."""
        return link_slowed(self.namespace(node), delay_ms, loss, "JAXTRAIN_REQUIRE_SLURM")

    def run_on(self, node: str, command: str, *,
               timeout: float = 60) -> subprocess.CompletedProcess:
        """`command` run by a shell on `node`, as a one-task job step there: what a task sees."""
        return subprocess.run(["srun", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
                               "sh", "-c", command], env=self.env(), capture_output=True,
                              text=True, timeout=timeout)

    def env(self, **extra: str) -> dict[str, str]:
        """The driver's environment: the cluster's config, its shared directory declared shared,
        and nothing of an allocation the test process itself may run in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXTRAIN_"))}
        env.update(SLURM_CONF=self.conf, JAXTRAIN_SHARED_STORAGE=str(self.shared))
        env.update(extra)
        return env

    def restore(self) -> None:
        """Brings back a cluster a test has damaged (a node killed): stopped and started anew."""
        self.lock.run([str(SCRIPT), "start"], check=True, capture_output=True)

    def run(self, *argv: str) -> str:
        """A Slurm client command (squeue, scontrol, ...); its stdout."""
        return subprocess.run(argv, env=self.env(), check=True, capture_output=True,
                              text=True).stdout


@pytest.fixture(scope="session")
def slurm_cluster():
    with namespace_hosts(SCRIPT, state=STATE, what="the Slurm test cluster",
                         root_for="network namespaces, slurmd",
                         installed=shutil.which("slurmctld") is not None,
                         not_installed="Slurm is not installed and there is no apt-get to install "
                         "slurm-wlm and munge", require="JAXTRAIN_REQUIRE_SLURM") as lock:
        yield SlurmCluster(
            lock=lock,
            conf=str(STATE / "etc" / "slurm.conf"),
            shared=STATE / "shared",
            nodes=[f"node{i}" for i in range(1, NODES + 1)],
        )


@pytest.fixture
def slurm_shared_dir(slurm_cluster: SlurmCluster) -> Path:
    """A fresh directory that every node sees: the working directory and storage of one test.
    Named apart from ssh_fixtures' (both plugins may be loaded in one session); test modules
    bind their own ``shared_dir`` to it."""
    return Path(tempfile.mkdtemp(prefix="test-", dir=slurm_cluster.shared))
