"""Peer copies of the checkpoints held in host memory (JAXTRAIN_CHECKPOINT_IN_MEMORY=1, in a run
across hosts): each rank also sends its copy to its *peer*, the rank of the same local rank on the
next host (rank + local world size, modulo the world size), whose host keeps it in its store as
its own ranks' copies are kept (checkpoint_memory.py). A rank restarted on a host whose memory
holds no copy of its part (the host was replaced, its pod recreated, its memory freed) fetches
the part from its peer's host before it builds its view; with neither copy left it reads storage.

Each worker runs a *peer server*: one thread listening on the host's address towards the
controller, on a port of the system's choice, published in the JAX coordination service's
key-value store (``jaxtrain/peer/<rank>``: address, port, host name and their HMAC with the run's
secret, which a reader checks) right after ``jax.distributed.initialize``, so a rank finds its
peer's address in its attempt's own coordination service. A connection carries one request over
the secure channel (channel.py): ``jaxtrain-peer-copy`` from ``rank-<r>`` to ``rank-<peer>``,
proven both ways with the run's secret, every byte after the handshake encrypted and
authenticated. Then, one record each:

    client -> server   the request (JSON)
    server -> client   a reply (JSON); {"error": why} ends the request
    put:  server -> client   {"ready": true}
          client -> server   the files' bytes, in the order of the request's entries
          server -> client   {"kept": true} once the copy and its record are written
    get:  server -> client   {"name", "files"}, then the copy's files' bytes in that order

A put is accepted from the peer's donor only (the rank whose peer this one is, by the donor's
own host size): the rank the channel proved, not one the request claims, into the store's
``rank<donor>/`` as that rank's own copy would be; every file's size, CRC-32C and SHA-256 are
checked on the way in, by the server against the request, and by a fetching rank against the
committed manifest. Nothing read from a peer is used that the manifest does not vouch for.
Every rank of a run holds its secret, so these checks keep out whoever does not, not a rank of
the run itself (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import socket
import sys
import threading
import time

from jaxtrain import _core
from jaxtrain.hosts import channel
from jaxtrain.hosts.channel import Connection
from jaxtrain.worker.checkpoint_memory import HostMemory, copy_name

_MAX_CONNECTIONS = 8  # served at once; more are closed unanswered (a flood costs only fallbacks)
_TIMEOUT_S = 60.0
_PROOF_S = 10.0  # from a connection to its proven request
# A fetch's deadline: this much, and a second per this many bytes more (a slow or stuck peer
# holds a restarted rank's start no longer than that; it then reads storage).
_FETCH_BASE_S = 30.0
_FETCH_BYTES_PER_S = 50 << 20
_PURPOSE = "jaxtrain-peer-copy"
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
        self._listener = socket.create_server((host, 0), family=channel.family_of(host), backlog=16)
        port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, name="jaxtrain-peer-server", daemon=True).start()
        try:
            kv.key_value_set(_KEY.format(rank), json.dumps(
                [host, port, self._hostname, self._address_mac(rank, host, port, self._hostname)]))
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
        with self._open(self.peer, {
                "op": "put", "local_world_size": self._local_world_size,
                "host": self._hostname, "name": os.path.basename(copy_dir), "id": copy_id,
                "files": files}) as conn:
            reply = self._reply(conn)  # the peer takes the copy, or says why not
            if "error" in reply:
                raise PeerError(f"rank {self.peer} refused the copy: {reply['error']}")
            for e in files:
                if "link" not in e:
                    with open(os.path.join(copy_dir, e["path"]), "rb") as f:
                        if os.fstat(f.fileno()).st_size != e["size"]:
                            raise PeerError(f"'{e['path']}' changed since it was kept")
                        _send_file(conn, f, e["size"])
            if not self._reply(conn).get("kept"):
                raise PeerError(f"rank {self.peer} did not keep the copy")

    def fetch(self, copy_id: str, expected: dict[str, tuple[int, int, str | None]]) -> int:
        """Fetches this rank's copy ``copy_id`` from its peer's host into this host's store, and
        returns its bytes. ``expected``: path -> (size, CRC-32C, SHA-256 hex or None) of this
        rank's part as the committed manifest lists it (HostMemory.missing_part); any difference,
        in the bytes received too, raises PeerError and keeps nothing. A manifest without hashes
        (written before them) vouches with the id, the sizes and the CRC-32C only."""
        if self.peer is None:
            raise PeerError("every rank is on one host")
        deadline = time.monotonic() + _FETCH_BASE_S + sum(
            size for size, *_ in expected.values()) / _FETCH_BYTES_PER_S
        written = None
        try:
            with self._open(self.peer, {"op": "get", "id": copy_id}) as conn:
                reply = self._reply(conn)
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
                        digest = _receive_file(conn, os.path.join(written, e["path"]), e,
                                               deadline)
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
                host, port, hostname, mac = json.loads(value)
                if not hmac.compare_digest(str(mac),
                                           self._address_mac(rank, host, port, hostname)):
                    raise PeerError(f"rank {rank}'s published address {host}:{port} is not "
                                    "vouched for by this run's secret (written by someone else)")
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

    def _open(self, rank: int, request: dict) -> Connection:
        """A proven channel to ``rank``'s server, ``request`` sent on it."""
        host, port, _ = self.address(rank)
        try:
            conn = Connection.connect((host, port), self._secret, _PURPOSE, f"rank-{self.rank}",
                                      f"rank-{rank}", _PROOF_S)
        except channel.Errors as e:
            raise PeerError(f"rank {rank}'s peer server at {host}:{port}: {e}") from None
        try:
            conn.send_json(request, _TIMEOUT_S)
        except channel.Errors as e:
            conn.close()
            raise PeerError(f"rank {rank}'s peer server at {host}:{port}: {e}") from None
        return conn

    def _reply(self, conn: Connection) -> dict:
        """The server's next reply."""
        try:
            return conn.receive_json(_TIMEOUT_S)
        except channel.Errors as e:
            raise PeerError(f"the peer's reply: {e}") from None

    def _address_mac(self, rank: int, host: str, port: int, hostname: str) -> str:
        return hmac.new(self._secret, b"jaxtrain-peer-address" + json.dumps(
            [rank, host, port, hostname]).encode(), hashlib.sha256).hexdigest()

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

    def _answer(self, sock: socket.socket) -> None:
        """Serves one connection: its handshake and request within _PROOF_S (however a peer
        without the secret trickles its bytes), then ``_put`` or ``_get``. Whatever goes wrong
        ends the connection, so the requester falls back; after the proof it is also said (once)
        in this rank's log."""
        request = None
        try:
            deadline = time.monotonic() + _PROOF_S
            with Connection.accept(sock, self._secret, _PURPOSE, f"rank-{self.rank}", [],
                                   _PROOF_S) as conn:
                request = conn.receive_json(max(0.0, deadline - time.monotonic()))
                request["rank"] = channel.end_number(conn.peer, "rank")  # proven, not claimed
                if request["rank"] is None:
                    raise PeerError(f"a peer named {conn.peer!r}")
                {"put": self._put, "get": self._get}[request["op"]](conn, request)
        except Exception as e:
            if request is not None:
                self.say_once(f"serve-{request.get('op')}",
                              f"a {request.get('op')} request of rank {request.get('rank')} "
                              f"failed here ({type(e).__name__}: {e}); said once")
        finally:
            self._slots.release()

    def _put(self, conn: Connection, request: dict) -> None:
        donor = request["rank"]  # the proven rank
        try:
            local_world_size = _rank(request, "local_world_size", self._world_size + 1)
        except PeerError as e:
            return conn.send_json({"error": str(e)})
        if request.get("host") == self._hostname:
            return conn.send_json({
                "error": f"rank {donor} runs on this host ({self._hostname}) too"})
        # The donor's own host size names its peer (hosts may differ in size).
        if peer_of(donor, self._world_size, local_world_size) != self.rank:
            return conn.send_json({
                "error": f"rank {self.rank} is not rank {donor}'s peer"})
        attempt, round_ = _name(request["name"])
        files = _entries(request["files"])
        memory = HostMemory(self.memory.run_dir, donor, self.memory.root)
        try:  # a store that is not this user's, a copy above the memory budget: said, refused
            written = memory.prepare(attempt, round_, sum(e.get("size", 0) for e in files))
        except OSError as e:
            self.say_once("put-store", f"not keeping rank {donor}'s copies: {e} (said once)")
            return conn.send_json({"error": f"{type(e).__name__}: {e}"})
        try:
            conn.send_json({"ready": True})
            kept = []
            for e in files:
                if "link" not in e:
                    digest = _receive_file(conn, os.path.join(written, e["path"]), e,
                                           time.monotonic() + _TIMEOUT_S)
                    _check_sha256(e["path"], digest, e.get("sha256"), "its sender")
                    e = {**e, "sha256": digest}  # what this host wrote
                kept.append(e)
            memory.keep(written, attempt, round_, kept, request["id"])
        except BaseException:
            shutil.rmtree(written, ignore_errors=True)
            raise
        conn.send_json({"kept": True})

    def _get(self, conn: Connection, request: dict) -> None:
        try:
            rank = _rank(request, "rank", self._world_size)
        except PeerError as e:
            return conn.send_json({"error": str(e)})
        try:  # raises for a store that is not this user's: nothing of it is served
            held = HostMemory(self.memory.run_dir, rank,
                              self.memory.root).copy_named(request["id"])
        except OSError as e:
            self.say_once("get-store", f"serving no copies: {e} (said once)")
            return conn.send_json({"error": f"{type(e).__name__}: {e}"})
        if held is None:
            return conn.send_json({
                "error": f"no copy {request['id']} of rank {rank} here"})
        copy, record = held
        files = _entries(_declared(record["files"]))  # clean paths only
        conn.send_json({"name": os.path.basename(copy), "files": files})
        # A file freed meanwhile ends the connection short: the fetching rank keeps nothing.
        for e in files:
            if "link" not in e:
                with open(os.path.join(copy, e["path"]), "rb") as f:
                    _send_file(conn, f, e["size"])


def _declared(files: list[dict]) -> list[dict]:
    """A copy's record entries as they are sent: without this host's modification times."""
    return [{k: v for k, v in e.items() if k != "mtime_ns"} for e in files]


def _send_file(conn: Connection, f, size: int) -> None:
    """Sends ``size`` bytes of the open file ``f`` (one that ends sooner ends the connection: the
    receiver keeps nothing)."""
    try:
        conn.send_file(f.fileno(), size, _TIMEOUT_S)
    except channel.Errors as e:
        raise PeerError(f"sending '{f.name}': {e}") from None


def _receive_file(conn: Connection, path: str, entry: dict, deadline: float) -> str:
    """Reads ``entry["size"]`` bytes into ``path`` by ``deadline``, checking them against the
    entry's CRC-32C; returns their SHA-256 (hex), for the caller to check."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    crc, left = 0, entry["size"]
    sha256 = hashlib.sha256()
    buffer = memoryview(bytearray(channel.RECORD_SIZE))
    with open(path, "wb", buffering=0) as f:
        while left > 0:
            try:
                n = conn.receive_into(buffer, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise PeerError(f"'{entry['path']}' did not arrive in time") from None
            except channel.Errors as e:
                raise PeerError(f"the connection ended in '{entry['path']}': {e}") from None
            if n > left:
                raise PeerError(f"'{entry['path']}' arrived longer than {entry['size']} bytes")
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
