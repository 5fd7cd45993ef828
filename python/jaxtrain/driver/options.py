"""The engine's options: every ``JAXTRAIN_*`` switch a user sets for ``fit()`` that the Python
layer reads, read and checked once, when ``fit()`` starts (``EngineOptions.read``), before
anything starts. A bad value is refused with a ValueError naming the variable, its value and
what is allowed. docs/configuration.md lists them all, with those the C++ engine reads.

The variables the driver sets for its workers (``JAXTRAIN_RANK``, ``JAXTRAIN_WORLD_SIZE``, the
switches below as the driver passes them on, ...) are the protocol between the two, not options:
the worker reads them where it uses them (jaxtrain.worker).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from jaxtrain.worker import gce_metadata as worker_gce_metadata

COMPILATION_CACHE_ENV = "JAXTRAIN_COMPILATION_CACHE"
PRELOAD_TASK_ENV = "JAXTRAIN_PRELOAD_TASK"
VERIFY_CHECKSUMS_ENV = "JAXTRAIN_VERIFY_CHECKSUMS"
PRIVATE_ENV = "JAXTRAIN_PRIVATE"
STORE_DIRECT_ENV = "JAXTRAIN_STORE_DIRECT"
STAGING_DIR_ENV = "JAXTRAIN_STAGING_DIR"
SNAPSHOT_BUDGET_ENV = "JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB"
IN_MEMORY_ENV = "JAXTRAIN_CHECKPOINT_IN_MEMORY"
MEMORY_DIR_ENV = "JAXTRAIN_MEMORY_DIR"
MEMORY_BUDGET_ENV = "JAXTRAIN_MEMORY_BUDGET_MIB"
METRICS_PORT_ENV = "JAXTRAIN_METRICS_PORT"
METRICS_HOST_ENV = "JAXTRAIN_METRICS_HOST"
WORKING_DIR_MAX_MIB_ENV = "JAXTRAIN_WORKING_DIR_MAX_MIB"
WORKING_DIR_GITIGNORE_ENV = "JAXTRAIN_WORKING_DIR_GITIGNORE"
# Passed on to the workers as it is set (jaxtrain.worker reads it too).
VERBOSE_ENV = "JAXTRAIN_VERBOSE"
WARM_WORKERS_IDLE_ENV = "JAXTRAIN_WARM_WORKERS_IDLE_S"
PROGRESS_TIMEOUT_FLOOR_ENV = "JAXTRAIN_PROGRESS_TIMEOUT_FLOOR_S"

DEFAULT_MEMORY_DIR = "/dev/shm"
DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_WORKING_DIR_MAX_MIB = 100
# Seconds the standby workers a fit() leaves are kept for a next fit() (docs/warm-workers.md).
DEFAULT_WARM_WORKERS_IDLE_S = 60.0
# The floor of the progress watchdog's automatic limit (AutoLimit, src/controller/watchdog.h).
DEFAULT_PROGRESS_TIMEOUT_FLOOR_S = 600.0


@dataclass(frozen=True)
class EngineOptions:
    """What the ``JAXTRAIN_*`` switches ask of one ``fit()``, checked."""

    compilation_cache: str = "1"  # "1": workers cache compiled programs in the run directory
    preload_task: bool = True  # standby workers unpickle the task ahead of a restart
    verify_checksums: bool = True  # restores check every file's CRC-32C, not only its size
    private: bool = False  # the run directory and what the run writes are its owner's only
    store_direct: str = ""  # "1"/"0": workers upload to object storage themselves, or not
    staging_dir: str = ""  # where remote runs' staging copies live ("" the default)
    snapshot_budget_mib: str | None = None  # None: a quarter of the host's memory
    checkpoint_in_memory: str | None = None  # "1"/"0", None: unset
    memory_dir: str = DEFAULT_MEMORY_DIR  # absolute
    memory_budget_mib: str = ""  # "": a copy may take half the memory filesystem's free space
    gce_metadata: str = ""  # "1"/"0", "": on GCE VMs
    metrics_endpoint: tuple[str, int] | None = None  # (host, port) of the metrics endpoint
    working_dir_max_bytes: int = DEFAULT_WORKING_DIR_MAX_MIB << 20
    working_dir_gitignore: bool = True
    verbose: bool = False  # the driver and the workers also say how they went about the run
    warm_workers_idle_s: float = DEFAULT_WARM_WORKERS_IDLE_S  # then unused standbys are ended
    # The floor of the progress watchdog's automatic limit, FailureConfig(progress_timeout_s=
    # "auto").
    progress_timeout_floor_s: float = DEFAULT_PROGRESS_TIMEOUT_FLOOR_S

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ,
             metrics_port: int | None = None) -> EngineOptions:
        """The options `environ` sets; `metrics_port` is RunConfig's, which wins over
        JAXTRAIN_METRICS_PORT. Raises ValueError for the first bad value."""
        in_memory = checkpoint_in_memory(environ)
        return cls(
            compilation_cache=switch(
                environ, COMPILATION_CACHE_ENV,
                "the workers cache compiled programs in <run dir>/compilation-cache",
                "no cache from jaxtrain"),
            preload_task=switch(
                environ, PRELOAD_TASK_ENV,
                "standby workers unpickle the training function and import its modules "
                "before a restart, docs/warm-workers.md",
                "they do both at activation") == "1",
            verify_checksums=switch(
                environ, VERIFY_CHECKSUMS_ENV,
                "a restore checks every file's size and CRC-32C",
                "sizes only") == "1",
            private=private(environ, in_memory),
            store_direct=store_direct(environ),
            staging_dir=environ.get(STAGING_DIR_ENV, ""),
            snapshot_budget_mib=snapshot_budget_mib(environ),
            checkpoint_in_memory=in_memory,
            memory_dir=os.path.abspath(environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_DIR),
            memory_budget_mib=environ.get(MEMORY_BUDGET_ENV, ""),
            # The worker reads it again when it starts its watcher, with the same rule.
            gce_metadata=worker_gce_metadata.setting(environ),
            metrics_endpoint=metrics_endpoint(metrics_port, environ),
            working_dir_max_bytes=working_dir_max_bytes(environ),
            working_dir_gitignore=working_dir_gitignore(environ),
            verbose=verbose(environ),
            warm_workers_idle_s=warm_workers_idle_s(environ),
            progress_timeout_floor_s=progress_timeout_floor_s(environ),
        )


def switch(environ: Mapping[str, str], name: str, on: str, off: str) -> str:
    """The value of the switch variable `name`: "1" (the default; unset or empty too) or "0";
    any other value is refused, naming the variable, the value and what each allowed one does."""
    value = environ.get(name) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} is not allowed; use 1 (the default: {on}) or 0 "
                         f"({off})")
    return value


def verbose(environ: Mapping[str, str]) -> bool:
    """JAXTRAIN_VERBOSE: "1" the run also says how jaxtrain went about it (standbys used, the
    preload, status codes); "0", empty or unset (the default) it does not."""
    value = environ.get(VERBOSE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{VERBOSE_ENV}={value!r} is not allowed; use 1 (the console and the rank logs also "
            "say how jaxtrain went about the run), or 0 or leave it unset (the default: they do "
            "not)")
    return value == "1"


def private(environ: Mapping[str, str], in_memory: str | None) -> bool:
    """JAXTRAIN_PRIVATE: "1" the run is private, "0" (or empty) it is not; unset, it is when
    checkpoints are also held in host memory, whose copies are restored into the run's workers
    as its checkpoints are (docs/security.md)."""
    value = environ.get(PRIVATE_ENV)
    if value is None:
        return in_memory == "1"
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{PRIVATE_ENV}={value!r} is not allowed; use 1 (the run directory is 0700 and what "
            "the run writes 0700/0600), 0 (as the umask makes them), or leave it unset (1 when "
            f"{IN_MEMORY_ENV}=1, else 0)")
    return value == "1"


def store_direct(environ: Mapping[str, str]) -> str:
    """JAXTRAIN_STORE_DIRECT: "1", "0", or "" (unset: decided by where the workers are)."""
    value = environ.get(STORE_DIRECT_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{STORE_DIRECT_ENV}={value!r} is not allowed; use 1 (the workers upload their "
            "checkpoints to the object store themselves), 0 (they stage them in the driver's "
            "staging copy, which every host must then share), or leave it unset (1 when the "
            f"workers are on other hosts and {STAGING_DIR_ENV} is unset)")
    return value


def snapshot_budget_mib(environ: Mapping[str, str]) -> str | None:
    """JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB as the driver passes it on (None: unset, the default);
    anything but a whole number of MiB >= 0 is refused."""
    value = environ.get(SNAPSHOT_BUDGET_ENV)
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(
            f"{SNAPSHOT_BUDGET_ENV}={value!r} is not allowed; use a whole number of MiB >= 0 (the "
            "memory each rank may hold a checkpoint in while report(checkpoint=) stages it in the "
            "background; 0 copies every checkpoint before report() returns), or leave it unset "
            "(a quarter of the host's memory, shared by its ranks)")
    return str(int(value))


def checkpoint_in_memory(environ: Mapping[str, str]) -> str | None:
    """JAXTRAIN_CHECKPOINT_IN_MEMORY as the driver passes it on: None (unset or empty), "0" or
    "1". With "1", JAXTRAIN_MEMORY_DIR (when set) must be an existing directory, and
    JAXTRAIN_MEMORY_BUDGET_MIB (when set) a whole number of MiB."""
    value = environ.get(IN_MEMORY_ENV)
    if not value:
        return None
    if value not in ("0", "1"):
        raise ValueError(
            f"{IN_MEMORY_ENV}={value!r} is not allowed; use 1 (each rank keeps its latest "
            "checkpoints in its host's memory, so a restarted group restores from there) or 0 "
            "(the default: restores read the storage)")
    memory_dir = environ.get(MEMORY_DIR_ENV)
    if value == "1" and memory_dir and not os.path.isdir(memory_dir):
        raise ValueError(
            f"{MEMORY_DIR_ENV}={memory_dir!r} is not a directory; name a directory on a memory "
            f"filesystem (tmpfs) that exists on every host, or unset it ({DEFAULT_MEMORY_DIR})")
    budget = environ.get(MEMORY_BUDGET_ENV)
    if value == "1" and budget and not budget.isdigit():
        raise ValueError(
            f"{MEMORY_BUDGET_ENV}={budget!r} is not allowed; use a whole number of MiB (the most "
            "this run's copies may take of each host's memory filesystem), or unset it (a copy is "
            "kept when it takes at most half the filesystem's free space)")
    return value


_PORT_RULE = "it must be a port number, 0 to 65535 (0: any free port)"


def metrics_endpoint(metrics_port: int | None,
                     environ: Mapping[str, str]) -> tuple[str, int] | None:
    """Where to serve the metrics: RunConfig's ``metrics_port``, else ``JAXTRAIN_METRICS_PORT``,
    on ``JAXTRAIN_METRICS_HOST`` (default 127.0.0.1); None when neither asks for an endpoint."""
    port = metrics_port
    if port is None:
        text = environ.get(METRICS_PORT_ENV, "").strip()
        if not text:
            return None
        port = int(text) if text.isdigit() else -1
        if not 0 <= port <= 65535:
            raise ValueError(f"{METRICS_PORT_ENV}={text!r} is not allowed; {_PORT_RULE}; unset it "
                             "for no metrics endpoint")
    return environ.get(METRICS_HOST_ENV, "").strip() or DEFAULT_METRICS_HOST, port


def working_dir_max_bytes(environ: Mapping[str, str]) -> int:
    """The cap on a packed working_dir, from JAXTRAIN_WORKING_DIR_MAX_MIB."""
    value = environ.get(WORKING_DIR_MAX_MIB_ENV) or str(DEFAULT_WORKING_DIR_MAX_MIB)
    if not value.isdigit() or int(value) == 0:
        raise ValueError(f"{WORKING_DIR_MAX_MIB_ENV}={value!r} is not allowed; use a whole "
                         f"number of MiB above 0 (the default is {DEFAULT_WORKING_DIR_MAX_MIB})")
    return int(value) * 2**20


def warm_workers_idle_s(environ: Mapping[str, str]) -> float:
    """JAXTRAIN_WARM_WORKERS_IDLE_S: seconds (>= 0, finite) the standby workers a fit() leaves
    wait for the next fit() before they are ended; 0 ends them when fit() returns."""
    value = environ.get(WARM_WORKERS_IDLE_ENV) or str(DEFAULT_WARM_WORKERS_IDLE_S)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(
            f"{WARM_WORKERS_IDLE_ENV}={value!r} is not allowed; use a number of seconds >= 0 "
            "that the standby workers a fit() leaves wait for the next fit() before they are "
            f"ended (0: when fit() returns; the default is {DEFAULT_WARM_WORKERS_IDLE_S:g})")
    return seconds


def progress_timeout_floor_s(environ: Mapping[str, str]) -> float:
    """JAXTRAIN_PROGRESS_TIMEOUT_FLOOR_S: the seconds (> 0, finite) the progress watchdog's
    automatic limit is at least (docs/failure-detection.md)."""
    value = environ.get(PROGRESS_TIMEOUT_FLOOR_ENV) or str(DEFAULT_PROGRESS_TIMEOUT_FLOOR_S)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(
            f"{PROGRESS_TIMEOUT_FLOOR_ENV}={value!r} is not allowed; use a number of seconds > 0 "
            "that the progress watchdog's automatic limit is at least (the default is "
            f"{DEFAULT_PROGRESS_TIMEOUT_FLOOR_S:g})")
    return seconds


def working_dir_gitignore(environ: Mapping[str, str]) -> bool:
    """JAXTRAIN_WORKING_DIR_GITIGNORE: whether the .gitignore files in working_dir exclude what
    they list (default 1; Ray: RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 for 0)."""
    value = environ.get(WORKING_DIR_GITIGNORE_ENV) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{WORKING_DIR_GITIGNORE_ENV}={value!r} is not allowed; use 1 (the "
                         "default: the .gitignore files in working_dir exclude what they list) "
                         "or 0 (they exclude nothing)")
    return value == "1"
