"""The joins and relay sessions of a run started on every host (jaxtrain/hosts/join.py), attacked on
loopback: a relayed join proof, tampered records, a trickling connection at the coordinator port,
the secrets in what the agents run. The whole path on real hosts is tests/test_ssh.py's
test_the_same_command_on_two_hosts_*.

Attack traffic goes only to 127.0.0.1, from this process, bounded in count and time."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from jaxtrain.hosts import join as hosts
from jaxtrain.hosts.channel import Connection

SECRET = b"0123456789abcdef0123456789abcdef"
TOKEN = "0f" * 16


@pytest.fixture
def agent():
    """Host 1's agent server on loopback, admitted to the run TOKEN; host 0 is 127.0.0.1."""
    server = hosts.AgentServer(SECRET, "host-1", "127.0.0.1", "127.0.0.1")
    server.admit(TOKEN)
    yield server
    server.close()


def _read_message(sock: socket.socket) -> bytes:
    (length,) = struct.unpack(">I", _exactly(sock, 4))
    return _exactly(sock, length)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _message(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _session(agent: hosts.AgentServer, command: str) -> Connection:
    session = Connection.connect(("127.0.0.1", agent.port), hosts.agent_key(SECRET, TOKEN),
                                 hosts.agent_purpose(TOKEN), "host-0", "host-1", 10)
    session.send_json({"command": command})
    return session


def _output(session: Connection) -> tuple[bytes, int]:
    out = b""
    while (record := session.receive(30))[:1] == b"o":
        out += record[1:]
    return out, struct.unpack(">i", record[1:5])[0]


def test_host_0s_session_runs_its_command_with_stdin_and_no_secret(agent, monkeypatch):
    # What an agent runs (the ssh agent, then the worker) inherits none of the run's secrets.
    monkeypatch.setenv(hosts.SECRET_ENV, "x" * 20)
    server = hosts.AgentServer(SECRET, "host-1", "127.0.0.1", "127.0.0.1")
    server.admit(TOKEN)
    try:
        with _session(server, "cat; env") as session:
            session.send(b"dhello ")
            session.send(b"dworld\n")
            session.send(b"e")
            out, status = _output(session)
    finally:
        server.close()
    assert status == 0
    assert out.startswith(b"hello world\n")
    for name in hosts._PRIVATE_ENV:
        assert f"{name}=".encode() not in out


def test_a_relayed_join_proof_opens_no_agent_session(agent, tmp_path):
    # The attack of the review: whoever holds host 0's coordinator port gets a joining host's
    # proof and relays it to an agent server of the run. The proof names its purpose (a join)
    # and both ends, so the agent refuses it, and nothing is run.
    squat = socket.create_server(("127.0.0.1", 0))
    joiner = hosts.SameCommand(("127.0.0.1", squat.getsockname()[1]), 1, 2, SECRET)
    threading.Thread(target=joiner.join, daemon=True).start()
    marker = tmp_path / "pwned"
    conn, _ = squat.accept()
    with conn, socket.create_connection(("127.0.0.1", agent.port), timeout=10) as a:
        conn.settimeout(10)
        a.sendall(_message(_read_message(conn)))  # the joiner's open, relayed to the agent
        answer = _read_message(a)
        assert answer[:1] == b"R"  # refused ...
        assert b"do not hold the same secret" in answer
        assert a.recv(1) == b""  # ... and closed
        conn.sendall(_message(answer))
    time.sleep(0.5)
    assert not marker.exists()
    squat.close()


class _Tamper:
    """A TCP relay between a client and `target` that flips one bit in the `nth` message the
    client sends (length-prefixed, counting from 0: the open, the confirm, then records)."""

    def __init__(self, target: int, nth: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._target, self._nth = target, nth
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self._target))

        def back() -> None:
            try:
                while data := server.recv(65536):
                    client.sendall(data)
            except OSError:
                pass
            client.close()

        threading.Thread(target=back, daemon=True).start()
        try:
            for n in range(100):
                message = bytearray(_message(_read_message(client)))
                if n == self._nth:
                    message[-1] ^= 1
                server.sendall(message)
        except OSError:
            pass
        server.close()


def test_a_tampered_command_record_is_refused(agent, tmp_path):
    marker = tmp_path / "ran"
    tamper = _Tamper(agent.port, nth=2)  # the first record: the command
    session = Connection.connect(("127.0.0.1", tamper.port), hosts.agent_key(SECRET, TOKEN),
                                 hosts.agent_purpose(TOKEN), "host-0", "host-1", 10)
    with session:
        session.send_json({"command": f"touch {marker}"})
        with pytest.raises(OSError):
            session.receive(10)
    time.sleep(0.5)
    assert not marker.exists()


def test_a_tampered_stdin_record_ends_the_command(agent, tmp_path):
    marker = tmp_path / "got"
    tamper = _Tamper(agent.port, nth=3)  # the second record: the first stdin bytes
    session = Connection.connect(("127.0.0.1", tamper.port), hosts.agent_key(SECRET, TOKEN),
                                 hosts.agent_purpose(TOKEN), "host-0", "host-1", 10)
    with session:
        session.send_json({"command": f"cat > {marker}.part && mv {marker}.part {marker}"})
        session.send(b"dprint('trusted')\n")
        session.send(b"e")
        out, status = _output(session)
    assert status == 128 + 9  # killed
    assert not marker.exists()


def test_sessions_of_another_run_or_from_another_host_are_refused(agent):
    with pytest.raises(PermissionError, match="do not hold the same secret"):
        Connection.connect(("127.0.0.1", agent.port), hosts.agent_key(SECRET, "1" * 32),
                           hosts.agent_purpose("1" * 32), "host-0", "host-1", 10)
    with pytest.raises(PermissionError, match="meant for 'host-2' reached 'host-1'"):
        Connection.connect(("127.0.0.1", agent.port), hosts.agent_key(SECRET, TOKEN),
                           hosts.agent_purpose(TOKEN), "host-0", "host-2", 10)
    with pytest.raises(PermissionError, match="accepts no connection from 'host-3'"):
        Connection.connect(("127.0.0.1", agent.port), hosts.agent_key(SECRET, TOKEN),
                           hosts.agent_purpose(TOKEN), "host-3", "host-1", 10)
    other = hosts.AgentServer(SECRET, "host-1", "127.0.0.1", "127.0.0.2")  # host 0 elsewhere
    other.admit(TOKEN)
    try:
        with socket.create_connection(("127.0.0.1", other.port), timeout=10) as s:
            assert s.recv(1) == b""  # closed unanswered
    finally:
        other.close()


def _quietly(function, *args, **kwargs):
    def run() -> None:
        try:
            function(*args, **kwargs)
        except (OSError, TimeoutError):
            pass

    return run


def test_one_trickling_connection_does_not_keep_a_host_from_joining(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # gather() sets host 0's settings
    host0 = hosts.SameCommand(("127.0.0.1", _free_port()), 0, 2, SECRET)
    gathered = threading.Thread(target=host0.gather, kwargs={"timeout_s": 60}, daemon=True)
    gathered.start()
    trickle = _connect_when_listening(host0.coordinator[1])
    stop = threading.Event()

    def drip() -> None:
        with trickle:
            while not stop.is_set():
                try:
                    trickle.sendall(b"\0")
                except OSError:
                    return
                stop.wait(0.5)

    threading.Thread(target=drip, daemon=True).start()
    host1 = hosts.SameCommand(host0.coordinator, 1, 2, SECRET)
    status: list[int] = []
    joiner = threading.Thread(target=lambda: status.append(host1.join()), daemon=True)
    joiner.start()
    gathered.join(60)
    stop.set()
    assert not gathered.is_alive()
    assert os.environ[hosts.JOINED_HOSTS_ENV]
    host0.end(0, "/nowhere")
    joiner.join(30)
    assert status == [0]


def test_host_0_without_its_coordinator_port_says_so(tmp_path):
    with socket.create_server(("", 0)) as squat:
        host0 = hosts.SameCommand(("127.0.0.1", squat.getsockname()[1]), 0, 2, SECRET)
        with pytest.raises(OSError, match="host 0 cannot listen at the coordinator port .*"
                                          "Another program holds it"):
            host0.gather(timeout_s=5)


def test_a_host_with_another_secret_is_refused_and_says_why(tmp_path):
    host0 = hosts.SameCommand(("127.0.0.1", _free_port()), 0, 2, SECRET)
    threading.Thread(target=_quietly(host0.gather, timeout_s=30), daemon=True).start()
    _connect_when_listening(host0.coordinator[1]).close()
    # A refusal without the secret may come from anyone: the host says so at once, tries again
    # until its time is up, then exits naming the likely cause.
    code = (f"import sys; from jaxtrain.hosts import join; sys.exit(join.SameCommand(('127.0.0.1', "
            f"{host0.coordinator[1]}), 1, 2, b'another secret of 32 characters!')"
            f".join(timeout_s=2))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "does not prove the join secret: wrong join secret" in proc.stderr
    assert "refused this host (host rank 1): wrong join secret" in proc.stderr


def test_silent_connections_never_keep_a_host_from_joining(monkeypatch):
    # More silent connections than host 0 keeps in their handshake, held open: at the cap the
    # oldest makes way for the newest, so the joining host gets in long before their handshake
    # deadline (made longer than the gather's here) frees a place.
    monkeypatch.setattr(os, "environ", dict(os.environ))  # gather() sets host 0's settings
    monkeypatch.setattr(hosts, "HANDSHAKE_TIMEOUT_S", 300.0)
    host0 = hosts.SameCommand(("127.0.0.1", _free_port()), 0, 2, SECRET)
    failed: list[BaseException] = []

    def gather() -> None:
        try:
            host0.gather(timeout_s=60)
        except (OSError, TimeoutError) as e:
            failed.append(e)

    gathered = threading.Thread(target=gather, daemon=True)
    gathered.start()
    silent = [_connect_when_listening(host0.coordinator[1])
              for _ in range(hosts._MAX_UNPROVEN + 4)]
    try:
        host1 = hosts.SameCommand(host0.coordinator, 1, 2, SECRET)
        status: list[int] = []
        joiner = threading.Thread(target=lambda: status.append(host1.join(timeout_s=60)),
                                  daemon=True)
        joiner.start()
        gathered.join(60)
        assert not gathered.is_alive()
        assert failed == []
        host0.end(0, "/nowhere")
        joiner.join(30)
        assert status == [0]
    finally:
        for s in silent:
            s.close()


def test_a_joiner_refused_without_the_secret_tries_again_and_joins(monkeypatch):
    # Whatever holds host 0's port first (or writes into the connection) sends a refusal that is
    # not made with the secret; it must not end the joining host, which joins host 0 once host 0
    # has the port.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    squat = socket.create_server(("127.0.0.1", 0))
    port = squat.getsockname()[1]
    refused = threading.Event()

    def refuse_once() -> None:
        with squat:
            conn, _ = squat.accept()
            with conn:
                _read_message(conn)
                conn.sendall(_message(b"R" + b"the two ends do not hold the same secret" +
                                      bytes(32)))
                refused.set()

    threading.Thread(target=refuse_once, daemon=True).start()
    host1 = hosts.SameCommand(("127.0.0.1", port), 1, 2, SECRET)
    status: list[int] = []
    joiner = threading.Thread(target=lambda: status.append(host1.join(timeout_s=60)),
                              daemon=True)
    joiner.start()
    assert refused.wait(30)
    host0 = hosts.SameCommand(("127.0.0.1", port), 0, 2, SECRET)
    deadline = time.monotonic() + 30
    while True:  # the squatter's socket may linger for a moment after it closed
        try:
            host0.gather(timeout_s=60)
            break
        except OSError as e:
            assert "cannot listen" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.1)
    assert joiner.is_alive(), status
    host0.end(0, "/nowhere")
    joiner.join(30)
    assert status == [0]


def test_tpu_metadata_is_never_asked_through_a_proxy(monkeypatch):
    seen = []
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        monkeypatch.setattr(hosts, "_TPU_METADATA", "http://127.0.0.1:9/")
        proxy.settimeout(0.2)
        assert hosts._tpu_metadata("accelerator-type") is None
        try:
            seen.append(proxy.accept())
        except TimeoutError:
            pass
    assert seen == []


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _connect_when_listening(port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_relay_reads_its_key_from_the_descriptor_host_0_passed(agent, tmp_path, monkeypatch):
    fd = hosts._pass_agent_key(hosts.agent_key(SECRET, TOKEN))
    monkeypatch.setenv(hosts.AGENT_KEY_FD_ENV, str(fd))
    monkeypatch.setenv(hosts.TOKEN_ENV, TOKEN)
    monkeypatch.setenv(hosts.JOINED_HOSTS_ENV, f'{{"h1": ["127.0.0.1", {agent.port}, 1]}}')
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.hosts", "relay", "-o", "X=y", "--",
                           "h1", "echo", "relayed"], input=b"", capture_output=True,
                          timeout=60, pass_fds=(fd,), env=dict(os.environ))
    os.close(fd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"relayed\n"


def test_silent_connections_never_keep_host_0s_sessions_out(agent, tmp_path):
    # Whoever may connect from host 0's address holds as many silent connections as it likes:
    # at the cap, the oldest is dropped for the newest, so host 0's session still gets through.
    silent = [socket.create_connection(("127.0.0.1", agent.port), timeout=10)
              for _ in range(hosts._MAX_UNPROVEN + 4)]
    try:
        with _session(agent, "echo through") as session:
            session.send(b"e")
            out, status = _output(session)
        assert (out, status) == (b"through\n", 0)
    finally:
        for s in silent:
            s.close()


def test_a_malformed_answer_is_a_connection_error_not_a_crash():
    # A message longer than the channel allows, or an answer that is neither an accept nor a
    # refusal, from whoever answers at host 0's port: an error the joiner retries after.
    for answer in (struct.pack(">I", 0xFFFFFFF0), _message(b"X" * 40)):
        with socket.create_server(("127.0.0.1", 0)) as liar:
            def reply(answer=answer) -> None:
                conn, _ = liar.accept()
                with conn:
                    _read_message(conn)
                    conn.sendall(answer)

            threading.Thread(target=reply, daemon=True).start()
            with pytest.raises(ConnectionError):
                Connection.connect(liar.getsockname(), SECRET, "jaxtrain-join:1:2", "host-1",
                                   "host-0", 10)


def test_a_join_meant_for_another_run_of_the_same_secret_is_refused_naming_both():
    host0 = hosts.SameCommand(("127.0.0.1", _free_port()), 0, 3, SECRET)
    threading.Thread(target=_quietly(host0.gather, timeout_s=20), daemon=True).start()
    _connect_when_listening(host0.coordinator[1]).close()
    host1 = hosts.SameCommand(host0.coordinator, 1, 2, SECRET)  # thinks the run has 2 hosts
    with pytest.raises(PermissionError, match=r"a connection for 'jaxtrain-join:\d+:2' reached "
                                              r"'host-0', which serves 'jaxtrain-join:\d+:3'"):
        host1._join_once("host-1")
    host1._agents and host1._agents.close()
