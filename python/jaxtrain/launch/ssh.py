"""The ssh launcher: workers on listed hosts over ssh, TPU VMs included (src/launch/ssh_launcher.*;
the hosts' agent is jaxtrain.hosts)."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

from jaxtrain import _core
from jaxtrain.launch.base import Launcher, label_field

HOSTFILE_ENV = "JAXTRAIN_HOSTFILE"


class Ssh(Launcher):
    name = "ssh"
    resizes = True

    def plan(self, scaling_config: Any) -> Any:
        return _core.plan_ssh(scaling_config._core)

    def spans_hosts(self, plan: Any) -> bool:
        """Unless every worker is on this host, by name or address."""
        here = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
        return any(w["address"] not in here and w["host"] not in here
                   for w in plan.to_dict()["workers"])

    @contextlib.contextmanager
    def select_nodes(self, scaling_config: Any) -> Iterator[dict[str, str]]:
        """Only the hosts of the hostfile whose labels match: JAXTRAIN_HOSTFILE names a copy
        holding those."""
        path = os.environ.get(HOSTFILE_ENV)
        if not path:
            raise ValueError(
                f"{label_field(scaling_config)}: the hosts of this run (JAXTRAIN_SSH_HOSTS or "
                "JAXTRAIN_HOSTS) have no labels to select by; list them in a hostfile "
                "(JAXTRAIN_HOSTFILE) with labels=key=value words (docs/hosts.md), or leave "
                "label_selector out")
        try:
            with open(os.path.expanduser(path)) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{HOSTFILE_ENV}='{path}' cannot be read: {e.strerror}") from None
        from jaxtrain.hosts import join as hosts

        selected = hosts.select_hosts(text, f"{HOSTFILE_ENV}={path}",
                                      scaling_config.node_labels(), scaling_config.max_workers)
        fd, chosen = tempfile.mkstemp(prefix="jaxtrain-hostfile-", suffix=".txt")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(selected)
            yield {HOSTFILE_ENV: chosen}
        finally:
            os.unlink(chosen)
