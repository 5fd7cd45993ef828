"""Checkpoints held in host memory (JAXTRAIN_CHECKPOINT_IN_MEMORY=1): each rank keeps its part of
its latest checkpoints on a memory filesystem of its host, so that a group restarted after a
failure reads them from memory instead of from storage.

A host's *store* is ``<JAXTRAIN_MEMORY_DIR, default /dev/shm>/jaxtrain-<uid>/jaxtrain-<key>``,
in this user's own directory (0700, so no other user can make a store of that name first), the
key derived from the run directory's path, so every attempt of a run (and a run resumed by name)
finds it:

    <store>/owner.json                     {"run_dir": ...}: what the sweep reads
    <store>/rank<r>/a<attempt>-r<round>/   a copy of rank r's files of one checkpoint
    <store>/rank<r>/a<attempt>-r<round>.json   the copy's id and its entries (paths, sizes,
                                           CRC-32C, SHA-256 of the bytes written, modes,
                                           mtimes), written last: a copy without it is not used
    <store>/views/rank<r>-a<attempt>/<checkpoint name>/   what get_checkpoint() returned

Every reader and writer first checks that the store and the user's directory are this user's,
0700, and that the memory directory lets no other user replace them (_check_store): nothing of a
store that fails is read, served, written or cleaned up.

A rank writes its copy in the background, after its staging copy and before its report (so
every part of a committed checkpoint has one, unless writing it failed), and keeps its newest two
(the checkpoint being committed and the one before it, which is the latest committed until the
new one is) and the one its current view restored. A file on a memory filesystem outlives the
process that wrote it, so the copies survive the worker's death; they do not survive the host's.

Each copy has an id, a random token that the rank's checkpoint report carries and the commit
records in the manifest ("copies": rank -> id). At a restart each rank builds a *view* of the
checkpoint it restores from: every file of the committed checkpoint of which this host holds the
copy that the manifest names for the file's rank, with the manifest's size, CRC-32C and SHA-256
(where the manifest has one), is a hard link to that copy (no data is copied); a file that no
copy here matches (one written by a rank on another host, or whose copy is gone or was written
to) is a symbolic link to the committed file in storage, so it is read from there, and only if
the training function reads it. The view holds the manifest too. Nothing is ever restored from
memory that the manifest does not vouch for, and with no copy at all the checkpoint is restored
from storage as without the switch.

In a local run the controller checks a checkpoint whose every part has its copy here by sizes
only before a restart (storage/memory_copies.h reads this layout).

Freed: by the driver on its own host when ``fit()`` ends; on every host by its local rank 0 when
the run ends normally (end_of_run); otherwise by the next worker started there with the switch
on, which removes the stores of runs that ended (_running). A copy is kept only within the
memory budget (JAXTRAIN_MEMORY_BUDGET_MIB; check_budget). docs/checkpoint-memory.md has the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import threading
from dataclasses import dataclass
from typing import NamedTuple

from jaxtrain import private_dirs
from jaxtrain.storage import MANIFEST_NAME

IN_MEMORY_ENV = "JAXTRAIN_CHECKPOINT_IN_MEMORY"
MEMORY_DIR_ENV = "JAXTRAIN_MEMORY_DIR"
BUDGET_ENV = "JAXTRAIN_MEMORY_BUDGET_MIB"
DEFAULT_MEMORY_DIR = "/dev/shm"
_OWNER = "owner.json"
_HELD = re.compile(r"a(\d+)-r(\d+)")
# What a user whose store is refused can do (private_dirs).
_REMEDY = f"or set {MEMORY_DIR_ENV} to a directory of your own"


def enabled() -> bool:
    return os.environ.get(IN_MEMORY_ENV) == "1"


def memory_dir() -> str:
    """JAXTRAIN_MEMORY_DIR, absolute (the driver passes it on so), or /dev/shm."""
    return os.path.abspath(os.environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_DIR)


def user_dir() -> str:
    """This user's directory in the memory directory, where all its stores are:
    ``<memory dir>/jaxtrain-<uid>``, 0700."""
    return os.path.join(memory_dir(), f"jaxtrain-{os.geteuid()}")


def store_path(run_dir: str) -> str:
    """This host's store for the run in ``run_dir``."""
    key = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(user_dir(), f"jaxtrain-{key}")


def remove_store(run_dir: str) -> None:
    """Frees this host's store of the run (the driver, when fit() ends; local rank 0 of every
    host, when the run ends normally). Nothing is removed from a store that fails _check_store."""
    root = store_path(run_dir)
    try:
        _check_store(root)
    except OSError:
        return
    shutil.rmtree(root, ignore_errors=True)


def end_of_run(run_dir: str, local_rank: int) -> None:
    """Called by each worker once the run has ended normally (every rank has finished: the
    worker's jax.distributed.shutdown(), a barrier of all ranks, returned after its done message
    was taken): local rank 0 frees its host's store, so hosts where no driver runs do not keep
    the copies until a later worker's sweep."""
    if local_rank == 0 and os.path.lexists(store_path(run_dir)):
        remove_store(run_dir)
        sys.stderr.write("jaxtrain worker: the run has ended; this host's checkpoint copies in "
                         "memory are freed\n")


def sweep(run_dir: str) -> None:
    """Removes this host's stores of other runs that have ended (_running): the only way a host
    where no driver runs gets its memory back from a run that did not end normally. Also those
    kept directly in the memory directory (where stores were before the user's directory)."""
    own = store_path(run_dir)
    for parent in (os.path.dirname(own), memory_dir()):
        try:
            if parent != memory_dir():
                _check_private(parent)
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            store = os.path.join(parent, name)
            if not name.startswith("jaxtrain-") or store == own:
                continue
            try:
                st = os.lstat(store)
                if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
                    continue  # another user's
                with open(os.path.join(store, _OWNER), encoding="utf-8") as f:
                    other = json.load(f)["run_dir"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a store, or one being created
            if not _running(other):
                shutil.rmtree(store, ignore_errors=True)


class MemoryBudgetError(OSError):
    """A copy that the memory budget has no room for (check_budget)."""


def check_budget(root: str, size: int) -> None:
    """Raises MemoryBudgetError, naming the sizes, when a copy of ``size`` bytes does not fit in
    the store ``root``'s memory filesystem: above JAXTRAIN_MEMORY_BUDGET_MIB together with what the
    store holds already (all its ranks' copies), or above the filesystem's free space; with the
    variable unset, above half the free space (statvfs), so that the copies never fill the
    filesystem that NCCL and other users' jobs need too."""
    if size <= 0:
        return
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    mib = 1 << 20
    budget = os.environ.get(BUDGET_ENV)
    if budget:
        held = sum(found.size for found in _copies(root).values())
        if held + size > int(budget) * mib:
            raise MemoryBudgetError(
                f"a copy of {size / mib:.1f} MiB with the {held / mib:.1f} MiB this host's store "
                f"holds is above {BUDGET_ENV}={budget}")
        if size > free:
            raise MemoryBudgetError(f"a copy of {size / mib:.1f} MiB is above the "
                                    f"{free / mib:.1f} MiB free in '{os.path.dirname(root)}'")
    elif size > free // 2:
        raise MemoryBudgetError(
            f"a copy of {size / mib:.1f} MiB is above half the {free / mib:.1f} MiB free in "
            f"'{os.path.dirname(root)}' (set {BUDGET_ENV} to allow more)")


def _running(run_dir: str) -> bool:
    """Whether the run in ``run_dir`` may still need its copies: its run.json says RUNNING and a
    live driver holds its lock or, where locks do not cross hosts (FUSE, NFS ``nolock``), renews
    its lease (run_lock_holder says either; a driver killed by SIGKILL leaves RUNNING behind, but
    neither a lock nor a fresh lease); True when that cannot be told from here."""
    from jaxtrain import _core, records

    try:
        if records.read_state(run_dir).get("status") != "RUNNING":
            return False
        return _core.run_lock_holder(run_dir) is not None
    except FileNotFoundError:
        return os.path.isdir(run_dir)  # a run directory without run.json yet: starting
    except Exception:  # unreadable here, a lock that cannot be queried: not ours to judge
        return True


@dataclass(frozen=True)
class View:
    """A rank's view of a committed checkpoint (HostMemory.view), in this host's memory."""

    path: str
    in_memory: int  # files linked to copies in this host's memory
    files: int  # files in the checkpoint; the others link to storage
    bytes: int  # the bytes of those in memory


class HostMemory:
    """One rank's side of its host's store."""

    def __init__(self, run_dir: str, rank: int, root: str | None = None) -> None:
        """``root``: the store (default: this host's for the run, store_path)."""
        self.run_dir = run_dir
        self.rank = rank
        self.root = root or store_path(run_dir)
        self.dir = os.path.join(self.root, f"rank{rank}")

    def prepare(self, attempt: int, round_: int, size: int = 0) -> str:
        """A new, empty directory for a copy of this rank's checkpoint of ``round_``, of ``size``
        bytes. What an earlier copy left unfinished here (a worker killed while writing it) is
        removed. Raises PermissionError when the store is not this user's private directory
        (_check_store), MemoryBudgetError when the copy is above the budget (check_budget)."""
        user = os.path.dirname(self.root)
        private_dirs.private_dir(os.path.dirname(user), os.path.basename(user),
                                 os.path.basename(self.root), remedy=_REMEDY)
        check_budget(self.root, size)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        owner = os.path.join(self.root, _OWNER)
        if not os.path.exists(owner):
            _write_atomically(owner, json.dumps({"run_dir": os.path.abspath(self.run_dir)}))
        held = {name for _, name in self._held()}
        for name in os.listdir(self.dir):
            if name.removesuffix(".json") not in held:
                _remove(os.path.join(self.dir, name))
        return os.path.join(self.dir, f".writing-a{attempt}-r{round_}")

    def keep(self, written: str, attempt: int, round_: int, entries: list[dict],
             copy_id: str) -> None:
        """Makes the copy in ``written`` (from prepare) one this rank's restores may use, and frees
        older copies: all but the newest of them (the checkpoint before this one stays the latest
        committed until this one is) and the one this rank's current view restored from (a rank
        that has not yet built its view may still need it). ``entries``: the files as written,
        each with the SHA-256 of the bytes written ("sha256", hex) where it was computed."""
        _check_store(self.root)
        name = f"a{attempt}-r{round_}"
        final = os.path.join(self.dir, name)
        _remove(final)
        os.rename(written, final)
        try:
            files = [e if "link" in e else
                     {**e, "mtime_ns": os.stat(os.path.join(final, e["path"])).st_mtime_ns}
                     for e in entries]
            _write_atomically(final + ".json", json.dumps({"id": copy_id, "files": files}))
        except OSError:
            _remove(final)
            raise
        restored = self._restored_ids(attempt)
        for _, old in sorted(self._held(), reverse=True)[2:]:  # newest first
            record = _record(os.path.join(self.dir, old))
            if record is not None and record["id"] in restored:
                continue
            os.unlink(os.path.join(self.dir, old + ".json"))
            _remove(os.path.join(self.dir, old))

    def copy_named(self, copy_id: str) -> tuple[str, dict] | None:
        """This rank's kept copy ``copy_id``: its directory and its record; None when there is
        no such copy here (nor a store). Raises PermissionError when the store fails
        _check_store."""
        try:
            _check_store(self.root)
        except FileNotFoundError:
            return None
        for _, name in self._held():
            copy = os.path.join(self.dir, name)
            record = _record(copy)
            if record is not None and record["id"] == copy_id:
                return copy, record
        return None

    def missing_part(self, checkpoint_dir: str
                     ) -> tuple[str, dict[str, tuple[int, int, str | None]]] | None:
        """What this host lacks to restore this rank's own part of the committed checkpoint in
        ``checkpoint_dir`` from memory: the id of the part's copy and its files (path -> (size,
        CRC-32C, SHA-256 hex or None in a manifest from before hashes)), as the manifest names
        them; None when this host holds that part unchanged, or the manifest names no copy of it
        (or cannot be read), or this host's store fails _check_store (the restore then says
        why)."""
        try:
            with open(os.path.join(checkpoint_dir, MANIFEST_NAME), encoding="utf-8") as f:
                manifest = json.load(f)
            ids = _copy_ids(manifest)
            own = [e for e in manifest.get("file_list", []) if e.get("rank") == self.rank]
            expected = {e["path"]: (e["size"], e["crc32c"], e.get("sha256")) for e in own}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if self.rank not in ids or not own:
            return None
        try:
            copies = _copies(self.root)
        except FileNotFoundError:
            copies = {}  # no store here yet: the fetch makes it
        except OSError:
            return None
        if all(_find(copies, ids, e) for e in own):
            return None
        return ids[self.rank], expected

    def _held(self) -> list[tuple[tuple[int, int], str]]:
        """This rank's copies: ((attempt, round), name), those with their record only."""
        out = []
        for name in _listdir(self.dir):
            held = copy_name(name.removesuffix(".json"))
            if held and name.endswith(".json"):
                out.append((held, name.removesuffix(".json")))
        return out

    def _restored_ids(self, attempt: int) -> set[str]:
        """The copy ids of the checkpoint this rank's view of ``attempt`` restored."""
        _check_store(self.root)
        top = os.path.join(self.root, "views", f"rank{self.rank}-a{attempt}")
        ids: set[str] = set()
        for name in _listdir(top):
            try:
                with open(os.path.join(top, name, MANIFEST_NAME), encoding="utf-8") as f:
                    ids.update(_copy_ids(json.load(f)).values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        return ids

    def view(self, checkpoint_dir: str, attempt: int) -> View | None:
        """Builds this rank's view of the committed checkpoint in ``checkpoint_dir``; None when
        this host holds no copy of any of its files (or its manifest cannot be read, or the store
        fails _check_store, or its ``views`` is not a directory): the restore then reads the
        storage. This rank's views of earlier attempts are removed either way, except from a
        store that fails the check."""
        views = os.path.join(self.root, "views")
        top = os.path.join(views, f"rank{self.rank}-a{attempt}")
        try:
            _check_store(self.root)
        except FileNotFoundError:
            return None  # no store here
        except OSError as e:  # another user's store: nothing in it is read, or removed
            sys.stderr.write(f"jaxtrain worker: rank {self.rank}: not restoring from host "
                             f"memory: {e}\n")
            return None
        if os.path.lexists(views) and not _is_dir(views):  # never through a link, say
            sys.stderr.write(f"jaxtrain worker: rank {self.rank}: not restoring from host "
                             f"memory: '{views}' is not a directory\n")
            return None
        try:
            return self._build_view(checkpoint_dir, top)
        finally:
            if _is_dir(views):
                for old in _listdir(views):
                    if old.startswith(f"rank{self.rank}-") and old != os.path.basename(top):
                        shutil.rmtree(os.path.join(views, old), ignore_errors=True)

    def _build_view(self, checkpoint_dir: str, top: str) -> View | None:
        try:
            with open(os.path.join(checkpoint_dir, MANIFEST_NAME), encoding="utf-8") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            sys.stderr.write(f"jaxtrain worker: rank {self.rank}: not restoring from host "
                             f"memory: {e}\n")
            return None
        copies = _copies(self.root)
        ids = _copy_ids(manifest)
        entries = manifest.get("file_list", [])
        found = [_find(copies, ids, e) for e in entries]
        if not any(found):
            return None
        view = os.path.join(top, os.path.basename(os.path.normpath(checkpoint_dir)))
        in_memory = bytes_ = 0
        try:
            shutil.rmtree(top, ignore_errors=True)
            os.makedirs(view)
            for entry, copy in zip(entries, found, strict=True):
                dst = os.path.join(view, entry["path"])
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if copy is not None and _link(copy, dst):
                    in_memory += 1
                    bytes_ += entry["size"]
                else:
                    os.symlink(os.path.join(os.path.abspath(checkpoint_dir), entry["path"]), dst)
            for link in manifest.get("links", []):
                os.makedirs(os.path.dirname(os.path.join(view, link["path"])), exist_ok=True)
                os.symlink(link["target"], os.path.join(view, link["path"]))
            for d in manifest.get("dirs", []):
                os.makedirs(os.path.join(view, d["path"]), exist_ok=True)
                os.chmod(os.path.join(view, d["path"]), d["mode"] | 0o700)
            shutil.copyfile(os.path.join(checkpoint_dir, MANIFEST_NAME),
                            os.path.join(view, MANIFEST_NAME))
        except OSError as e:  # a full memory filesystem, say: use the storage
            sys.stderr.write(f"jaxtrain worker: rank {self.rank}: restoring from host memory "
                             f"failed ({e}); restoring from storage\n")
            shutil.rmtree(top, ignore_errors=True)
            return None
        return View(view, in_memory, len(entries), bytes_)


def copy_name(name: str) -> tuple[int, int] | None:
    """(attempt, round) of a copy's name in a store (a<attempt>-r<round>); None for another."""
    m = _HELD.fullmatch(name)
    return (int(m[1]), int(m[2])) if m else None


def _copy_ids(manifest: dict) -> dict[int, str]:
    """rank -> the id of that rank's part (the manifest's "copies"; ranks without a copy absent)."""
    return {c["rank"]: c["id"] for c in manifest.get("copies", [])}


class _Held(NamedTuple):
    """One file of a copy in a store, as its record says."""

    size: int
    crc32c: int
    mtime_ns: int
    file: str  # the copy's file
    sha256: str | None  # of the bytes written; None in a record from before hashes


def _find(copies: dict[tuple[str, str], _Held], ids: dict[int, str], entry: dict) -> str | None:
    """The file in memory that is ``entry`` of a committed manifest, or None: a copy of the very
    part the entry's rank staged (its copy id), with the entry's size, CRC-32C and SHA-256,
    unchanged since it was written (its mtime: a write into a restored checkpoint, whose files
    are the copies, makes them unusable). The id matters: files that end with their own CRC-32C
    (OCDBT's, say) all have the same CRC-32C at a given size, so size and checksum alone could
    take another checkpoint's file for this one. The SHA-256 is what the manifest vouches with:
    the copy's record holds the hash of the bytes this host wrote (a copy whose record has none,
    kept before hashes, is hashed now). A manifest without hashes (written before them) vouches
    with the id, the size and the CRC-32C only."""
    copy_id = ids.get(entry.get("rank"))
    found = copies.get((copy_id, entry["path"])) if copy_id else None
    if found is None or (found.size, found.crc32c) != (entry["size"], entry["crc32c"]):
        return None
    try:
        st = os.lstat(found.file)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (found.size,
                                                                        found.mtime_ns):
        return None
    expected = entry.get("sha256")
    if expected is None:
        return found.file
    try:
        digest = found.sha256 if found.sha256 is not None else _sha256_of(found.file)
    except OSError:
        return None
    return found.file if digest == expected else None


def _sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _copies(root: str) -> dict[tuple[str, str], _Held]:
    """Every copy in a store: (copy id, path) -> its file (_Held). Raises PermissionError when
    the store fails _check_store, FileNotFoundError when there is none."""
    _check_store(root)
    out: dict[tuple[str, str], _Held] = {}
    for rank_dir in _listdir(root):
        if not rank_dir.startswith("rank") or not rank_dir[4:].isdigit():
            continue
        for name in _listdir(os.path.join(root, rank_dir)):
            if not (name.endswith(".json") and copy_name(name[:-5])):
                continue
            base = os.path.join(root, rank_dir, name[:-5])
            record = _record(base)
            for e in record["files"] if record is not None else []:
                if "link" not in e:
                    out[(record["id"], e["path"])] = _Held(
                        e["size"], e["crc32c"], e["mtime_ns"], os.path.join(base, e["path"]),
                        e.get("sha256"))
    return out


def _record(copy: str) -> dict | None:
    """The record of the copy in directory ``copy`` (``<copy>.json``: its id and entries), or
    None when it is missing or damaged, or names a path that leaves the copy."""
    from jaxtrain import _core

    try:
        with open(copy + ".json", encoding="utf-8") as f:
            record = json.load(f)
        if isinstance(record["id"], str) and all(
                isinstance(e["path"], str) and _core.is_clean_relative_path(e["path"]) and
                ("link" in e or ({"size", "crc32c", "mtime_ns"} <= e.keys() and
                                 isinstance(e.get("sha256", ""), str)))
                for e in record["files"]):
            return record
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _check_private(root: str) -> None:
    """Raises PermissionError unless ``root`` is a directory of this user's that no one else may
    enter (private_dirs.check_private): its name is predictable, so another user could have made
    it first."""
    private_dirs.check_private(root, _REMEDY)


def _check_store(root: str) -> None:
    """Raises PermissionError (FileNotFoundError when there is none) unless the store ``root``
    and the directory it is in (the user's, jaxtrain-<uid>) are private directories of this
    user's (_check_private), and the memory directory above them is one where no other user can
    rename or replace them (private_dirs.check_location). Nothing else can then change what is
    in the store: so the paths in it stay the store's between this check and their use."""
    parent = os.path.dirname(root)
    _check_private(parent)
    _check_private(root)
    private_dirs.check_location(os.path.dirname(parent),
                                f"or set {MEMORY_DIR_ENV} to such a directory")


def _is_dir(path: str) -> bool:
    """A directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _link(copy: str, dst: str) -> bool:
    """Hard-links ``copy`` as ``dst``; False when the copy is gone (freed since it was listed)."""
    try:
        os.link(copy, dst)
    except FileNotFoundError:
        return False
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"  # the peer server writes too
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.rename(tmp, path)
