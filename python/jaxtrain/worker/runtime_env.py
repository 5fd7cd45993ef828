"""The runtime env's ``working_dir`` on each worker (jaxtrain.driver.runtime_env packs it).

``unwrap`` reads the payload ``wrap`` made: the task's bytes and the shipped directory. ``enter``:
each host unpacks an archive once, by its SHA-256, under
``<$TMPDIR or /tmp>/jaxtrain-<uid>/working_dir/<sha256>/`` (unpacked to a temporary name, then
renamed: ranks of one host that race each unpack, one rename wins, the others use it). Every
member's name, type and link target is checked first: an archive cannot write outside. The worker
then works in that directory and puts it first on its import path, in place of the driver's.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import posixpath
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from jaxtrain import private_dirs

if TYPE_CHECKING:
    import tarfile

# A partial copy (its worker was killed while unpacking) is removed once this old.
PARTIAL_STALE_S = 3600.0


def leads_out(name: str, target: str) -> bool:
    """Whether the link ``name`` -> ``target`` leaves the directory, read as written."""
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    return not target or target.startswith("/") or resolved == ".." or resolved.startswith("../")


def unwrap(payload: bytes) -> tuple[bytes, dict | None]:
    """(the task's bytes, the shipped working_dir or None), from a payload made by ``wrap``."""
    outer = pickle.loads(payload)
    return outer["task"], outer["working_dir"]


# -- unpacking (each worker) ------------------------------------------------------------------


def _check_member(m: tarfile.TarInfo) -> str:
    """The member's name, once it is one an archive of ``pack`` could hold; ValueError if not."""
    name = m.name.rstrip("/") if m.isdir() else m.name

    def refuse(why: str) -> ValueError:
        return ValueError(f"the shipped working_dir's member {m.name!r} {why}; the archive is "
                          "refused, nothing of it is used")

    if not name or name.startswith("/") or posixpath.normpath(name) != name or \
            name.split("/")[0] in (".", ".."):
        raise refuse("is not a plain relative path inside the directory")
    if not (m.isreg() or m.isdir() or m.issym()):
        raise refuse("is neither a file, a directory nor a symbolic link")
    if m.issym() and leads_out(name, m.linkname):
        raise refuse(f"is a link that leads out of the directory (to {m.linkname!r})")
    return name


def _extract(archive: bytes, dest: str) -> None:
    """Unpacks ``archive`` into the empty directory ``dest``: every member is checked before
    anything is written; links are made last, so nothing is written through one."""
    import tarfile  # here: a run without a working_dir does not load it

    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = tar.getmembers()
        kinds: dict[str, tarfile.TarInfo] = {}
        for m in members:
            name = _check_member(m)
            if name in kinds:
                raise ValueError(f"the shipped working_dir holds {name!r} twice; the archive is "
                                 "refused, nothing of it is used")
            kinds[name] = m
        for name in kinds:
            parts = name.split("/")
            for i in range(1, len(parts)):
                parent = kinds.get("/".join(parts[:i]))
                if parent is not None and not parent.isdir():
                    raise ValueError(f"the shipped working_dir's member {name!r} lies under "
                                     f"{parent.name!r}, which is not a directory; the archive "
                                     "is refused, nothing of it is used")
        dirs = []
        for name, m in kinds.items():
            path = os.path.join(dest, name)
            if m.isdir():
                os.makedirs(path, 0o700, exist_ok=True)
                dirs.append((path, m))
            elif m.isreg():
                os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    shutil.copyfileobj(tar.extractfile(m), f)
                    os.fchmod(f.fileno(), m.mode & 0o777)
                os.utime(path, (m.mtime, m.mtime), follow_symlinks=False)
    real_dest = os.path.realpath(dest)
    for name, m in kinds.items():
        if m.issym():
            path = os.path.join(dest, name)
            os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
            os.symlink(m.linkname, path)
    for name, m in kinds.items():  # links through links: where they lead, now that all exist
        resolved = os.path.realpath(os.path.join(dest, name))
        if m.issym() and resolved != real_dest and not resolved.startswith(real_dest + os.sep):
            raise ValueError(f"the shipped working_dir's link {name!r} -> {m.linkname!r} leads "
                             "out of the directory; the archive is refused, nothing of it is "
                             "used")
    for path, m in sorted(dirs, key=lambda d: -d[0].count("/")):
        os.chmod(path, (m.mode & 0o777) | 0o700)
        os.utime(path, (m.mtime, m.mtime))


def unpack(archive: bytes) -> str:
    """This host's copy of ``archive``, unpacked once: its directory, named by its SHA-256."""
    root = private_dirs.private_dir(private_dirs.tmp_base(), f"jaxtrain-{os.geteuid()}",
                                    "working_dir", remedy="or set TMPDIR to another directory")
    final = os.path.join(root, hashlib.sha256(archive).hexdigest())
    if os.path.isdir(final):
        return final  # another rank of this host, or an earlier attempt, unpacked it
    _sweep_partial(root)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)[:16]}-", dir=root)
    try:
        _extract(archive, tmp)
        os.rename(tmp, final)
    except OSError as e:
        _remove(tmp)
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and os.path.isdir(final):
            return final  # another rank of this host renamed its copy first
        raise
    except BaseException:
        _remove(tmp)
        raise
    return final


def _sweep_partial(root: str) -> None:
    """Removes the partial copies of workers killed while unpacking (fresh ones are in use)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if name.startswith(".") and time.time() - os.lstat(path).st_mtime > PARTIAL_STALE_S:
                _remove(path)
        except OSError:  # another rank removed it, or renamed it into place
            pass


def _remove(path: str) -> None:
    """Removes a copy: its directories are all writable by their owner (``_extract``)."""
    shutil.rmtree(path, ignore_errors=True)


def enter(shipped: dict) -> str:
    """Unpacks the shipped working_dir, makes it this worker's working directory and puts it first
    on the import path (``sys.path`` and PYTHONPATH, for processes the worker starts) in place of
    the driver's path; what the driver's path held (a ``src/`` entry) maps to the copy."""
    path = unpack(shipped["archive"])
    source = shipped["source"]
    started_in = os.getcwd()

    def mapped(entry: str) -> str:
        if entry == source or entry.startswith(source + os.sep):
            return path + entry[len(source):]
        return entry

    rest = sys.path[1:] if sys.path and sys.path[0] in ("", started_in) else sys.path
    sys.path[:] = list(dict.fromkeys([path, *map(mapped, rest)]))
    pythonpath = [mapped(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([path, *pythonpath]))
    os.chdir(path)
    return path
