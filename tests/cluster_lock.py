"""A test cluster belongs to the test session that started it (scripts/lib/cluster_lock.sh).

The session holds an flock on ``<state>.lock`` for as long as its cluster lives, and hands the
locked descriptor to the cluster script's commands (``ClusterLock.run``). Another test run's
fixture, or a ``stop`` typed in another shell, finds the lock held and refuses instead of
stopping the cluster under this session's tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Iterator

import pytest

FD_ENV = "JAXTRAIN_TEST_CLUSTER_LOCK_FD"


class ClusterLock:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def run(self, argv: list, **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(argv, **kwargs) for a command that changes the cluster: it is handed
        this session's lock."""
        env = dict(kwargs.pop("env", None) or os.environ)
        env[FD_ENV] = str(self.fd)
        return subprocess.run(argv, env=env, pass_fds=(self.fd,), **kwargs)


@contextlib.contextmanager
def held(state: str, what: str) -> Iterator[ClusterLock]:
    """Holds ``<state>.lock`` for the block; fails the test naming the holder if another run
    has it."""
    path = f"{state}.lock"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            pytest.fail(f"{what} are in use by the test run of pid {holder} (it holds {path}): "
                        "two test runs cannot share one machine's test clusters; wait for it")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield ClusterLock(fd)
    finally:
        os.close(fd)
