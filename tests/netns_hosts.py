"""Test hosts made as network namespaces on this machine, by a script of scripts/ with start and
stop commands (scripts/slurm_cluster.sh, scripts/ssh_hosts.sh; both use scripts/lib/netns.sh).

Each host has its own address, hostname and /etc/hosts, and its own /dev/shm, /tmp, /var/tmp and
~/.cache (tmpfs's in its mount namespace, PRIVATE): what jaxtrain writes there on one host no
other host sees, nor the driver. The rest of the machine's filesystems is shared as a cluster
shares an installation (the checkout, its virtual environment, the Python it runs on), and so is
each cluster's state directory, whose shared/ stands for an NFS mount."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import cluster_lock
import link_impair
import pytest

# The directories each host has of its own (scripts/lib/netns.sh), "~" the home of the user that
# runs the tests (root), as on the hosts.
PRIVATE = ("/dev/shm", "/tmp", "/var/tmp", "~/.cache")


def private_path(directory: str, name: str) -> str:
    """`name` in one of the PRIVATE directories, "~" expanded as on the hosts."""
    home = pwd.getpwuid(os.getuid()).pw_dir
    return os.path.join(directory.replace("~", home, 1), name)


@contextlib.contextmanager
def link_cut(veth: str) -> Iterator[None]:
    """A host's link to the bridge down (its veth in the root namespace) for the block."""
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)


@contextlib.contextmanager
def link_slowed(namespace: str, delay_ms: float, loss: float, require: str) -> Iterator[None]:
    """The host's link slow and lossy for the block (tests/link_impair.py, on its "eth0"):
    `delay_ms` on every packet it sends, so on every round trip through it; `loss` on every
    packet each way. Where that cannot be done here the test is skipped with the reason, unless
    the environment variable `require` is 1: then it fails."""
    if why := link_impair.why_not():
        if os.environ.get(require) == "1":
            pytest.fail(f"{require}=1, but {why}")
        pytest.skip(why)
    with link_impair.impaired(namespace, "eth0", delay_ms, loss):
        yield


@contextlib.contextmanager
def namespace_frozen(namespace: str) -> Iterator[list[int]]:
    """Every process of the network namespace stopped (SIGSTOP) for the block, as a host that
    hangs: its sshd, its ssh sessions, its workers; its kernel still answers TCP. Stopped until no
    new process turns up (one may be forking); continued (SIGCONT) after the block. Yields the
    pids stopped."""
    stopped: list[int] = []
    try:
        while True:
            pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", namespace],
                                                   capture_output=True, text=True,
                                                   check=True).stdout.split()]
            new = [p for p in pids if p not in stopped]
            if not new:
                break
            for pid in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def host_mounts(namespace: str) -> list[str]:
    """The host's own filesystems still mounted anywhere on this machine, as "pid source
    target"; none once the host is deleted."""
    own = re.compile(rf"^{re.escape(namespace)}-(shm|tmp|vartmp|cache) (\S+) ")
    found: dict[str, str] = {}
    for mounts in Path("/proc").glob("[0-9]*/mounts"):
        try:
            text = mounts.read_text()
        except OSError:
            continue  # ended meanwhile
        for m in filter(None, map(own.match, text.splitlines())):
            found.setdefault(m.group(0).strip(), mounts.parent.name)
    return sorted(f"{pid} {mount}" for mount, pid in found.items())


def _why_not(what: str, root_for: str, installed: bool, not_installed: str) -> str | None:
    if os.geteuid() != 0:
        return f"{what} needs root ({root_for})"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{what} needs '{tool}' (iproute2, util-linux)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    if not installed and shutil.which("apt-get") is None:
        return not_installed
    return None


@contextlib.contextmanager
def namespace_hosts(script: Path, *, state: Path, what: str, root_for: str, installed: bool,
                    not_installed: str, require: str) -> Iterator[cluster_lock.ClusterLock]:
    """Runs `script start`, and `script stop` when the block ends, holding the hosts' lock
    (cluster_lock.py) all the while. Where the hosts cannot be made (not root, no network
    namespaces, nothing to install the daemons with) the test is skipped with the reason, unless
    the environment variable `require` is 1: then it fails."""
    why = _why_not(what, root_for, installed, not_installed)
    if why:
        if os.environ.get(require) == "1":
            pytest.fail(f"{require}=1, but {why}")
        pytest.skip(why)
    with cluster_lock.held(str(state), what) as lock:
        started = lock.run([str(script), "start"], capture_output=True, text=True)
        if started.returncode != 0:
            pytest.fail(f"{script.relative_to(script.parent.parent)} start failed:\n"
                        f"{started.stdout}{started.stderr}")
        try:
            yield lock
        finally:
            lock.run([str(script), "stop"], capture_output=True, text=True, check=False)
