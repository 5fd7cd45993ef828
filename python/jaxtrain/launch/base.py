"""What every launcher answers for the driver (jaxtrain.driver.trainer)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Launcher:
    """One launcher's answers; the defaults are those of a launcher that starts its workers on
    this host."""

    #: The engine's name for it (jaxtrain._core.Controller(launcher=...)).
    name = ""
    #: Standby workers take the pickled task ahead of a restart (docs/warm-workers.md).
    preloads_task = True
    #: Resizes an elastic run (docs/elastic.md); others train on ``max`` workers.
    resizes = False
    #: Its workers on other hosts need the run directory shared with them, unless they upload
    #: their checkpoints to object storage themselves.
    needs_shared_run_dir = True
    #: Restarts may restore from this host's memory (docs/checkpoint-memory.md).
    restores_from_this_host = False

    def plan(self, scaling_config: Any) -> Any:
        """The placement of every rank (jaxtrain._core.Plan); errors name the field."""
        raise NotImplementedError

    def spans_hosts(self, plan: Any) -> bool:
        """Whether some worker of `plan` runs on another host than the driver."""
        return False

    @contextlib.contextmanager
    def select_nodes(self, scaling_config: Any) -> Iterator[dict[str, str]]:
        """Yields the environment, for the length of a fit(), that makes this launcher start
        the workers only where `scaling_config.label_selector` (not empty) allows."""
        raise ValueError(
            f"{label_field(scaling_config)}: this run starts its workers on this machine "
            f"({self.name} launcher), which has no node labels to select by; labels select "
            "Kubernetes nodes, Slurm node features (--constraint) and hosts of a hostfile "
            "(docs/hosts.md), so run there, or leave label_selector out")
        yield {}  # not reached; a generator, as select_nodes() is everywhere

    def options_json(self, run_name: str, run_dir: str, scaling_config: Any,
                     failure_config: Any, store: dict | None) -> str:
        """The engine's options of this launcher, as JSON ("" for none)."""
        return ""

    def adjust_worker_env(self, env: dict[str, str]) -> None:
        """Edits the workers' environment for where they run."""


def label_field(scaling_config: Any) -> str:
    """ScalingConfig.label_selector as errors name it."""
    return f"ScalingConfig.label_selector={scaling_config.label_selector!r}"
