"""The jaxtrain engine (C++)."""

from collections.abc import Mapping, Sequence


class ScalingConfig:
    def __init__(self, num_workers: int, use_tpu: bool, use_gpu: bool, topology: str | None, accelerator_type: str | None, resources_per_worker: Mapping[str, float] | None, placement_strategy: str, min_workers: int | None = None, elastic_resize_monitor_interval_s: float = 60.0) -> None: ...

    @property
    def resources_per_worker(self) -> dict[str, float]: ...

    @property
    def min_workers(self) -> int: ...

    @property
    def elastic(self) -> bool: ...

    @property
    def workers_per_slice(self) -> int: ...

    @property
    def num_slices(self) -> int: ...

    @property
    def tpu_slice(self) -> object: ...

class RunConfig:
    def __init__(self, name: str | None, storage_path: str | None) -> None: ...

    @property
    def name(self) -> str: ...

    @property
    def storage_path(self) -> str: ...

class CheckpointConfig:
    def __init__(self, num_to_keep: int | None, checkpoint_score_attribute: str | None, checkpoint_score_order: str) -> None: ...

class FailureConfig:
    def __init__(self, max_failures: int, controller_failure_limit: int, progress_timeout_s: float | None, max_preemption_failures: int = -1, preemption_grace_s: float = 30.0, unreachable_host_timeout_s: float = 300.0, progress_timeout_auto: bool = False) -> None: ...

def stage_directory(src: str, dst: str, durable: bool = True, sha256: bool = False) -> list:
    """
    Copies a checkpoint directory into staging; returns its files (sizes, CRC-32C, modes) and kept links. Without durable, the copy is not fsynced (the commit fsyncs it). With sha256, each file's SHA-256 (hex) too, computed in the same pass over its bytes.
    """

class DirectorySnapshot:
    @property
    def bytes(self) -> int: ...

    def write(self, dst: str, release: bool = True, sha256: bool = False) -> list:
        """
        Writes the snapshot into dst as stage_directory(durable=False) would have copied its source, computing the checksums (with sha256, each file's SHA-256 too, hex, once per snapshot); returns the files as stage_directory does. Then frees its memory, unless release is False (to write it again).
        """

    def describe(self, sha256: bool = False) -> list:
        """
        The files as write() would return them, computed from memory without writing: CRC-32C and, with sha256, SHA-256 (hex, once per snapshot), in one pass over each file.
        """

    def read(self, path: str, offset: int, size: int) -> object:
        """
        Up to size bytes of the snapshot's file at path (relative, as describe() names it) from offset, as bytes: a part of an upload from memory. Thread-safe; KeyError for a path the snapshot has no file at.
        """

    def files(self) -> list:
        """
        The snapshot's files as (path, size), in the order describe() lists them; no checksum is computed.
        """

    def release(self) -> None:
        """Frees the snapshot's memory (what describe() and read() use)."""

def sha256_implementation() -> str:
    """
    What computes the SHA-256s of checkpoints in this process: 'openssl' (the CPU's SHA instructions where present) or 'libsodium' (portable, where no libcrypto can be loaded).
    """

def crc32c(data: object, crc: int = 0) -> int:
    """
    Extends the CRC-32C `crc` (0 to start) with `data` (bytes, or any contiguous buffer: bytearray, memoryview, mmap), as checkpoint manifests record it.
    """

def snapshot_directory(src: str, budget_bytes: int) -> object:
    """
    Reads a checkpoint directory into memory (DirectorySnapshot), by the rules of stage_directory; None when its files hold more than budget_bytes together.
    """

def verify_checkpoint(dir: str, checksums: bool, threads: int = 0) -> None: ...

def is_clean_relative_path(path: str) -> bool:
    """
    Whether a checkpoint file's path stays inside its directory: relative, with no empty, '.' or '..' component (the rule the commit applies to staged files).
    """

def ranked_checkpoints(run_dir: str, score_attribute: str | None, higher_is_better: bool) -> list:
    """
    The committed checkpoints of a run directory, best first: (dir_name, metrics JSON, with what their validations returned merged in).
    """

def apply_retention(run_dir: str, num_to_keep: int, score_attribute: str | None, higher_is_better: bool) -> list[str]:
    """
    Applies CheckpointConfig's retention to a run directory whose controller has ended, scored with what validations returned; one line per checkpoint it could not delete.
    """

class Plan:
    def to_dict(self) -> dict:
        """
        platform, accelerator, simulated, hosts_source, num_slices, and per rank: rank, local_rank, local_world_size, node_rank, host, address, slice, devices, env, unset_env.
        """

def plan_local(scaling_config: ScalingConfig) -> Plan:
    """
    Plans for the local launcher: the hosts of JAXTRAIN_HOSTS, the simulated hosts (JAXTRAIN_SIMULATE=1), or this machine.
    """

def plan(scaling_config: ScalingConfig, hosts_json: str, environ: Mapping[str, str], simulate: bool) -> Plan:
    """
    Plans over the hosts of a JSON host description, as inherited from `environ`; reads nothing of this machine.
    """

def choose_launcher() -> str:
    """
    'local', 'slurm', 'ssh' or 'kubernetes': JAXTRAIN_LAUNCHER, or by default ssh when hosts are listed, slurm inside a Slurm allocation.
    """

def plan_slurm(scaling_config: ScalingConfig) -> Plan:
    """
    Plans for the Slurm launcher: one environment for every rank; Slurm places them.
    """

MAX_WORKERS: int = 100000

SSH_OPTIONS: tuple = ...

SSH_FORWARDED_ENV_PREFIXES: tuple = ('JAX_', 'XLA_', 'LIBTPU_', 'NCCL_', 'TF_CPP_')

MAX_BROADCAST_BYTES: int = 1048576

ACTIVATION_ENV: tuple = ...

def warm_workers_requested() -> bool:
    """
    JAXTRAIN_WARM_WORKERS: whether standby workers are kept (docs/warm-workers.md); ValueError naming the value when it is neither 1 nor 0.
    """

def end_idle_standbys() -> int:
    """
    Ends the standby workers this driver keeps for a later fit() (none runs now that they serve) and returns how many it ended (docs/warm-workers.md).
    """

def check_local_workers(scaling_config: ScalingConfig) -> None:
    """
    Raises ValueError when a local run of `scaling_config` has more workers than this machine starts (config::LocalWorkerLimit).
    """

def run_lock_holder(run_dir: str) -> str | None:
    """
    The driver holding the run directory's lock ('host H, pid P, since T'), or None when no live driver holds it.
    """

def plan_kubernetes(scaling_config: ScalingConfig) -> Plan:
    """
    Plans for the Kubernetes launcher: one environment for every rank, one pod each.
    """

def kubernetes_jobset(scaling_config: ScalingConfig, options_json: str, jobset_name: str, env: Mapping[str, str]) -> str:
    """
    The JobSet (JSON) the Kubernetes launcher would create; for `jaxtrain plan`.
    """

def plan_ssh(scaling_config: ScalingConfig) -> Plan:
    """
    Plans for the ssh launcher over the hosts of JAXTRAIN_HOSTFILE, JAXTRAIN_SSH_HOSTS or JAXTRAIN_HOSTS.
    """

def describe_this_host() -> dict:
    """
    This machine as placement sees it: name, gpus (count), tpu_chips, and its TPU identity.
    """

def check_shared_storage(path: str) -> None:
    """Raises ValueError when `path` is on storage local to this host."""

class Channel:
    @property
    def peer(self) -> str:
        """The other end's proven name."""

    def send(self, data: bytes, timeout_s: float | None = None) -> None:
        """Sends `data` sealed, in records of at most 1 MiB."""

    def send_file(self, file_fd: int, size: int, timeout_s: float | None = None) -> None:
        """Sends the first `size` bytes of the open file `file_fd`, sealed."""

    def receive(self, timeout_s: float | None = None) -> bytes:
        """The next record's bytes, checked."""

    def receive_into(self, buffer: object, timeout_s: float | None = None) -> int:
        """
        The next record's bytes, checked, into `buffer` (a writable buffer of at least 1 MiB holds any record); returns how many.
        """

def channel_connect(fd: int, secret: bytes, purpose: str, me: str, responder: str, timeout_s: float) -> Channel:
    """
    The connecting end's handshake on the connected socket `fd`: proves `me` to `responder` for `purpose` with `secret`, and returns the channel.
    """

def channel_accept(fd: int, secret: bytes, purpose: str, me: str, initiators: Sequence[str], timeout_s: float) -> Channel:
    """
    The accepting end's handshake on the accepted socket `fd`, all of it within `timeout_s`: accepts an end in `initiators` (any when empty) that proves it holds `secret` and means `me` for `purpose`; the channel's `peer` is its name.
    """

class ControllerOptions:
    """The options of Controller(**options), one field each."""

    def __init__(self) -> None: ...

    @property
    def run_dir(self) -> str: ...

    @run_dir.setter
    def run_dir(self, arg: str, /) -> None: ...

    @property
    def experiment_name(self) -> str: ...

    @experiment_name.setter
    def experiment_name(self, arg: str, /) -> None: ...

    @property
    def plan(self) -> Plan: ...

    @plan.setter
    def plan(self, arg: Plan, /) -> None: ...

    @property
    def worker_argv(self) -> list[str]: ...

    @worker_argv.setter
    def worker_argv(self, arg: Sequence[str], /) -> None: ...

    @property
    def worker_cwd(self) -> str: ...

    @worker_cwd.setter
    def worker_cwd(self, arg: str, /) -> None: ...

    @property
    def worker_env(self) -> dict[str, str]: ...

    @worker_env.setter
    def worker_env(self, arg: Mapping[str, str], /) -> None: ...

    @property
    def payload(self) -> bytes: ...

    @payload.setter
    def payload(self, arg: bytes, /) -> None: ...

    @property
    def run_config_json(self) -> str: ...

    @run_config_json.setter
    def run_config_json(self, arg: str, /) -> None: ...

    @property
    def terminate_grace_s(self) -> float: ...

    @terminate_grace_s.setter
    def terminate_grace_s(self, arg: float, /) -> None: ...

    @property
    def start_timeout_s(self) -> float: ...

    @start_timeout_s.setter
    def start_timeout_s(self, arg: float, /) -> None: ...

    @property
    def progress_timeout_floor_s(self) -> float: ...

    @progress_timeout_floor_s.setter
    def progress_timeout_floor_s(self, arg: float, /) -> None: ...

    @property
    def failure_config(self) -> FailureConfig | None: ...

    @failure_config.setter
    def failure_config(self, arg: FailureConfig | None, /) -> None: ...

    @property
    def checkpoint_config(self) -> CheckpointConfig | None: ...

    @checkpoint_config.setter
    def checkpoint_config(self, arg: CheckpointConfig | None, /) -> None: ...

    @property
    def verify_checksums(self) -> bool: ...

    @verify_checksums.setter
    def verify_checksums(self, arg: bool, /) -> None: ...

    @property
    def console_fd(self) -> int: ...

    @console_fd.setter
    def console_fd(self, arg: int, /) -> None: ...

    @property
    def launcher(self) -> str:
        """'local', 'slurm', 'ssh' or 'kubernetes'"""

    @launcher.setter
    def launcher(self, arg: str, /) -> None: ...

    @property
    def scaling_config(self) -> ScalingConfig | None:
        """required by every launcher but 'local'"""

    @scaling_config.setter
    def scaling_config(self, arg: ScalingConfig | None, /) -> None: ...

    @property
    def status_line(self) -> bool: ...

    @status_line.setter
    def status_line(self, arg: bool, /) -> None: ...

    @property
    def launcher_options_json(self) -> str: ...

    @launcher_options_json.setter
    def launcher_options_json(self, arg: str, /) -> None: ...

    @property
    def memory_store(self) -> str: ...

    @memory_store.setter
    def memory_store(self, arg: str, /) -> None: ...

    @property
    def verbose(self) -> bool: ...

    @verbose.setter
    def verbose(self, arg: bool, /) -> None: ...

class Controller:
    def __init__(self, **kwargs) -> None:
        """
        Controller(**options): the fields of ControllerOptions by name; an unknown option, or a missing one that the run needs, is a TypeError naming it.
        """

    def start(self) -> None: ...

    def wait(self, timeout_s: float) -> bool: ...

    def wait_for_commits(self, seen: int, timeout_s: float) -> int:
        """
        Waits up to timeout_s until more than `seen` checkpoints have been committed, or the run has ended; the number committed so far.
        """

    def abort(self, reason: str) -> None: ...

    def take_stacks(self, timeout_s: float) -> str: ...

    def start_profile(self, steps: int, timeout_s: float) -> str: ...

    def outcome(self) -> dict: ...

    def metrics_json(self) -> str: ...

    def close(self) -> None: ...

class WorkerClient:
    @staticmethod
    def connect(address: str, secret_hex: str, rank: int, attempt: int, timeout_s: float, registration_json: str) -> WorkerClient: ...

    def wait_start(self) -> tuple: ...

    def report(self, round: int, metrics_json: str) -> bool: ...

    def report_checkpoint(self, round: int, checkpoint_json: str, metrics_json: str) -> None: ...

    def wait_checkpoints_settled(self) -> None: ...

    def collective(self, sequence: int, broadcast: bool, data: bytes) -> bytes: ...

    def send_error(self, json: str) -> None: ...

    def send_done(self, json: str) -> None: ...

    def watch_controller(self, exit_code: int) -> None: ...

    def watch_preemption(self, usr1_notice_s: int = -1) -> None: ...

    def send_preemption_notice(self, source: str, deadline_ms: int) -> None: ...

    def preemption_call(self) -> str: ...

    def note_round(self, round: int) -> bool: ...

    def enable_stacks(self, fd: int, signal: int, thread: int) -> None: ...

    def take_profile_request(self) -> str: ...

    def stop(self) -> None: ...
