"""The driver's care of the run directory it writes (a local path, or the staging copy of a
remote one): whether its lock reaches other hosts, and private runs (JAXTRAIN_PRIVATE)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator

# The run's lease (src/storage/run_store.h): renewed every 10 s, another driver's counts for 60 s.
LEASE_PERIOD_S = 10
LEASE_STALE_AFTER_S = 60


def lock_free_mount(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The mount that holds `path` ("<type> at <mount point>") when file locks taken there do not
    reach other hosts: a FUSE mount (GCS FUSE, s3fs, ...), NFS mounted with ``nolock`` or
    ``local_lock``, Lustre with ``localflock``; None otherwise, and when `mounts` cannot be
    read."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[str, str, set[str]] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2], set(fields[3].split(",")))
    if best is None:
        return None
    point, kind, options = best
    local_lock = {o for o in options if o.startswith("local_lock=") and o != "local_lock=none"}
    if (kind.startswith("fuse") or (kind.startswith("nfs") and ("nolock" in options or local_lock))
            or (kind == "lustre" and "localflock" in options)):
        return f"{kind} at {point}"
    return None


def warn_if_locks_stay_local(run_dir: str) -> None:
    """Says on stderr when the run directory is on a mount whose locks do not cross hosts: there
    only the run's lease keeps a second driver on another host out."""
    mount = lock_free_mount(run_dir)
    if mount is not None:
        print(f"jaxtrain: warning: the run directory {run_dir} is on {mount}, where a file lock "
              "does not reach other hosts; a second driver of this run on another host is kept "
              f"out only by the run's lease (LEASE, renewed every {LEASE_PERIOD_S} s, another "
              f"driver's counted as live for {LEASE_STALE_AFTER_S} s), so keep the hosts' clocks "
              "in sync (NTP)", file=sys.stderr)


@contextlib.contextmanager
def private_files(private: bool) -> Iterator[None]:
    """With `private`, the umask gains 077 while the run lasts, so that every directory the run
    creates is 0700 and every file 0600 (worker processes inherit it); restored afterwards."""
    if not private:
        yield
        return
    old = os.umask(0o077)
    os.umask(old | 0o077)
    try:
        yield
    finally:
        os.umask(old)


def make_private(run_dir: str) -> None:
    """Makes the run directory 0700, also when an earlier, non-private run created it."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
