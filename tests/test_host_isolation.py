"""The test hosts are as separate as real hosts where a run can tell (tests/netns_hosts.py,
scripts/lib/netns.sh): each ssh host and Slurm node has its own /dev/shm, /tmp, /var/tmp and
~/.cache, which no other host sees, nor the driver; every host sees the installation and the
shared directory; a host's network link can be cut; and stopping the hosts leaves none of their
filesystems behind.

What a host sees is asked of the host the way a run asks it: over ssh on the ssh hosts, as a job
step on the Slurm nodes, run by the checkout's Python (the installation every host shares).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from netns_hosts import PRIVATE, host_mounts, private_path

if TYPE_CHECKING:
    from slurm_fixtures import SlurmCluster
    from ssh_fixtures import SshHosts

pytest_plugins = ["ssh_fixtures", "slurm_fixtures"]  # the fixtures ssh_hosts and slurm_cluster

RunOn = Callable[..., subprocess.CompletedProcess]

WRITE = """
import socket, sys
import jaxtrain  # the installation is there
for path in sys.argv[1:]:
    with open(path, "w") as f:
        f.write(socket.gethostname())
"""

LOOK = """
import json, sys
seen = {}
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            seen[path] = f.read()
    except FileNotFoundError:
        seen[path] = None
print(json.dumps(seen))
"""


def python_on(run_on: RunOn, host: str, program: str, paths: list[str]) -> str:
    proc = run_on(host, shlex.join([sys.executable, "-c", program, *paths]))
    assert proc.returncode == 0, f"on {host}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def look(run_on: RunOn, host: str, paths: list[str]) -> dict[str, str | None]:
    """What `host` reads at each path: the file's text, or None where it has no such file."""
    return json.loads(python_on(run_on, host, LOOK, paths).splitlines()[-1])


def check_isolated(run_on: RunOn, first: str, second: str, shared: Path) -> None:
    """`first` writes a file to each of its own directories and to the shared one: only it sees
    the former (in a later session too: they are the host's), every host and the driver the
    latter."""
    name = f"isolation-{uuid.uuid4().hex}"
    own = [private_path(d, name) for d in PRIVATE]
    everyone = str(shared / name)
    python_on(run_on, first, WRITE, [*own, everyone])
    try:
        assert look(run_on, first, [*own, everyone]) == dict.fromkeys([*own, everyone], first)
        assert look(run_on, second, [*own, everyone]) == {**dict.fromkeys(own), everyone: first}
        assert {p: os.path.exists(p) for p in own} == dict.fromkeys(own, False)  # the driver's
        assert Path(everyone).read_text() == first
    finally:
        run_on(first, shlex.join(["rm", "-f", *own, everyone]))


def eventually(probe: Callable[[], str], want: str, *, within: float = 30) -> str:
    """What `probe` says, asked again until it says `want` or `within` seconds have passed: a link
    just set up again takes a moment to carry traffic (carrier, neighbour entries)."""
    deadline = time.monotonic() + within
    said = probe()
    while said != want and time.monotonic() < deadline:
        time.sleep(0.5)
        said = probe()
    return said


def hosts_left(prefix: str) -> list[str]:
    """The network namespaces of this machine named `prefix`..."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=True).stdout.split()
    return [n for n in names if n.startswith(prefix)]


# --- ssh hosts ----------------------------------------------------------------------------------


def test_an_ssh_hosts_own_directories_are_its_alone_and_the_shared_one_is_everyones(
        ssh_hosts: SshHosts):
    check_isolated(ssh_hosts.run_on, "host1", "host2", ssh_hosts.shared)
    check_isolated(ssh_hosts.run_on, "host2", "host1", ssh_hosts.shared)


def test_an_ssh_hosts_link_can_be_cut_and_restored(ssh_hosts: SshHosts):
    with ssh_hosts.cut("host2"):
        cut = ssh_hosts.run_on("host2", "hostname")
        other = ssh_hosts.run_on("host1", "hostname")
    again = eventually(lambda: ssh_hosts.run_on("host2", "hostname").stdout.strip(), "host2")

    assert cut.returncode == 255
    assert "ssh: connect to host 198.19.13.12 port 22: Connection timed out" in cut.stderr, \
        cut.stderr
    assert other.stdout.strip() == "host1"
    assert again == "host2"


def test_stopped_ssh_hosts_leave_nothing_and_start_again_empty(ssh_hosts: SshHosts):
    name = f"isolation-{uuid.uuid4().hex}"
    own = [private_path(d, name) for d in PRIVATE]
    python_on(ssh_hosts.run_on, "host1", WRITE, own)
    script = Path(__file__).resolve().parent.parent / "scripts" / "ssh_hosts.sh"

    ssh_hosts.lock.run([str(script), "stop"], check=True, capture_output=True)
    left = {"namespaces": hosts_left("jtssh-"),
            "mounts": host_mounts("jtssh-host1") + host_mounts("jtssh-host2"),
            "state": ssh_hosts.state.exists()}
    ssh_hosts.lock.run([str(script), "start"], check=True, capture_output=True)

    assert left == {"namespaces": [], "mounts": [], "state": False}
    assert look(ssh_hosts.run_on, "host1", own) == dict.fromkeys(own)


# --- Slurm nodes --------------------------------------------------------------------------------


def test_a_slurm_nodes_own_directories_are_its_alone_and_the_shared_one_is_everyones(
        slurm_cluster: SlurmCluster):
    check_isolated(slurm_cluster.run_on, "node1", "node2", slurm_cluster.shared)
    check_isolated(slurm_cluster.run_on, "node2", "node1", slurm_cluster.shared)


REACH = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("reached")
except OSError as e:
    print(f"unreachable: {e}")
"""


def test_a_slurm_nodes_link_can_be_cut_and_restored(slurm_cluster: SlurmCluster):
    def reach(node: str) -> str:
        # From the node's network namespace to slurmctld, on the bridge (scripts/slurm_cluster.sh).
        return subprocess.run(["ip", "netns", "exec", slurm_cluster.namespace(node),
                               sys.executable, "-c", REACH, "198.18.0.1", "6817"],
                              capture_output=True, text=True, timeout=30).stdout.strip()

    with slurm_cluster.cut("node2"):
        cut, other = reach("node2"), reach("node1")
    again = eventually(lambda: reach("node2"), "reached")

    assert cut.startswith("unreachable: "), cut
    assert (other, again) == ("reached", "reached")
    assert slurm_cluster.run_on("node2", "hostname").stdout.strip() == "node2"


def test_a_stopped_slurm_cluster_leaves_nothing_and_starts_again_empty(
        slurm_cluster: SlurmCluster):
    name = f"isolation-{uuid.uuid4().hex}"
    own = [private_path(d, name) for d in PRIVATE]
    python_on(slurm_cluster.run_on, "node1", WRITE, own)
    script = Path(__file__).resolve().parent.parent / "scripts" / "slurm_cluster.sh"
    state = Path(slurm_cluster.conf).parent.parent

    slurm_cluster.lock.run([str(script), "stop"], check=True, capture_output=True)
    left = {"namespaces": hosts_left("jtslurm-"),
            "mounts": [m for n in slurm_cluster.nodes
                       for m in host_mounts(slurm_cluster.namespace(n))],
            "state": state.exists()}
    slurm_cluster.restore()

    assert left == {"namespaces": [], "mounts": [], "state": False}
    assert look(slurm_cluster.run_on, "node1", own) == dict.fromkeys(own)
