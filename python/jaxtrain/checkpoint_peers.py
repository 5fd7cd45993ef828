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
    server -> client   a reply: u32 length, JSON, HMAC(secret, "jaxtrain-peer-reply" ||
                       client nonce || server nonce || JSON); {"error": why} ends the request
    put:  server -> client   {"ready": true}
          client -> server   the files' bytes, in the order of the request's entries
          server -> client   {"kept": true} once the copy and its record are written
    get:  server -> client   {"name", "files"}, then the copy's files' bytes in that order

A put is accepted from the peer's donor only (the rank whose peer this one is, by the donor's
own host size), into the store's ``rank<donor>/`` as that rank's own copy would be; every file's
size and CRC-32C are checked on the way in, by the server against the request, and by a fetching
rank against the committed manifest. Nothing read from a peer is used that the manifest does not
vouch for. The bytes after a proven header carry no MAC of their own (docs/checkpoint-memory.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import socket
import struct
import sys
import threading
import time

from jaxtrain import _core
from jaxtrain.checkpoint_memory import HostMemory, copy_name

_NONCE = 32
_MAX_HEADER = 4 << 20
_MAX_CONNECTIONS = 8  # served at once; more are closed unanswered (a flood costs only fallbacks)
_CHUNK = 4 << 20
_TIMEOUT_S = 60.0
_PROOF_S = 10.0  # from a connection to its proven request
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
    ``kv``: where the servers' addresses are published, the coordination service's client
    (jax.distributed): key_value_set(key, value) and blocking_key_value_get(key, timeout_ms).
    ``host``: the address to listen on, one the other hosts reach."""

    def __init__(self, memory: HostMemory, secret: bytes, rank: int, world_size: int,
                 local_world_size: int, host: str, kv) -> None:
        self.memory = memory
        self.rank = rank
        self.peer = peer_of(rank, world_size, local_world_size)
        self._world_size = world_size
        self._local_world_size = local_world_size
        self._secret = secret
        self._kv = kv
        self._addresses: dict[int, tuple[str, int, str] | PeerError] = {}
        self._said: set[str] = set()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._closed = False
        self._hostname = socket.gethostname()
        self._listener = socket.create_server((host, 0), family=_family(host), backlog=16)
        port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, name="jaxtrain-peer-server", daemon=True).start()
        try:
            kv.key_value_set(_KEY.format(rank), json.dumps([host, port, self._hostname]))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stops serving (requests in progress end with their connections)."""
        self._closed = True
        self._listener.close()

    # -- requests ------------------------------------------------------------------------------

    def replicate(self, copy_id: str) -> None:
        """Sends this rank's kept copy ``copy_id`` to its peer. Raises PeerError or OSError (said
        by the caller; the checkpoint then has one copy)."""
        held = self.memory.copy_named(copy_id)
        if self.peer is None or held is None:
            raise PeerError(f"no kept copy {copy_id} of rank {self.rank} to send")
        copy_dir, record = held
        files = _declared(record["files"])
        sock, nonces = self._open(self.peer, {
            "op": "put", "rank": self.rank, "local_world_size": self._local_world_size,
            "host": self._hostname, "name": os.path.basename(copy_dir), "id": copy_id,
            "files": files})
        with sock:
            reply = self._reply(sock, nonces)  # the peer takes the copy, or says why not
            if "error" in reply:
                raise PeerError(f"rank {self.peer} refused the copy: {reply['error']}")
            for e in files:
                if "link" not in e:
                    with open(os.path.join(copy_dir, e["path"]), "rb") as f:
                        if sock.sendfile(f) != e["size"]:
                            raise PeerError(f"'{e['path']}' changed while it was sent")
            if not self._reply(sock, nonces).get("kept"):
                raise PeerError(f"rank {self.peer} did not keep the copy")

    def fetch(self, copy_id: str, expected: dict[str, tuple[int, int, str | None]]) -> int:
        """Fetches this rank's copy ``copy_id`` from its peer's host into this host's store, and
        returns its bytes. ``expected``: path -> (size, CRC-32C, SHA-256 hex or None) of this
        rank's part as the committed manifest lists it (HostMemory.missing_part); any difference,
        in the bytes received too, raises PeerError and keeps nothing. A manifest without hashes
        (written before them) vouches with the id, the sizes and the CRC-32C only."""
        if self.peer is None:
            raise PeerError("every rank is on one host")
        sock, nonces = self._open(self.peer, {"op": "get", "rank": self.rank, "id": copy_id})
        written = None
        try:
            with sock:
                reply = self._reply(sock, nonces)
                if "error" in reply:
                    raise PeerError(f"rank {self.peer}'s host: {reply['error']}")
                attempt, round_ = _name(reply.get("name", ""))
                files = _entries(reply.get("files"))
                got = {e["path"]: (e["size"], e["crc32c"]) for e in files if "link" not in e}
                if got != {path: sums[:2] for path, sums in expected.items()}:
                    raise PeerError(f"rank {self.peer}'s copy {copy_id} does not list the "
                                    "committed files")
                size = sum(sums[0] for sums in expected.values())
                written = self.memory.prepare(attempt, round_, size)
                kept = []
                for e in files:
                    if "link" not in e:
                        digest = _receive_file(sock, os.path.join(written, e["path"]), e)
                        sums = expected[e["path"]]
                        _check_sha256(e["path"], digest, sums[2] if len(sums) > 2 else None,
                                      "the manifest")
                        e = {**e, "sha256": digest}  # what this host wrote
                    kept.append(e)
            self.memory.keep(written, attempt, round_, kept, copy_id)
            return size
        except BaseException:
            if written is not None:
                shutil.rmtree(written, ignore_errors=True)
            raise

    def address(self, rank: int) -> tuple[str, int, str]:
        """``rank``'s peer server: (address, port, host name), as it published them. A rank that
        published none in time, or runs on this host, is remembered as such: asked once."""
        if rank not in self._addresses:
            try:
                value = self._kv.blocking_key_value_get(_KEY.format(rank), int(_TIMEOUT_S * 1000))
                host, port, hostname = json.loads(value)
                if hostname == self._hostname:
                    # Hosts of uneven sizes: a copy on this host would be no second copy, and
                    # would share the store with the rank's own.
                    raise PeerError(f"rank {rank} runs on this host ({hostname}) too")
                self._addresses[rank] = (host, int(port), hostname)
            except PeerError as e:
                self._addresses[rank] = e
            except Exception as e:
                self._addresses[rank] = PeerError(f"rank {rank} published no peer address: {e}")
        found = self._addresses[rank]
        if isinstance(found, PeerError):
            raise found
        return found

    def say_once(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            sys.stderr.write(f"jaxtrain worker: rank {self.rank}: {line}\n")
            sys.stderr.flush()

    def _open(self, rank: int, request: dict) -> tuple[socket.socket, bytes]:
        """Connects to ``rank``'s server and sends ``request``, proven; returns the socket and the
        nonces (this side's, then the server's) that the server's reply must prove."""
        host, port, _ = self.address(rank)
        nonce_c = secrets.token_bytes(_NONCE)
        header = json.dumps({**request, "nonce": nonce_c.hex()}).encode()
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=_TIMEOUT_S)
            nonce_s = _read_exactly(sock, _NONCE)
            sock.sendall(struct.pack(">I", len(header)) + header +
                         self._mac(b"jaxtrain-peer-request", nonce_s, header))
        except (OSError, PeerError) as e:
            if sock is not None:
                sock.close()
            raise PeerError(f"rank {rank}'s peer server at {host}:{port}: {e}") from None
        return sock, nonce_c + nonce_s

    def _reply(self, sock: socket.socket, nonces: bytes) -> dict:
        """The server's reply; PeerError unless the server proves it holds the run's secret."""
        try:
            (length,) = struct.unpack(">I", _read_exactly(sock, 4))
            if length > _MAX_HEADER:
                raise PeerError(f"a reply of {length} bytes")
            body, mac = _read_exactly(sock, length), _read_exactly(sock, 32)
        except OSError as e:
            raise PeerError(f"the peer's reply: {e}") from None
        if not hmac.compare_digest(mac, self._mac(b"jaxtrain-peer-reply", nonces, body)):
            raise PeerError("the peer server could not prove it holds this run's secret")
        return json.loads(body)

    # -- the server ----------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)  # out of descriptors, say: the next request may find some
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._answer, args=(conn,), name="jaxtrain-peer-request",
                             daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        """Serves one connection: its request proven, then ``_put`` or ``_get``. Whatever goes
        wrong ends the connection, so the requester falls back; after the proof it is also said
        (once) in this rank's log."""
        request = None
        with conn:
            try:
                # Until the request is proven, one deadline for all of it: a peer without the
                # secret holds a slot for _PROOF_S at most, however it trickles its bytes.
                deadline = time.monotonic() + _PROOF_S
                nonce_s = secrets.token_bytes(_NONCE)
                conn.settimeout(_PROOF_S)
                conn.sendall(nonce_s)
                (length,) = struct.unpack(">I", _read_exactly(conn, 4, deadline))
                if length > _MAX_HEADER:
                    return
                header = _read_exactly(conn, length, deadline)
                mac = _read_exactly(conn, 32, deadline)
                if not hmac.compare_digest(mac, self._mac(b"jaxtrain-peer-request", nonce_s,
                                                          header)):
                    return  # not a rank of this run: nothing is said to it
                conn.settimeout(_TIMEOUT_S)
                request = json.loads(header)
                nonces = bytes.fromhex(request["nonce"]) + nonce_s
                {"put": self._put, "get": self._get}[request["op"]](conn, request, nonces)
            except Exception as e:
                if request is not None:
                    self.say_once(f"serve-{request.get('op')}",
                                  f"a {request.get('op')} request of rank {request.get('rank')} "
                                  f"failed here ({type(e).__name__}: {e}); said once")
            finally:
                self._slots.release()

    def _put(self, conn: socket.socket, request: dict, nonces: bytes) -> None:
        try:
            donor = _rank(request, "rank", self._world_size)
            local_world_size = _rank(request, "local_world_size", self._world_size + 1)
        except PeerError as e:
            return self._send_reply(conn, nonces, {"error": str(e)})
        if request.get("host") == self._hostname:
            return self._send_reply(conn, nonces, {
                "error": f"rank {donor} runs on this host ({self._hostname}) too"})
        # The donor's own host size names its peer (hosts may differ in size).
        if peer_of(donor, self._world_size, local_world_size) != self.rank:
            return self._send_reply(conn, nonces, {
                "error": f"rank {self.rank} is not rank {donor}'s peer"})
        attempt, round_ = _name(request["name"])
        files = _entries(request["files"])
        memory = HostMemory(self.memory.run_dir, donor, self.memory.root)
        try:  # a store that is not this user's, a copy above the memory budget: said, refused
            written = memory.prepare(attempt, round_, sum(e.get("size", 0) for e in files))
        except OSError as e:
            self.say_once("put-store", f"not keeping rank {donor}'s copies: {e} (said once)")
            return self._send_reply(conn, nonces, {"error": f"{type(e).__name__}: {e}"})
        try:
            self._send_reply(conn, nonces, {"ready": True})
            kept = []
            for e in files:
                if "link" not in e:
                    digest = _receive_file(conn, os.path.join(written, e["path"]), e)
                    _check_sha256(e["path"], digest, e.get("sha256"), "its sender")
                    e = {**e, "sha256": digest}  # what this host wrote
                kept.append(e)
            memory.keep(written, attempt, round_, kept, request["id"])
        except BaseException:
            shutil.rmtree(written, ignore_errors=True)
            raise
        self._send_reply(conn, nonces, {"kept": True})

    def _get(self, conn: socket.socket, request: dict, nonces: bytes) -> None:
        try:
            rank = _rank(request, "rank", self._world_size)
        except PeerError as e:
            return self._send_reply(conn, nonces, {"error": str(e)})
        try:  # raises for a store that is not this user's: nothing of it is served
            held = HostMemory(self.memory.run_dir, rank,
                              self.memory.root).copy_named(request["id"])
        except OSError as e:
            self.say_once("get-store", f"serving no copies: {e} (said once)")
            return self._send_reply(conn, nonces, {"error": f"{type(e).__name__}: {e}"})
        if held is None:
            return self._send_reply(conn, nonces, {
                "error": f"no copy {request['id']} of rank {rank} here"})
        copy, record = held
        files = _entries(_declared(record["files"]))  # clean paths only
        self._send_reply(conn, nonces, {"name": os.path.basename(copy), "files": files})
        # A file freed meanwhile ends the connection short: the fetching rank keeps nothing.
        for e in files:
            if "link" not in e:
                with open(os.path.join(copy, e["path"]), "rb") as f:
                    if conn.sendfile(f) != e["size"]:
                        return

    def _send_reply(self, conn: socket.socket, nonces: bytes, reply: dict) -> None:
        body = json.dumps(reply).encode()
        conn.sendall(struct.pack(">I", len(body)) + body +
                     self._mac(b"jaxtrain-peer-reply", nonces, body))

    def _mac(self, label: bytes, nonces: bytes, body: bytes) -> bytes:
        return hmac.new(self._secret, label + nonces + body, hashlib.sha256).digest()


def _declared(files: list[dict]) -> list[dict]:
    """A copy's record entries as they are sent: without this host's modification times."""
    return [{k: v for k, v in e.items() if k != "mtime_ns"} for e in files]


def _read_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    parts = []
    while n > 0:
        if deadline is not None and time.monotonic() > deadline:
            raise PeerError("too slow")
        chunk = sock.recv(min(n, _CHUNK))
        if not chunk:
            raise PeerError("the connection ended early")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _receive_file(sock: socket.socket, path: str, entry: dict) -> str:
    """Reads ``entry["size"]`` bytes into ``path``, checking them against the entry's CRC-32C;
    returns their SHA-256 (hex), for the caller to check."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    crc, left = 0, entry["size"]
    sha256 = hashlib.sha256()
    buffer = memoryview(bytearray(min(left, _CHUNK)))
    with open(path, "wb", buffering=0) as f:
        while left > 0:
            n = sock.recv_into(buffer, min(left, len(buffer)))
            if n == 0:
                raise PeerError(f"the connection ended in '{entry['path']}'")
            crc = _core.crc32c(buffer[:n], crc)
            sha256.update(buffer[:n])
            f.write(buffer[:n])
            left -= n
    if crc != entry["crc32c"]:
        raise PeerError(f"'{entry['path']}' arrived with CRC-32C {crc}, not {entry['crc32c']}")
    if "mode" in entry:
        os.chmod(path, entry["mode"] & 0o777)
    return sha256.hexdigest()


def _check_sha256(path: str, digest: str, expected, whose: str) -> None:
    """PeerError unless the SHA-256 of the bytes received as ``path`` is the one ``whose`` list
    gives (None: it gives none, a manifest from before hashes)."""
    if expected is not None and digest != expected:
        raise PeerError(f"'{path}' arrived with SHA-256 {digest}, not {expected} as {whose} "
                        "lists it")


def _rank(request: dict, field: str, limit: int) -> int:
    """The request's ``field``, an int (not a bool or a float) in [0, limit); PeerError naming
    the field and the value otherwise."""
    value = request.get(field)
    if type(value) is not int or not 0 <= value < limit:
        raise PeerError(f"a request whose {field} is {value!r}; an integer from 0 to "
                        f"{limit - 1} is allowed")
    return value


def _entries(files) -> list[dict]:
    """A copy's entries as a peer sent them, refused unless every path stays inside the copy."""
    if not isinstance(files, list):
        raise PeerError("no list of files")
    for e in files:
        path = e.get("path") if isinstance(e, dict) else None
        if not isinstance(path, str) or not _core.is_clean_relative_path(path):
            raise PeerError(f"a file entry that is not allowed: {e!r}")
        if "link" not in e and not (isinstance(e.get("size"), int) and e["size"] >= 0 and
                                    isinstance(e.get("crc32c"), int)):
            raise PeerError(f"a file entry without a size and a checksum: {e!r}")
    return files


def _name(name) -> tuple[int, int]:
    held = copy_name(name) if isinstance(name, str) else None
    if held is None:
        raise PeerError(f"a copy named {name!r}")
    return held


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
