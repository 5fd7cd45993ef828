"""The worker pod's holder (python/jaxtrain/kubernetes/pod.py) as a plain process, no cluster: it
runs the worker command, outlives a failed worker, starts the next attempt's worker (from its
standby, or afresh) on an activation through its socket, signals the running worker, and passes
a pod's SIGTERM on. The workers here are small Python programs that play the worker's part of
the protocol; tests/test_kubernetes.py runs the real ones in a real cluster's pods."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from conftest import wait_for

# A worker that says its attempt and what it got, then fails in attempt 0 and succeeds after.
# As a standby (JAXTRAIN_STANDBY=1) it first reads its activation from the pipe, as
# jaxtrain.worker does, and says whether its environment had the activation's variables.
FAKE_WORKER = textwrap.dedent('''
    import json, os, signal, sys, time
    got = {"standby": os.environ.get("JAXTRAIN_STANDBY") == "1",
           "sigterm_ignored": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN}
    if got["standby"]:
        got["had_attempt"] = "JAXTRAIN_ATTEMPT" in os.environ
        got["had_secret_file"] = "JAXTRAIN_RUN_SECRET_FILE" in os.environ
        fd = int(os.environ["JAXTRAIN_RUN_SECRET_FD"])
        data = b"".join(iter(lambda: os.read(fd, 65536), b""))
        if not data:
            sys.exit(0)
        activation = json.loads(data)
        got["secret"] = activation["secret"]
        os.environ.update(activation["env"])
    attempt = os.environ["JAXTRAIN_ATTEMPT"]
    got["attempt"] = attempt
    print("WORKER " + json.dumps(got), flush=True)
    if os.environ.get("FAKE_MODE") == "wait":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
        print("READY", flush=True)
        time.sleep(600)
    sys.exit(3 if attempt == "0" else 0)
''')


class Holder:
    def __init__(self, tmp: Path, standby: bool = True, **env: str) -> None:
        (tmp / "worker.py").write_text(FAKE_WORKER)
        (tmp / "secret").write_text("the-run-key\n")
        (tmp / "t").mkdir()
        self.env = {**os.environ, "TMPDIR": str(tmp / "t"), "JAXTRAIN_ATTEMPT": "0",
                    "JAXTRAIN_RUN_SECRET_FILE": str(tmp / "secret"), **env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxtrain.kubernetes", "hold",
             *([] if standby else ["--no-standby"]), "--", sys.executable,
             str(tmp / "worker.py")], env=self.env, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def tell(self, message: dict) -> dict:
        out = subprocess.run([sys.executable, "-m", "jaxtrain.kubernetes", "activate",
                              json.dumps(message)], env=self.env, capture_output=True, text=True,
                             timeout=30)
        return json.loads(out.stdout)

    def workers(self) -> list[dict]:
        return [json.loads(line[len("WORKER "):]) for line in self.lines
                if line.startswith("WORKER ")]

    def end(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=5)
        return code


@pytest.fixture
def holders(tmp_path):
    made: list[Holder] = []

    def make(standby: bool = True, **env: str) -> Holder:
        made.append(Holder(tmp_path, standby, **env))
        return made[-1]

    yield make
    for h in made:
        if h.proc.poll() is None:
            h.proc.kill()
            h.proc.wait()


def test_a_failed_worker_leaves_the_pod_waiting_and_the_next_attempt_starts_in_it(holders):
    h = holders(standby=False)
    wait_for("attempt 0's end", lambda: h.saw("attempt 0: worker exited with status 3"))
    assert h.proc.poll() is None  # the pod stays for the next attempt
    answer = h.tell({"start": {"attempt": "1", "env": {"JAXTRAIN_ATTEMPT": "1"}}})
    assert answer["ok"] and not answer["warm"] and answer["why"] == "standbys are off", answer

    assert h.end() == 0  # attempt 1's worker succeeded: the run is over for this pod
    assert h.lines[0] == "jaxtrain pod: attempt 0: worker started (first)"
    assert "jaxtrain pod: attempt 1: worker started (cold: standbys are off)" in h.lines
    assert h.lines[-1] == "jaxtrain pod: attempt 1: worker exited with status 0"
    assert [w["attempt"] for w in h.workers()] == ["0", "1"]


def test_the_next_attempt_starts_from_the_standby_with_the_key_and_its_variables(holders):
    h = holders()
    wait_for("attempt 0's end", lambda: h.saw("attempt 0: worker exited with status 3"))
    assert len(h.workers()) == 1  # no standby before the attempt trains: none was asked for
    assert h.tell({"prepare": {}}) == {"ok": True, "standby": True}
    answer = h.tell({"start": {"attempt": "1", "env": {"JAXTRAIN_ATTEMPT": "1"}}})
    assert answer["ok"] and answer["warm"], answer

    assert h.end() == 0
    assert "jaxtrain pod: attempt 1: worker started (warm)" in h.lines
    first, standby = h.workers()
    assert first == {"standby": False, "sigterm_ignored": True, "attempt": "0"}
    # The standby's environment had neither the activation's variables nor the key's path; the
    # activation brought both the variables and the key itself.
    assert standby == {"standby": True, "sigterm_ignored": True, "had_attempt": False,
                       "had_secret_file": False, "secret": "the-run-key", "attempt": "1"}


def test_signals_reach_the_running_worker_and_a_pods_sigterm_ends_the_holder(holders):
    h = holders(FAKE_MODE="wait", standby=False)
    wait_for("the worker's handler", lambda: h.saw("READY"))
    assert h.tell({"signal": "TERM"}) == {"ok": True, "running": True}
    wait_for("its end", lambda: h.saw("attempt 0: worker exited with status 143"))
    assert h.tell({"signal": "TERM"}) == {"ok": True, "running": False, "attempt": "0",
                                          "ended": "exited with status 143"}

    # Refused: a variable an activation does not set, a signal it does not send, a second
    # worker while one runs.
    assert "PATH is not set by an activation" in h.tell(
        {"start": {"attempt": "1", "env": {"PATH": "/nowhere"}}})["error"]
    assert "is not one of" in h.tell({"signal": "HUP"})["error"]
    assert h.tell({"start": {"attempt": "1", "env": {"JAXTRAIN_ATTEMPT": "1"}}})["ok"]
    assert "is running" in h.tell(
        {"start": {"attempt": "2", "env": {"JAXTRAIN_ATTEMPT": "2"}}})["error"]
    wait_for("attempt 1's handler", lambda: len([x for x in h.lines if x == "READY"]) == 2)

    # The pod deleted (the kubelet's SIGTERM to its first process): the worker gets it, and the
    # holder ends with the worker's status instead of waiting for another attempt.
    h.proc.send_signal(signal.SIGTERM)
    assert h.end() == 143
    assert h.lines[-1] == "jaxtrain pod: attempt 1: worker exited with status 143"


def test_workers_start_with_sigterm_ignored_and_kill_ends_them(holders):
    h = holders(FAKE_MODE="wait", standby=False)
    wait_for("the worker", lambda: h.saw("READY"))
    # Until the worker sets its own handler it ignores SIGTERM, as the pod's first process did.
    assert h.workers()[0]["sigterm_ignored"]
    assert h.tell({"signal": "KILL"}) == {"ok": True, "running": True}
    wait_for("its end", lambda: h.saw("attempt 0: worker killed by signal 9"))
    assert h.proc.poll() is None
    h.proc.send_signal(signal.SIGTERM)
    assert h.end() == 137  # idle when the pod went: the last worker's status, as a shell says it


def test_no_request_ends_the_holder(holders):
    h = holders(FAKE_MODE="wait", standby=False)
    wait_for("the worker", lambda: h.saw("READY"))
    for bad in ("[" * 60000, "not json", '{"start": 3}', '{"start": {"env": 1}}', "{}"):
        out = subprocess.run([sys.executable, "-m", "jaxtrain.kubernetes", "activate", bad],
                             env=h.env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and "error" in json.loads(out.stdout), (bad[:20], out)
    assert h.proc.poll() is None
    assert h.tell({"signal": "KILL"})["running"]
    wait_for("its end", lambda: h.saw("attempt 0: worker killed by signal 9"))


def test_a_command_that_cannot_run_is_named(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "jaxtrain.kubernetes", "hold", "--",
                          "/nonexistent/python"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 127
    assert "attempt 0: cannot run /nonexistent/python: FileNotFoundError" in out.stdout
