"""ScalingConfig and RunConfig. Every rule lives in the C++ core (``jaxtrain._core``); this layer
only checks Python types so that a wrong type gets the same kind of message as a wrong value."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxtrain import _core


def _expect(owner: str, field: str, value: Any, types: tuple, allowed: str) -> None:
    # bool is an int in Python; an int field given True is a mistake.
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        raise ValueError(f"{owner}.{field}={value!r} is not allowed; {allowed}")


class ScalingConfig:
    """How many workers, on which hardware (names and meanings as in Ray Train V2).

    Validated completely when constructed; an error names the field, the value and what is
    allowed. ``num_workers`` is the number of worker processes (for TPU: hosts of the slice, or
    more with ``resources_per_worker={"TPU": k}``).
    """

    def __init__(
        self,
        num_workers: int = 1,
        use_tpu: bool = False,
        use_gpu: bool = False,
        topology: str | None = None,
        accelerator_type: str | None = None,
        resources_per_worker: Mapping[str, float] | None = None,
        placement_strategy: str = "PACK",
    ) -> None:
        owner = "ScalingConfig"
        _expect(owner, "num_workers", num_workers, (int,), "it must be a whole number >= 1")
        _expect(owner, "use_tpu", use_tpu, (bool,), "it must be True or False")
        _expect(owner, "use_gpu", use_gpu, (bool,), "it must be True or False")
        if topology is not None:
            _expect(owner, "topology", topology, (str,), "it must be a string such as '4x4'")
        if accelerator_type is not None:
            _expect(owner, "accelerator_type", accelerator_type, (str,),
                    "it must be a string such as 'TPU-V6E'")
        _expect(owner, "placement_strategy", placement_strategy, (str,),
                "allowed: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD")
        resources = None
        if resources_per_worker is not None:
            _expect(owner, "resources_per_worker", resources_per_worker, (Mapping,),
                    "it must be a dict such as {'TPU': 4}")
            resources = {}
            for key, amount in resources_per_worker.items():
                _expect(owner, "resources_per_worker key", key, (str,), "names are strings")
                if isinstance(amount, bool) or not isinstance(amount, (int, float)):
                    raise ValueError(
                        f"{owner}.resources_per_worker[{key!r}]={amount!r} is not allowed; "
                        "amounts are numbers >= 0"
                    )
                resources[key] = float(amount)
        self._core = _core.ScalingConfig(
            num_workers=num_workers,
            use_tpu=use_tpu,
            use_gpu=use_gpu,
            topology=topology,
            accelerator_type=accelerator_type,
            resources_per_worker=resources,
            placement_strategy=placement_strategy,
        )
        self.num_workers = num_workers
        self.use_tpu = use_tpu
        self.use_gpu = use_gpu
        self.topology = topology
        self.accelerator_type = accelerator_type
        self.resources_per_worker = dict(resources_per_worker) if resources_per_worker else None
        self.placement_strategy = placement_strategy

    @property
    def num_slices(self) -> int:
        """TPU slices the workers span (0 without a topology)."""
        return self._core.num_slices

    @property
    def tpu_slice(self) -> dict | None:
        """The TPU slice: generation, topology, chips, chips_per_host, hosts, pod_type."""
        return self._core.tpu_slice

    def _as_dict(self) -> dict:
        return {
            "num_workers": self.num_workers,
            "use_tpu": self.use_tpu,
            "use_gpu": self.use_gpu,
            "topology": self.topology,
            "accelerator_type": self.accelerator_type,
            "resources_per_worker": self.resources_per_worker,
            "placement_strategy": self.placement_strategy,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._as_dict().items())
        return f"ScalingConfig({fields})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScalingConfig) and self._as_dict() == other._as_dict()


class RunConfig:
    """Where a run lives: ``<storage_path>/<name>``.

    ``name`` defaults to ``jaxtrain_run-<UTC timestamp>``; ``storage_path`` to
    ``~/jaxtrain_results``.
    """

    def __init__(self, name: str | None = None, storage_path: str | os.PathLike | None = None):
        if name is not None:
            _expect("RunConfig", "name", name, (str,), "it must be a string")
        if storage_path is not None:
            _expect("RunConfig", "storage_path", storage_path, (str, os.PathLike),
                    "it must be a path or a URL string")
            storage_path = os.fspath(storage_path)
        core = _core.RunConfig(name=name, storage_path=storage_path)
        self.name: str = core.name
        self.storage_path: str = core.storage_path

    def __repr__(self) -> str:
        return f"RunConfig(name={self.name!r}, storage_path={self.storage_path!r})"
