"""The Slurm launcher: every rank a task of one srun step in an allocation, jaxtrain's own
(salloc) or the user's (src/launch/slurm_launcher.*)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

from jaxtrain import _core
from jaxtrain.launch.base import Launcher

CONSTRAINT_ENV = "JAXTRAIN_SLURM_CONSTRAINT"


class Slurm(Launcher):
    name = "slurm"
    resizes = True  # by whole nodes of the allocation (docs/elastic.md)

    def plan(self, scaling_config: Any) -> Any:
        return _core.plan_slurm(scaling_config._core)

    def spans_hosts(self, plan: Any) -> bool:
        """Unless the allocation is this one host."""
        return os.environ.get("SLURM_JOB_NODELIST", "") != socket.gethostname().split(".")[0]

    @contextlib.contextmanager
    def select_nodes(self, scaling_config: Any) -> Iterator[dict[str, str]]:
        """The allocation's and steps' --constraint (JAXTRAIN_SLURM_CONSTRAINT, ANDed with the
        user's own)."""
        constraint_ = constraint(scaling_config.node_labels())
        own = os.environ.get(CONSTRAINT_ENV)
        yield {CONSTRAINT_ENV: f"({own})&{constraint_}" if own else constraint_}


def constraint(node_labels: dict[str, tuple[str, tuple[str, ...]]]) -> str:
    """A label selector (ScalingConfig.node_labels()) as Slurm's --constraint: Slurm's node
    features are plain names, so a label's value is the feature its nodes must have (the key
    only says what it means): {"gpu": "h100", "net": "in(ib,roce)"} -> "h100&(ib|roce)". Slurm
    cannot exclude a feature, so '!v' and '!in(...)' are refused with a ValueError naming
    the label."""
    terms = []
    for key, (op, values) in node_labels.items():
        if op == "notin":
            raise ValueError(
                f"ScalingConfig.label_selector[{key!r}] excludes {'|'.join(values)}, which a "
                "Slurm --constraint cannot say (it asks for node features, it does not exclude "
                "them); select the nodes by the features they have")
        terms.append(values[0] if len(values) == 1 else f"({'|'.join(values)})")
    return "&".join(terms)


def place_worker(environ: dict[str, str] | Any = os.environ) -> None:
    """In a worker: one srun step runs every rank, so task r is rank r and its place comes from
    Slurm's task variables (SLURM_STEP_TASKS_PER_NODE reads like "2(x3),1")."""
    if "JAXTRAIN_RANK" in environ or "SLURM_PROCID" not in environ:
        return
    node = int(environ["SLURM_NODEID"])
    per_node: list[int] = []
    for part in environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split(","):
        count, _, repeat = part.partition("(x")
        per_node += [int(count)] * int(repeat.rstrip(")") or 1)
    environ["JAXTRAIN_RANK"] = environ["SLURM_PROCID"]
    environ["JAXTRAIN_LOCAL_RANK"] = environ["SLURM_LOCALID"]
    environ["JAXTRAIN_NODE_RANK"] = str(node)
    environ["JAXTRAIN_LOCAL_WORLD_SIZE"] = str(per_node[node])
