"""The stager of a rank's checkpoints (the session's, jaxtrain.session): a thread that writes
each checkpoint's snapshot into its staging directory (or, where the rank's host writes to object
storage itself, uploads it from memory), keeps its copies in host memory, and sends the reports
in round order.
Runs in each worker, and in local mode's driver, whose process is the one rank."""

from __future__ import annotations

import collections
import json
import shutil
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

from jaxtrain.worker.checkpoint_memory import HostMemory
from jaxtrain.worker.checkpoint_peers import Peers
from jaxtrain.worker.checkpoint_store import Store, StoreError, status_code


class Stager:
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
        self._closed = False  # close(): the thread ends once the queue is empty
        self._thread: threading.Thread | None = None

    @property
    def holds_copies(self) -> bool:
        return self._memory is not None

    def report(self, round_: int, text: str) -> bool:
        """Sends a metrics-only report now, or queues it behind the checkpoints being staged;
        either way the client counts the round at once (WorkerClient::NoteRound). Returns
        whether a profile request waits (jaxtrain profile), which the client says with it."""
        with self._cv:
            if not self._queue and not self._busy:
                return self._client.report(round_, text)
            self._queue.append((round_, text, None))
            return self._client.note_round(round_)

    def checkpoint(self, round_: int, text: str, snapshot: Any, description: dict,
                   prepare: Callable[[dict], Any] | None = None,
                   delete: str | None = None) -> None:
        """Queues the checkpoint of a round: `snapshot` written into description["staging"] (in
        a store run: described and uploaded from memory), or, without one, `prepare(description)`
        run on this thread to fill in description["files"] (checkpoint_upload_mode=ASYNC),
        returning the snapshot it read the part into, to upload from, or None where it staged
        it; then the part uploaded (a store run), `delete` (the user's directory) removed, and
        the report sent."""
        with self._cv:
            self._queue.append((round_, text, (snapshot, description, prepare, delete)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxtrain-stager",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def drain(self) -> None:
        """Returns once everything queued has been sent."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._busy)

    def close(self) -> None:
        """Ends the thread once everything queued has been sent (a worker's process ends with
        it; local mode's driver goes on)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                round_, text, work = self._queue.popleft()
                self._busy = True
            try:
                if work is None:
                    self._client.report(round_, text)
                else:
                    snapshot, description, prepare, delete = work
                    staging = description["staging"]
                    read = None  # an ASYNC part of a store run, read into memory by prepare
                    try:
                        if prepare is not None:
                            read = prepare(description)
                        elif self._store is None:  # a store's part goes up from memory: upload()
                            # A part with a copy in memory is staged with each file's SHA-256,
                            # which the manifest then vouches for the copies with
                            # (docs/checkpoint-memory.md).
                            description["files"] = snapshot.write(
                                staging, release=self._memory is None,
                                sha256=self._memory is not None)
                    except Exception as e:
                        self._fail(f"report(checkpoint=...) on rank {self._rank}: staging the "
                                   f"checkpoint of round {round_} into '{staging}' "
                                   f"in the background failed: {type(e).__name__}: {e}")
                    if self._store is not None:
                        upload(self._store, description, round_, self._fail_storage,
                               snapshot if prepare is None else read)
                        if read is not None:
                            read.release()
                        if self._memory is None and snapshot is not None:
                            snapshot.release()
                    if delete is not None:
                        delete_local(delete, self._rank)
                    if self._memory is not None and snapshot is not None:
                        # Before the report, which names the copy: every part of a committed
                        # checkpoint then has its copy, unless keeping it failed (said in the
                        # log, and then the report names none).
                        copy_id = uuid.uuid4().hex
                        if self._hold(round_, snapshot, copy_id):
                            description["copy_id"] = copy_id
                    del snapshot, work, prepare, read
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
           fail_storage: Callable[[str, str], NoReturn] | None, snapshot: Any = None) -> None:
    """Uploads the part to the store: from `snapshot`'s memory where it is given (its files
    described meanwhile, into description["files"]), else from where it was staged
    (description["staging"]); then makes `description` the store's kind (no staging
    directory). An upload that fails ends the worker with the cause "storage" (fail_storage),
    or raises StoreError without it."""
    staging = description.pop("staging")
    try:
        if snapshot is not None:
            description["files"] = store.upload_snapshot(snapshot, description["dir_name"])
        else:
            store.upload(staging, description["files"], description["dir_name"])
    except StoreError as e:
        if fail_storage is None:
            raise
        fail_storage(f"report(checkpoint=...) on rank {store.rank}: the checkpoint of round "
                     f"{round_}: {e}", status_code(e.__cause__))
    description["store"] = True


def delete_local(path: str, rank: int) -> None:
    """Deletes a reported directory once its files are in the run's storage; a failure is said
    on stderr, never fatal (the checkpoint is safe)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        sys.stderr.write(f"jaxtrain worker: rank {rank}: deleting the reported checkpoint "
                         f"directory '{path}' after its upload failed ({e})\n")
        sys.stderr.flush()
