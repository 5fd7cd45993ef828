"""Test hosts reachable over real OpenSSH on this machine, for the ssh tests
(scripts/ssh_hosts.sh).

The session fixture ``ssh_hosts`` makes the hosts once (installing openssh-server with apt-get
when it is missing; keys made fresh for the session) and deletes them, keys included, when the
session ends. host1 and host2 run sshd; host3 runs none (it refuses ssh); "stranger" is host2
under a name whose host key is not known. Where the hosts cannot be made (not root, no network
namespaces) every test that uses them is skipped with the reason, unless
JAXTRAIN_REQUIRE_SSH=1 (CI sets it): then the tests fail instead.

What each host has of its own, as a real host: its address, hostname and /etc/hosts, and its
/dev/shm, /tmp, /var/tmp and ~/.cache (root's, the user ssh logs in as): tmpfs's that no other
host sees, nor the driver, and that live as long as the host (every ssh session of a host sees
the same ones). What every host shares, as a cluster shares an installation: the rest of this
machine's filesystems (the checkout, its virtual environment and the Python it runs on, at the
same paths), and the hosts' state directory (STATE, under /var/tmp but kept visible): its
`shared/` stands for an NFS mount, the one directory that the hosts and the driver share for
writing. A test's working directory and storage on the hosts belong there (``ssh_shared_dir``);
the driver's tmp_path is on no host.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_lock import ClusterLock
from netns_hosts import link_cut, link_slowed, namespace_frozen, namespace_hosts

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "ssh_hosts.sh"
STATE = Path(os.environ.get("JAXTRAIN_SSH_TEST_STATE", "/var/tmp/jaxtrain-ssh"))


@dataclass
class SshHosts:
    ssh_command: str  # JAXTRAIN_SSH_COMMAND: ssh with the hosts' config, key and known_hosts
    shared: Path  # stands for an NFS mount seen by every host
    state: Path
    lock: ClusterLock  # this session's hold on the hosts (cluster_lock.py)

    def namespace(self, host: str) -> str:
        """The network namespace of `host` (ip netns exec ...)."""
        return f"jtssh-{host}"

    def veth(self, host: str) -> str:
        """`host`'s link to the bridge, in the root namespace."""
        return f"jtssh-v{host.removeprefix('host')}"

    def cut(self, host: str) -> contextlib.AbstractContextManager[None]:
        """`host`'s network link down for the block (as a cable pulled), up again after it."""
        return link_cut(self.veth(host))

    def slow(self, host: str, delay_ms: float,
             loss: float) -> contextlib.AbstractContextManager[None]:
        """`host`'s link slow and lossy for the block (netns_hosts.link_slowed)."""
        return link_slowed(self.namespace(host), delay_ms, loss, "JAXTRAIN_REQUIRE_SSH")

    def freeze(self, host: str) -> contextlib.AbstractContextManager[list[int]]:
        """Every process of `host` stopped (SIGSTOP) for the block, as a host that hangs; they
        continue (SIGCONT) after it. Yields their pids."""
        return namespace_frozen(self.namespace(host))

    def run_on(self, host: str, command: str, *,
               timeout: float = 60) -> subprocess.CompletedProcess:
        """`command` run by a shell on `host`, over ssh: what a session there sees."""
        return subprocess.run([*self.ssh_command.split(), "-o", "BatchMode=yes", host, command],
                              capture_output=True, text=True, timeout=timeout)

    def env(self, **extra: str) -> dict[str, str]:
        """The driver's environment: the hosts' ssh command, the shared directory declared
        shared, and no jaxtrain or Slurm settings of the test process itself."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXTRAIN_"))}
        env.update(JAXTRAIN_SSH_COMMAND=self.ssh_command,
                   JAXTRAIN_SHARED_STORAGE=str(self.shared))
        env.update(extra)
        return env

    def processes(self, host: str) -> list[str]:
        """What runs on `host` besides its sshd listener: "pid command line" per process."""
        pids = subprocess.run(["ip", "netns", "pids", self.namespace(host)], capture_output=True,
                              text=True, check=True).stdout.split()
        listener = (self.state / "run" / f"sshd-{host.removeprefix('host')}.pid")
        keep = {listener.read_text().strip()} if listener.exists() else set()
        out = []
        for pid in pids:
            if pid in keep:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue  # ended meanwhile
            out.append(f"{pid} {cmdline.decode(errors='replace')[:200]}")
        return out


@pytest.fixture(scope="session")
def ssh_hosts():
    with namespace_hosts(SCRIPT, state=STATE, what="the ssh test hosts",
                         root_for="network namespaces, sshd",
                         installed=Path("/usr/sbin/sshd").exists(),
                         not_installed="sshd is not installed and there is no apt-get to install "
                         "openssh-server", require="JAXTRAIN_REQUIRE_SSH") as lock:
        yield SshHosts(ssh_command=f"ssh -F {STATE / 'ssh_config'}", shared=STATE / "shared",
                       state=STATE, lock=lock)


@pytest.fixture
def ssh_shared_dir(ssh_hosts: SshHosts) -> Path:
    """A fresh directory that every host sees: the working directory and storage of one test.
    Named apart from slurm_fixtures' (both plugins may be loaded in one session); test modules
    bind their own ``shared_dir`` to it."""
    return Path(tempfile.mkdtemp(prefix="test-", dir=ssh_hosts.shared))
