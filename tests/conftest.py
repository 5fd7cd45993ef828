"""Shared helpers for the Python and end-to-end tests (real worker processes, real JAX)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def storage(tmp_path: Path) -> str:
    """A fresh storage_path for one test's runs."""
    path = tmp_path / "runs"
    path.mkdir()
    return str(path)


@pytest.fixture
def umask_022():
    """Runs the test under umask 022 (the common default), whatever the caller's is."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def run_driver(code: str, tmp_path: Path, *, env: dict | None = None, timeout: float = 180):
    """Runs `code` as a driver script (its functions live in __main__, as in users' scripts)."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(code))
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it runs nothing and is only waiting to be reaped.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Fifo:
    """A FIFO the test holds open read-write, so that no worker's open() of it blocks. Reads wait
    at most `timeout` seconds, only so that a bug fails the test instead of hanging it."""

    def __init__(self, path: Path, timeout: float = 240) -> None:
        os.mkfifo(path)
        self.path = str(path)
        self.fd = os.open(path, os.O_RDWR)
        self.timeout = timeout

    def read_line(self) -> str:
        data = b""
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([self.fd], [], [], self.timeout)
            assert ready, f"nothing came through {self.path}"
            data += os.read(self.fd, 1)  # one byte: never past the line
        return data.decode().strip()

    def write(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> None:
        os.close(self.fd)
