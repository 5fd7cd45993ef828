"""Checkpoints held in host memory (JAXTRAIN_CHECKPOINT_IN_MEMORY=1): each rank keeps its part of
its latest checkpoints on a memory filesystem of its host, so that a group restarted after a
failure reads them from memory instead of from storage.

A host's *store* is ``<JAXTRAIN_MEMORY_DIR, default /dev/shm>/jaxtrain-<key>``, the key derived
from the run directory's path, so every attempt of a run (and a run resumed by name) finds it:

    <store>/owner.json                     {"run_dir": ...}: what the sweep reads
    <store>/rank<r>/a<attempt>-r<round>/   a copy of rank r's files of one checkpoint
    <store>/rank<r>/a<attempt>-r<round>.json   their entries (paths, sizes, CRC-32C, modes),
                                           written last: a copy without it is not used
    <store>/views/rank<r>-a<attempt>/<checkpoint name>/   what get_checkpoint() returned

A rank writes its copy in the background, after its staging copy (report() does not wait for
it), and keeps its newest two: the checkpoint being committed and the one before it, which is
the latest committed until the new one is. A file on a memory filesystem outlives the process
that wrote it, so the copies survive the worker's death; they do not survive the host's.

At a restart each rank builds a *view* of the checkpoint it restores from: every file of the
committed checkpoint whose copy in this host's memory matches the manifest (path, size and
CRC-32C) is a hard link to that copy (no data is copied); a file that no copy here matches (one
written by a rank on another host, or whose copy is gone) is a symbolic link to the committed
file in storage, so it is read from there, and only if the training function reads it. The
view holds the manifest too. Nothing is ever restored from memory that the manifest does not
vouch for, and with no copy at all the checkpoint is restored from storage as without the switch.

Freed: by the driver on its own host when ``fit()`` ends; on other hosts by the next worker
started there with the switch on, which removes the stores of runs whose run.json says they
ended. docs/checkpoint-memory.md has the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass

from jaxtrain.storage import MANIFEST_NAME

IN_MEMORY_ENV = "JAXTRAIN_CHECKPOINT_IN_MEMORY"
MEMORY_DIR_ENV = "JAXTRAIN_MEMORY_DIR"
DEFAULT_MEMORY_DIR = "/dev/shm"
_OWNER = "owner.json"
_HELD = re.compile(r"a(\d+)-r(\d+)")


def check_switch() -> str | None:
    """JAXTRAIN_CHECKPOINT_IN_MEMORY as the driver passes it on: None (unset or empty), "0" or
    "1"; anything else is refused with a ValueError naming the variable, the value and what is
    allowed. With "1", JAXTRAIN_MEMORY_DIR (when set) must be an existing directory."""
    value = os.environ.get(IN_MEMORY_ENV)
    if not value:
        return None
    if value not in ("0", "1"):
        raise ValueError(
            f"{IN_MEMORY_ENV}={value!r} is not allowed; use 1 (each rank keeps its latest "
            "checkpoints in its host's memory, so a restarted group restores from there) or 0 "
            "(the default: restores read the storage)")
    memory_dir = os.environ.get(MEMORY_DIR_ENV)
    if value == "1" and memory_dir and not os.path.isdir(memory_dir):
        raise ValueError(
            f"{MEMORY_DIR_ENV}={memory_dir!r} is not a directory; name a directory on a memory "
            f"filesystem (tmpfs) that exists on every host, or unset it ({DEFAULT_MEMORY_DIR})")
    return value


def enabled() -> bool:
    return os.environ.get(IN_MEMORY_ENV) == "1"


def store_path(run_dir: str) -> str:
    """This host's store for the run in ``run_dir``."""
    key = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(os.environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_DIR, f"jaxtrain-{key}")


def remove_store(run_dir: str) -> None:
    """Frees this host's store of the run (the driver, when fit() ends)."""
    shutil.rmtree(store_path(run_dir), ignore_errors=True)


def sweep(run_dir: str) -> None:
    """Removes this host's stores of other runs that have ended (their run.json says so, or their
    run directory is gone): the only way a host where no driver runs gets its memory back."""
    memory_dir = os.path.dirname(store_path(run_dir))
    own = store_path(run_dir)
    try:
        names = os.listdir(memory_dir)
    except OSError:
        return
    for name in names:
        store = os.path.join(memory_dir, name)
        if not name.startswith("jaxtrain-") or store == own:
            continue
        try:
            with open(os.path.join(store, _OWNER), encoding="utf-8") as f:
                other = json.load(f)["run_dir"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a store, or one being created
        try:
            with open(os.path.join(other, "run.json"), encoding="utf-8") as f:
                running = json.load(f).get("status") == "RUNNING"
        except FileNotFoundError:
            running = os.path.isdir(other)  # a run dir without run.json yet: starting
        except (OSError, ValueError):
            running = True  # unreadable here: not ours to judge
        if not running:
            shutil.rmtree(store, ignore_errors=True)


@dataclass(frozen=True)
class View:
    """A rank's view of a committed checkpoint (HostMemory.view), in this host's memory."""

    path: str
    in_memory: int  # files linked to copies in this host's memory
    files: int  # files in the checkpoint; the others link to storage
    bytes: int  # the bytes of those in memory


class HostMemory:
    """One rank's side of its host's store."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.root = store_path(run_dir)
        self.dir = os.path.join(self.root, f"rank{rank}")

    def prepare(self, attempt: int, round_: int) -> str:
        """A new, empty directory for a copy of this rank's checkpoint of ``round_``."""
        # The store is the owner's alone (0700): checkpoints are often private.
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        owner = os.path.join(self.root, _OWNER)
        if not os.path.exists(owner):
            _write_atomically(owner, json.dumps({"run_dir": os.path.abspath(self.run_dir)}))
        path = os.path.join(self.dir, f".writing-a{attempt}-r{round_}")
        shutil.rmtree(path, ignore_errors=True)
        return path

    def keep(self, written: str, attempt: int, round_: int, entries: list[dict]) -> None:
        """Makes the copy in ``written`` (from prepare) one this rank's restores may use, and frees
        the older copies but one: the checkpoint before it stays the latest committed until this
        one is."""
        name = f"a{attempt}-r{round_}"
        final = os.path.join(self.dir, name)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(written, final)
        _write_atomically(final + ".json", json.dumps({"files": entries}))
        held = sorted(self._held(), reverse=True)  # newest first
        for _, old in held[2:]:
            os.unlink(os.path.join(self.dir, old + ".json"))
            shutil.rmtree(os.path.join(self.dir, old), ignore_errors=True)

    def _held(self) -> list[tuple[tuple[int, int], str]]:
        out = []
        for name in os.listdir(self.dir):
            m = _HELD.fullmatch(name.removesuffix(".json"))
            if m and name.endswith(".json"):
                out.append(((int(m[1]), int(m[2])), m[0]))
        return out

    def view(self, checkpoint_dir: str, attempt: int) -> View | None:
        """Builds this rank's view of the committed checkpoint in ``checkpoint_dir``; None when
        this host holds no copy of any of its files (or its manifest cannot be read): the restore
        then reads the storage."""
        try:
            with open(os.path.join(checkpoint_dir, MANIFEST_NAME), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return None
        copies = _copies(self.root)
        entries = manifest.get("file_list", [])
        if not any((e["path"], e["size"], e["crc32c"]) in copies for e in entries):
            return None
        views = os.path.join(self.root, "views")
        top = os.path.join(views, f"rank{self.rank}-a{attempt}")
        view = os.path.join(top, os.path.basename(os.path.normpath(checkpoint_dir)))
        in_memory = bytes_ = 0
        try:
            shutil.rmtree(top, ignore_errors=True)
            os.makedirs(view)
            for entry in entries:
                dst = os.path.join(view, entry["path"])
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                copy = copies.get((entry["path"], entry["size"], entry["crc32c"]))
                try:
                    if copy is None:
                        raise FileNotFoundError(entry["path"])
                    os.link(copy, dst)
                    in_memory += 1
                    bytes_ += entry["size"]
                except FileNotFoundError:  # no copy, or one freed since it was listed
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
        # This rank's earlier views go only now: other ranks may have been linking from them.
        for old in _listdir(views):
            if old.startswith(f"rank{self.rank}-") and old != os.path.basename(top):
                shutil.rmtree(os.path.join(views, old), ignore_errors=True)
        return View(view, in_memory, len(entries), bytes_)


def _copies(root: str) -> dict[tuple[str, int, int], str]:
    """Every usable copy in a store: (path, size, CRC-32C) -> a file with those contents. The
    ranks' kept copies, and the files of earlier views that came from memory (a view's hard links
    keep the checkpoint it restored in memory after the ranks' newer copies replaced it, so that
    the next restart finds it even if the checkpoints after it were never committed)."""
    out: dict[tuple[str, int, int], str] = {}
    views = os.path.join(root, "views")
    for top in _listdir(views):
        for name in _listdir(os.path.join(views, top)):
            view = os.path.join(views, top, name)
            try:
                with open(os.path.join(view, MANIFEST_NAME), encoding="utf-8") as f:
                    entries = json.load(f)["file_list"]
            except (OSError, ValueError, KeyError):
                continue
            for e in entries:
                path = os.path.join(view, e["path"])
                if os.path.isfile(path) and not os.path.islink(path):
                    out[(e["path"], e["size"], e["crc32c"])] = path
    for rank_dir in _listdir(root):
        if not rank_dir.startswith("rank") or not rank_dir[4:].isdigit():
            continue
        for name in _listdir(os.path.join(root, rank_dir)):
            if not (name.endswith(".json") and _HELD.fullmatch(name[:-5])):
                continue
            base = os.path.join(root, rank_dir, name[:-5])
            try:
                with open(base + ".json", encoding="utf-8") as f:
                    held = json.load(f)["files"]
            except (OSError, ValueError, KeyError):
                continue
            for e in held:
                if "link" not in e:
                    out[(e["path"], e["size"], e["crc32c"])] = os.path.join(base, e["path"])
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.rename(tmp, path)
