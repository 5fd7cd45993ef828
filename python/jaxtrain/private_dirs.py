"""The one rule for directories jaxtrain makes where other users may also make things: ``/tmp``
(or ``$TMPDIR``), ``/dev/shm`` (or ``JAXTRAIN_MEMORY_DIR``), a container's temporary directory.

Their names are predictable (``jaxtrain-<uid>``), so another local user may have made one first,
made it a link, or left it open to others. Every such directory comes from ``private_dir``: each
level is made 0700 when it is missing, then opened without following a link and checked (a
directory, owned by this user, no permission for anyone else); anything else is refused with a
PermissionError that names the path and what is wrong. The location itself must not let others
rename or replace what is in it (owned by root or this user, and sticky like ``/tmp`` or writable
by its owner only). A directory that passed is this user's alone: the paths under it stay its own
between the check and their use. docs/security.md lists every such path.
"""

from __future__ import annotations

import contextlib
import os
import stat

# How a directory that fails the check can be fixed, said after what is wrong with it.
_REMOVE = "remove it (it is not jaxtrain's to take over)"


def tmp_base() -> str:
    """Where host-local directories go: ``$TMPDIR``, or ``/tmp``; absolute."""
    return os.path.abspath(os.environ.get("TMPDIR") or "/tmp")


def host_dir() -> str:
    """This user's host-local directory, ``<$TMPDIR or /tmp>/jaxtrain-<uid>`` (private_dir)."""
    return private_dir(tmp_base(), f"jaxtrain-{os.geteuid()}",
                       remedy="or set TMPDIR to a directory of your own")


def check_location(path: str, remedy: str = "") -> None:
    """Raises PermissionError unless no other user can rename or replace what is in ``path``:
    owned by root or this user, and sticky (``/tmp``, ``/dev/shm``) or writable by its owner
    only. Follows a link: the location is the user's to name."""
    st = os.stat(path)
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and
                                              not st.st_mode & stat.S_ISVTX):
        raise PermissionError(
            f"'{path}' lets other users replace what is in it (mode "
            f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}); use a directory that is "
            f"sticky (as /tmp and /dev/shm) or writable by its owner only{_then(remedy)}")


def check_private(path: str, remedy: str = "") -> None:
    """Raises PermissionError unless ``path`` is a private directory of this user's (not a link;
    owned by this user; no permission for group or others); FileNotFoundError when missing."""
    _check(path, os.lstat(path), remedy)


def private_dir(base: str, *names: str, remedy: str = "") -> str:
    """``base/names[0]/names[1]/...``, each level made 0700 where missing and checked (opened
    without following links: a directory of this user's that no one else may enter); ``base``
    must pass check_location. Returns the path. Raises PermissionError naming the first level that
    fails and what is wrong with it (``remedy`` added to the message: what the user can do)."""
    check_location(base, remedy)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    path = base
    try:
        for name in names:
            path = os.path.join(path, name)
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=fd)
            try:
                level = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                dir_fd=fd)
            except FileNotFoundError:
                raise
            except OSError:  # a link (ELOOP), not a directory, another user's 0700 one
                _check(path, os.lstat(name, dir_fd=fd), remedy)  # says what it is instead
                raise
            os.close(fd)
            fd = level
            _check(path, os.fstat(fd), remedy)
    finally:
        os.close(fd)
    return path


def _check(path: str, st: os.stat_result, remedy: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        problem = "it is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"another user (uid {st.st_uid}) owns it"
    elif st.st_mode & 0o077:
        problem = "other users may enter it"
    else:
        return
    raise PermissionError(
        f"'{path}' is not a private directory of this user's (uid {os.geteuid()}): {problem} "
        f"(mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}); {_REMOVE}"
        f"{_then(remedy)}")


def _then(remedy: str) -> str:
    return f", {remedy}" if remedy else ""


def open_beneath(dir_fd: int, rel: str, owner: int | None = None) -> int:
    """A file descriptor (read only) of the regular file ``rel`` (a relative path, '/'-separated)
    under the directory open as ``dir_fd``, no part of which is a link (each is opened with
    O_NOFOLLOW); with ``owner``, every level and the file must be owned by that uid. Raises
    OSError: FileNotFoundError when it is not there, PermissionError (naming ``rel``) when a part
    is a link, not a directory or file, or another user's."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise PermissionError(f"'{rel}' is not a plain relative path")
    fd = os.dup(dir_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (
                os.O_NONBLOCK if last else os.O_DIRECTORY)  # a FIFO must not block the open
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                raise
            except OSError as e:  # ELOOP: a link; ENOTDIR
                raise PermissionError(f"'{rel}': '{part}' is a link or not a directory "
                                      f"({e.strerror})") from None
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            if owner is not None and st.st_uid != owner:
                raise PermissionError(f"'{rel}': '{part}' belongs to uid {st.st_uid}, not to "
                                      f"uid {owner}")
            if last and not stat.S_ISREG(st.st_mode):
                raise PermissionError(f"'{rel}' is not a regular file")
        os.set_blocking(fd, True)
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)
