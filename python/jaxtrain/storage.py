"""Run directories on fsspec filesystems: ``s3://``, ``gs://``, ``memory://`` and the like.

The C++ engine writes a run to a POSIX directory (local disk or NFS), where a checkpoint commits by
an atomic rename. For any other storage the driver keeps that directory as a local *staging copy*
and mirrors it to the remote run directory with a ``Mirror``:

* at the start, ``pull()`` checks that the remote run directory can be written, deletes what an
  interrupted upload left there, and rebuilds the staging copy from it (the run's records, its logs,
  every kept checkpoint's manifest, and the files of the newest checkpoint whose remote files
  match their manifest), so that the engine resumes exactly as from a local run directory;
* as soon as each checkpoint is committed, every second while the run goes on, and once more at
  its end, ``push()`` uploads each newly committed checkpoint (its files, streamed; then its
  manifest), then the records, then the index ``checkpoints.json`` in one PUT, and only then
  deletes the checkpoints the index no longer holds;
  a directory name that a later round reuses is first dropped from the remote index, then deleted
  and uploaded again, so the index never names a directory that is being replaced.

Object stores keep neither file modes nor symbolic links: each checkpoint's manifest records them
(every file's and directory's mode, every kept link with its target), and a download applies them
again, never wider than the umask, recreating only links that stay inside the checkpoint.

Every local path made from a remote name (an object key under ``logs/``, a ``dir_name`` of the
remote index, a file of a manifest) is checked first: a key that is not a plain relative path
(``_core.is_clean_relative_path``, the rule the commit applies) and a ``dir_name`` that is not one
plain component (the controller's rule) are refused, never written; and every file is opened
directory by directory without following a symbolic link (``O_NOFOLLOW``), so that nothing inside
the local copy redirects a write out of it. Whoever can write objects under the run's prefix
therefore cannot write outside the local copy of the machine that reads the run.

On the remote side a checkpoint therefore exists once the index names it: a reader
(``Result.from_path``, the next ``fit()``) never sees a partial upload, and the next ``pull()``
sweeps one away. Files are copied in chunks, never read whole into memory; an upload that takes
longer than a few seconds reports its progress on the driver's stderr.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import posixpath
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxtrain import _core
from jaxtrain.records import INDEX_FILE, RECORD_FILES, RUN_FILE

# The file in each committed checkpoint directory that lists its files, sizes and checksums
# (written by the engine's CommitCheckpoint).
MANIFEST_NAME = ".jaxtrain_manifest.json"

INDEX_NAME = INDEX_FILE
_CHUNK = 8 << 20
_BLOCK = 8 << 20
_PROGRESS_AFTER_S = 3.0
_PROGRESS_EVERY_S = 5.0
_PUSH_EVERY_S = 1.0
_PROBE_NAME = ".jaxtrain_write_probe"


def remote_filesystem(storage_path: str, storage_filesystem: Any = None,
                      field: str = "RunConfig.storage_path",
                      connect: bool = True) -> tuple[Any, str] | None:
    """The fsspec filesystem and path of a storage path, or None when it is a POSIX path that the
    engine writes itself. ``storage_filesystem`` (fsspec or pyarrow) overrides the URL's scheme.
    With ``connect=False`` only the scheme is checked and nothing is opened (the result is then
    None). Raises ValueError naming the field, the value and what is allowed."""
    if storage_filesystem is not None:
        fs = as_fsspec(storage_filesystem)
        if "file" in _protocols(fs) or "local" in _protocols(fs) or not connect:
            return None
        return fs, fs._strip_protocol(storage_path).rstrip("/")
    if "://" not in storage_path or storage_path.startswith("file://"):
        return None
    scheme = storage_path.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise ValueError(
            f"{field}={storage_path!r} is a URL, which needs the fsspec package (and the one for "
            f"'{scheme}://', e.g. s3fs or gcsfs); install them, or use a local or shared directory"
        ) from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        known = ", ".join(f"{p}://" for p in sorted(fsspec.available_protocols())[:12])
        raise ValueError(
            f"{field}={storage_path!r} uses the scheme '{scheme}://', which no fsspec filesystem "
            f"handles (known: {known}, ...); use one of those or a local or shared directory"
        ) from None
    except ImportError as e:
        raise ValueError(
            f"{field}={storage_path!r} needs a package that is not installed for "
            f"'{scheme}://': {e}"
        ) from None
    if not connect:
        return None
    try:
        fs, path = fsspec.core.url_to_fs(storage_path)
    except Exception as e:  # noqa: BLE001 - a backend may fail in any way when it connects
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise ValueError(
            f"{field}={storage_path!r} cannot be opened: {type(e).__name__}: {reason}"
        ) from None
    return fs, path.rstrip("/")


def as_fsspec(filesystem: Any) -> Any:
    """An fsspec filesystem for an fsspec or pyarrow filesystem object (Ray accepts pyarrow's)."""
    try:
        import fsspec
    except ImportError:
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return filesystem
    if type(filesystem).__module__.startswith("pyarrow"):
        from fsspec.implementations.arrow import ArrowFSWrapper

        return ArrowFSWrapper(filesystem)
    raise ValueError(
        f"RunConfig.storage_filesystem={filesystem!r} is not allowed; pass an fsspec filesystem "
        "(fsspec.AbstractFileSystem) or a pyarrow.fs.FileSystem"
    )


def url(fs: Any, path: str) -> str:
    """`path` on `fs` as a URL, for messages."""
    protocol = _protocols(fs)[0]
    return f"{protocol}://{path}"


def staging_dir(fs: Any, root: str) -> str:
    """The local staging copy of the remote run directory `root`: under $JAXTRAIN_STAGING_DIR, by
    default ~/.cache/jaxtrain/staging (on Slurm across hosts it must be a shared directory)."""
    base = os.environ.get("JAXTRAIN_STAGING_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxtrain", "staging")
    safe = re.sub(r"[^A-Za-z0-9._/-]", "_", root).strip("/").replace("..", "_")
    return os.path.abspath(os.path.join(base, _protocols(fs)[0], safe))


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


class _Progress:
    """Bytes moved in one pass, shown on stderr once the pass has run for a few seconds."""

    def __init__(self, verb: str, where: str) -> None:
        self.verb, self.where = verb, where
        self.start = self.last = time.monotonic()
        self.done = 0
        self.total = 0
        self.what = ""
        self.shown = False

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.start >= _PROGRESS_AFTER_S and (not self.shown
                                                      or now - self.last >= _PROGRESS_EVERY_S):
            self.last, self.shown = now, True
            self._say(f"{_size(self.done)} of {_size(self.total)} ({self._rate(now)})")

    def finish(self) -> None:
        if self.shown:
            now = time.monotonic()
            self._say(f"{_size(self.done)} in {now - self.start:.1f} s ({self._rate(now)}), done")

    def _rate(self, now: float) -> str:
        return f"{_size(self.done / max(now - self.start, 1e-9))}/s"

    def _say(self, text: str) -> None:
        print(f"jaxtrain: {self.verb} {self.what} {self.where}: {text}", file=sys.stderr,
              flush=True)


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _copy(read, write, progress: _Progress | None) -> None:
    while chunk := read(_CHUNK):
        write(chunk)
        if progress is not None:
            progress.add(len(chunk))


class Mirror:
    """Keeps the remote run directory `root` on `fs` a copy of the committed state of the local
    run directory `local`; see the module docstring for the order of writes."""

    def __init__(self, fs: Any, root: str, local: str) -> None:
        self.fs, self.root, self.local = fs, root, local
        self.url = url(fs, root)
        self._uploaded: dict[str, int] = {}  # checkpoint -> its round, as the remote index may name
        self._remote: list[dict] = []  # the records the remote index names now
        self._sent: dict[str, tuple[int, int]] = {}  # record/log file -> (size, mtime_ns) sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._index_sent = b""  # the remote index as last written
        self.store_direct = False  # pull() says

    # --- start: from remote to staging ------------------------------------------------------

    def pull(self, store_direct: bool = False) -> None:
        """Checks the remote run directory is writable, sweeps interrupted uploads from it, and
        rebuilds the local staging copy from it. When the staging copy left by an earlier run
        holds a checkpoint newer than any on the storage (its driver died, or the storage failed,
        before the upload), that copy is uploaded first instead. With `store_direct` (the
        workers read and write the checkpoints on the storage themselves: checkpoint_store.py)
        the copy gets only the checkpoints' manifests, marked as in the store, and only of
        those whose remote files have their manifest's sizes. Raises ValueError when the storage
        cannot be written."""
        self.store_direct = store_direct
        self.fs.invalidate_cache()
        self._check_writable()
        index = self._remote_index()
        records = index.get("checkpoints", [])
        kept = [c["dir_name"] for c in records]
        self._uploaded = {c["dir_name"]: c["round"] for c in records}
        self._remote = list(records)
        # Only for a run the storage still has: a run deleted there starts afresh.
        if (self._newest_round(self._local_index()) > self._newest_round(index)
                and self.fs.exists(posixpath.join(self.root, RUN_FILE))):
            print(f"jaxtrain: {self.local} holds checkpoints that {self.url} lacks (an upload "
                  "that did not finish); uploading them first", file=sys.stderr)
            self.push(with_logs=True)
            # Swept only now: a checkpoint the workers uploaded, committed here but not yet
            # there, has its manifest and its place in the index on the storage from now on.
            self._sweep()
            return
        self._sweep()
        if os.path.exists(self.local):
            shutil.rmtree(self.local)
        os.makedirs(self.local)
        self._download_records(index)
        restore = None
        for name in reversed(kept):
            manifest = self._download_manifest(name)
            if store_direct:
                self._mark_in_store(name, manifest)
                continue
            if manifest is not None and "location" in manifest:
                # Read from the staging copy now, not from the storage: checked here.
                manifest.pop("location")
                self._write_manifest(name, manifest)
            if manifest is not None and restore is None and self._matches(name, manifest):
                restore = name
                self._download_checkpoint(name, manifest)

    def _mark_in_store(self, name: str, manifest: dict | None) -> None:
        """Keeps the local manifest of `name`, marked as in the store (where the workers read
        it), when its remote files match it; else removes it, so that the engine does not index
        it. Without a manifest on the storage it is no checkpoint."""
        local = os.path.join(self.local, name)
        if manifest is None or not self._matches(name, manifest):
            shutil.rmtree(local, ignore_errors=True)
            return
        if manifest.get("location") != "store":
            self._write_manifest(name, dict(manifest, location="store"))

    def _write_manifest(self, name: str, manifest: dict) -> None:
        with os.fdopen(_create_inside(self.local, [name, MANIFEST_NAME]), "w",
                       encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=1) + "\n")

    @staticmethod
    def _newest_round(index: dict) -> int:
        return max((c["round"] for c in index.get("checkpoints", [])), default=0)

    def _check_writable(self) -> None:
        probe = posixpath.join(self.root, _PROBE_NAME)
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 - any backend's failure is the same answer
            raise ValueError(
                f"RunConfig.storage_path: the run directory {self.url!r} cannot be written: "
                f"{type(e).__name__}: {e}"
            ) from None

    def _remote_index(self) -> dict:
        path = posixpath.join(self.root, INDEX_NAME)
        if not self.fs.exists(path):
            return {}
        try:
            index = json.loads(self.fs.cat_file(path))
            records = index.get("checkpoints", [])
            if not isinstance(records, list) or not all(isinstance(c, dict) for c in records):
                raise ValueError("'checkpoints' is not a list of records")
        except (ValueError, UnicodeDecodeError, AttributeError) as e:
            raise ValueError(
                f"the checkpoint index {url(self.fs, path)!r} is damaged: {e}") from None
        kept = []
        for c in records:
            if valid_dir_name(c.get("dir_name")) and isinstance(c.get("round"), int):
                kept.append(c)
            else:
                print(f"jaxtrain: warning: ignoring the record {json.dumps(c)[:200]} of "
                      f"{url(self.fs, path)!r}: its dir_name is not one plain directory name "
                      "(no '/', not beginning with '.') or it has no whole-number round",
                      file=sys.stderr)
        return dict(index, checkpoints=kept)

    def _sweep(self) -> None:
        """Deletes remote directories that the remote index does not name: interrupted
        uploads."""
        kept = {c["dir_name"] for c in self._remote}
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:  # object stores have no empty directories
            return
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry["type"] == "directory" and name not in kept and name != "logs":
                print(f"jaxtrain: removing {url(self.fs, entry['name'])}: an upload that did "
                      "not finish", file=sys.stderr)
                self.fs.rm(entry["name"], recursive=True)

    def _download_records(self, index: dict) -> None:
        """The records, the logs, and `index` (the remote index as _remote_index() read it: only
        its valid records)."""
        for name in RECORD_FILES:
            self._get(posixpath.join(self.root, name), [name])
        if index:
            with os.fdopen(_create_inside(self.local, [INDEX_NAME]), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=1) + "\n")
        logs = posixpath.join(self.root, "logs")
        if self.fs.exists(logs):
            for path in self.fs.find(logs):
                rel = path[len(logs) + 1:] if path.startswith(logs + "/") else ""
                if not _core.is_clean_relative_path(rel):
                    print(f"jaxtrain: warning: not copying {url(self.fs, path)!r}: its key is not "
                          f"a plain relative path under {url(self.fs, logs)!r} (no '..', '.' or "
                          "empty parts)", file=sys.stderr)
                    continue
                self._get(path, ["logs", *rel.split("/")])

    def _download_manifest(self, name: str) -> dict | None:
        remote = posixpath.join(self.root, name, MANIFEST_NAME)
        if not self._get(remote, [name, MANIFEST_NAME]):
            return None
        try:
            with open(os.path.join(self.local, name, MANIFEST_NAME), encoding="utf-8") as f:
                return json.load(f)
        except ValueError:
            return None

    def _matches(self, name: str, manifest: dict) -> bool:
        """Whether every file of the remote checkpoint `name` has its manifest's size."""
        base = posixpath.join(self.root, name)
        sizes = {posixpath.relpath(e["name"], base): e["size"]
                 for e in self.fs.find(base, detail=True).values()}
        for f in manifest.get("file_list", []):
            if sizes.get(f["path"]) != f["size"]:
                print(f"jaxtrain: warning: checkpoint {url(self.fs, base)} is not restorable: "
                      f"'{f['path']}' has {sizes.get(f['path'], 'no')} bytes, its manifest says "
                      f"{f['size']}; trying the one before", file=sys.stderr)
                return False
        return True

    def _download_checkpoint(self, name: str, manifest: dict) -> None:
        progress = _Progress("downloading", f"from {self.url}")
        progress.what = name
        progress.total = manifest.get("bytes", 0)
        where = url(self.fs, posixpath.join(self.root, name))
        for f in manifest.get("file_list", []):
            parts = _clean_parts(f["path"], where)
            self._get(posixpath.join(self.root, name, f["path"]), [name, *parts], progress)
        apply_manifest(manifest, os.path.join(self.local, name), where)
        progress.finish()

    def _get(self, remote: str, parts: list[str], progress: _Progress | None = None) -> bool:
        """Downloads `remote` to the path `parts` inside the local copy."""
        return _download(self.fs, remote, self.local, parts, progress)

    # --- during and after the run: from staging to remote -----------------------------------

    def start(self, wait_for_commits: Callable[[int, float], int] | None = None) -> None:
        """Pushes in a background thread until ``close()``: every second, and with
        `wait_for_commits` (the controller's: ``(seen, timeout_s) -> committed``, returning
        early once more than `seen` checkpoints are committed) as soon as a checkpoint is
        committed, so that its manifest, the commit on the storage, goes up when its last part
        is in and not at the next poll."""
        self._thread = threading.Thread(target=self._loop, args=(wait_for_commits,),
                                        name="jaxtrain-mirror", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the background pushes, then pushes the final state, logs included. Raises
        RuntimeError when that fails: the run is then complete in the staging copy, and the next
        ``fit()`` of the same run uploads it before anything else."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        try:
            self.push(with_logs=True)
            if self.store_direct:  # what the last attempt's workers uploaded and no one commits
                self._sweep()
        except Exception as e:  # noqa: BLE001 - any backend's failure is the same answer
            raise RuntimeError(
                f"uploading the run to {self.url} failed: {type(e).__name__}: {e}; everything "
                f"is in {self.local}, and running it again by name uploads it first"
            ) from e

    def _loop(self, wait_for_commits: Callable[[int, float], int] | None) -> None:
        """Pushes after each commit and every second; a failed push (the storage unreachable
        for a while) is reported once and retried, since the run itself goes on."""
        failing = ""
        seen = 0
        while not self._stop.is_set():
            if wait_for_commits is None:
                if self._stop.wait(_PUSH_EVERY_S):
                    return
            else:
                started = time.monotonic()
                committed = wait_for_commits(seen, _PUSH_EVERY_S)
                if committed == seen:  # no commit: the second passed, or the run has ended
                    left = _PUSH_EVERY_S - (time.monotonic() - started)
                    if self._stop.wait(max(left, 0.0)):
                        return
                seen = committed
            try:
                self.push()
                failing = ""
            except Exception as e:  # noqa: BLE001 - retried; close() reports a lasting failure
                if not failing:
                    print(f"jaxtrain: warning: uploading to {self.url} failed "
                          f"({type(e).__name__}: {e}); retrying", file=sys.stderr)
                failing = str(e)

    def push(self, with_logs: bool = False) -> None:
        """One pass: new checkpoints (files, then manifest), records, the index, deletions."""
        index = self._local_index()
        records = index.get("checkpoints", [])
        progress = _Progress("uploading", f"to {self.url}")
        for r in records:
            if self._uploaded.get(r["dir_name"]) != r["round"]:
                if r["dir_name"] in self._uploaded:  # a name reused by a later round
                    self._write_index(index, [c for c in self._remote
                                              if c["dir_name"] != r["dir_name"]])
                self._uploaded.pop(r["dir_name"], None)
                if self._upload_checkpoint(r, progress):
                    self._uploaded[r["dir_name"]] = r["round"]
        progress.finish()
        for name in RECORD_FILES:
            self._put_if_changed(name)
        if with_logs:
            logs = os.path.join(self.local, "logs")
            for dirpath, _, files in os.walk(logs):
                for f in files:
                    self._put_if_changed(os.path.relpath(os.path.join(dirpath, f), self.local))
        kept = [r for r in records if self._uploaded.get(r["dir_name"]) == r["round"]]
        named = {r["dir_name"] for r in kept}
        if records or self._uploaded:
            self._write_index(index, kept)
        for gone in sorted(set(self._uploaded) - named):
            self.fs.rm(posixpath.join(self.root, gone), recursive=True)
            del self._uploaded[gone]

    def _write_index(self, index: dict, kept: list[dict]) -> None:
        """The remote index, naming exactly `kept`, in one PUT."""
        remote_index = dict(index, checkpoints=kept, latest=kept[-1]["dir_name"] if kept else None)
        text = (json.dumps(remote_index, indent=1) + "\n").encode()
        if text != self._index_sent:
            self.fs.pipe_file(posixpath.join(self.root, INDEX_NAME), text)
            self._index_sent = text
        self._remote = list(kept)

    def _local_index(self) -> dict:
        try:
            with open(os.path.join(self.local, INDEX_NAME), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def _upload_checkpoint(self, record: dict, progress: _Progress) -> bool:
        """Uploads one committed checkpoint, manifest last. False when retention deleted it
        locally before it was uploaded: it will not be in the index again."""
        name = record["dir_name"]
        local = os.path.join(self.local, name)
        remote = posixpath.join(self.root, name)
        try:
            with open(os.path.join(local, MANIFEST_NAME), encoding="utf-8") as f:
                manifest = json.load(f)
            if manifest.get("location") == "store":
                # The workers uploaded its files there: the manifest, last, commits it.
                self._put(os.path.join(local, MANIFEST_NAME),
                          posixpath.join(remote, MANIFEST_NAME))
                return True
            if self.fs.exists(remote):  # a directory name reused by a later round
                self.fs.rm(remote, recursive=True)
            progress.what = name
            progress.total += manifest.get("bytes", 0)
            for f in manifest.get("file_list", []):
                self._put(os.path.join(local, *f["path"].split("/")),
                          posixpath.join(remote, f["path"]), progress)
            self._put(os.path.join(local, MANIFEST_NAME), posixpath.join(remote, MANIFEST_NAME))
        except FileNotFoundError:
            if self.fs.exists(remote):
                self.fs.rm(remote, recursive=True)
            return False
        return True

    def _put_if_changed(self, rel: str) -> None:
        local = os.path.join(self.local, rel)
        try:
            st = os.stat(local)
        except FileNotFoundError:
            return
        if self._sent.get(rel) != (st.st_size, st.st_mtime_ns):
            self._put(local, posixpath.join(self.root, *rel.split(os.sep)))
            self._sent[rel] = (st.st_size, st.st_mtime_ns)

    def _put(self, local: str, remote: str, progress: _Progress | None = None) -> None:
        # Object stores upload in parts of block_size, which the client buffers: small parts keep
        # the driver's memory flat; S3 allows at most 10,000 parts to an object.
        block = max(_BLOCK, -(-os.path.getsize(local) // 9000))
        with open(local, "rb") as src, self.fs.open(remote, "wb", block_size=block) as dst:
            _copy(src.read, dst.write, progress)


def local_view(fs: Any, root: str) -> str:
    """A temporary local copy of a remote run directory's records, logs and checkpoint manifests
    (no checkpoint files), for reading it as a local run directory. The caller removes it."""
    view = tempfile.mkdtemp(prefix="jaxtrain-run-")
    mirror = Mirror(fs, root, view)
    fs.invalidate_cache()
    if not fs.exists(posixpath.join(root, RUN_FILE)):
        shutil.rmtree(view)
        raise FileNotFoundError(f"{url(fs, root)!r} is not a jaxtrain run directory: it has no "
                                "run.json")
    try:
        index = mirror._remote_index()
        mirror._download_records(index)
        for c in index.get("checkpoints", []):
            mirror._download_manifest(c["dir_name"])
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


def download_tree(fs: Any, root: str, target: str, skip: tuple[str, ...] = ()) -> None:
    """Copies every file under `root` on `fs` into the local directory `target`, streaming; when
    `root` is a committed checkpoint, its files then get their recorded modes and its kept links
    are recreated (apply_manifest). Raises ValueError for a remote name that would land outside
    `target`."""
    progress = _Progress("downloading", f"from {url(fs, root)}")
    files = fs.find(root, detail=True)
    progress.total = sum(e["size"] for e in files.values())
    progress.what = posixpath.basename(root)
    manifest = None
    os.makedirs(target, exist_ok=True)
    prefix = root.rstrip("/") + "/"
    for path in files:
        if not path.startswith(prefix):
            raise ValueError(f"{url(fs, root)!r} lists {path!r}, which is not inside it; "
                             "refusing to copy it")
        rel = path[len(prefix):]
        parts = _clean_parts(rel, url(fs, root))
        if rel == MANIFEST_NAME:
            with fs.open(path, "rb") as f:
                manifest = json.loads(f.read())
        if rel in skip:
            continue
        _download(fs, path, target, parts, progress)
    if manifest is not None:
        apply_manifest(manifest, target, url(fs, root))
    progress.finish()


_DOWNLOADS = 8  # files downloaded at once
_RANGE = 32 << 20  # a ranged read of a large file
_RANGES = 4  # ranged reads of one file at once


def download_checkpoint(fs: Any, root: str, target: str, first_rank: int | None = None) -> None:
    """Copies the files that the committed checkpoint at `root` on `fs` lists in its manifest
    into the local directory `target`, on up to 8 threads (those `first_rank` wrote first, then
    the largest first; a file above 32 MiB in ranged reads, 4 at once), each checked against the
    manifest's size and CRC-32C while it streams;
    then modes and links as apply_manifest. Objects under `root` that the manifest does not list
    are not copied. Raises ValueError naming the file that differs, or a remote name that would
    land outside `target`; FileNotFoundError when `root` has no manifest."""
    where = url(fs, root)
    try:
        manifest = json.loads(fs.cat_file(posixpath.join(root, MANIFEST_NAME)))
    except FileNotFoundError:
        raise FileNotFoundError(f"{where!r} is not a committed checkpoint: it has no manifest "
                                f"({MANIFEST_NAME})") from None
    files = manifest.get("file_list") if isinstance(manifest, dict) else None
    if not isinstance(files, list):
        raise ValueError(f"checkpoint {where} has a damaged manifest ({MANIFEST_NAME}): "
                         "no list of files")
    for f in files:
        if not isinstance(f, dict) or not all(isinstance(f.get(k), int)
                                              for k in ("size", "crc32c")):
            raise ValueError(f"checkpoint {where} has a damaged manifest ({MANIFEST_NAME}): "
                             f"{json.dumps(f)[:200]} is not a file with a whole-number size "
                             "and crc32c")
        f["_parts"] = _clean_parts(f.get("path"), where)
    files.sort(key=lambda f: (f.get("rank") != first_rank, -f["size"]))
    progress = _Progress("downloading", f"from {where}")
    progress.what = posixpath.basename(root)
    progress.total = sum(f["size"] for f in files)
    os.makedirs(target, exist_ok=True)

    def get(f: dict) -> None:
        remote = posixpath.join(root, f["path"])
        crc = 0
        size = 0
        with os.fdopen(_create_inside(target, f["_parts"]), "wb") as dst:
            for chunk in _read_in_order(fs, remote, f["size"]):
                crc = _core.crc32c(chunk, crc)
                size += len(chunk)
                dst.write(chunk)
                progress.add(len(chunk))
        if size != f["size"] or crc != f["crc32c"]:
            raise ValueError(
                f"checkpoint {where}: {f['path']!r} does not match its manifest: "
                f"{size} bytes with CRC-32C {crc:#010x} where the manifest says {f['size']} bytes "
                f"with {f['crc32c']:#010x} (damaged or replaced on the storage)")

    with ThreadPoolExecutor(max_workers=_DOWNLOADS, thread_name_prefix="jaxtrain-download") as p:
        for done in [p.submit(get, f) for f in files]:
            done.result()
    apply_manifest(manifest, target, where)
    progress.finish()


def _read_in_order(fs: Any, remote: str, expected: int) -> Iterator[bytes]:
    """The bytes of the object `remote`, in order: streamed where the manifest says it holds
    one range or less (`expected` bytes), else in ranged reads of ``_RANGE`` bytes, ``_RANGES``
    at once (a single stream is slower than the store gives one client). Ranges are taken from
    the object's size on the store, so that one longer or shorter than `expected` reads whole
    and fails its check."""
    if expected <= _RANGE:
        with fs.open(remote, "rb") as src:
            while chunk := src.read(_CHUNK):
                yield chunk
        return
    size = fs.info(remote)["size"]
    starts = range(0, size, _RANGE)
    with ThreadPoolExecutor(max_workers=_RANGES, thread_name_prefix="jaxtrain-range") as pool:
        pending: collections.deque = collections.deque()
        for start in starts:
            pending.append(pool.submit(fs.cat_file, remote, start=start,
                                       end=min(start + _RANGE, size)))
            if len(pending) == _RANGES:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _clean_parts(rel: str, where: str) -> list[str]:
    """The parts of a checkpoint-relative path, refusing one that would leave the checkpoint
    (the commit's rule, storage::IsCleanRelativePath)."""
    if not isinstance(rel, str) or not _core.is_clean_relative_path(rel):
        raise ValueError(f"checkpoint {where} names the file {rel!r}, which is not a plain "
                         "relative path inside it (no leading '/', no '..', '.' or empty parts); "
                         "refusing to copy it")
    return rel.split("/")


def valid_dir_name(name: Any) -> bool:
    """Whether a checkpoint's dir_name is one the engine writes and reads (the controller's
    ValidDirName): one plain path component, not beginning with '.', not a record's name."""
    return (isinstance(name, str) and _core.is_clean_relative_path(name) and "/" not in name
            and not name.startswith(".") and name not in (INDEX_NAME, "logs"))


def _open_dir(base: str, parts: list[str], create: bool) -> int:
    """A descriptor of the directory `parts` inside `base`, reached one component at a time
    without following a symbolic link (created when `create`). Raises ValueError naming the part
    that is a link or not a directory."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _not_through(base, parts[:i + 1]) from None
                raise
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_through(base: str, parts: list[str]) -> ValueError:
    return ValueError(f"{os.path.join(base, *parts)!r} is a symbolic link or not a directory; "
                      "refusing to write through it (a copy is written only to plain files and "
                      "directories inside it)")


def _create_inside(base: str, parts: list[str]) -> int:
    """A new, empty file at `parts` inside `base` (its directories made), open for writing; no
    symbolic link on the way or at the end is followed."""
    parent = _open_dir(base, parts[:-1], create=True)
    try:
        return os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                       | os.O_CLOEXEC, 0o666, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            raise _not_through(base, parts) from None
        raise
    finally:
        os.close(parent)


def link_inside(path: str, target: str) -> bool:
    """Whether a link at `path` (relative to a checkpoint) to `target` stays inside it by name."""
    if not target or target.startswith("/"):
        return False
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    return resolved != ".." and not resolved.startswith("../")


def current_umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting it back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_manifest(manifest: dict, target: str, where: str) -> None:
    """Gives the files and directories of a checkpoint copied into `target` the modes its manifest
    records (never wider than the umask; the owner keeps read, and rwx on directories) and
    recreates its kept links, never following a symbolic link inside `target` on the way. Raises
    ValueError, naming the link and its target, for a link that would point outside the
    checkpoint, and naming the path for one that leads through a link."""
    mask = current_umask()
    for f in manifest.get("file_list", []):
        if "mode" in f:
            _chmod_inside(target, _clean_parts(f["path"], where),
                          (int(f["mode"]) | 0o400) & 0o777 & ~mask, directory=False)
    for d in manifest.get("dirs", []):
        _chmod_inside(target, _clean_parts(d["path"], where),
                      (int(d["mode"]) | 0o700) & 0o777 & ~mask, directory=True)
    for link in manifest.get("links", []):
        path, link_target = link["path"], link["target"]
        parts = _clean_parts(path, where)
        if not link_inside(path, link_target):
            raise ValueError(
                f"checkpoint {where} lists a symbolic link {path!r} -> {link_target!r}, which "
                "points outside the checkpoint; refusing to create it")
        parent = _open_dir(target, parts[:-1], create=True)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(parts[-1], dir_fd=parent)
            os.symlink(link_target, parts[-1], dir_fd=parent)
        finally:
            os.close(parent)


def _chmod_inside(target: str, parts: list[str], mode: int, directory: bool) -> None:
    """Sets the mode of the file or directory `parts` inside `target` when it is one (not a link,
    not missing), reaching it without following a link."""
    try:
        parent = _open_dir(target, parts[:-1], create=False)
    except (ValueError, FileNotFoundError):
        return
    try:
        kind = os.O_DIRECTORY if directory else 0
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | kind,
                     dir_fd=parent)
    except OSError:  # missing, a link, or not of that kind
        return
    finally:
        os.close(parent)
    try:
        if directory or stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _download(fs: Any, remote: str, base: str, parts: list[str],
              progress: _Progress | None) -> bool:
    """Streams one file from `fs` to the path `parts` inside the local directory `base` (clean
    parts: the caller checked them), never through a symbolic link; False when it does not
    exist."""
    try:
        src = fs.open(remote, "rb")
    except FileNotFoundError:
        return False
    with src, os.fdopen(_create_inside(base, parts), "wb") as dst:
        _copy(src.read, dst.write, progress)
    return True
