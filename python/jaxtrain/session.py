"""What the training function calls: ``report``, ``get_context`` and ``get_checkpoint``.

A worker process installs one session before it runs the training function; outside a worker
these functions raise a RuntimeError that says so.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from jaxtrain.checkpoint import Checkpoint
from jaxtrain.checkpoint_memory import HostMemory
from jaxtrain.checkpoint_peers import Peers
from jaxtrain.checkpoint_store import Store, StoreError, status_code


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
        """How many times the worker group has been restarted before this one (0 at first)."""
        return self.attempt


SNAPSHOT_BUDGET_ENV = "JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB"


def snapshot_budget_bytes(local_world_size: int) -> int:
    """How many bytes of checkpoint files ``report(checkpoint=)`` may hold in memory per rank:
    JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB (MiB; 0 turns snapshots off), by default a quarter of this
    host's memory shared by its ranks. The driver has checked the variable
    (check_snapshot_budget)."""
    value = os.environ.get(SNAPSHOT_BUDGET_ENV)
    if value:
        return int(value) << 20
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return memory // 4 // max(local_world_size, 1)


def check_snapshot_budget() -> str | None:
    """JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB as the driver passes it on (None: unset, the default);
    anything but a whole number of MiB >= 0 is refused with a ValueError naming it."""
    value = os.environ.get(SNAPSHOT_BUDGET_ENV)
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(
            f"{SNAPSHOT_BUDGET_ENV}={value!r} is not allowed; use a whole number of MiB >= 0 (the "
            "memory each rank may hold a checkpoint in while report(checkpoint=) stages it in the "
            "background; 0 copies every checkpoint before report() returns), or leave it unset "
            "(a quarter of the host's memory, shared by its ranks)")
    return str(int(value))


class _Stager:
    """This rank's background stager: one thread that writes checkpoint snapshots into their
    staging directories (checksums on the way, in C++ without the GIL) and then sends their
    reports, and sends the metrics-only reports queued behind them, in the order of the rounds.

    Reports go to the controller in round order: a metrics-only report is sent at once when
    nothing is queued, and queued behind the pending checkpoint otherwise. A failure to stage
    (a full disk, a permission) ends the worker as a raising training function does, with the
    rank and the path in the message: a checkpoint is never lost silently. ``fail(message)``
    is the worker's: it reports the exception being handled with ``message`` and exits."""

    def __init__(self, client: Any, rank: int, fail: Callable[[str], NoReturn],
                 memory: HostMemory | None = None, peers: Peers | None = None,
                 attempt: int = 0, store: Store | None = None,
                 fail_storage: Callable[[str, str], NoReturn] | None = None) -> None:
        self._client = client
        self._store = store  # the rank's host uploads its files to object storage itself
        self._fail_storage = fail_storage
        self._rank = rank
        self._attempt = attempt  # names the copies kept in memory
        self._fail = fail
        self._memory = memory  # JAXTRAIN_CHECKPOINT_IN_MEMORY=1: where copies are kept
        self._peers = peers  # and, across hosts, who keeps a second one
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple] = collections.deque()
        self._busy = False  # an item is taken off the queue and not yet sent
        self._thread: threading.Thread | None = None

    @property
    def holds_copies(self) -> bool:
        return self._memory is not None

    def report(self, round_: int, text: str) -> None:
        with self._cv:
            if not self._queue and not self._busy:
                self._client.report(round_, text)
                return
            self._queue.append((round_, text, None))

    def checkpoint(self, round_: int, text: str, snapshot: Any, description: dict) -> None:
        with self._cv:
            self._queue.append((round_, text, (snapshot, description)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxtrain-stager",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def drain(self) -> None:
        """Returns once everything queued has been sent."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._busy)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                round_, text, work = self._queue.popleft()
                self._busy = True
            try:
                if work is None:
                    self._client.report(round_, text)
                else:
                    snapshot, description = work
                    staging = description["staging"]
                    try:
                        # A part with a copy in memory is staged with each file's SHA-256, which
                        # the manifest then vouches for the copies with (docs/checkpoint-memory.md);
                        # one uploaded to object storage gets its SHA-256s while it is uploaded.
                        description["files"] = snapshot.write(staging,
                                                              release=self._memory is None,
                                                              sha256=self._memory is not None)
                    except Exception as e:
                        self._fail(f"report(checkpoint=...) on rank {self._rank}: staging the "
                                   f"checkpoint of round {round_} into '{staging}' "
                                   f"in the background failed: {type(e).__name__}: {e}")
                    if self._store is not None:
                        upload(self._store, description, round_, self._fail_storage)
                    if self._memory is not None:
                        # Before the report, which names the copy: every part of a committed
                        # checkpoint then has its copy, unless keeping it failed (said in the
                        # log, and then the report names none).
                        copy_id = uuid.uuid4().hex
                        if self._hold(round_, snapshot, copy_id):
                            description["copy_id"] = copy_id
                    del snapshot, work
                    self._client.report_checkpoint(round_, json.dumps(description), text)
            except Exception as e:
                self._fail(f"report() on rank {self._rank}: sending the report of round {round_} "
                           f"in the background failed: {type(e).__name__}: {e}")
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _hold(self, round_: int, snapshot: Any, copy_id: str) -> bool:
        """Keeps a copy of the snapshot just staged in this host's memory, and sends that copy to
        this rank's peer (checkpoint_peers.py) when there is one; whether the copy was kept. A
        copy that cannot be kept (a full memory filesystem, one above the memory budget, a store
        that is not this user's) is said on stderr in one line and not sent, so the restores of
        its checkpoint read storage; one that cannot be sent is said once, and only this host
        holds it."""
        assert self._memory is not None
        written = None
        try:
            written = self._memory.prepare(self._attempt, round_, snapshot.bytes)
            self._memory.keep(written, self._attempt, round_,
                              snapshot.write(written, sha256=True), copy_id)
        except Exception as e:
            if written is not None:
                shutil.rmtree(written, ignore_errors=True)
            sys.stderr.write(f"jaxtrain worker: rank {self._rank}: keeping the checkpoint of "
                             f"round {round_} in host memory failed ({type(e).__name__}: {e}); "
                             "a restart restores it from storage\n")
            sys.stderr.flush()
            return False
        if self._peers is None:
            return True
        try:
            self._peers.replicate(copy_id)
        except Exception as e:  # PeerError, OSError, a peer of another version: never fatal
            self._peers.say_once("replicate", f"sending the checkpoint of round {round_} to its "
                                 f"peer, rank {self._peers.peer}, failed ({e}); where this "
                                 "host's copy is lost, a restart reads storage (said once)")
        return True


def upload(store: Store, description: dict, round_: int,
           fail_storage: Callable[[str, str], NoReturn] | None) -> None:
    """Uploads the part staged at description["staging"] to the store, then makes `description`
    the store's kind (no staging directory). An upload that fails ends the worker with the
    cause "storage" (fail_storage), or raises StoreError without it."""
    staging = description.pop("staging")
    try:
        store.upload(staging, description["files"], description["dir_name"])
    except StoreError as e:
        if fail_storage is None:
            raise
        fail_storage(f"report(checkpoint=...) on rank {store.rank}: the checkpoint of round "
                     f"{round_}: {e}", status_code(e.__cause__))
    description["store"] = True


class _Session:
    def __init__(self, client: Any, context: TrainContext, checkpoint: Checkpoint | None,
                 fail: Callable[[str], NoReturn], memory: HostMemory | None = None,
                 peers: Peers | None = None, store: Store | None = None,
                 fail_storage: Callable[[str, str], NoReturn] | None = None):
        self.client = client
        self.context = context
        self.checkpoint = checkpoint  # the committed checkpoint this attempt started from
        self.round = 0
        self.lock = threading.Lock()
        self.store = store
        self.fail_storage = fail_storage
        self.stager = _Stager(client, context.world_rank, fail, memory, peers, context.attempt,
                              store, fail_storage)
        self.snapshot_budget = snapshot_budget_bytes(context.local_world_size)
        self.said_over_budget = False

    def wait_checkpoints_settled(self) -> None:
        """Returns once this rank's checkpoints are staged, reported and their commits ended."""
        self.stager.drain()
        self.client.wait_checkpoints_settled()

    def flush(self) -> None:
        """Returns once every report of this rank has been sent (before the worker says done or
        reports its error)."""
        self.stager.drain()


_session: _Session | None = None


def _install(session: _Session | None) -> None:
    global _session
    _session = session


def _require(what: str) -> _Session:
    if _session is None:
        raise RuntimeError(
            f"jaxtrain.{what}() works only inside the training function that "
            "JaxTrainer.fit() runs on its workers"
        )
    return _session


def _to_json(value: Any) -> Any:
    # numpy and JAX scalars and arrays, which training code reports all the time.
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(
        f"report() metrics must be JSON-serialisable; a value of type "
        f"{type(value).__name__} is not (convert it with float(), int() or str())"
    )


def report(
    metrics: dict,
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
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
    a permission) fails the run, naming the rank and the path. Ranks must write different file
    names into one checkpoint.
    """
    session = _require("report")
    text = _metrics_text(metrics)
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(
            f"report(checkpoint=...) takes a jaxtrain.Checkpoint; got {type(checkpoint).__name__} "
            "(use Checkpoint.from_directory(path))"
        )
    if checkpoint_dir_name is not None and not isinstance(checkpoint_dir_name, str):
        raise TypeError(f"report(checkpoint_dir_name={checkpoint_dir_name!r}) takes a string")
    with session.lock:
        store = session.store
        if checkpoint is not None and store is not None:  # refused before the round counts
            checkpoint_dir_name = store.dir_name(session.round + 1, checkpoint_dir_name)
        session.round += 1
        if checkpoint is None:
            session.stager.report(session.round, text)
            return
        from jaxtrain import _core, data

        data._save_positions(checkpoint.path)  # the tracked iterators' positions, with the files
        ctx = session.context
        staging = store.staging(session.round) if store is not None else os.path.join(
            ctx.run_dir, ".staging", f"a{ctx.attempt}-r{session.round}-rank{ctx.world_rank}"
        )
        # Back-pressure: the previous checkpoint is staged and its commit has ended before this
        # one is read, so one snapshot at most is held in memory.
        session.wait_checkpoints_settled()
        description = {"staging": staging, "dir_name": checkpoint_dir_name}
        try:
            snapshot = _core.snapshot_directory(checkpoint.path, session.snapshot_budget)
            if snapshot is None:
                _say_over_budget(session, checkpoint.path)
                description["files"] = _core.stage_directory(checkpoint.path, staging,
                                                             durable=False)
        except (FileNotFoundError, ValueError, PermissionError) as e:
            raise type(e)(f"report(checkpoint=...) on rank {ctx.world_rank}: {e}") from None
        if snapshot is None:  # copied: nothing is queued (drained above), so it goes now
            if store is not None:
                upload(store, description, session.round, session.fail_storage)
            session.client.report_checkpoint(session.round, json.dumps(description), text)
        else:
            session.stager.checkpoint(session.round, text, snapshot, description)


def _report_in_store(metrics: dict, dir_name: str, files: list[dict]) -> None:
    """``report(metrics)`` with this rank's part of a checkpoint that is already in place on the
    store (jaxtrain.orbax): `files` (as Store.describe gives them) in ``<run>/<dir_name>/``, the
    name session.store.dir_name gave for this report. Nothing is staged or uploaded; the round
    counts, waits for the previous checkpoint and goes after the queued reports as with
    ``report(checkpoint=)``."""
    session = _require("report")
    text = _metrics_text(metrics)
    description = {"store": True, "dir_name": dir_name, "files": files}
    with session.lock:
        session.round += 1
        session.wait_checkpoints_settled()
        session.client.report_checkpoint(session.round, json.dumps(description), text)


def _metrics_text(metrics: Any) -> str:
    """The metrics of a report as the controller takes them: a dict, as JSON."""
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics) takes a dict; got {type(metrics).__name__}")
    return json.dumps(metrics, default=_to_json)


def _say_over_budget(session: _Session, path: str) -> None:
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
    return _require("get_checkpoint").checkpoint


def get_context() -> TrainContext:
    """This worker's ranks, world size and experiment name."""
    return _require("get_context").context
