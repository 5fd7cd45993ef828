"""What the training function calls: ``report``, ``get_context`` and ``get_checkpoint`` (and,
through jaxtrain.collective, ``barrier`` and ``broadcast_from_rank_zero``).

A worker process installs one session before it runs the training function; outside a worker
these functions raise a RuntimeError that says so.
"""

from __future__ import annotations

import enum
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from jaxtrain import records
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.validation import (
    CheckpointConsistencyMode,
    ReportedCheckpoint,
    ValidationTaskConfig,
    check_validation_arg,
    reported_checkpoints,
    wait_validated,
    write_request,
)
from jaxtrain.worker import stager
from jaxtrain.worker.checkpoint_memory import HostMemory
from jaxtrain.worker.checkpoint_peers import Peers
from jaxtrain.worker.checkpoint_store import Store, round_dir_name


@dataclass(frozen=True)
class TrainContext:
    """The position of this worker in the run (names as in Ray Train)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    attempt: int
    run_dir: str

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_attempt(self) -> int:
        """This attempt's number in the run: 0 at first, then on across restarts and resumes."""
        return self.attempt

    def get_storage(self) -> StorageContext:
        """Where this run keeps its checkpoints (Ray's ``TrainContext.get_storage()``): for
        ``report(..., checkpoint_upload_mode=NO_UPLOAD)`` and ``checkpoint_upload_fn``, which
        put a checkpoint at ``build_checkpoint_path_from_name(name)`` themselves."""
        store = _session.store if _session is not None else None
        if store is not None:
            return StorageContext(store.url, store.fs, store.root)
        return StorageContext(self.run_dir)


@dataclass(frozen=True)
class StorageContext:
    """The run's storage as the training function sees it: ``experiment_fs_path`` is the run
    directory (its URL in a run whose hosts write to object storage themselves)."""

    experiment_fs_path: str
    storage_filesystem: Any = None  # the store's fsspec filesystem; None for a local directory
    _root: str = ""

    def build_checkpoint_path_from_name(self, checkpoint_dir_name: str) -> str:
        """Where the checkpoint named `checkpoint_dir_name` of this run lies once committed."""
        from jaxtrain import storage

        if not storage.valid_dir_name(checkpoint_dir_name):
            raise ValueError(
                f"build_checkpoint_path_from_name({checkpoint_dir_name!r}): the name must be one "
                "directory name, not starting with '.', and not 'logs' or "
                f"'{storage.INDEX_NAME}'")
        if self.storage_filesystem is not None:
            return storage.url(self.storage_filesystem,
                               f"{self._root.rstrip('/')}/{checkpoint_dir_name}")
        return os.path.join(self.experiment_fs_path, checkpoint_dir_name)


class CheckpointUploadMode(enum.Enum):
    """How ``report(checkpoint=...)`` takes a checkpoint into the run's storage (Ray Train's
    names; what each means here: docs/checkpoints.md)."""

    ASYNC = "ASYNC"
    SYNC = "SYNC"
    NO_UPLOAD = "NO_UPLOAD"

    def default_delete_local_checkpoint_after_upload(self) -> bool:
        """What ``report`` does when ``delete_local_checkpoint_after_upload`` is None: True for
        ASYNC, False for the other modes (as in Ray)."""
        return self is CheckpointUploadMode.ASYNC


SNAPSHOT_BUDGET_ENV = "JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB"


def snapshot_budget_bytes(local_world_size: int) -> int:
    """How many bytes of checkpoint files ``report(checkpoint=)`` may hold in memory per rank:
    JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB (MiB; 0 turns snapshots off), by default a quarter of this
    host's memory shared by its ranks. The driver has checked the variable
    (jaxtrain.driver.options)."""
    value = os.environ.get(SNAPSHOT_BUDGET_ENV)
    if value:
        return int(value) << 20
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return memory // 4 // max(local_world_size, 1)


class Session:
    def __init__(self, client: Any, context: TrainContext, checkpoint: Checkpoint | None,
                 fail: Callable[[str], NoReturn], memory: HostMemory | None = None,
                 peers: Peers | None = None, store: Store | None = None,
                 fail_storage: Callable[[str, str], NoReturn] | None = None,
                 validation: bool = False,
                 first_round: int = 1):
        self.client = client
        self.validation = validation  # the trainer has a validation_config
        self.context = context
        self.checkpoint = checkpoint  # the committed checkpoint this attempt started from
        self.round = 0
        self.first_round = first_round  # the run's number of this attempt's first report
        self.lock = threading.Lock()
        self.store = store
        self.fail_storage = fail_storage
        self.stager = stager.Stager(client, context.world_rank, fail, memory, peers,
                                    context.attempt, store, fail_storage)
        self.snapshot_budget = snapshot_budget_bytes(context.local_world_size)
        self.said_over_budget = False
        self.preempted = False  # get_preemption_info() returned a notice (preemption.py)
        # The registered just-in-time save (preemption.on_preemption, orbax.save_on_preemption):
        # (metrics, checkpoint_dir_name) -> None, which reports the round with its checkpoint.
        self.preemption_save: Callable[[dict, str | None], None] | None = None
        self.saved_on_preemption = False  # the just-in-time checkpoint has been reported
        self.profile_left = 0  # reports until the jax.profiler trace stops (jaxtrain profile)
        self.collective_lock = threading.Lock()
        self.collectives = 0  # jaxtrain.collective calls made; numbers them for the controller

    def collective(self, broadcast: bool, payload: bytes) -> bytes | None:
        """Makes this rank's next jaxtrain.collective call and waits until every rank has made it
        (the GIL released); returns rank 0's payload for a broadcast, b"" for a barrier. Calls from
        several threads go one at a time. A session without a control connection (``client``
        None: a training function run in the driver's own process) has no other rank to wait
        for: it returns None at once, and broadcast_from_rank_zero() returns its own data."""
        if self.client is None:
            return None
        with self.collective_lock:
            self.collectives += 1
            return self.client.collective(self.collectives, broadcast, payload)

    def wait_checkpoints_settled(self) -> None:
        """Returns once this rank's checkpoints are staged, reported and their commits ended."""
        self.stager.drain()
        self.client.wait_checkpoints_settled()

    def flush(self) -> None:
        """Returns once every report of this rank has been sent (before the worker says done or
        reports its error)."""
        self.stager.drain()


_session: Session | None = None


def install(session: Session | None) -> None:
    """Makes `session` this process's (the worker's, or local mode's driver), or None for none."""
    global _session
    _session = session


def current() -> Session | None:
    """This process's session; None outside a training function's process."""
    return _session


def require(what: str) -> Session:
    """This process's session, or a RuntimeError that says `what` works only in a worker."""
    if _session is None:
        raise RuntimeError(
            f"jaxtrain.{what}() works only inside the training function that "
            "JaxTrainer.fit() runs on its workers"
        )
    return _session


def to_json(value: Any) -> Any:
    """json.dumps' default for reported metrics."""
    # numpy and JAX scalars and arrays, which training code reports all the time.
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(
        f"report() metrics must be JSON-serialisable; a value of type "
        f"{type(value).__name__} is not (convert it with float(), int() or str())"
    )


def profile_step(session: Session) -> None:
    """``jaxtrain profile RUN --steps N`` (docs/cli.md): a request the controller sent
    starts a jax.profiler trace at this report(), into ``<its folder>/rank-<R>``, which stops N
    reports later (or when the training function returns, stop_profile()). report() calls it
    only when a request waits or a trace is under way."""
    request = session.client.take_profile_request()
    if request:
        import jax

        asked = json.loads(request)
        if session.profile_left:
            stop_profile(session)  # a new request replaces the trace under way
        log_dir = os.path.join(asked["dir"], f"rank-{session.context.world_rank}")
        try:
            jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        except Exception as e:  # a trace of the user's own under way: theirs goes on
            sys.stderr.write(f"jaxtrain: the profile asked for was not taken: {e}\n")
            return
        session.profile_left = int(asked["steps"])
    elif session.profile_left == 1:
        stop_profile(session)
    elif session.profile_left:
        session.profile_left -= 1


def stop_profile(session: Session) -> None:
    """Stops the trace profile_step() started, if one is under way."""
    if not session.profile_left:
        return
    import jax

    session.profile_left = 0
    try:
        jax.profiler.stop_trace()
    except Exception as e:
        sys.stderr.write(f"jaxtrain: the profile could not be written: {e}\n")


def report(
    metrics: dict,
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Callable[[Checkpoint, str], Checkpoint] | None = None,
    validation: bool | ValidationTaskConfig = False,
) -> None:
    """Reports one round of metrics from this worker, and optionally its part of a checkpoint.

    Every worker must call ``report`` the same number of times; rank 0's metrics become the
    run's (``Result.metrics``, ``result.jsonl``, ``progress.csv``). A metrics-only call does not
    wait for the controller. With ``checkpoint``, this rank's files are read into memory before
    ``report`` returns, so the directory may be changed or deleted right after; a background
    thread writes them into the run's staging area (with their checksums) and reports them. A
    checkpoint larger than the snapshot budget (JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB, by default a
    quarter of the host's memory shared by its ranks) is copied before ``report`` returns instead
    (said once in the rank's log). Reports reach the controller in order: later metrics-only calls
    wait behind a checkpoint being staged, without blocking the caller. When every rank has
    reported the round, the controller commits the files of all the ranks that passed a
    checkpoint together as one checkpoint, named ``checkpoint_dir_name`` or
    ``checkpoint_<round>``, in the background (fsync, manifest, atomic rename) while training
    goes on. At most one checkpoint is in flight: a ``report`` with a checkpoint first waits until
    this rank's previous one is staged and its commit has ended. A failure to stage (a full disk,
    a permission) fails the run, naming the rank and the path. Several ranks may write a file of
    the same name into one checkpoint only with the same contents (it is committed once); with
    different contents the round fails, naming the file and both ranks.

    ``validation`` (True, or a ValidationTaskConfig whose ``fn_kwargs`` override the trainer's):
    once the round's checkpoint has committed, the driver runs the trainer's ValidationConfig
    function on it in a process of its own and merges the metrics it returns into the
    checkpoint's (docs/checkpoints.md). Rank 0's argument decides.
    ``checkpoint_upload_mode`` (Ray Train's; docs/checkpoints.md): ``SYNC`` (the default) is the
    above; ``ASYNC`` returns at once and stages the files from the directory in the background,
    so the directory must stay as it is until then, and deletes it afterwards unless
    ``delete_local_checkpoint_after_upload=False``; ``NO_UPLOAD`` takes a checkpoint the caller
    wrote straight into the run's storage, at
    ``get_context().get_storage().build_checkpoint_path_from_name(name)``, and only commits it.
    ``delete_local_checkpoint_after_upload`` (None: True for ASYNC only) deletes the directory
    once its files are in the run's storage. ``checkpoint_upload_fn(checkpoint, dir_name)`` is
    called instead of jaxtrain's copy (with ASYNC, in the background) and returns the
    ``Checkpoint`` that jaxtrain then commits: one it put at the round's place in the run's
    storage, which is committed where it lies, or any other local directory, which is copied.
    """
    session = require("report")
    text = _metrics_text(metrics)
    if (checkpoint is None and validation is False and checkpoint_dir_name is None
            and checkpoint_upload_mode is CheckpointUploadMode.SYNC
            and delete_local_checkpoint_after_upload is None and checkpoint_upload_fn is None
            and session.preemption_save is None):
        # Metrics only, every other argument its default (the call a training loop makes every
        # step): nothing else to check or to agree on (bench/startup_and_report.py times it).
        with session.lock:
            session.round += 1
            if session.stager.report(session.round, text) or session.profile_left:
                profile_step(session)  # after the report: its trace covers the steps after it
        return
    check_validation_arg(validation, session.validation)
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(
            f"report(checkpoint=...) takes a jaxtrain.Checkpoint; got {type(checkpoint).__name__} "
            "(use Checkpoint.from_directory(path))"
        )
    if checkpoint_dir_name is not None and not isinstance(checkpoint_dir_name, str):
        raise TypeError(f"report(checkpoint_dir_name={checkpoint_dir_name!r}) takes a string")
    mode, delete = _upload_options(checkpoint_upload_mode, delete_local_checkpoint_after_upload,
                                   checkpoint_upload_fn)
    from jaxtrain import preemption

    if preemption._save_on_notice(session, metrics, checkpoint is not None, checkpoint_dir_name):
        return  # the registered save reported this round with the just-in-time checkpoint
    with session.lock:
        store = session.store
        ctx = session.context
        dir_name = checkpoint_dir_name
        if checkpoint is not None:  # refused before the round counts
            if mode is CheckpointUploadMode.NO_UPLOAD:
                dir_name = _no_upload_dir_name(session, checkpoint, checkpoint_dir_name)
            elif store is not None:
                dir_name = store.dir_name(session.round + 1, checkpoint_dir_name)
            elif checkpoint_upload_fn is not None:
                dir_name = _round_dir_name(session, checkpoint_dir_name)
        session.round += 1
        # A preemption's answer names the round; a profile request waits when it says so.
        if session.client.note_round(session.round) or session.profile_left:
            profile_step(session)
        if session.context.world_rank == 0 and session.validation:
            if validation and store is not None:
                raise ValueError(
                    "report(validation=...) is not available in a run whose hosts upload their "
                    "checkpoints to object storage themselves (docs/checkpoints.md)")
            # Before the report is sent: the request exists when the checkpoint commits.
            write_request(session.context.run_dir, session.round, validation)
        if checkpoint is None:
            session.stager.report(session.round, text)
            return
        from jaxtrain import _core, data

        data._save_positions(checkpoint.path)  # the tracked iterators' positions, with the files
        staging = store.staging(session.round) if store is not None else os.path.join(
            ctx.run_dir, ".staging", f"a{ctx.attempt}-r{session.round}-rank{ctx.world_rank}"
        )
        # Back-pressure: the previous checkpoint is staged and its commit has ended before this
        # one is read, so one snapshot at most is held in memory.
        session.wait_checkpoints_settled()
        description = {"staging": staging, "dir_name": dir_name}
        if mode is CheckpointUploadMode.ASYNC:
            session.stager.checkpoint(
                session.round, text, None, description,
                prepare=lambda d: _stage_async(session, checkpoint, d, checkpoint_upload_fn),
                delete=checkpoint.path if delete and checkpoint.filesystem is None else None)
            return _settle_if_preempted(session)
        source = checkpoint
        if checkpoint_upload_fn is not None:
            source = _call_upload_fn(session, checkpoint_upload_fn, checkpoint, dir_name)
            if delete and not _same_directory(source, checkpoint):
                stager.delete_local(checkpoint.path, ctx.world_rank)
            delete = False  # the upload function's result is committed, never deleted
        if mode is CheckpointUploadMode.NO_UPLOAD or _in_place(session, source, dir_name):
            try:
                description["files"] = _claim(source.path, staging)
            except (FileNotFoundError, ValueError, PermissionError) as e:
                raise type(e)(f"report(checkpoint=...) on rank {ctx.world_rank}: {e}") from None
            session.client.report_checkpoint(session.round, json.dumps(description), text)
            return _settle_if_preempted(session)
        try:
            snapshot = _core.snapshot_directory(_local_path(source, "checkpoint"),
                                                session.snapshot_budget)
            if snapshot is None:
                _say_over_budget(session, source.path)
                if store is not None:
                    store.make_staging(staging)
                # A part for the store is hashed as it is staged: the upload checks what it
                # sends against these SHA-256s (checkpoint_store.Store.upload).
                description["files"] = _core.stage_directory(source.path, staging,
                                                             durable=False,
                                                             sha256=store is not None)
        except (FileNotFoundError, ValueError, PermissionError) as e:
            raise type(e)(f"report(checkpoint=...) on rank {ctx.world_rank}: {e}") from None
        if delete:  # the files are in memory or staged: the directory is no longer needed
            stager.delete_local(source.path, ctx.world_rank)
        if snapshot is None:  # copied: nothing is queued (drained above), so it goes now
            if store is not None:
                stager.upload(store, description, session.round, session.fail_storage)
            session.client.report_checkpoint(session.round, json.dumps(description), text)
        else:
            session.stager.checkpoint(session.round, text, snapshot, description)
        _settle_if_preempted(session)


def _settle_if_preempted(session: Session) -> None:
    """After a checkpoint report that follows a preemption notice (a just-in-time checkpoint):
    waits for its commit, which stops the group, so that nothing is done past it that the
    restart would do again (the controller sends no settle for it; docs/preemption.md)."""
    if session.preempted:
        session.wait_checkpoints_settled()


_MODES = ", ".join(f"CheckpointUploadMode.{m.name}" for m in CheckpointUploadMode)


def _upload_options(mode: Any, delete: Any, upload_fn: Any) -> tuple[CheckpointUploadMode, bool]:
    """The upload mode of a report and whether it deletes the reported directory, checked;
    a TypeError or ValueError naming the argument and its value otherwise."""
    if not isinstance(mode, CheckpointUploadMode):
        raise ValueError(f"report(checkpoint_upload_mode={mode!r}) is not allowed; use one of "
                         f"{_MODES} (jaxtrain.CheckpointUploadMode)")
    if delete is not None and not isinstance(delete, bool):
        raise TypeError(f"report(delete_local_checkpoint_after_upload={delete!r}) takes True, "
                        "False or None (None: True for ASYNC, False otherwise)")
    if upload_fn is not None and not callable(upload_fn):
        raise TypeError(f"report(checkpoint_upload_fn={upload_fn!r}) takes a function "
                        "(checkpoint, checkpoint_dir_name) -> Checkpoint, or None")
    if upload_fn is not None and mode is CheckpointUploadMode.NO_UPLOAD:
        raise ValueError(
            f"report(checkpoint_upload_fn={getattr(upload_fn, '__name__', upload_fn)!r}, "
            "checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD): a NO_UPLOAD checkpoint is "
            "already in the run's storage, so no upload function would run; use SYNC or ASYNC "
            "with checkpoint_upload_fn")
    if mode is CheckpointUploadMode.NO_UPLOAD:
        delete = False  # the checkpoint is the stored copy itself (Ray deletes nothing either)
    elif delete is None:
        delete = mode.default_delete_local_checkpoint_after_upload()
    return mode, delete


def _round_dir_name(session: Session, asked: str | None) -> str:
    """The name of this report's checkpoint in a run directory the ranks share: `asked`, or
    ``checkpoint_<round>`` as the controller names it."""
    return round_dir_name(session.first_round + session.round, asked)


def _no_upload_dir_name(session: Session, checkpoint: Checkpoint, asked: str | None) -> str:
    """The checkpoint name of a NO_UPLOAD report: its directory's, which must be one directly
    in the run directory; a ValueError naming the path and the place otherwise."""
    ctx = session.context
    what = (f"report(checkpoint=Checkpoint({checkpoint.path!r}), "
            "checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)")
    if session.store is not None:
        raise ValueError(
            f"{what} on rank {ctx.world_rank}: this run's hosts write its checkpoints to "
            f"{session.store.url} themselves, where jaxtrain cannot take over a directory that "
            "another writer left; report with SYNC or ASYNC (or save with jaxtrain.orbax.save, "
            "which commits Orbax's files in place there)")
    path = checkpoint.path.rstrip("/")
    name = os.path.basename(path)
    if checkpoint.filesystem is not None or (
            os.path.realpath(os.path.dirname(path)) != os.path.realpath(ctx.run_dir)):
        raise ValueError(
            f"{what} on rank {ctx.world_rank}: a NO_UPLOAD checkpoint must already be in the "
            f"run's storage, one directory directly in '{ctx.run_dir}' (write it at "
            "get_context().get_storage().build_checkpoint_path_from_name(name)); use SYNC or "
            "ASYNC for a directory anywhere else")
    if asked is not None and asked != name:
        raise ValueError(
            f"{what} with checkpoint_dir_name={asked!r} on rank {ctx.world_rank}: a NO_UPLOAD "
            f"checkpoint keeps the name of its directory, {name!r}; leave checkpoint_dir_name "
            "out or give that name")
    return _round_dir_name(session, name)


def _in_place(session: Session, checkpoint: Checkpoint, dir_name: str | None) -> bool:
    """Whether `checkpoint` is the directory of `dir_name` in a run directory the ranks
    share (where a NO_UPLOAD report or an upload function put it)."""
    return (session.store is None and checkpoint.filesystem is None and dir_name is not None
            and os.path.realpath(checkpoint.path)
            == os.path.realpath(os.path.join(session.context.run_dir, dir_name)))


def _same_directory(a: Checkpoint, b: Checkpoint) -> bool:
    return a.filesystem is None and b.filesystem is None and (
        os.path.realpath(a.path) == os.path.realpath(b.path))


def _local_path(checkpoint: Checkpoint, what: str) -> str:
    if checkpoint.filesystem is not None:
        raise ValueError(f"the {what} {checkpoint.path!r} is on a remote filesystem; report() "
                         "copies a local directory (or commits one in the run's storage with "
                         "checkpoint_upload_mode=NO_UPLOAD)")
    return checkpoint.path


def _call_upload_fn(session: Session, upload_fn: Callable, checkpoint: Checkpoint,
                    dir_name: str | None) -> Checkpoint:
    """The checkpoint that `upload_fn(checkpoint, dir_name)` returns, which must be a
    Checkpoint (a ValueError naming what it returned otherwise, as Ray raises)."""
    result = upload_fn(checkpoint, dir_name)
    if not isinstance(result, Checkpoint):
        raise ValueError(
            f"report(checkpoint_upload_fn={getattr(upload_fn, '__name__', upload_fn)!r}) on rank "
            f"{session.context.world_rank}: the function must return a jaxtrain.Checkpoint of "
            f"what it uploaded; it returned {result!r}")
    return result


def _stage_async(session: Session, checkpoint: Checkpoint, description: dict,
                 upload_fn: Callable | None) -> Any:
    """An ASYNC report's part, on the stager's thread: the upload function's result (or the
    user's directory) claimed where it lies in the run directory, or copied into staging; in a
    store run, read into memory (within the snapshot budget), and that snapshot returned for the
    stager to upload from (and describe meanwhile), with no staging copy. None otherwise."""
    from jaxtrain import _core

    source = checkpoint
    if upload_fn is not None:
        source = _call_upload_fn(session, upload_fn, checkpoint, description["dir_name"])
    if _in_place(session, source, description["dir_name"]):
        description["files"] = _claim(source.path, description["staging"])
        return None
    path = _local_path(source, "checkpoint")
    if session.store is not None:
        snapshot = _core.snapshot_directory(path, session.snapshot_budget)
        if snapshot is not None:
            return snapshot
        session.store.make_staging(description["staging"])
    description["files"] = _core.stage_directory(path, description["staging"], durable=False,
                                                 sha256=session.store is not None)
    return None


def _claim(src: str, staging: str) -> list[dict]:
    """Moves the regular files under `src`, a checkpoint directory in the run directory, into
    this rank's `staging` (renames: nothing is copied) and describes them as stage_directory
    does (path, size, CRC-32C, mode); the commit moves them back under the checkpoint's name.
    A file that another rank of the same checkpoint moved first is that rank's. A symbolic
    link is refused with a ValueError naming it."""
    from jaxtrain import _core

    if not os.path.isdir(src):
        raise FileNotFoundError(f"the checkpoint directory '{src}' does not exist")
    os.makedirs(staging, exist_ok=True)
    files = []
    for root, _, names in os.walk(src):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue  # another rank's report of this directory took it
            if stat.S_ISLNK(mode):
                raise ValueError(f"'{path}' is a symbolic link; a checkpoint committed where it "
                                 "lies holds regular files only")
            if not stat.S_ISREG(mode):
                continue
            target = os.path.join(staging, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.rename(path, target)
            except FileNotFoundError:
                continue  # another rank's report of this directory took it
            crc, size = 0, 0
            with open(target, "rb") as f:
                while chunk := f.read(8 << 20):
                    crc = _core.crc32c(chunk, crc)
                    size += len(chunk)
            files.append({"path": rel, "size": size, "crc32c": crc, "mode": mode & 0o7777})
    return files



def report_in_store(metrics: dict, dir_name: str, files: list[dict]) -> None:
    """``report(metrics)`` with this rank's part of a checkpoint that is already in place on the
    store (jaxtrain.orbax): `files` (as Store.describe gives them) in ``<run>/<dir_name>/``, the
    name session.store.dir_name gave for this report. Nothing is staged or uploaded; the round
    counts, waits for the previous checkpoint and goes after the queued reports as with
    ``report(checkpoint=)``."""
    session = require("report")
    text = _metrics_text(metrics)
    description = {"store": True, "dir_name": dir_name, "files": files}
    with session.lock:
        session.round += 1
        session.wait_checkpoints_settled()
        session.client.report_checkpoint(session.round, json.dumps(description), text)


# json.dumps(metrics, default=to_json) without making an encoder per call.
_METRICS_ENCODER = json.JSONEncoder(default=to_json)


def _metrics_text(metrics: Any) -> str:
    """The metrics of a report as the controller takes them: a dict, as JSON."""
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics) takes a dict; got {type(metrics).__name__}")
    text = _METRICS_ENCODER.encode(metrics)
    # A top-level key under jaxtrain's names shows in the text as '"jaxtrain'; only then is each
    # key looked at.
    if f'"{records.RESERVED_METRIC}' in text:
        records.check_metric_names(metrics)
    return text


def _say_over_budget(session: Session, path: str) -> None:
    if session.said_over_budget:
        return
    session.said_over_budget = True
    sys.stderr.write(
        f"jaxtrain worker: rank {session.context.world_rank}: the checkpoint in '{path}' is larger "
        f"than the snapshot budget ({session.snapshot_budget >> 20} MiB, {SNAPSHOT_BUDGET_ENV}); "
        "report(checkpoint=) copies such checkpoints before it returns instead of in the "
        "background (said once)"
        + ("; nor are they kept in host memory" if session.stager.holds_copies else "") + "\n")
    sys.stderr.flush()


def get_checkpoint() -> Checkpoint | None:
    """The latest committed checkpoint of this run when this worker group started (after a
    restart, or when a run is resumed by name), or None. With JAXTRAIN_CHECKPOINT_IN_MEMORY=1, after
    a restart: a view of it in this host's memory, under another path but with the same files
    (docs/checkpoint-memory.md)."""
    return require("get_checkpoint").checkpoint


def get_all_reported_checkpoints(
    consistency_mode: CheckpointConsistencyMode = CheckpointConsistencyMode.VALIDATED,
) -> list[ReportedCheckpoint]:
    """The run's committed checkpoints still kept (those of earlier attempts and fit()s of the
    run too), oldest first, each with rank 0's metrics of its round and what its validation
    returned merged in. Blocks until this rank's reports so far are sent and their checkpoints'
    commits have ended; with ``CheckpointConsistencyMode.VALIDATED`` (the default, as in Ray)
    also until the validations of those checkpoints have ended. Returns [] when no checkpoint
    was committed. Every rank that calls it after the same report gets the same checkpoints."""
    session = require("get_all_reported_checkpoints")
    if not isinstance(consistency_mode, CheckpointConsistencyMode):
        raise ValueError(
            f"get_all_reported_checkpoints(consistency_mode={consistency_mode!r}) is not "
            "allowed; use jaxtrain.CheckpointConsistencyMode.COMMITTED or .VALIDATED")
    if session.store is not None:
        raise ValueError(
            "get_all_reported_checkpoints() is not available in a run whose hosts upload their "
            "checkpoints to object storage themselves (docs/checkpoints.md)")
    with session.lock:  # no report of this rank is in flight meanwhile
        session.wait_checkpoints_settled()
        last = session.first_round + session.round - 1 if session.round else 0
    run_dir = session.context.run_dir
    # A rank that passed no part of its latest round's checkpoint (only rank 0 saving) has no
    # commit of its own to wait for: it waits until the run's record holds that round, which is
    # written once the round's checkpoint, if any, is committed.
    _wait_recorded(run_dir, last)
    if consistency_mode is CheckpointConsistencyMode.VALIDATED:
        return wait_validated(run_dir)
    return reported_checkpoints(run_dir)


def _wait_recorded(run_dir: str, round_: int) -> None:
    """Returns once result.jsonl's last line is of `round_` or later (at once for 0)."""
    path = os.path.join(run_dir, "result.jsonl")
    while round_ > 0:
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        for line in reversed(lines):
            try:
                if json.loads(line)["round"] >= round_:
                    return
                break
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by the tail's start, or one being appended
        time.sleep(0.01)


def get_context() -> TrainContext:
    """This worker's ranks, world size and experiment name."""
    return require("get_context").context


def get_dataset_shard(dataset_name: str | None = None) -> NoReturn:
    """Ray's ``get_dataset_shard``: refused, since jaxtrain has no Ray Data. Raises
    NotImplementedError saying what to use instead (docs/data.md)."""
    raise NotImplementedError(
        f"get_dataset_shard({dataset_name!r}) is not supported: jaxtrain has no Ray Data "
        "(JaxTrainer(datasets=...) is refused too). Pass arrays, file lists or a loader in "
        "train_loop_config and take this process's shard with jaxtrain.data.shard() or "
        "jaxtrain.data.iter_batches() (docs/data.md)")
