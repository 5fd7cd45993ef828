"""Test hosts made as network namespaces on this machine, by a script of scripts/ with start and
stop commands (scripts/slurm_cluster.sh, scripts/ssh_hosts.sh; both use scripts/lib/netns.sh)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


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
def namespace_hosts(script: Path, *, what: str, root_for: str, installed: bool,
                    not_installed: str, require: str) -> Iterator[None]:
    """Runs `script start`, and `script stop` when the block ends. Where the hosts cannot be made
    (not root, no network namespaces, nothing to install the daemons with) the test is skipped
    with the reason, unless the environment variable `require` is 1: then it fails."""
    why = _why_not(what, root_for, installed, not_installed)
    if why:
        if os.environ.get(require) == "1":
            pytest.fail(f"{require}=1, but {why}")
        pytest.skip(why)
    started = subprocess.run([str(script), "start"], capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"{script.relative_to(script.parent.parent)} start failed:\n"
                    f"{started.stdout}{started.stderr}")
    try:
        yield
    finally:
        subprocess.run([str(script), "stop"], capture_output=True, text=True, check=False)
