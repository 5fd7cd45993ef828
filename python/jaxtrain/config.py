"""ScalingConfig and RunConfig. Every rule lives in the C++ core (``jaxtrain._core``); this layer
only checks Python types so that a wrong type gets the same kind of message as a wrong value."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxtrain import _core, labels, storage


def _expect(owner: str, field: str, value: Any, types: tuple, allowed: str) -> None:
    # bool is an int in Python; an int field given True is a mistake.
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        raise ValueError(f"{owner}.{field}={value!r} is not allowed; {allowed}")


# The configs are dataclasses, as in Ray (``==``, ``dataclasses.replace``, ``asdict``), with their
# own __init__ so that every field is validated when one is made, replaced ones too.
_config = dataclasses.dataclass(init=False, repr=False, eq=True)


@_config
class ScalingConfig:
    """How many workers, on which hardware (names and meanings as in Ray Train V2).

    Validated completely when constructed; an error names the field, the value and what is
    allowed. ``num_workers`` is the number of worker processes (for TPU: hosts of the slice, or
    more with ``resources_per_worker={"TPU": k}``). ``num_workers=0`` is Ray's local mode: the
    training function runs in the driver's own process (a debugger's breakpoints work), with the
    devices the driver's JAX sees and no ``jax.distributed``; ``topology``, ``accelerator_type``
    and ``resources_per_worker`` do not apply to it (docs/ray-differences.md).

    ``num_workers=(min, max)`` makes the run elastic (Ray Train V2's contract, docs/elastic.md):
    it asks for ``max`` workers and trains on as many as it has hosts for, ``min`` at least; a
    restart that finds a host gone goes on with fewer, and every
    ``elastic_resize_monitor_interval_s`` seconds a run below ``max`` looks for the hosts it lacks
    and grows back at the next committed checkpoint. A plain int is a fixed-size run.
    """

    num_workers: int | tuple[int, int]
    use_tpu: bool
    use_gpu: bool
    topology: str | None
    accelerator_type: str | None
    resources_per_worker: dict[str, float] | None
    placement_strategy: str
    label_selector: dict[str, str] | list[dict[str, str]] | None
    elastic_resize_monitor_interval_s: float

    def __init__(
        self,
        num_workers: int | tuple[int, int] = 1,
        use_tpu: bool = False,
        use_gpu: bool = False,
        topology: str | None = None,
        accelerator_type: str | None = None,
        resources_per_worker: Mapping[str, float] | None = None,
        placement_strategy: str = "PACK",
        label_selector: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        elastic_resize_monitor_interval_s: float = 60.0,
    ) -> None:
        owner = "ScalingConfig"
        allowed = (f"it must be a whole number >= 1 and at most {_core.MAX_WORKERS}, or 0 for "
                   "local mode (the training function runs in the driver's process); an elastic "
                   "run gives a (min, max) pair of whole numbers")
        min_workers = None
        if isinstance(num_workers, (tuple, list)):
            if len(num_workers) != 2 or not all(
                    isinstance(n, int) and not isinstance(n, bool) for n in num_workers):
                raise ValueError(f"{owner}.num_workers={num_workers!r} is not allowed; an "
                                 "elastic run's range is a (min, max) pair of whole numbers "
                                 "with 1 <= min <= max")
            num_workers = tuple(num_workers)
            min_workers, max_workers = num_workers
            for n in num_workers:
                if n < 0 or n > _core.MAX_WORKERS:  # the core takes a C int
                    raise ValueError(f"{owner}.num_workers={num_workers!r} is not allowed; an "
                                     "elastic run's range is a (min, max) pair with "
                                     f"1 <= min <= max <= {_core.MAX_WORKERS}")
        else:
            _expect(owner, "num_workers", num_workers, (int,), allowed)
            if num_workers < 0 or num_workers > _core.MAX_WORKERS:  # the core takes a C int
                raise ValueError(f"{owner}.num_workers={num_workers} is not allowed; {allowed}")
            max_workers = num_workers
        _expect(owner, "elastic_resize_monitor_interval_s", elastic_resize_monitor_interval_s,
                (int, float), "it must be a number of seconds > 0")
        if num_workers == 0:
            for name, value in (("topology", topology), ("accelerator_type", accelerator_type),
                                ("resources_per_worker", resources_per_worker)):
                if value is not None:
                    raise ValueError(
                        f"{owner}(num_workers=0, {name}={value!r}) is not allowed: local mode "
                        "runs the training function in the driver's process, with the devices "
                        f"its JAX sees; leave {name} unset, or use num_workers >= 1")
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
            num_workers=max(max_workers, 1),  # local mode: the other fields checked as for one
            use_tpu=use_tpu,
            use_gpu=use_gpu,
            topology=topology,
            accelerator_type=accelerator_type,
            resources_per_worker=resources,
            placement_strategy=placement_strategy,
            min_workers=min_workers,
            elastic_resize_monitor_interval_s=float(elastic_resize_monitor_interval_s),
        )
        self.num_workers = num_workers
        self.use_tpu = use_tpu
        self.use_gpu = use_gpu
        self.topology = topology
        self.accelerator_type = accelerator_type
        self.resources_per_worker = dict(resources_per_worker) if resources_per_worker else None
        self.placement_strategy = placement_strategy
        self.label_selector = labels.check_selector(label_selector, max_workers)
        self.elastic_resize_monitor_interval_s = elastic_resize_monitor_interval_s
        self.node_labels()  # refuses per-worker selectors that differ, now

    @property
    def min_workers(self) -> int:
        """The fewest workers the run trains on: ``num_workers``, or an elastic run's min."""
        return self._core.min_workers if self.num_workers != 0 else 0

    @property
    def max_workers(self) -> int:
        """The workers the run asks for: ``num_workers``, or an elastic run's max."""
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def elastic(self) -> bool:
        """Whether ``num_workers`` is a (min, max) range (docs/elastic.md)."""
        return isinstance(self.num_workers, tuple)

    def node_labels(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """The label selector as every worker's node must match it: label -> ("in" or "notin",
        values); empty without one. A per-worker list is one selector when its entries agree;
        a ValueError names the field when they differ (no launcher places workers apart by
        labels: a JobSet has one pod template, a Slurm job one constraint, an ssh run one
        host list)."""
        selector = self.label_selector
        if isinstance(selector, list):
            distinct = {labels.json_key(s) for s in selector}
            if len(distinct) > 1:
                raise ValueError(
                    f"ScalingConfig.label_selector={selector!r} gives the workers different "
                    "selectors, which no launcher of jaxtrain can place apart (one JobSet pod "
                    "template, one Slurm constraint, one host list); give one dict for all")
            selector = selector[0] if selector else {}
        return {key: labels.requirement(value) for key, value in (selector or {}).items()}

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
            "label_selector": self.label_selector,
            "elastic_resize_monitor_interval_s": self.elastic_resize_monitor_interval_s,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._as_dict().items())
        return f"ScalingConfig({fields})"


@_config
class CheckpointConfig:
    """Which checkpoints to keep: the best ``num_to_keep`` by ``checkpoint_score_attribute`` (a
    reported metric; nested keys joined with '/') in ``checkpoint_score_order`` ("max" or "min"),
    or the newest ``num_to_keep`` without a score. The newest is never deleted. None keeps all."""

    num_to_keep: int | None
    checkpoint_score_attribute: str | None
    checkpoint_score_order: str

    def __init__(
        self,
        num_to_keep: int | None = None,
        checkpoint_score_attribute: str | None = None,
        checkpoint_score_order: str = "max",
    ) -> None:
        owner = "CheckpointConfig"
        if num_to_keep is not None:
            _expect(owner, "num_to_keep", num_to_keep, (int,), "it must be a whole number >= 1")
        if checkpoint_score_attribute is not None:
            _expect(owner, "checkpoint_score_attribute", checkpoint_score_attribute, (str,),
                    "it must be the name of a reported metric")
        _expect(owner, "checkpoint_score_order", checkpoint_score_order, (str,),
                "use 'max' or 'min'")
        self._core = _core.CheckpointConfig(
            num_to_keep=num_to_keep,
            checkpoint_score_attribute=checkpoint_score_attribute,
            checkpoint_score_order=checkpoint_score_order,
        )
        self.num_to_keep = num_to_keep
        self.checkpoint_score_attribute = checkpoint_score_attribute
        self.checkpoint_score_order = checkpoint_score_order

    def _as_dict(self) -> dict:
        return {
            "num_to_keep": self.num_to_keep,
            "checkpoint_score_attribute": self.checkpoint_score_attribute,
            "checkpoint_score_order": self.checkpoint_score_order,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._as_dict().items())
        return f"CheckpointConfig({fields})"


@_config
class FailureConfig:
    """How failures are handled. When a worker fails, the whole group is stopped and restarted from
    the latest committed checkpoint, up to ``max_failures`` times (-1: without limit). A group that
    cannot start (a start-up failure) is retried up to ``controller_failure_limit`` times (-1:
    without limit; Ray's default is -1, jaxtrain's 3, see docs/ray-differences.md).
    ``progress_timeout_s`` is the progress watchdog's limit: once a rank has called ``report()``,
    going that many seconds without another call counts as a failure (alive but stuck); the
    stale ranks are pinged, those that do not answer (a stopped process, a hung host) are blamed
    over those waiting for them, else the rank the others wait for, told from every rank's
    stacks, which are kept in the run directory (docs/failure-detection.md). ``"auto"`` (the
    default): 10 times the run's median step time, at least 10 minutes (the floor covers a
    later compilation, a checkpoint, an evaluation; the first compilation is never counted,
    since a rank is watched from its first ``report()``); ``None`` turns the watchdog off.
    Preemptions (a worker's SIGTERM that the run did not send: a reclaimed spot VM, a drained
    node; docs/preemption.md) are not failures: they have their own budget,
    ``max_preemption_failures`` (-1, the default: without limit), and the group goes on after a
    notice for ``preemption_grace_s`` at most (or until a checkpoint reported after it is
    committed) before it is stopped and restarted. A restart on ssh hosts waits up to
    ``unreachable_host_timeout_s`` for a host it cannot reach (down, rebooting, its network cut),
    probing it again with backoff, before that start fails (docs/hosts.md); 0 fails at once."""

    max_failures: int
    controller_failure_limit: int
    progress_timeout_s: float | str | None
    max_preemption_failures: int
    preemption_grace_s: float
    unreachable_host_timeout_s: float

    def __init__(
        self,
        max_failures: int = 0,
        controller_failure_limit: int = 3,
        progress_timeout_s: float | str | None = "auto",
        max_preemption_failures: int = -1,
        preemption_grace_s: float = 30.0,
        unreachable_host_timeout_s: float = 300.0,
    ) -> None:
        owner = "FailureConfig"
        _expect(owner, "max_failures", max_failures, (int,), "use 0, a positive number, or -1")
        _expect(owner, "controller_failure_limit", controller_failure_limit, (int,),
                "use 0, a positive number, or -1")
        auto = progress_timeout_s == "auto"
        if progress_timeout_s is not None and not auto:
            _expect(owner, "progress_timeout_s", progress_timeout_s, (int, float),
                    "give a number of seconds > 0, \"auto\" or None")
        _expect(owner, "max_preemption_failures", max_preemption_failures, (int,),
                "use 0, a positive number, or -1")
        _expect(owner, "preemption_grace_s", preemption_grace_s, (int, float),
                "give a number of seconds > 0")
        _expect(owner, "unreachable_host_timeout_s", unreachable_host_timeout_s, (int, float),
                "give a number of seconds >= 0")
        self._core = _core.FailureConfig(
            max_failures=max_failures,
            controller_failure_limit=controller_failure_limit,
            progress_timeout_s=None if progress_timeout_s is None or auto
            else float(progress_timeout_s),
            max_preemption_failures=max_preemption_failures,
            preemption_grace_s=float(preemption_grace_s),
            unreachable_host_timeout_s=float(unreachable_host_timeout_s),
            progress_timeout_auto=auto,
        )
        self.max_failures = max_failures
        self.controller_failure_limit = controller_failure_limit
        self.progress_timeout_s = progress_timeout_s
        self.max_preemption_failures = max_preemption_failures
        self.preemption_grace_s = preemption_grace_s
        self.unreachable_host_timeout_s = unreachable_host_timeout_s

    def _as_dict(self) -> dict:
        return {
            "max_failures": self.max_failures,
            "controller_failure_limit": self.controller_failure_limit,
            "progress_timeout_s": self.progress_timeout_s,
            "max_preemption_failures": self.max_preemption_failures,
            "preemption_grace_s": self.preemption_grace_s,
            "unreachable_host_timeout_s": self.unreachable_host_timeout_s,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._as_dict().items())
        return f"FailureConfig({fields})"


@_config
class RunConfig:
    """Where a run lives (``<storage_path>/<name>``), how it keeps checkpoints and how it handles
    failures.

    ``name`` defaults to ``jaxtrain_run-<UTC timestamp, ms>-<random>``, new for every run;
    ``storage_path`` to
    ``~/jaxtrain_results``. Running again with the same name and storage_path resumes the run
    from its latest committed checkpoint.

    ``storage_path`` is a local or shared (NFS) directory, or a URL of any fsspec filesystem
    (``s3://bucket/prefix``, ``gs://...``, ``memory://...``); ``storage_filesystem``, an fsspec or
    pyarrow filesystem object, makes ``storage_path`` a path on that filesystem instead.

    ``callbacks``: driver-side ``jaxtrain.UserCallback`` objects told of every report round,
    failed attempt and restart, and of the end of the run (see docs/callbacks.md).
    ``worker_runtime_env``: as Ray's, a dict with ``env_vars`` (environment variables set in
    every worker) and ``working_dir`` (the workers' working directory, also put first on their
    import path; shipped to workers on other hosts, without what ``excludes`` lists: see
    docs/hosts.md); Ray's other keys (``pip``, ``conda``, ...) are refused.

    ``metrics_port``: serve the run's Prometheus metrics from the driver on this port while
    ``fit()`` runs (0: any free port, said on stderr); ``None``: the ``JAXTRAIN_METRICS_PORT``
    environment variable, or no endpoint (see docs/observability.md).
    """

    name: str
    storage_path: str
    storage_filesystem: Any
    failure_config: FailureConfig
    checkpoint_config: CheckpointConfig
    callbacks: list
    worker_runtime_env: dict[str, Any] | None
    metrics_port: int | None

    def __init__(
        self,
        name: str | None = None,
        storage_path: str | os.PathLike | None = None,
        storage_filesystem: Any = None,
        failure_config: FailureConfig | None = None,
        checkpoint_config: CheckpointConfig | None = None,
        callbacks: Sequence[Any] | None = None,
        worker_runtime_env: Mapping[str, Any] | None = None,
        metrics_port: int | None = None,
    ) -> None:
        if name is not None:
            _expect("RunConfig", "name", name, (str,), "it must be a string")
        if storage_path is not None:
            _expect("RunConfig", "storage_path", storage_path, (str, os.PathLike),
                    "it must be a path or a URL string")
            storage_path = os.fspath(storage_path)
        if failure_config is not None:
            _expect("RunConfig", "failure_config", failure_config, (FailureConfig,),
                    "pass a jaxtrain.FailureConfig")
        if checkpoint_config is not None:
            _expect("RunConfig", "checkpoint_config", checkpoint_config, (CheckpointConfig,),
                    "pass a jaxtrain.CheckpointConfig")
        core = _core.RunConfig(name=name, storage_path=storage_path)
        self.name: str = core.name
        self.storage_path: str = core.storage_path
        self.storage_filesystem = storage_filesystem
        # A URL's scheme or a filesystem object is checked now, without touching the storage.
        storage.remote_filesystem(self.storage_path, storage_filesystem, connect=False)
        self.failure_config = failure_config or FailureConfig()
        self.checkpoint_config = checkpoint_config or CheckpointConfig()
        self.callbacks = _callbacks(callbacks)
        self.worker_runtime_env = _runtime_env(worker_runtime_env)
        if metrics_port is not None:
            _expect("RunConfig", "metrics_port", metrics_port, (int,),
                    "it must be a port number, 0 to 65535 (0: any free port), or None")
            if not 0 <= metrics_port <= 65535:
                raise ValueError(f"RunConfig.metrics_port={metrics_port!r} is not allowed; it must "
                                 "be a port number, 0 to 65535 (0: any free port), or None")
        self.metrics_port = metrics_port

    def __repr__(self) -> str:
        fs = ("" if self.storage_filesystem is None
              else f"storage_filesystem={self.storage_filesystem!r}, ")
        return (
            f"RunConfig(name={self.name!r}, storage_path={self.storage_path!r}, {fs}"
            f"failure_config={self.failure_config!r}, "
            f"checkpoint_config={self.checkpoint_config!r}, callbacks={self.callbacks!r}, "
            f"worker_runtime_env={self.worker_runtime_env!r}"
            + ("" if self.metrics_port is None else f", metrics_port={self.metrics_port!r}")
            + ")"
        )


def _callbacks(callbacks: Sequence[Any] | None) -> list:
    from jaxtrain.callbacks import UserCallback

    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes, Mapping)) or not isinstance(callbacks, Sequence):
        raise ValueError(f"RunConfig.callbacks={callbacks!r} is not allowed; pass a list of "
                         "jaxtrain.UserCallback objects")
    for i, callback in enumerate(callbacks):
        if not isinstance(callback, UserCallback):
            raise ValueError(
                f"RunConfig.callbacks[{i}]={callback!r} is not allowed; a callback must be a "
                "jaxtrain.UserCallback (subclass it and override the hooks you need)")
    return list(callbacks)


_RUNTIME_ENV_KEYS = ("env_vars", "working_dir", "excludes")


def _runtime_env(env: Mapping[str, Any] | None) -> dict[str, Any] | None:
    owner = "RunConfig.worker_runtime_env"
    if env is None:
        return None
    if not isinstance(env, Mapping):
        raise ValueError(f"{owner}={env!r} is not allowed; it must be a dict with 'env_vars' "
                         "and/or 'working_dir'")
    unknown = [k for k in env if k not in _RUNTIME_ENV_KEYS]
    if unknown:
        raise ValueError(
            f"{owner} key {unknown[0]!r} is not supported; allowed: 'env_vars', 'working_dir', "
            "'excludes' "
            "(jaxtrain runs workers from the driver's Python environment: install packages "
            "there, or on every host)")
    out: dict[str, Any] = {}
    if env.get("env_vars") is not None:
        variables = env["env_vars"]
        if not isinstance(variables, Mapping):
            raise ValueError(f"{owner}['env_vars']={variables!r} is not allowed; it must be a "
                             "dict of strings")
        for key, value in variables.items():
            if not isinstance(key, str) or not key or "=" in key:
                raise ValueError(f"{owner}['env_vars'] key {key!r} is not allowed; names are "
                                 "non-empty strings without '='")
            if key.startswith("JAXTRAIN_"):
                raise ValueError(f"{owner}['env_vars'] key {key!r} is not allowed; JAXTRAIN_* "
                                 "variables are set by jaxtrain for each worker")
            if not isinstance(value, str):
                raise ValueError(f"{owner}['env_vars'][{key!r}]={value!r} is not allowed; "
                                 "values are strings")
        out["env_vars"] = dict(variables)
    if env.get("working_dir") is not None:
        working_dir = env["working_dir"]
        if not isinstance(working_dir, (str, os.PathLike)):
            raise ValueError(f"{owner}['working_dir']={working_dir!r} is not allowed; it must be "
                             "a local directory path")
        working_dir = os.path.abspath(os.fspath(working_dir))
        if not os.path.isdir(working_dir):
            raise ValueError(f"{owner}['working_dir']={working_dir!r} is not a directory; give "
                             "an existing local (or shared, for other hosts) directory; URLs of "
                             "zip files are not supported")
        out["working_dir"] = working_dir
    if env.get("excludes") is not None:
        from jaxtrain.driver import runtime_env

        if "working_dir" not in out:
            raise ValueError(f"{owner}['excludes'] is given without a working_dir; it names what "
                             "of the working_dir is not shipped to other hosts")
        out["excludes"] = runtime_env.check_excludes(env["excludes"])
    return out
