"""Checkpoints written straight to object storage by each rank's own host.

A run whose ``storage_path`` is on an object store (``s3://``, ``gs://``, any fsspec URL) and
whose hosts share no directory with the driver cannot stage its checkpoints in the driver's run
directory. Each rank then uploads its own files of a round directly into the checkpoint's
directory on the store, ``<run>/<dir_name>/``, and tells the controller what it uploaded (paths,
sizes, CRC-32C and SHA-256, computed on this host while the part is uploaded). Once every
rank's part of the round is in, the controller commits a manifest that names them all
(``"location": "store"``), and the driver uploads that manifest as the checkpoint's commit point
and the index after it (``storage.Mirror``): a directory on the store without its manifest is no
checkpoint for any reader, and one the index does not name is swept.

Per rank and round: the files of the part in memory (the snapshot ``report(checkpoint=)``
took, or the one the stager read for an ASYNC report) are uploaded from that memory on up to
``_UPLOADS`` threads, in parts of ``_PART`` bytes, while another thread takes each file's
CRC-32C and SHA-256 in one pass, in C++ without the GIL (upload_snapshot): nothing is written
on this host. A part above the snapshot budget is copied with each file's SHA-256 into a
host-local staging directory (``<$TMPDIR or /tmp>/jaxtrain-<uid>/staging/...``, every level 0700
and checked: jaxtrain.private_dirs), its files are uploaded from there and checked against
those SHA-256s on the way, then the staging copy is deleted (upload).

At the start of every attempt, rank 0 deletes from the store the directories that no committed
checkpoint names (what a failed attempt left) while the other ranks wait at a barrier, so no
upload of the new attempt can race the sweep.

A restart reads from the store: ``get_checkpoint()`` is a ``Checkpoint`` whose ``path`` is on
``filesystem``; ``as_directory()``/``to_directory()`` download the files its manifest lists, in
parallel (a large one in ranged reads), this rank's own first, each checked against its size
and CRC-32C (``storage.download_checkpoint``), and Orbax or tensorstore may read ``path``
without a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import re
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxtrain import private_dirs, storage

_UPLOADS = 8  # files uploaded at once by one rank
_PART = 50 << 20  # a part of an upload from memory: s3fs's multipart chunk
_S3_MAX_PARTS = 10_000  # the parts of one S3 multipart upload, at most
# Set by the driver in the workers' environment when they upload to the store themselves.
STORE_ENV = "JAXTRAIN_RUN_STORE"


class StoreError(Exception):
    """An upload to, or a listing of, the store failed; the message names the host and the URL."""


def round_dir_name(round_: int, asked: str | None) -> str:
    """The name of the checkpoint of the run's round `round_`: `asked`, or
    ``checkpoint_<round>`` as the controller names it; a ValueError for a name the engine
    would not take."""
    name = asked if asked is not None else f"checkpoint_{round_:06d}"
    if not storage.valid_dir_name(name):
        raise ValueError(f"report(checkpoint_dir_name={name!r}) is not allowed; it must be one "
                         "directory name, not starting with '.', and not 'logs' or "
                         f"'{storage.INDEX_NAME}'")
    return name


class Store:
    """The run directory on the object store, as one worker writes and reads it."""

    def __init__(self, fs: Any, root: str, rank: int, attempt: int, first_round: int,
                 committed: list[str], experiment_name: str) -> None:
        self.fs, self.root, self.rank, self.attempt = fs, root, rank, attempt
        self.first_round = first_round
        self.committed = set(committed)
        self.url = storage.url(fs, root)
        self._used: set[str] = set()  # the names this rank wrote in this attempt
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", experiment_name)[:100]
        # This process's own: two runs of one name on a host never share a staging directory.
        self._staging_names = (f"jaxtrain-{os.geteuid()}", "staging", f"{safe}-{os.getpid()}")
        self.staging_root = os.path.join(private_dirs.tmp_base(), *self._staging_names)
        if rank != 0:
            # A client's first request loads its service's description and opens a connection
            # (0.3-1 s of CPU for S3); done while rank 0 sweeps, not by the first upload. Rank 0
            # connects by sweeping.
            threading.Thread(target=self._connect, name="jaxtrain-store-connect",
                             daemon=True).start()

    def _connect(self) -> None:
        with contextlib.suppress(Exception):  # the uploads and their errors come later
            self.fs.exists(self.root)

    # --- writing ---------------------------------------------------------------------------

    def dir_name(self, report_round: int, asked: str | None) -> str:
        """The directory of this attempt's `report_round`-th report on the store: `asked`, or
        ``checkpoint_<round>`` as the controller names it. A name that a committed checkpoint has
        is refused with a ValueError: an object store cannot swap a directory in atomically."""
        name = round_dir_name(self.first_round + report_round - 1, asked)
        if name in self.committed or name in self._used:
            raise ValueError(
                f"report(checkpoint_dir_name={name!r}): {self.url}/{name} is already a checkpoint "
                "of this run, and on object storage a checkpoint cannot be replaced in place (no "
                "atomic rename); give each checkpoint a new name, e.g. with the round in it")
        self._used.add(name)
        return name

    def staging(self, report_round: int) -> str:
        """Where this rank's files of one round are staged when they must be copied before they
        are uploaded (a part above the snapshot budget):
        ``<$TMPDIR or /tmp>/jaxtrain-<uid>/staging/<run>-<pid>/a<A>-r<R>-rank<r>``; made only by
        make_staging. A part read into memory is uploaded from there and never staged."""
        return os.path.join(self.staging_root, f"a{self.attempt}-r{report_round}-rank{self.rank}")

    def make_staging(self, staging: str) -> str:
        """Makes `staging` (a path staging() gave), each level 0700 and checked
        (private_dirs.private_dir): no other user reads a staged part, or replaces one between
        staging and upload. PermissionError naming the level otherwise."""
        return private_dirs.private_dir(
            private_dirs.tmp_base(), *self._staging_names, os.path.basename(staging),
            remedy="or set TMPDIR to a directory of your own")

    def upload(self, staging: str, files: list[dict], dir_name: str) -> None:
        """Uploads the files (as stage_directory described them, each with the SHA-256 computed
        while it was staged) from `staging` into ``<run>/<dir_name>/`` on the store, in parallel,
        then deletes `staging`. What is sent is read from the staged file, opened without
        following links, and hashed again on the way: bytes other than the staged ones (a file
        changed since) are never vouched for. Raises StoreError naming this host, the object's
        URL and the cause."""
        remote = posixpath.join(self.root, dir_name)
        regular = sorted((f for f in files if "link" not in f), key=lambda f: -f["size"])
        progress = storage._Progress(f"rank {self.rank}: uploading", f"to {self.url}")
        progress.what = dir_name
        progress.total = sum(f["size"] for f in regular)

        def put(f: dict, hashes: ThreadPoolExecutor) -> None:
            target = posixpath.join(remote, f["path"])
            where = storage.url(self.fs, target)
            try:
                fd = private_dirs.open_beneath(staging_fd, f["path"], owner=os.geteuid())
            except OSError as e:
                raise StoreError(_failure("uploading", where, e)) from e
            try:
                os.fchmod(fd, 0o600)
                # The SHA-256 of what is sent (the staged copy, in the page cache), by OpenSSL
                # with the CPU's SHA instructions and without the GIL, while it is uploaded from
                # the same open file.
                sha256 = hashes.submit(_sha256_of_fd, fd)
                try:
                    self.fs.put_file(f"/proc/self/fd/{fd}", target)
                except Exception as e:  # noqa: BLE001 - any backend's failure, named the same way
                    sha256.exception()  # waits: it reads the descriptor closed below
                    raise StoreError(_failure("uploading", where, e)) from e
                sent = sha256.result()
            finally:
                os.close(fd)
            if sent != f.get("sha256"):
                raise StoreError(
                    f"uploading {where} from host {os.uname().nodename} failed: the file sent is "
                    f"not the one staged (SHA-256 {sent}, staged {f.get('sha256')}): it changed "
                    "after it was staged, so it is not vouched for")
            progress.add(f["size"])

        staging_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with ThreadPoolExecutor(max_workers=_UPLOADS,
                                    thread_name_prefix="jaxtrain-upload") as pool, \
                    ThreadPoolExecutor(max_workers=_UPLOADS,
                                       thread_name_prefix="jaxtrain-sha256") as hashes:
                for done in [pool.submit(put, f, hashes) for f in regular]:
                    done.result()
        finally:
            os.close(staging_fd)
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.staging_root)  # when no other round of this process is in it
        progress.finish()

    def upload_snapshot(self, snapshot: Any, dir_name: str) -> list[dict]:
        """Uploads the files of `snapshot` (the part read into memory) into
        ``<run>/<dir_name>/`` on the store straight from memory, on up to ``_UPLOADS`` threads,
        without a staging copy: each file is sent in parts of ``_PART`` bytes read from the
        snapshot (an S3 multipart upload for a file of two parts or more, a GCS resumable one,
        ...). Meanwhile a thread of its own takes the files' checksums
        (``snapshot.describe(sha256=True)``: CRC-32C and SHA-256 in one pass, in C++ without the
        GIL), which are returned, as describe() gives them, once both are done. The snapshot does
        not change while it is uploaded, so what is sent is what was hashed. Raises StoreError
        naming this host, the object's URL and the cause."""
        remote = posixpath.join(self.root, dir_name)
        regular = [{"path": path, "size": size} for path, size in snapshot.files()]
        regular.sort(key=lambda f: -f["size"])
        progress = storage._Progress(f"rank {self.rank}: uploading", f"to {self.url}")
        progress.what = dir_name
        progress.total = sum(f["size"] for f in regular)
        s3 = "s3" in _protocols(self.fs)

        def put(f: dict) -> None:
            target = posixpath.join(remote, f["path"])
            try:
                if s3 and f["size"] >= 2 * _PART:
                    # s3fs sends the parts of what it is given concurrently (it takes len() and
                    # slices), each read from memory only when its turn comes.
                    self.fs.pipe_file(target, _Parts(snapshot, f["path"], f["size"]),
                                      chunksize=max(_PART, -(-f["size"] // _S3_MAX_PARTS)))
                elif s3 or f["size"] <= _PART:
                    self.fs.pipe_file(target, snapshot.read(f["path"], 0, f["size"]))
                else:
                    with self.fs.open(target, "wb", block_size=_PART) as out:
                        for offset in range(0, f["size"], _PART):
                            out.write(snapshot.read(f["path"], offset, _PART))
            except Exception as e:  # noqa: BLE001 - any backend's failure, named the same way
                raise StoreError(_failure("uploading", storage.url(self.fs, target), e)) from e
            progress.add(f["size"])

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxtrain-checksums") as sums, \
                ThreadPoolExecutor(max_workers=_UPLOADS,
                                   thread_name_prefix="jaxtrain-upload") as pool:
            described = sums.submit(snapshot.describe, sha256=True)
            for done in [pool.submit(put, f) for f in regular]:
                done.result()
            files = described.result()
        progress.finish()
        return files

    def describe(self, dir_name: str, paths: list[str]) -> list[dict]:
        """The files at `paths` (relative to ``<run>/<dir_name>/``), which another writer put on
        the store (Orbax: jaxtrain/orbax.py), described as an uploaded part describes its own:
        path, size, CRC-32C, mode 0644 and SHA-256, read back from the store on up to
        ``_UPLOADS`` threads (one read of each file). Raises StoreError naming this host, the
        object's URL and the cause."""
        from jaxtrain import _core

        remote = posixpath.join(self.root, dir_name)

        def read(path: str) -> dict:
            target = posixpath.join(remote, path)
            crc, size, sha256 = 0, 0, hashlib.sha256()
            try:
                with self.fs.open(target, "rb") as f:
                    while chunk := f.read(storage._CHUNK):
                        crc = _core.crc32c(chunk, crc)
                        sha256.update(chunk)
                        size += len(chunk)
            except Exception as e:  # noqa: BLE001 - any backend's failure, named the same way
                raise StoreError(_failure("reading", storage.url(self.fs, target), e)) from e
            return {"path": path, "size": size, "crc32c": crc, "mode": 0o644,
                    "sha256": sha256.hexdigest()}

        with ThreadPoolExecutor(max_workers=_UPLOADS,
                                thread_name_prefix="jaxtrain-describe") as pool:
            return list(pool.map(read, paths))

    # --- the attempt's start ---------------------------------------------------------------

    def sweep(self) -> list[str]:
        """Deletes the directories on the store that no committed checkpoint names (what an
        earlier attempt's uploads left); the names deleted. Rank 0 calls it while the others
        wait."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise StoreError(_failure("listing", self.url, e)) from e
        gone = []
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if (entry["type"] == "directory" and name not in self.committed and name != "logs"
                    and not name.startswith(".")):
                try:
                    self.fs.rm(entry["name"], recursive=True)
                except Exception as e:  # noqa: BLE001
                    raise StoreError(_failure("deleting", storage.url(self.fs, entry["name"]),
                                              e)) from e
                gone.append(name)
        return gone

    # --- reading ---------------------------------------------------------------------------

    def checkpoint(self, committed_path: str) -> Any:
        """The Checkpoint on the store of the committed checkpoint whose manifest the driver
        holds at `committed_path`."""
        from jaxtrain.checkpoint import Checkpoint

        checkpoint = Checkpoint(posixpath.join(self.root, os.path.basename(committed_path)),
                                filesystem=self.fs)
        checkpoint._rank = self.rank  # its own files are downloaded first
        return checkpoint


def open_url(storage_path: str) -> Any:
    """The filesystem of a storage URL as this host opens it, with its own credentials. Raises
    StoreError naming this host and the URL."""
    try:
        import fsspec

        return fsspec.core.url_to_fs(storage_path)[0]
    except Exception as e:  # noqa: BLE001 - a missing package, a backend that cannot connect
        raise StoreError(_failure("opening", storage_path, e)) from e


class _Parts:
    """The file at `path` of a snapshot as s3fs's pipe_file takes a large object: its length,
    and each slice (a part) as bytes read from the snapshot when asked for."""

    def __init__(self, snapshot: Any, path: str, size: int) -> None:
        self._snapshot, self._path, self._size = snapshot, path, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(self._size)
        return self._snapshot.read(self._path, start, max(stop - start, 0))


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _sha256_of_fd(fd: int) -> str:
    """The SHA-256 (hex) of the file open as ``fd``, read from its start (pread: the offset is
    left alone)."""
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 8 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def host_cache_dir(*parts: str) -> str:
    """A directory of this host's own under $XDG_CACHE_HOME (default ~/.cache)/jaxtrain."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxtrain", *parts)


def status_code(e: BaseException | None) -> str:
    """The status code the controller's failure policy decides a failure of the store by:
    missing credentials, a permission and a missing bucket are never retried, anything else
    counts as the storage being unavailable (retried)."""
    text = f"{type(e).__name__} {e}"
    if no_credentials(e):
        return "UNAUTHENTICATED"
    if isinstance(e, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return "PERMISSION_DENIED"
    if "NoSuchBucket" in text or (isinstance(e, FileNotFoundError) and "bucket" in text.lower()):
        return "NOT_FOUND"
    return "UNAVAILABLE"


_HINTS = {
    "UNAUTHENTICATED": " (this host has no credentials for the store: give them to its workers, "
                       "e.g. in RunConfig(worker_runtime_env={'env_vars': ...}), the host's "
                       "environment or its credential files)",
    "PERMISSION_DENIED": " (permission denied: this host's credentials may not write there)",
    "NOT_FOUND": " (the bucket does not exist)",
}


def _failure(doing: str, where: str, e: BaseException) -> str:
    reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    hint = _HINTS.get(status_code(e), "")
    if "RequestTimeTooSkewed" in reason or "clock skew" in reason.lower():
        hint = " (this host's clock is far from the store's: synchronise it, e.g. with NTP)"
    return (f"{doing} {where} from host {os.uname().nodename} failed: {type(e).__name__}: "
            f"{reason}{hint}")


def no_credentials(e: BaseException | None) -> bool:
    """Whether `e` says that this host has no credentials for the store (botocore's
    NoCredentialsError, an anonymous caller refused by GCS): retrying on it cannot help."""
    text = f"{type(e).__name__} {e}"
    return ("NoCredentials" in text or "Unable to locate credentials" in text
            or "Anonymous caller" in text or "could not find default credentials" in text.lower())


def say(text: str) -> None:
    sys.stderr.write(f"jaxtrain worker: {text}\n")
    sys.stderr.flush()
