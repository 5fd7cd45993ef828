"""Peer copies of the checkpoints held in host memory (JAXTRAIN_CHECKPOINT_IN_MEMORY=1, in a run
across hosts): each rank also sends its copy to its *peer*, the rank of the same local rank on the
next host (rank + local world size, modulo the world size), whose host keeps it in its store as
its own ranks' copies are kept (checkpoint_memory.py). A rank restarted on a host whose memory
holds no copy of its part (the host was replaced, its pod recreated, its memory freed) fetches
the part from its peer's host before it builds its view; with neither copy left it reads storage.

Each worker runs a *peer server*: one thread listening on the host's address towards the
controller, on a port of the system's choice, published in the JAX coordination service's
key-value store (``jaxtrain/peer/<rank>``) right after ``jax.distributed.initialize``, so a rank
finds its peer's address in its attempt's own coordination service. A connection carries one
request, both ways proven with the run's secret as the control connection's handshake is:

    server -> client   32-byte nonce
    client -> server   u32 length, request JSON (with the client's nonce, hex), then
                       HMAC-SHA-256(secret, "jaxtrain-peer-request" || server nonce || request)
    put:  client -> server   the files' bytes, in the order of the request's entries
          server -> client   u32 length, reply JSON, HMAC(secret, "jaxtrain-peer-reply" ||
                             client nonce || server nonce || reply)
    get:  server -> client   the reply as for put, then the copy's files' bytes in its order

A put is accepted from the peer's donor only (the rank whose peer this one is), into the store's
``rank<donor>/`` as that rank's own copy would be; every file's size and CRC-32C are checked on
the way in, by the server against the request, and by a fetching rank against the committed
manifest. Nothing read from a peer is used that the manifest does not vouch for.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import socket
import struct
import sys
import threading

from jaxtrain.checkpoint_memory import HostMemory, _listdir, _record

_NONCE = 32
_MAX_HEADER = 4 << 20
_MAX_CONNECTIONS = 8  # served at once; more are closed unanswered (a flood costs only fallbacks)
_CHUNK = 4 << 20
_TIMEOUT_S = 60.0
_KEY = "jaxtrain/peer/{}"


class PeerError(Exception):
    """A peer that cannot be reached, refuses, or sends what does not check out."""


def peer_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank that keeps ``rank``'s peer copy, or None when every rank is on one host."""
    if local_world_size <= 0 or world_size <= local_world_size:
        return None
    return (rank + local_world_size) % world_size


class Peers:
    """One rank's side of the peer copies: its server, and its requests to other ranks' servers.
    ``kv``: the coordination service's client (jax.distributed), or None: no peer copies."""

    def __init__(self, memory: HostMemory, secret: bytes, rank: int, world_size: int,
                 local_world_size: int, host: str, kv) -> None:
        self.memory = memory
        self.rank = rank
        self.peer = peer_of(rank, world_size, local_world_size)
        self.donor = None if self.peer is None else (rank - local_world_size) % world_size
        self._secret = secret
        self._kv = kv
        self._addresses: dict[int, tuple[str, int, str]] = {}
        self._said: set[str] = set()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._listener = socket.create_server((host, 0), family=_family(host), backlog=16)
        port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, name="jaxtrain-peer-server", daemon=True).start()
        self._hostname = socket.gethostname()
        kv.key_value_set(_KEY.format(rank), json.dumps([host, port, self._hostname]))

    # -- requests ------------------------------------------------------------------------------

    def replicate(self, copy_dir: str, copy_id: str) -> None:
        """Sends this rank's kept copy in ``copy_dir`` (checkpoint_memory's a<attempt>-r<round>)
        to its peer. Raises PeerError (said by the caller; the checkpoint then has one copy)."""
        record = _record(copy_dir)
        if self.peer is None or record is None or record["id"] != copy_id:
            raise PeerError(f"no kept copy '{copy_dir}' with id {copy_id} to send")
        files = [{k: v for k, v in e.items() if k != "mtime_ns"} for e in record["files"]]
        request = {"op": "put", "rank": self.rank, "host": self._hostname,
                   "name": os.path.basename(copy_dir), "id": copy_id, "files": files}
        with self._request(self.peer, request) as (sock, prove):
            for e in files:
                if "link" not in e:
                    with open(os.path.join(copy_dir, e["path"]), "rb") as f:
                        sent = sock.sendfile(f)
                    if sent != e["size"]:
                        raise PeerError(f"'{e['path']}' changed while it was sent")
            reply = prove(_read_message(sock))
        if "error" in reply:
            raise PeerError(f"rank {self.peer} refused the copy: {reply['error']}")

    def fetch(self, copy_id: str, expected: dict[str, tuple[int, int]]) -> int:
        """Fetches this rank's copy ``copy_id`` from its peer's host into this host's store, and
        returns its bytes. ``expected``: path -> (size, CRC-32C) of this rank's part as the
        committed manifest lists it; any difference raises PeerError and keeps nothing."""
        if self.peer is None:
            raise PeerError("every rank is on one host")
        written = None
        try:
            with self._request(self.peer, {"op": "get", "rank": self.rank, "id": copy_id}) as (
                    sock, prove):
                reply = prove(_read_message(sock))
                if "error" in reply:
                    raise PeerError(f"rank {self.peer}'s host: {reply['error']}")
                attempt, round_ = _name(reply.get("name", ""))
                files = _entries(reply.get("files"))
                got = {e["path"]: (e["size"], e["crc32c"]) for e in files if "link" not in e}
                if got != expected:
                    raise PeerError(f"rank {self.peer}'s copy {copy_id} does not list the "
                                    "committed files")
                written = self.memory.prepare(attempt, round_)
                total = 0
                for e in files:
                    if "link" not in e:
                        _receive_file(sock, os.path.join(written, e["path"]), e)
                        total += e["size"]
            self.memory.keep(written, attempt, round_, files, copy_id)
            return total
        except BaseException:
            if written is not None:
                shutil.rmtree(written, ignore_errors=True)
            raise

    def _request(self, rank: int, request: dict):
        return _Exchange(self, rank, request)

    def address(self, rank: int) -> tuple[str, int, str]:
        """``rank``'s peer server: (address, port, host name), as it published them."""
        if rank not in self._addresses:
            try:
                value = self._kv.blocking_key_value_get(_KEY.format(rank), int(_TIMEOUT_S * 1000))
            except Exception as e:
                raise PeerError(f"rank {rank} published no peer address: {e}") from None
            host, port, hostname = json.loads(value)
            if hostname == self._hostname:
                # A layout with uneven hosts: a copy on this host would be no second copy, and
                # would share the store with the rank's own.
                raise PeerError(f"rank {rank} runs on this host ({hostname}) too")
            self._addresses[rank] = (host, int(port), hostname)
        return self._addresses[rank]

    def say_once(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            sys.stderr.write(f"jaxtrain worker: rank {self.rank}: {line}\n")
            sys.stderr.flush()

    # -- the server ----------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._answer, args=(conn,), name="jaxtrain-peer-request",
                             daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(_TIMEOUT_S)
                nonce_s = secrets.token_bytes(_NONCE)
                conn.sendall(nonce_s)
                raw = _read_exactly(conn, 4)
                (length,) = struct.unpack(">I", raw)
                if length > _MAX_HEADER:
                    return
                header = _read_exactly(conn, length)
                mac = _read_exactly(conn, 32)
                if not hmac.compare_digest(mac, self._mac(b"jaxtrain-peer-request", nonce_s,
                                                          header)):
                    return  # not a rank of this run: nothing is said to it
                request = json.loads(header)
                nonce_c = bytes.fromhex(request["nonce"])
                if request.get("op") == "put":
                    reply = self._put(conn, request)
                    self._send_reply(conn, nonce_c, nonce_s, reply)
                elif request.get("op") == "get":
                    self._get(conn, request, nonce_c, nonce_s)
            except (OSError, ValueError, KeyError, TypeError, PeerError):
                pass  # the requester sees the connection end and falls back
            finally:
                self._slots.release()

    def _put(self, conn: socket.socket, request: dict) -> dict:
        donor = request["rank"]
        if request.get("host") == self._hostname:
            return {"error": f"rank {donor} runs on this host ({self._hostname}) too"}
        if donor != self.donor:
            return {"error": f"rank {self.rank} keeps the copies of rank {self.donor}, not of "
                             f"rank {donor}"}
        attempt, round_ = _name(request["name"])
        files = _entries(request["files"])
        memory = HostMemory(self.memory.run_dir, donor, self.memory.root)
        written = memory.prepare(attempt, round_)
        try:
            for e in files:
                if "link" not in e:
                    _receive_file(conn, os.path.join(written, e["path"]), e)
            memory.keep(written, attempt, round_, files, request["id"])
        except BaseException:
            shutil.rmtree(written, ignore_errors=True)
            raise
        return {"ok": True}

    def _get(self, conn: socket.socket, request: dict, nonce_c: bytes, nonce_s: bytes) -> None:
        rank_dir = os.path.join(self.memory.root, f"rank{int(request['rank'])}")
        for name in _listdir(rank_dir):
            if not name.endswith(".json"):
                continue
            copy = os.path.join(rank_dir, name[:-5])
            record = _record(copy)
            if record is None or record["id"] != request["id"]:
                continue
            files = [{k: v for k, v in e.items() if k != "mtime_ns"} for e in record["files"]]
            # Opened before the reply, so that a copy freed meanwhile is refused, not cut short.
            handles = [open(os.path.join(copy, e["path"]), "rb")
                       for e in files if "link" not in e]
            try:
                self._send_reply(conn, nonce_c, nonce_s,
                                 {"name": os.path.basename(copy), "files": files})
                for f in handles:
                    conn.sendfile(f)
            finally:
                for f in handles:
                    f.close()
            return
        self._send_reply(conn, nonce_c, nonce_s,
                         {"error": f"no copy {request['id']} of rank {request['rank']} here"})

    def _send_reply(self, conn, nonce_c: bytes, nonce_s: bytes, reply: dict) -> None:
        body = json.dumps(reply).encode()
        conn.sendall(struct.pack(">I", len(body)) + body +
                     self._mac(b"jaxtrain-peer-reply", nonce_c + nonce_s, body))

    def _mac(self, label: bytes, nonces: bytes, body: bytes) -> bytes:
        return hmac.new(self._secret, label + nonces + body, hashlib.sha256).digest()


class _Exchange:
    """One request to ``rank``'s server: connects and proves the request; yields the socket and
    ``prove(raw reply) -> reply``, which raises PeerError unless the server holds the secret."""

    def __init__(self, peers: Peers, rank: int, request: dict) -> None:
        self.peers, self.rank, self.request = peers, rank, request
        self.sock: socket.socket | None = None

    def __enter__(self):
        host, port, _ = self.peers.address(self.rank)
        nonce_c = secrets.token_bytes(_NONCE)
        header = json.dumps({**self.request, "nonce": nonce_c.hex()}).encode()
        try:
            self.sock = socket.create_connection((host, port), timeout=_TIMEOUT_S)
            nonce_s = _read_exactly(self.sock, _NONCE)
            self.sock.sendall(struct.pack(">I", len(header)) + header +
                              self.peers._mac(b"jaxtrain-peer-request", nonce_s, header))
        except (OSError, PeerError) as e:
            self.__exit__(None, None, None)
            raise PeerError(f"rank {self.rank}'s peer server at {host}:{port}: {e}") from None

        def prove(raw: tuple[bytes, bytes]) -> dict:
            body, mac = raw
            if not hmac.compare_digest(mac, self.peers._mac(b"jaxtrain-peer-reply",
                                                            nonce_c + nonce_s, body)):
                raise PeerError(f"rank {self.rank}'s peer server could not prove it holds "
                                "this run's secret")
            return json.loads(body)

        return self.sock, prove

    def __exit__(self, *exc) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _read_message(sock: socket.socket) -> tuple[bytes, bytes]:
    try:
        (length,) = struct.unpack(">I", _read_exactly(sock, 4))
        if length > _MAX_HEADER:
            raise PeerError(f"a reply of {length} bytes")
        return _read_exactly(sock, length), _read_exactly(sock, 32)
    except OSError as e:
        raise PeerError(f"the peer's reply: {e}") from None


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n > 0:
        chunk = sock.recv(min(n, _CHUNK))
        if not chunk:
            raise PeerError("the connection ended early")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _receive_file(sock: socket.socket, path: str, entry: dict) -> None:
    """Reads ``entry["size"]`` bytes into ``path``, checking them against the entry's CRC-32C."""
    from jaxtrain import _core

    os.makedirs(os.path.dirname(path), exist_ok=True)
    crc, left = 0, entry["size"]
    buffer = memoryview(bytearray(min(left, _CHUNK)))
    with open(path, "wb", buffering=0) as f:
        while left > 0:
            n = sock.recv_into(buffer, min(left, len(buffer)))
            if n == 0:
                raise PeerError(f"the connection ended in '{entry['path']}'")
            crc = _core.crc32c(buffer[:n], crc)
            f.write(buffer[:n])
            left -= n
    if crc != entry["crc32c"]:
        raise PeerError(f"'{entry['path']}' arrived with CRC-32C {crc}, not {entry['crc32c']}")
    if "mode" in entry:
        os.chmod(path, entry["mode"] & 0o777)


def _entries(files) -> list[dict]:
    """A copy's entries as a peer sent them, refused unless every path stays inside the copy."""
    if not isinstance(files, list):
        raise PeerError("no list of files")
    for e in files:
        path = e.get("path") if isinstance(e, dict) else None
        if not isinstance(path, str) or path.startswith("/") or \
                any(part in ("", ".", "..") for part in path.split("/")):
            raise PeerError(f"a file entry that is not allowed: {e!r}")
        if "link" not in e and not (isinstance(e.get("size"), int) and e["size"] >= 0 and
                                    isinstance(e.get("crc32c"), int)):
            raise PeerError(f"a file entry without a size and a checksum: {e!r}")
    return files


def _name(name: str) -> tuple[int, int]:
    m = re.fullmatch(r"a(\d+)-r(\d+)", name)
    if not m:
        raise PeerError(f"a copy named {name!r}")
    return int(m[1]), int(m[2])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
