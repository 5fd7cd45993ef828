"""Shared helpers for the Python and end-to-end tests (real worker processes, real JAX)."""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What each test needs beyond this machine's processes. A test that uses a test cluster (the ssh
# hosts, Slurm, Kubernetes) is marked `cluster`, and also `kubernetes` when it uses that one; one
# that uses the GCS emulator is marked `emulator`. `scripts/test.sh --quick` leaves clusters and
# the emulator out; the full suite runs the Kubernetes tests, the other clusters' tests and the
# rest in three pytest processes side by side, so that each cluster is started once and never by
# two processes (a cluster is one per machine: fixed namespaces, addresses and state
# directories, tests/cluster_lock.py).
_CLUSTER_FIXTURES = {"ssh_hosts", "slurm_cluster", "kubernetes_cluster"}


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "cluster: needs a test cluster (ssh hosts, Slurm, Kubernetes)")
    config.addinivalue_line("markers", "kubernetes: needs the Kubernetes test cluster")
    config.addinivalue_line(
        "markers", "emulator: needs the GCS emulator, which scripts/test.sh --quick does not build")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        used = set(item.fixturenames)
        params = getattr(item, "callspec", None)
        if used & _CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.cluster)
            if "kubernetes_cluster" in used:
                item.add_marker(pytest.mark.kubernetes)
        elif "gcs_endpoint" in used or (params and params.params.get("store_bucket") == "gs"):
            item.add_marker(pytest.mark.emulator)


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
    return run_command([sys.executable, str(script)], cwd=tmp_path, env=full_env,
                       capture_output=True, text=True, timeout=timeout)


# --- processes the tests start ----------------------------------------------------------------
#
# A test starts a driver (a script that calls fit(), `jaxtrain run`, an example) with
# start_driver() or run_command(), never with subprocess directly, for two reasons:
#
# * The driver starts with SIGINT at its default action. A suite started as a background job
#   (`./scripts/test.sh &`, as some CI wrappers do) runs with SIGINT ignored, and a child inherits
#   that (subprocess's restore_signals leaves SIGINT alone): Ctrl-C tests would interrupt nothing.
# * The driver leads a session of its own, which its workers' process groups join. When a test
#   times out or ends with the driver still running, the whole session is killed: no driver or
#   worker group outlives the test that started it. Its stdin is /dev/null unless the test says
#   otherwise: a terminal there would not be its session's (salloc then waits forever to be put
#   in the foreground).

_STARTED: list[subprocess.Popen] = []


def _default_sigint() -> None:  # in the child, between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_driver(argv: list, **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen_kwargs), with SIGINT at its default action, in a session
    of its own that end_session() kills if the test has not reaped the driver when it ends."""
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_default_sigint,
                            **popen_kwargs)
    _STARTED.append(proc)
    return proc


def live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (process group, session) of every process that is not a zombie."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            found[int(entry)] = (int(fields[2]), int(fields[3]))
    return found


def _session_members(sid: int) -> dict[int, int]:
    """pid -> process group of every live process in session `sid`."""
    return {pid: pgrp for pid, (pgrp, session) in live_processes().items() if session == sid}


def end_session(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILLs every process group in the session that `proc` leads (the driver's own and its
    workers'), waits until none of them is left, and reaps `proc`. Does nothing once `proc` has
    been reaped: its pid, the session's id, may then be another process's."""
    if proc.returncode is not None:
        return
    deadline = time.monotonic() + timeout
    while members := _session_members(proc.pid):
        assert time.monotonic() < deadline, f"session {proc.pid} outlived SIGKILL: {members}"
        for pgrp in set(members.values()):
            try:
                os.killpg(pgrp, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    proc.wait()


def finish_driver(proc: subprocess.Popen, timeout: float,
                  input=None) -> subprocess.CompletedProcess:
    """proc.communicate(input, timeout), as subprocess.run does it; on a timeout, the driver's
    session is killed before TimeoutExpired is raised."""
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
    except BaseException:  # TimeoutExpired, or the test run interrupted
        end_session(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_command(argv: list, *, timeout: float, input=None, capture_output: bool = False,
                **popen_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv, timeout=timeout, ...) for a driver (see start_driver)."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    return finish_driver(start_driver(argv, **popen_kwargs), timeout, input)


def end_unreaped_drivers() -> None:
    """Ends the session of every driver started since the last call that is not reaped yet."""
    while _STARTED:
        end_session(_STARTED.pop())


@pytest.fixture(autouse=True)
def _no_driver_left_behind():
    """A test that fails or times out half way leaves no driver (or its workers) running."""
    yield
    end_unreaped_drivers()


atexit.register(end_unreaped_drivers)  # a run interrupted before a test's teardown


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


def wait_for(what: str, check, timeout: float = 120.0):
    """Polls an outside system (a cluster, a Prometheus) until `check` returns something true,
    and returns it; fails the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
