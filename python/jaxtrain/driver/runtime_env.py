"""The runtime env's ``working_dir`` shipped to hosts that do not share it, as Ray ships it: the
driver's side (jaxtrain.worker.runtime_env unpacks it).

``pack``: once per fit() of a run whose workers are on other hosts, the directory is packed into
one gzip'd tar in a fixed order, without ``.git``, ``__pycache__``, what the ``.gitignore`` files
in it list, and what the runtime env's ``excludes`` list (gitignore patterns, relative to the
directory). Symbolic links are kept as links when they lead to a place inside the directory and
refused when they lead out; none is followed. Above the cap (JAXTRAIN_WORKING_DIR_MAX_MIB, 100 MiB
of packed bytes by default) it is refused with a ValueError that says what to do.

``wrap``: the payload every worker gets over the control connection is a plain pickle of bytes
and strings: the task (cloudpickled) and, where the directory is shipped, the archive and the
directory's path on the driver (``unwrap`` on the worker reads it). The worker unpacks the archive
before it unpickles the task, whose function may live in a module of the directory, pickled by
reference.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from jaxtrain.worker.runtime_env import leads_out

# Never shipped, whatever the patterns say.
ALWAYS_EXCLUDED = (".git", "__pycache__")
# Seconds of packing after which progress is said on stderr, and between two such lines.
PROGRESS_AFTER_S = 3.0

_OWNER = "RunConfig.worker_runtime_env"


@dataclass(frozen=True)
class Packed:
    """A packed working_dir: the archive, and the directory's absolute path on the driver."""

    archive: bytes
    source: str
    files: int


# -- gitignore patterns ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    regex: re.Pattern
    negate: bool
    dir_only: bool


def _glob(segment: str) -> str:
    """One path segment of a gitignore pattern as a regex: ``*`` and ``?`` never match '/'."""
    out, i = [], 0
    while i < len(segment):
        c = segment[i]
        if c == "\\" and i + 1 < len(segment):
            out.append(re.escape(segment[i + 1]))
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := segment.find("]", i + 2)) != -1:
            body = segment[i + 1:end]
            if body[0] in "!^":
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _compile(line: str) -> _Pattern | None:
    """A line of a gitignore file (git's rules: https://git-scm.com/docs/gitignore), or None for
    a blank line or a comment."""
    line = line.rstrip("\n").rstrip("\r")
    while line.endswith(" ") and not line.endswith("\\ "):
        line = line[:-1]
    if not line or line.startswith("#"):
        return None
    negate = line.startswith("!")
    if negate or line.startswith("\\!") or line.startswith("\\#"):
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    # A separator at the start or in the middle anchors the pattern to its directory.
    anchored = "/" in line
    segments = line.lstrip("/").split("/")
    regex = "" if anchored else "(?:.*/)?"
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        if segment == "**":
            regex += ".+" if last else "(?:.*/)?"
        else:
            regex += _glob(segment) + ("" if last else "/")
    return _Pattern(re.compile(f"^{regex}$", re.DOTALL), negate, dir_only)


class _Rules:
    """gitignore patterns relative to ``base`` (a path relative to the working_dir, "" for it):
    the last pattern that matches a path decides, as in git."""

    def __init__(self, base: str, lines: Sequence[str]) -> None:
        self.base = base
        self.patterns = [p for p in map(_compile, lines) if p is not None]

    def excludes(self, rel: str, is_dir: bool) -> bool:
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1:]
        verdict = False
        for p in self.patterns:
            if (is_dir or not p.dir_only) and p.regex.match(rel):
                verdict = not p.negate
        return verdict


def check_excludes(excludes: object) -> list[str]:
    """The runtime env's ``excludes``, checked: a list of gitignore patterns (strings)."""
    if isinstance(excludes, (str, bytes)) or not isinstance(excludes, Sequence):
        raise ValueError(f"{_OWNER}['excludes']={excludes!r} is not allowed; it must be a list of "
                         "gitignore patterns relative to working_dir, e.g. ['data/', '*.ckpt']")
    for i, pattern in enumerate(excludes):
        if not isinstance(pattern, str):
            raise ValueError(f"{_OWNER}['excludes'][{i}]={pattern!r} is not allowed; patterns "
                             "are strings")
    return list(excludes)


# -- packing (the driver) ---------------------------------------------------------------------


def _walk(root: str, excludes: list[str], gitignore: bool) -> Iterator[tuple[str, os.DirEntry]]:
    """(path relative to root, entry) of everything to pack, parents before their contents, in
    name order; excluded directories are not entered."""
    user = _Rules("", excludes)

    def visit(rel_dir: str, rules: list[_Rules]) -> Iterator[tuple[str, os.DirEntry]]:
        path = os.path.join(root, rel_dir) if rel_dir else root
        ignore = os.path.join(path, ".gitignore")
        if gitignore and os.path.isfile(ignore) and not os.path.islink(ignore):
            with open(ignore, encoding="utf-8", errors="replace") as f:
                rules = [*rules, _Rules(rel_dir, f.readlines())]
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            if entry.name in ALWAYS_EXCLUDED or any(r.excludes(rel, is_dir)
                                                   for r in (*rules, user)):
                continue
            yield rel, entry
            if is_dir:
                yield from visit(rel, rules)

    yield from visit("", [])


def _link_target(root: str, real_root: str, rel: str, path: str) -> str:
    """The target to store for the link at ``path``: kept when it resolves inside the directory
    (one that is absolute, or reaches out and back in, made relative and direct), refused
    otherwise."""
    target = os.readlink(path)
    resolved = os.path.realpath(path)
    if resolved != real_root and not resolved.startswith(real_root + os.sep):
        raise ValueError(
            f"{_OWNER}['working_dir']={root!r} holds the symbolic link {rel!r} -> {target!r}, "
            f"which leads out of the directory (to {resolved!r}); the workers on other hosts "
            "would not find what it points to. Copy what it points to into the directory, or "
            "exclude the link with worker_runtime_env['excludes']")
    if leads_out(rel, target):
        target = os.path.relpath(resolved, os.path.realpath(os.path.dirname(path)))
    return target


def _too_big(root: str, packed: int, cap: int, files: list[tuple[str, int]]) -> ValueError:
    from jaxtrain.driver.options import WORKING_DIR_MAX_MIB_ENV

    by_top: dict[str, int] = {}
    for rel, size in files:
        top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
        by_top[top] = by_top.get(top, 0) + size
    largest = sorted(by_top.items(), key=lambda kv: -kv[1])[:3]
    total = sum(size for _, size in files)
    return ValueError(
        f"{_OWNER}['working_dir']={root!r} is too big to ship to the workers' hosts: it packs to "
        f"more than {_mib(packed)} (stopped there), over the cap of {_mib(cap)}; its files take "
        f"{_mib(total)} before packing, most in " + ", ".join(
            f"{name} ({_mib(size)})" for name, size in largest) + ". Exclude what the workers "
        "do not need with worker_runtime_env['excludes'] (gitignore patterns, e.g. ['data/', "
        f"'*.ckpt']), or raise the cap with {WORKING_DIR_MAX_MIB_ENV}=<MiB>")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class _OverCap(Exception):
    """The archive has grown over the cap: packing stops."""


class _CappedReader:
    """A file being packed, read in chunks that stop once the archive is over the cap: a big
    file is never packed whole into memory to be refused after."""

    def __init__(self, f: io.BufferedReader, out: io.BytesIO, cap: int) -> None:
        self._f, self._out, self._cap = f, out, cap

    def read(self, size: int = -1) -> bytes:
        if self._out.tell() > self._cap:
            raise _OverCap()
        return self._f.read(size)


def pack(working_dir: str, excludes: Sequence[str] = (), *, cap: int | None = None,
         gitignore: bool | None = None, clock: Callable[[], float] = time.monotonic) -> Packed:
    """Packs ``working_dir`` (absolute) for workers on other hosts, at most `cap` bytes, with
    its .gitignore files' exclusions when `gitignore` (None: as JAXTRAIN_WORKING_DIR_MAX_MIB and
    JAXTRAIN_WORKING_DIR_GITIGNORE say). Raises ValueError for a link that leads out, or a packed
    size over the cap."""
    import gzip  # here: a run without a working_dir does not load them
    import tarfile

    from jaxtrain.driver import options

    if cap is None:
        cap = options.working_dir_max_bytes(os.environ)
    if gitignore is None:
        gitignore = options.working_dir_gitignore(os.environ)
    real_root = os.path.realpath(working_dir)
    out = io.BytesIO()
    began = last_said = clock()
    sized: list[tuple[str, int]] = []
    said = False
    walk = _walk(working_dir, list(excludes), gitignore)
    try:
        with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for rel, entry in walk:
                st = entry.stat(follow_symlinks=False)
                info = tarfile.TarInfo(rel)
                info.mode = stat.S_IMODE(st.st_mode) & 0o777
                info.mtime = int(st.st_mtime)
                if stat.S_ISLNK(st.st_mode):
                    info.type = tarfile.SYMTYPE
                    info.linkname = _link_target(working_dir, real_root, rel, entry.path)
                    tar.addfile(info)
                elif stat.S_ISDIR(st.st_mode):
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                elif stat.S_ISREG(st.st_mode):
                    info.size = st.st_size
                    sized.append((rel, st.st_size))
                    with open(entry.path, "rb") as f:
                        tar.addfile(info, _CappedReader(f, out, cap))
                else:
                    continue  # sockets, fifos, devices: nothing a worker imports or reads
                if out.tell() > cap:
                    raise _OverCap()
                if clock() - last_said >= PROGRESS_AFTER_S:
                    last_said, said = clock(), True
                    sys.stderr.write(f"jaxtrain: packing working_dir {working_dir!r} for the "
                                     f"workers' hosts: {len(sized)} files, {_mib(out.tell())} "
                                     "so far\n")
        if out.tell() > cap:
            raise _OverCap()
    except _OverCap:
        for rel, entry in walk:  # the rest, for the sizes the error names
            if entry.is_file(follow_symlinks=False):
                sized.append((rel, entry.stat(follow_symlinks=False).st_size))
        raise _too_big(working_dir, out.tell(), cap, sized) from None
    archive = out.getvalue()
    if said:
        sys.stderr.write(f"jaxtrain: packed working_dir {working_dir!r}: {len(sized)} files, "
                         f"{_mib(len(archive))}, in {clock() - began:.1f} s\n")
    return Packed(archive, working_dir, len(sized))


# -- the payload (read by jaxtrain.worker.runtime_env.unwrap) -------------------------------


def wrap(task: bytes, packed: Packed | None) -> bytes:
    """The payload every worker gets: the task and, when shipped, the working_dir."""
    shipped = None if packed is None else {"archive": packed.archive, "source": packed.source}
    return pickle.dumps({"task": task, "working_dir": shipped}, protocol=pickle.HIGHEST_PROTOCOL)
