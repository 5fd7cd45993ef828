"""The local launcher: every worker a process of this host (src/launch/local_launcher.*)."""

from __future__ import annotations

from typing import Any

from jaxtrain import _core
from jaxtrain.launch.base import Launcher


class Local(Launcher):
    name = "local"
    restores_from_this_host = True

    def plan(self, scaling_config: Any) -> Any:
        _core.check_local_workers(scaling_config._core)  # before planning them all
        return _core.plan_local(scaling_config._core)
