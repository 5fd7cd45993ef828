"""Runs started by the same command on every host (docs/hosts.md): `jaxtrain run --coordinator
HOST:PORT --host-rank K --num-hosts M ...` on each host, as `gcloud compute tpus tpu-vm ssh
--worker=all --command=...` or pdsh start it; `--coordinator tpu` takes all three from the TPU VM
slice (host 0 of TPU_WORKER_HOSTNAMES, this host's TPU_WORKER_ID).

Host 0 drives the run. It waits until every other host has joined at the coordinator port, then
runs its JaxTrainer with the ssh launcher (src/launch/ssh_launcher.h), whose transport to each
host is this module's relay instead of ssh: ``python -m jaxtrain.hosts relay [ssh options]
TARGET COMMAND`` connects to the agent server of that host, which runs COMMAND there with the
relay's stdin as its stdin and sends back its output and exit status. So the run is one run:
one controller, one run directory, one Result, every rank's log on host 0.

Every connection (a join, a relay session) proves that both ends hold the join secret before
anything else is read: HMAC-SHA256 over a fresh nonce of each end, the joining end first. The
join secret comes from --join-secret-file (a file readable by its owner only) or
JAXTRAIN_JOIN_SECRET; the run's own secret travels inside the relay, never on a command line.
The connections are authenticated, not encrypted: on a network you do not trust, use the ssh
launcher (--hosts).

Every other host serves the relay sessions host 0 opens and exits with host 0's exit status once
host 0 says the run has ended; if host 0's connection drops, it ends every session (which kills
its workers) and exits 1.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

SECRET_ENV = "JAXTRAIN_JOIN_SECRET"
# target -> [address, agent port] of every host of the run; set on host 0 for its relays.
JOINED_HOSTS_ENV = "JAXTRAIN_JOINED_HOSTS"
DEFAULT_PORT = 8490
# Seconds host 0 waits for the other hosts to join, and every host for a connection's handshake.
JOIN_TIMEOUT_S = 600.0
HANDSHAKE_TIMEOUT_S = 10.0
_MIN_SECRET = 16
_TPU_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


def _say(line: str) -> None:
    sys.stderr.write(f"jaxtrain: {line}\n")
    sys.stderr.flush()


# --- the join secret and the handshake ----------------------------------------------------------


def load_secret(path: str | None) -> bytes:
    """The join secret: the file at `path`, else JAXTRAIN_JOIN_SECRET. ValueError when neither is
    given, the file is readable by others, or the secret is shorter than 16 characters."""
    if path:
        path = os.path.expanduser(path)
        try:
            mode = os.stat(path).st_mode
            if mode & 0o077:
                raise ValueError(
                    f"--join-secret-file '{path}' can be read by others (mode "
                    f"{oct(mode & 0o777)}); make it private: chmod 600 {path}")
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"--join-secret-file '{path}' cannot be read: {e.strerror}") from None
        where = f"--join-secret-file '{path}'"
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV].encode()
        where = SECRET_ENV
    else:
        raise ValueError(
            "a run started on every host needs a join secret that every host holds: give "
            f"--join-secret-file FILE (e.g. made by: openssl rand -hex 32 > FILE; chmod 600 FILE) "
            f"or set {SECRET_ENV}")
    if len(secret) < _MIN_SECRET:
        raise ValueError(f"the join secret of {where} has {len(secret)} characters; use at least "
                         f"{_MIN_SECRET} (e.g. openssl rand -hex 32)")
    return secret


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(secret, role + first + second, hashlib.sha256).hexdigest()


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _receive(sock: socket.socket) -> dict:
    """One JSON line; ConnectionError when the peer closes first or sends more than 64 KiB."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
        if len(data) > 65536:
            raise ConnectionError("a message longer than 64 KiB")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ConnectionError("a message that is not an object")
    return message


def _authenticate(sock: socket.socket, secret: bytes, *, joining: bool) -> None:
    """Both ends prove they hold `secret`; the joining (connecting) end proves it first, so the
    accepting end never answers a peer that does not. PermissionError when the peer fails."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    mine = os.urandom(32)
    if joining:
        theirs = bytes.fromhex(_receive(sock)["nonce"])
        _send(sock, {"nonce": mine.hex(), "proof": _proof(secret, b"join", theirs, mine)})
        answer = _receive(sock)
        if "refused" in answer:
            raise PermissionError(answer["refused"])
        if not hmac.compare_digest(str(answer.get("proof")),
                                   _proof(secret, b"accept", mine, theirs)):
            raise PermissionError("the other end does not hold the join secret")
    else:
        _send(sock, {"nonce": mine.hex()})
        hello = _receive(sock)
        theirs = bytes.fromhex(str(hello.get("nonce")))
        if not hmac.compare_digest(str(hello.get("proof")),
                                   _proof(secret, b"join", mine, theirs)):
            _send(sock, {"refused": "wrong join secret: it does not hold this run's join secret"})
            raise PermissionError("it does not hold the join secret")
        _send(sock, {"proof": _proof(secret, b"accept", theirs, mine)})
    sock.settimeout(None)


# --- the agent server: runs host 0's relay sessions on this host --------------------------------


class AgentServer:
    """Accepts relay sessions from host 0; each runs one command under /bin/sh with the session
    as its stdin, its output sent back in frames (b"o", length, bytes), then its exit status
    (b"x", status; 128 + n for signal n)."""

    def __init__(self, secret: bytes, bind: str = "0.0.0.0") -> None:
        self._secret = secret
        self._listener = socket.create_server((bind, 0))
        self.port = self._listener.getsockname()[1]
        self._sessions: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            _authenticate(conn, self._secret, joining=False)
            command = str(_receive(conn)["command"])
        except (OSError, ValueError, KeyError, PermissionError) as e:
            _say(f"refused a session from {peer[0]}:{peer[1]}: {e}")
            conn.close()
            return
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=conn.fileno(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            conn.sendall(b"o" + struct.pack(">I", len(str(e))) + str(e).encode()
                         + b"x" + struct.pack(">i", 127))
            conn.close()
            return
        with self._lock:
            self._sessions.append(proc)
        try:
            while chunk := proc.stdout.read1(65536):
                conn.sendall(b"o" + struct.pack(">I", len(chunk)) + chunk)
            rc = proc.wait()
            conn.sendall(b"x" + struct.pack(">i", 128 - rc if rc < 0 else rc))
        except OSError:
            proc.kill()  # host 0 went away: its agent kills the worker (stdin ends too)
            proc.wait()
        finally:
            conn.close()
            with self._lock:
                self._sessions.remove(proc)

    def close(self) -> None:
        """Ends every session: each agent's end kills its worker (PR_SET_PDEATHSIG)."""
        self._listener.close()
        with self._lock:
            for proc in self._sessions:
                proc.kill()


# --- the relay: host 0's "ssh" to the other hosts ----------------------------------------------


def relay(argv: list[str]) -> int:
    """``relay [ssh options] TARGET COMMAND`` or ``relay -G TARGET``, as the ssh launcher calls
    ssh: runs COMMAND on TARGET's agent server, stdin to it, its output to stdout; returns its
    exit status, or 255 when TARGET cannot be reached (the reason on stderr, as ssh does)."""
    words, resolve = [], False
    i = 0
    while i < len(argv):
        if argv[i] == "-G":
            resolve = True
        elif argv[i] in ("-o", "-F", "-i", "-p", "-l", "-J"):
            i += 1
        elif argv[i] == "--" or not argv[i].startswith("-"):
            words = argv[i + (argv[i] == "--"):]
            break
        i += 1
    hosts = json.loads(os.environ.get(JOINED_HOSTS_ENV, "{}"))
    if not words or words[0] not in hosts:
        sys.stderr.write(f"relay: no joined host {words[0] if words else '(none)'!r}; the hosts "
                         f"of this run are {', '.join(hosts) or 'none'}\n")
        return 255
    address, port = hosts[words[0]]
    if resolve:
        print(f"hostname {address}")
        return 0
    try:
        sock = socket.create_connection((address, port), timeout=HANDSHAKE_TIMEOUT_S)
        _authenticate(sock, os.environb[SECRET_ENV.encode()], joining=True)
        _send(sock, {"command": " ".join(words[1:])})
    except (OSError, PermissionError, KeyError) as e:
        sys.stderr.write(f"relay: cannot open a session on {words[0]} ({address}:{port}): {e}\n")
        return 255

    def forward_stdin() -> None:
        try:
            while data := os.read(0, 65536):
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # the driver closed it, or died: the worker ends
        except OSError:
            pass

    threading.Thread(target=forward_stdin, daemon=True).start()
    stream = sock.makefile("rb")
    out = sys.stdout.buffer
    while kind := stream.read(1):
        if kind == b"x":
            return struct.unpack(">i", stream.read(4))[0]
        (length,) = struct.unpack(">I", stream.read(4))
        out.write(stream.read(length))
        out.flush()
    sys.stderr.write(f"relay: lost the connection to {words[0]} ({address}:{port})\n")
    return 255


# --- the hosts of a run started on every host ----------------------------------------------------


def self_description() -> dict:
    """What this host has, as placement sees it (_core.describe_this_host)."""
    from jaxtrain import _core

    return dict(_core.describe_this_host())


def host_entry(name: str, address: str, has: dict, host_rank: int, slice_name: str) -> dict:
    """A host of the JAXTRAIN_HOSTS description (docs/accelerators.md) for a joined host. A TPU
    host that does not say which slice it is in (TPU_NAME unset) is worker `host_rank` of one
    slice named after the coordinator, with the TPU VM's accelerator type when it can tell."""
    entry: dict = {"name": name, "address": address}
    if has.get("gpus"):
        entry["gpus"] = int(has["gpus"])
    if has.get("tpu_chips"):
        tpu: dict = {"chips": int(has["tpu_chips"])}
        if has.get("tpu_slice"):
            tpu.update(slice=has["tpu_slice"], worker_id=int(has.get("tpu_worker_id", 0)))
        else:
            tpu.update(slice=f"{slice_name}-slice", worker_id=host_rank)
        kind = has.get("tpu_accelerator_type") or (_tpu_metadata("accelerator-type") or "")
        if kind.strip():
            tpu["accelerator_type"] = kind.strip()
        if has.get("tpu_topology"):
            tpu["topology"] = has["tpu_topology"]
        entry["tpu"] = tpu
    return entry



def _tpu_metadata(name: str) -> str | None:
    try:
        request = urllib.request.Request(_TPU_METADATA + name,
                                         headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def _tpu_slice() -> tuple[list[str], int]:
    """The TPU VM slice's hosts and this host's index: TPU_WORKER_HOSTNAMES and TPU_WORKER_ID,
    else the TPU VM's metadata server. ValueError when neither says."""
    names = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    worker = os.environ.get("TPU_WORKER_ID", "")
    if not names or not worker:
        endpoints = _tpu_metadata("worker-network-endpoints")
        number = _tpu_metadata("agent-worker-number")
        if endpoints and number:
            # "id:host-name:ip,..." per worker; the address is what the workers reach.
            names = ",".join(e.split(":")[2] for e in endpoints.split(","))
            worker = number.strip()
    if not names or not worker.isdigit():
        raise ValueError(
            "--coordinator tpu: this host does not say which TPU VM slice it is in "
            "(TPU_WORKER_HOSTNAMES and TPU_WORKER_ID are unset, and the TPU metadata server "
            "does not answer); give --coordinator HOST:PORT --host-rank K --num-hosts M")
    return [n.strip() for n in names.split(",") if n.strip()], int(worker)


@dataclass
class SameCommand:
    """One host's part of a run started on every host."""

    coordinator: tuple[str, int]
    host_rank: int
    num_hosts: int
    secret: bytes
    _joiners: list[socket.socket] = field(default_factory=list)
    _agents: AgentServer | None = None
    _description: Any = None  # the joined hosts' description file, while the run lasts

    @staticmethod
    def from_args(coordinator: str, host_rank: int | None, num_hosts: int | None,
                  secret_file: str | None) -> SameCommand:
        """ValueError naming the option for anything that does not fit."""
        if coordinator == "tpu":
            names, worker = _tpu_slice()
            host, port = names[0], DEFAULT_PORT
            host_rank = worker if host_rank is None else host_rank
            num_hosts = len(names) if num_hosts is None else num_hosts
        else:
            host, _, port_text = coordinator.rpartition(":")
            if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ValueError(f"--coordinator '{coordinator}' is not allowed; give HOST:PORT "
                                 f"(host 0's address and a free port, e.g. worker-0:"
                                 f"{DEFAULT_PORT}) or 'tpu'")
            port = int(port_text)
        if num_hosts is None or num_hosts < 1:
            raise ValueError(f"--num-hosts {num_hosts} is not allowed; give the number of hosts "
                             "that run this command (>= 1)")
        if host_rank is None or not 0 <= host_rank < num_hosts:
            raise ValueError(f"--host-rank {host_rank} is not allowed; it must be 0 (the host "
                             f"that drives the run) to {num_hosts - 1}")
        return SameCommand((host.strip("[]"), port), host_rank, num_hosts,
                           load_secret(secret_file))

    def gather(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Host 0: waits until every other host has joined, then sets this process's settings so
        that JaxTrainer.fit() starts the workers on every host through the relay."""
        self._agents = AgentServer(self.secret)
        listener = socket.create_server(("", self.coordinator[1]))
        listener.settimeout(1.0)
        hosts: dict[int, tuple[str, str, int]] = {}  # host rank -> (name, address, agent port)
        has: dict[int, dict] = {0: self_description()}  # host rank -> what it has
        here = None
        deadline = time.monotonic() + timeout_s
        if self.num_hosts > 1:
            _say(f"host 0 of {self.num_hosts}: waiting for the other hosts to join at port "
                 f"{self.coordinator[1]}")
        while len(hosts) < self.num_hosts - 1:
            if time.monotonic() > deadline:
                missing = [k for k in range(1, self.num_hosts) if k not in hosts]
                listener.close()
                raise TimeoutError(f"host(s) {', '.join(map(str, missing))} did not join within "
                                   f"{timeout_s:.0f} s at port {self.coordinator[1]}")
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            try:
                _authenticate(conn, self.secret, joining=False)
                hello = _receive(conn)
                rank = int(hello["host_rank"])
                if not 0 < rank < self.num_hosts or rank in hosts:
                    _send(conn, {"refused": f"host rank {rank} is taken or not in 1.."
                                 f"{self.num_hosts - 1}"})
                    raise ValueError(f"host rank {rank} is taken or out of range")
            except (OSError, ValueError, KeyError, PermissionError) as e:
                _say(f"refused a host joining from {peer[0]}:{peer[1]}: {e}")
                conn.close()
                continue
            here = conn.getsockname()[0]
            hosts[rank] = (str(hello["hostname"]), peer[0], int(hello["agent_port"]))
            has[rank] = dict(hello.get("has") or {})
            _send(conn, {"joined": True})
            self._joiners.append(conn)
            _say(f"host {rank} ({hello['hostname']}, {peer[0]}) joined")
        listener.close()
        hosts[0] = (socket.gethostname(), here or "127.0.0.1", self._agents.port)
        targets: dict[str, list] = {}
        described = []
        for rank in sorted(hosts):
            name, address, port = hosts[rank]
            target = name if name not in targets else f"{name}-{rank}"
            targets[target] = [address, port]
            described.append(host_entry(target, address, has[rank], rank, self.coordinator[0]))
        os.environ[SECRET_ENV] = self.secret.decode()  # for the relays; never passed on to workers
        os.environ[JOINED_HOSTS_ENV] = json.dumps(targets)
        os.environ["JAXTRAIN_LAUNCHER"] = "ssh"
        os.environ["JAXTRAIN_SSH_COMMAND"] = f"{sys.executable} -m jaxtrain.hosts relay"
        if any("tpu" in h or "gpus" in h for h in described):
            # Accelerators: placed by what each host has (docs/accelerators.md).
            self._description = tempfile.NamedTemporaryFile(
                "w", prefix="jaxtrain-joined-hosts-", suffix=".json")
            json.dump({"hosts": described}, self._description)
            self._description.flush()
            os.environ["JAXTRAIN_HOSTS"] = self._description.name
        else:
            os.environ["JAXTRAIN_SSH_HOSTS"] = ",".join(targets)  # equal shares of CPU workers

    def end(self, status: int, run_dir: str) -> None:
        """Host 0: tells every other host that the run has ended."""
        for conn in self._joiners:
            try:
                _send(conn, {"ended": status, "run_dir": run_dir, "host": socket.gethostname()})
                conn.close()
            except OSError:
                pass
        if self._agents is not None:
            self._agents.close()

    def join(self) -> int:
        """Every other host: joins host 0, serves its sessions until host 0 says the run has
        ended, and returns host 0's exit status (1 when host 0 went away or refused)."""
        self._agents = AgentServer(self.secret)
        host, port = self.coordinator
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:  # host 0 may start later than this host
            try:
                conn = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    _say(f"cannot join the run at {host}:{port}: {e}")
                    return 1
                time.sleep(0.5)
        try:
            _authenticate(conn, self.secret, joining=True)
            _send(conn, {"host_rank": self.host_rank, "hostname": socket.gethostname(),
                         "agent_port": self._agents.port, "has": self_description()})
            answer = _receive(conn)
            if "refused" in answer:
                raise PermissionError(answer["refused"])
        except (OSError, PermissionError) as e:
            _say(f"host 0 at {host}:{port} refused this host (host rank {self.host_rank}): {e}")
            self._agents.close()
            return 1
        _say(f"host {self.host_rank} joined the run of host 0 ({host}:{port}); the workers' "
             "output and the results are on host 0")
        try:
            conn.settimeout(None)
            ended = _receive(conn)
        except (OSError, ValueError):
            _say(f"lost the connection to host 0 ({host}:{port}); this host's workers were "
                 "stopped")
            self._agents.close()
            return 1
        self._agents.close()
        _say(f"the run ended on host 0 ({ended.get('host')}) with status {ended.get('ended')}; "
             f"results in {ended.get('run_dir')} there")
        return int(ended.get("ended", 1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        sys.exit(relay(sys.argv[2:]))
    sys.stderr.write("usage: python -m jaxtrain.hosts relay [ssh options] TARGET COMMAND\n")
    sys.exit(2)
