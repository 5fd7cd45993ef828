"""Runs started by the same command on every host (docs/hosts.md): `jaxtrain run --coordinator
HOST:PORT --host-rank K --num-hosts M ...` on each host, as `gcloud compute tpus tpu-vm ssh
--worker=all --command=...` or pdsh start it; `--coordinator tpu` takes all three from the TPU VM
slice (host 0 of TPU_WORKER_HOSTNAMES, this host's TPU_WORKER_ID).

Host 0 drives the run. It waits until every other host has joined at the coordinator port, then
runs its JaxTrainer with the ssh launcher (src/launch/ssh_launcher.h), whose transport to each
host is this module's relay instead of ssh: ``python -m jaxtrain.hosts relay [ssh options]
TARGET COMMAND`` opens a session on the agent server of that host, which runs COMMAND there with
the session's input as its stdin and sends back its output and exit status. So the run is one
run: one controller, one run directory, one Result, every rank's log on host 0.

Every connection is a secure channel (channel.py, src/wire/channel.h): a join is
``jaxtrain-join`` from ``host-K`` to ``host-0``, proven with the join secret; a relay session is
``jaxtrain-agent:<run token>`` from ``host-0`` to ``host-K``, proven with the run's agent key (the
join secret and the token host 0 drew for this run, which each host learns when it joins). A proof
made for one connection opens no other, and every message after it (commands, stdin, output,
exit status) is encrypted and authenticated. An agent server listens on the address towards host
0 and takes sessions from host 0's address only. The join secret comes from --join-secret-file (a
file readable by its owner only) or JAXTRAIN_JOIN_SECRET, which is removed from the environment
once read; host 0's relays get the agent key on an inherited descriptor, and no worker gets
either (docs/security.md).

Every other host serves the relay sessions host 0 opens and exits with host 0's exit status once
host 0 says the run has ended; if host 0's connection drops, it ends every session (which kills
its workers) and exits 1.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
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

from jaxtrain.hosts import channel
from jaxtrain.hosts.channel import Connection

SECRET_ENV = "JAXTRAIN_JOIN_SECRET"
# target -> [address, agent port, host rank] of every host of the run; set on host 0 for its relays.
JOINED_HOSTS_ENV = "JAXTRAIN_JOINED_HOSTS"
# The run's token, and the descriptor holding its agent key; set on host 0 for its relays.
TOKEN_ENV = "JAXTRAIN_JOIN_TOKEN"
AGENT_KEY_FD_ENV = "JAXTRAIN_AGENT_KEY_FD"
# Never passed on to what an agent server runs (the workers).
_PRIVATE_ENV = (SECRET_ENV, JOINED_HOSTS_ENV, TOKEN_ENV, AGENT_KEY_FD_ENV)
DEFAULT_PORT = 8490
# Seconds host 0 waits for the other hosts to join, and every host for a connection's handshake.
JOIN_TIMEOUT_S = 600.0
HANDSHAKE_TIMEOUT_S = 10.0
# Connections whose handshake is in progress at once, at the coordinator port and at each agent
# server; more are closed unanswered (a flood of silent ones costs only retries).
_MAX_UNPROVEN = 16
_JOIN = "jaxtrain-join"
_MIN_SECRET = 16
_TPU_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


def _say(line: str) -> None:
    sys.stderr.write(f"jaxtrain: {line}\n")
    sys.stderr.flush()


# --- the join secret and the agent key ----------------------------------------------------------


def load_secret(path: str | None) -> bytes:
    """The join secret: the file at `path`, else JAXTRAIN_JOIN_SECRET (then removed from this
    process's environment, so that nothing it starts inherits it). ValueError when neither is
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
        secret = os.environ.pop(SECRET_ENV).encode()
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


def agent_key(secret: bytes, token: str) -> bytes:
    """The key of the relay sessions of the run whose token is `token`."""
    return hmac.new(secret, b"jaxtrain-agent-key" + token.encode(), hashlib.sha256).digest()


def agent_purpose(token: str) -> str:
    return f"jaxtrain-agent:{token}"


def _pass_agent_key(key: bytes) -> int:
    """A descriptor holding `key` that host 0's relays inherit (the ssh launcher starts them);
    Python's own child processes close it, as they close every descriptor."""
    fd = os.memfd_create("jaxtrain-agent-key", 0)
    os.write(fd, key)
    os.set_inheritable(fd, True)
    return fd


# --- the agent server: runs host 0's relay sessions on this host --------------------------------

# Session messages, one per record, each a kind byte and its bytes:
#   relay -> agent   {"command": ...} first (JSON), then b"d" + stdin bytes, b"e" at stdin's end
#   agent -> relay   b"o" + output bytes, b"x" + the exit status (i32; 128 + n for signal n)


class AgentServer:
    """Serves relay sessions of host 0 on this host: each runs one command under /bin/sh with the
    session's stdin as its stdin, and sends back its output and exit status. It listens on
    `bind` (the address towards host 0) and takes sessions only from `host0_address`, once
    `admit()` has told it the run's token."""

    def __init__(self, secret: bytes, me: str, bind: str, host0_address: str) -> None:
        self._secret = secret
        self._me = me
        self._host0 = host0_address
        self._key: bytes | None = None
        self._purpose = ""
        self._listener = socket.create_server((bind, 0), family=channel.family_of(bind))
        self.port = self._listener.getsockname()[1]
        # Each session's socket and command (once started), until it ends.
        self._sessions: dict[socket.socket, subprocess.Popen | None] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # Connections whose handshake is in progress, oldest first: at the cap, the oldest is
        # dropped for the newest, so that silent ones never keep host 0's sessions out.
        self._unproven: dict[socket.socket, None] = {}
        self._refused = _Refusals()
        self._env = {k: v for k, v in os.environ.items() if k not in _PRIVATE_ENV}
        threading.Thread(target=self._accept, daemon=True).start()

    def admit(self, token: str) -> None:
        """Takes sessions of the run whose token is `token` from now on."""
        self._purpose = agent_purpose(token)
        self._key = agent_key(self._secret, token)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            if peer[0] != self._host0 or self._key is None:
                self._refused.say(peer, f"only host 0 ({self._host0}) opens sessions here, once "
                                  "this host has joined")
                conn.close()
                continue
            with self._lock:
                if len(self._unproven) >= _MAX_UNPROVEN:
                    oldest = next(iter(self._unproven))
                    del self._unproven[oldest]
                    channel.shut(oldest)  # its thread ends its handshake and closes it
                self._unproven[conn] = None
            self._start(self._serve, conn, peer)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with self._lock:
            self._sessions[conn] = None
        try:
            try:
                session = Connection.accept(conn, self._key, self._purpose, self._me,
                                            ["host-0"], HANDSHAKE_TIMEOUT_S)
                command = str(session.receive_json(HANDSHAKE_TIMEOUT_S)["command"])
            finally:
                with self._lock:
                    self._unproven.pop(conn, None)
        except (*channel.Errors, KeyError) as e:
            self._refused.say(peer, str(e))
            conn.close()
            with self._lock:
                self._sessions.pop(conn, None)
            return
        with session:
            self._run(session, command)

    def _run(self, session: Connection, command: str) -> None:
        try:
            try:
                proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=self._env)
            except OSError as e:
                session.send(b"o" + str(e).encode())
                session.send(b"x" + struct.pack(">i", 127))
                return
            with self._lock:
                self._sessions[session.sock] = proc
            self._pump(session, proc)
        finally:
            with self._lock:
                self._sessions.pop(session.sock, None)

    def _pump(self, session: Connection, proc: subprocess.Popen) -> None:
        """The command's output and exit status to host 0, host 0's input to the command."""
        stdin = threading.Thread(target=self._forward_stdin, args=(session, proc), daemon=True)
        stdin.start()
        try:
            while chunk := proc.stdout.read1(65536):
                session.send(b"o" + chunk)
            rc = proc.wait()
            session.send(b"x" + struct.pack(">i", 128 - rc if rc < 0 else rc))
            # The exit status goes first, then the end: closing with host 0's input unread would
            # reset the connection, which may drop what host 0 has not yet read.
            session.sock.shutdown(socket.SHUT_WR)
            stdin.join(HANDSHAKE_TIMEOUT_S)
        except channel.Errors:
            proc.kill()  # host 0 went away: its agent kills the worker (stdin ends too)
            proc.wait()
        finally:
            # The socket is closed by the caller only once no thread uses its descriptor.
            channel.shut(session.sock)
            stdin.join()

    @staticmethod
    def _forward_stdin(session: Connection, proc: subprocess.Popen) -> None:
        """The session's stdin records into the command's stdin. A record that fails its check
        (changed or forged on the way) ends the command."""
        try:
            while (record := session.receive())[:1] == b"d":
                proc.stdin.write(record[1:])
                proc.stdin.flush()
        except PermissionError as e:
            _say(f"ended a session of host 0: {e}")
            proc.kill()
        except (OSError, ValueError):
            pass  # the connection ended: as stdin's end
        try:
            proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        """Ends every session: each agent's end kills its worker (PR_SET_PDEATHSIG). Returns
        once the sessions' threads have ended (within a few seconds): none may still wait in the
        channel's code when the process exits."""
        self._listener.close()
        with self._lock:
            for sock, proc in self._sessions.items():
                if proc is not None:
                    proc.kill()
                channel.shut(sock)  # wakes a thread that waits on it
            threads = list(self._threads)
        deadline = time.monotonic() + 5
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


# --- the relay: host 0's "ssh" to the other hosts ----------------------------------------------


def relay(argv: list[str]) -> int:
    """``relay [ssh options] [--] TARGET COMMAND`` or ``relay -G TARGET``, as the ssh launcher
    calls ssh: runs COMMAND on TARGET's agent server, stdin to it, its output to stdout; returns
    its exit status, or 255 when TARGET cannot be reached (the reason on stderr, as ssh does)."""
    words, resolve = [], False
    i = 0
    while i < len(argv):
        if argv[i] == "-G":
            resolve = True
        elif argv[i] in ("-o", "-F", "-i", "-p", "-l", "-J"):
            i += 1
        elif argv[i] == "--":
            words = argv[i + 1:]
            break
        elif not argv[i].startswith("-"):
            words = argv[i:]
            break
        i += 1
    hosts = json.loads(os.environ.get(JOINED_HOSTS_ENV, "{}"))
    if not words or words[0] not in hosts:
        sys.stderr.write(f"relay: no joined host {words[0] if words else '(none)'!r}; the hosts "
                         f"of this run are {', '.join(hosts) or 'none'}\n")
        return 255
    address, port, rank = hosts[words[0]]
    if resolve:
        print(f"hostname {address}")
        return 0
    try:
        key = os.pread(int(os.environ[AGENT_KEY_FD_ENV]), 64, 0)
        token = os.environ[TOKEN_ENV]
        session = Connection.connect((address, port), key, agent_purpose(token), "host-0",
                                     f"host-{rank}", HANDSHAKE_TIMEOUT_S)
        session.send_json({"command": " ".join(words[1:])})
    except (*channel.Errors, KeyError) as e:
        sys.stderr.write(f"relay: cannot open a session on {words[0]} ({address}:{port}): {e}\n")
        return 255

    def forward_stdin() -> None:
        try:
            while data := os.read(0, 65536):
                session.send(b"d" + data)
            session.send(b"e")  # the driver closed it, or died: the worker ends
        except OSError:
            pass

    threading.Thread(target=forward_stdin, daemon=True).start()
    out = sys.stdout.buffer
    try:
        while True:
            record = session.receive()
            if record[:1] == b"x" and len(record) == 5:
                return struct.unpack(">i", record[1:5])[0]
            out.write(record[1:])
            out.flush()
    except PermissionError as e:
        sys.stderr.write(f"relay: the session on {words[0]} ({address}:{port}) failed: {e}\n")
    except channel.Errors:
        sys.stderr.write(f"relay: lost the connection to {words[0]} ({address}:{port})\n")
    return 255


# --- one command on a host of the run, as the ssh launcher reaches it ---------------------------

SSH_COMMAND_ENV = "JAXTRAIN_SSH_COMMAND"


def ssh_argv(target: str, command: str) -> tuple[list[str], tuple[int, ...]]:
    """The argv that runs the shell command `command` on `target` as the ssh launcher reaches
    that host — JAXTRAIN_SSH_COMMAND (default ssh; on host 0 of a run started on every host, the
    relay), the launcher's options, "--", the target — and the descriptors it must inherit (the
    relay's agent key). ssh exits 255 when the host cannot be reached."""
    ssh = os.environ.get(SSH_COMMAND_ENV, "").split() or ["ssh"]
    fds = (int(os.environ[AGENT_KEY_FD_ENV]),) if os.environ.get(AGENT_KEY_FD_ENV) else ()
    from jaxtrain import _core

    return [*ssh, *_core.SSH_OPTIONS, "--", target, command], fds


@dataclass
class RunHost:
    """A host an ssh run lists: its ssh target, its hostfile labels, and what its description
    says it has ("cpus", "gpus"; only what JAXTRAIN_HOSTS says)."""

    target: str
    labels: dict[str, str] = field(default_factory=dict)
    has: dict[str, int] = field(default_factory=dict)


def run_hosts() -> tuple[list[RunHost], str]:
    """The hosts the ssh launcher would start this run's workers on, as listed (before
    ScalingConfig.label_selector narrows them), and where they are listed: JAXTRAIN_HOSTFILE, else
    JAXTRAIN_SSH_HOSTS, else JAXTRAIN_HOSTS (the launcher's order). ValueError when none is set
    or the list cannot be read."""
    path = os.environ.get("JAXTRAIN_HOSTFILE")
    listed = os.environ.get("JAXTRAIN_SSH_HOSTS")
    described = os.environ.get("JAXTRAIN_HOSTS")
    if path:
        source = f"JAXTRAIN_HOSTFILE={path}"
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{source} cannot be read: {e.strerror}") from None
        return [RunHost(host, labels) for _, host, labels in hostfile_labels(text, source)], source
    if listed:
        entries = [e.strip() for e in listed.split(",") if e.strip()]
        return ([RunHost(e.rpartition(":")[0] if e.rpartition(":")[2].isdigit() else e)
                 for e in entries], f"JAXTRAIN_SSH_HOSTS={listed}")
    if described:
        source = f"JAXTRAIN_HOSTS={described}"
        try:
            with open(os.path.expanduser(described), encoding="utf-8") as f:
                entries = json.load(f)["hosts"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{source} cannot be read as a host description: {e}") from None
        out = []
        for entry in entries:
            has = {}
            if isinstance(entry.get("cpus"), int):
                has["cpus"] = entry["cpus"]
            gpus = entry.get("gpus")
            if isinstance(gpus, (int, list)):
                has["gpus"] = gpus if isinstance(gpus, int) else len(gpus)
            out.append(RunHost(str(entry.get("name")), {}, has))
        return out, source
    raise ValueError("the run lists no ssh hosts: set JAXTRAIN_HOSTFILE, JAXTRAIN_SSH_HOSTS or "
                     "JAXTRAIN_HOSTS (docs/hosts.md)")


# --- a hostfile's labels: ScalingConfig.label_selector on ssh runs -------------------------------

LABELS_WORD = "labels="


def hostfile_labels(text: str, source: str) -> list[tuple[str, str, dict[str, str]]]:
    """The hosts of a hostfile (docs/hosts.md) with their labels: (its line without the labels
    word, the host, {label: value}) for each host line. A line's labels are one word,
    ``labels=key=value[,key=value...]``; a label or value that Kubernetes would not take is
    refused with a ValueError naming the file, the line and the word."""
    from jaxtrain.labels import LABEL_NAME, valid_key

    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        labels: dict[str, str] = {}
        kept = []
        for word in words:
            if not word.startswith(LABELS_WORD):
                kept.append(word)
                continue
            for item in word[len(LABELS_WORD):].split(","):
                key, eq, value = item.partition("=")
                if not eq or not valid_key(key) or not LABEL_NAME.match(value):
                    raise ValueError(
                        f"{source} line {number}: {word!r} is not allowed; labels are "
                        "'labels=key=value,key2=value2', each key a label name (optionally "
                        "after a DNS prefix and '/') and each value up to 63 letters, digits, "
                        "'-', '_' or '.'")
                labels[key] = value
        hosts.append((" ".join(kept), kept[0], labels))
    return hosts


def matches(labels: dict[str, str], node_labels: dict[str, tuple[str, tuple[str, ...]]]) -> bool:
    """Whether a host with `labels` satisfies a label selector (ScalingConfig.node_labels()):
    every "in" label present with one of its values, every "notin" label absent or with another
    value (Kubernetes' and Ray's rule)."""
    for key, (op, values) in node_labels.items():
        present = labels.get(key) in values
        if present != (op == "in"):
            return False
    return True


def select_hosts(text: str, source: str, node_labels: dict[str, tuple[str, tuple[str, ...]]],
                 num_workers: int) -> str:
    """The hostfile of the hosts of `text` whose labels match the selector, without their
    labels. A ValueError with the reason when none matches, or when the matching hosts' slots
    hold fewer than `num_workers` (hosts without slots share the workers, so any number of
    them will do)."""
    hosts = hostfile_labels(text, source)
    chosen = [(line, host) for line, host, labels in hosts if matches(labels, node_labels)]
    wanted = {k: (v[0] if op == "in" and len(v) == 1 else f"{'!' if op == 'notin' else ''}in("
                  f"{','.join(v)})") for k, (op, v) in node_labels.items()}
    if not chosen:
        listed = "; ".join(f"{host}: {labels or 'no labels'}" for _, host, labels in hosts)
        raise ValueError(
            f"ScalingConfig.label_selector={wanted!r} matches no host of {source} ({listed}); "
            "give the hosts labels=key=value words, or change the selector")
    slots = [_slots(line) for line, _ in chosen]
    if all(n is not None for n in slots) and sum(slots) < num_workers:
        names = ", ".join(f"{host} (slots={n})" for (_, host), n in zip(chosen, slots,
                                                                         strict=True))
        raise ValueError(
            f"ScalingConfig.label_selector={wanted!r} matches only {names} of {source}: "
            f"{sum(slots)} slots for {num_workers} workers (num_workers); label more hosts, or "
            "ask for fewer workers")
    return "".join(line + "\n" for line, _ in chosen)


def _slots(line: str) -> int | None:
    for word in line.split()[1:]:
        if word.startswith("slots=") and word[6:].isdigit():
            return int(word[6:])
    return None


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
        # Never through a proxy: only the host's own metadata server may answer.
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with direct.open(request, timeout=2) as r:
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
    _joiners: list[Connection] = field(default_factory=list)
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
        that JaxTrainer.fit() starts the workers on every host through the relay. OSError when
        the coordinator port cannot be had, TimeoutError when a host does not join in time."""
        port = self.coordinator[1]
        try:
            listener = socket.create_server(("", port))
        except OSError as e:
            raise OSError(
                f"host 0 cannot listen at the coordinator port {port}: {e.strerror}. Another "
                "program holds it; the other hosts refuse whatever answers there (it does not "
                "hold the join secret). Free the port or give another with --coordinator "
                "HOST:PORT on every host") from None
        listener.settimeout(0.5)
        token = secrets.token_hex(16)
        joined: dict[int, tuple[Connection, dict, str, str]] = {}  # rank -> (conn, hello, ...)
        lock = threading.Lock()
        pending: dict[socket.socket, threading.Thread] = {}  # handshakes in progress, oldest first
        admitting: list[threading.Thread] = []  # every handshake's thread, joined at the end
        refused = _Refusals("a host joining")

        def admit(conn: socket.socket, peer) -> None:
            """One joining host, its handshake and hello within HANDSHAKE_TIMEOUT_S."""
            try:
                try:
                    host = Connection.accept(conn, self.secret, self._join_purpose(), "host-0",
                                             [], HANDSHAKE_TIMEOUT_S)
                    hello = host.receive_json(HANDSHAKE_TIMEOUT_S)
                finally:
                    with lock:
                        pending.pop(conn, None)
                rank = channel.end_number(host.peer, "host")
                with lock:
                    taken = rank is None or not 0 < rank < self.num_hosts or rank in joined
                    if not taken:
                        joined[rank] = (host, hello, peer[0], conn.getsockname()[0])
                if taken:
                    host.send_json({"refused": f"{host.peer} is taken or not host-1.."
                                    f"host-{self.num_hosts - 1}"})
                    host.close()
                    raise ValueError(f"{host.peer} is taken or out of range")
            except (*channel.Errors, KeyError) as e:
                refused.say(peer, str(e))
                return
            _say(f"host {rank} ({hello.get('hostname')}, {peer[0]}) joined")

        deadline = time.monotonic() + timeout_s
        if self.num_hosts > 1:
            _say(f"host 0 of {self.num_hosts}: waiting for the other hosts to join at port {port}")
        try:
            while True:
                with lock:
                    if len(joined) == self.num_hosts - 1:
                        break
                if time.monotonic() > deadline:
                    missing = [k for k in range(1, self.num_hosts) if k not in joined]
                    raise TimeoutError(f"host(s) {', '.join(map(str, missing))} did not join "
                                       f"within {timeout_s:.0f} s at port {port}")
                try:
                    conn, peer = listener.accept()
                except TimeoutError:
                    continue
                thread = threading.Thread(target=admit, args=(conn, peer), daemon=True)
                with lock:
                    # At the cap the oldest handshake makes way for the newest (whose joiner,
                    # if it was one, tries again): silent connections never keep a host out, as
                    # dropping the newest let 16 of them do.
                    if len(pending) >= _MAX_UNPROVEN:
                        oldest = next(iter(pending))
                        del pending[oldest]
                        channel.shut(oldest)  # its thread ends its handshake and closes it
                    pending[conn] = thread
                admitting.append(thread)
                thread.start()
        finally:
            listener.close()
            # Handshakes still in progress end now: no thread may wait in the channel's code
            # when this process exits.
            with lock:
                left = list(pending)
            for conn in left:
                channel.shut(conn)
            for thread in admitting:
                thread.join(5)
        here = next((local for *_, local in joined.values()), "127.0.0.1")
        self._agents = AgentServer(self.secret, "host-0", here, here)
        self._agents.admit(token)
        hosts: dict[int, tuple[str, str, int]] = {0: (socket.gethostname(), here,
                                                      self._agents.port)}
        has: dict[int, dict] = {0: self_description()}
        for rank, (conn, hello, address, _) in sorted(joined.items()):
            hosts[rank] = (str(hello.get("hostname")), address, int(hello["agent_port"]))
            has[rank] = dict(hello.get("has") or {})
            try:
                conn.send_json({"joined": True, "token": token}, HANDSHAKE_TIMEOUT_S)
            except channel.Errors as e:
                raise OSError(f"host {rank} ({address}) went away after it joined: {e}") from None
            self._joiners.append(conn)
        targets: dict[str, list] = {}
        described = []
        for rank in sorted(hosts):
            name, address, agent_port = hosts[rank]
            target = name if name not in targets else f"{name}-{rank}"
            targets[target] = [address, agent_port, rank]
            described.append(host_entry(target, address, has[rank], rank, self.coordinator[0]))
        os.environ[AGENT_KEY_FD_ENV] = str(_pass_agent_key(agent_key(self.secret, token)))
        os.environ[TOKEN_ENV] = token
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
                conn.send_json({"ended": status, "run_dir": run_dir,
                                "host": socket.gethostname()}, HANDSHAKE_TIMEOUT_S)
            except channel.Errors:
                pass
            conn.close()
        if self._agents is not None:
            self._agents.close()

    def join(self, timeout_s: float = JOIN_TIMEOUT_S) -> int:
        """Every other host: joins host 0 (trying for `timeout_s`), serves its sessions until
        host 0 says the run has ended, and returns host 0's exit status (1 when host 0 went away
        or refused, or the time is up).

        Only a refusal made with the join secret ends the tries at once. A refusal without it
        (what a peer that does not hold the secret can say) is tried again until the time is up:
        it may come from a wrong secret on either host, but also from anyone who holds host 0's
        port before it or writes into the connection on the way, and one such packet must not
        end a joiner for good."""
        host, port = self.coordinator
        me = f"host-{self.host_rank}"
        deadline = time.monotonic() + timeout_s
        said_unproven = False
        while True:  # host 0 may start later than this host, or be slow to answer
            try:
                conn = self._join_once(me)
                break
            except PermissionError as e:
                if channel.NOT_THE_SAME_SECRET not in str(e):
                    _say(f"host 0 at {host}:{port} refused this host (host rank "
                         f"{self.host_rank}): {e}")
                    return 1
                why = (f"wrong join secret: {e} (or another program answers at port {port} "
                       "on host 0)")
                if time.monotonic() > deadline:
                    _say(f"host 0 at {host}:{port} refused this host (host rank "
                         f"{self.host_rank}): {why}")
                    return 1
                if not said_unproven:
                    said_unproven = True
                    _say(f"what answers at {host}:{port} does not prove the join secret: {why}; "
                         f"trying again for up to {timeout_s:.0f} s")
                time.sleep(0.5)
            except channel.Errors as e:
                if time.monotonic() > deadline:
                    _say(f"cannot join the run at {host}:{port}: {e}")
                    return 1
                time.sleep(0.5)
        _say(f"host {self.host_rank} joined the run of host 0 ({host}:{port}); the workers' "
             "output and the results are on host 0")
        try:
            ended = conn.receive_json()
        except channel.Errors:
            _say(f"lost the connection to host 0 ({host}:{port}); this host's workers were "
                 "stopped")
            self._agents.close()
            return 1
        self._agents.close()
        conn.close()
        _say(f"the run ended on host 0 ({ended.get('host')}) with status {ended.get('ended')}; "
             f"results in {ended.get('run_dir')} there")
        return int(ended.get("ended", 1))

    def _join_purpose(self) -> str:
        """A join names the coordinator's port and the number of hosts, so that a join meant for
        another run of the same secret is refused, naming both."""
        return f"{_JOIN}:{self.coordinator[1]}:{self.num_hosts}"

    def _join_once(self, me: str) -> Connection:
        """One try at joining: the handshake, this host's hello, host 0's answer. Its agent
        server listens on the address towards host 0, for host 0's address only."""
        conn = Connection.connect(self.coordinator, self.secret, self._join_purpose(), me,
                                  "host-0", HANDSHAKE_TIMEOUT_S)
        try:
            local, host0 = conn.sock.getsockname()[0], conn.sock.getpeername()[0]
            if self._agents is not None:
                self._agents.close()
            self._agents = AgentServer(self.secret, me, local, host0)
            conn.send_json({"hostname": socket.gethostname(), "agent_port": self._agents.port,
                            "has": self_description()})
            answer = conn.receive_json()  # as long as host 0 takes to gather every host
            if "refused" in answer:
                raise PermissionError(answer["refused"])
            self._agents.admit(str(answer["token"]))
        except BaseException:
            conn.close()
            raise
        return conn


class _Refusals:
    """Says a refused connection once per address: a flood makes one line, not one a second."""

    def __init__(self, what: str = "a session") -> None:
        self._what = what
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def say(self, peer, why: str) -> None:
        with self._lock:
            if peer[0] in self._said:
                return
            self._said.add(peer[0])
        _say(f"refused {self._what} from {peer[0]}:{peer[1]}: {why} (said once per address)")


def main() -> None:
    """``python -m jaxtrain.hosts``."""
    if sys.argv[1:2] == ["relay"]:
        status = relay(sys.argv[2:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # its stdin thread may still wait in the channel's code
    sys.stderr.write("usage: python -m jaxtrain.hosts relay [ssh options] TARGET COMMAND\n")
    sys.exit(2)
