"""The peer copies' protocol (jaxtrain/worker/checkpoint_peers.py) between real peer servers on
loopback: two ranks, each with a store of its own (two memory directories stand for two hosts'
memory), and a dict for the coordination service's key-value store. The whole path across hosts,
with real JAX workers, is
tests/test_ssh.py's test_a_host_that_lost_its_memory_restores_from_its_peers_*."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from jaxtrain import _core
from jaxtrain.hosts.channel import Connection
from jaxtrain.worker import checkpoint_memory, checkpoint_peers
from jaxtrain.worker.checkpoint_memory import HostMemory
from jaxtrain.worker.checkpoint_peers import PeerError, Peers, peer_of

SECRET = secrets.token_bytes(32)


class FakeKeyValue:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def key_value_set(self, key: str, value: str) -> None:
        self.values[key] = value

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        if key not in self.values:
            raise TimeoutError(f"{key} not set within {timeout_ms} ms")
        return self.values[key]


def _host(memory_dir: Path, run_dir: Path, rank: int, kv, hostname: str,
          secret: bytes = SECRET, world_size: int = 2, local_world_size: int = 1) -> Peers:
    """Rank ``rank`` (of a 2-rank run with one rank per host unless said), on a host named
    ``hostname`` whose memory is ``memory_dir``."""
    with mock.patch.dict(os.environ, {"JAXTRAIN_MEMORY_DIR": str(memory_dir)}), \
            mock.patch("socket.gethostname", return_value=hostname):
        return Peers(HostMemory(str(run_dir), rank), secret, rank, world_size, local_world_size,
                     "127.0.0.1", kv)


def _copy(peers: Peers, memory_dir: Path, files: dict[str, bytes]) -> tuple[str, list]:
    """Keeps ``files`` as rank's copy of round 1 of attempt 0; returns (id, entries)."""
    with mock.patch.dict(os.environ, {"JAXTRAIN_MEMORY_DIR": str(memory_dir)}):
        written = peers.memory.prepare(0, 1)
        entries = []
        for path, data in files.items():
            Path(written, path).parent.mkdir(parents=True, exist_ok=True)
            Path(written, path).write_bytes(data)
            entries.append({"path": path, "size": len(data), "crc32c": _core.crc32c(data),
                            "mode": 0o644})
        copy_id = secrets.token_hex(16)
        peers.memory.keep(written, 0, 1, entries, copy_id)
        return copy_id, entries


def _nothing_in(directory: Path) -> bool:
    return not directory.exists() or not list(directory.iterdir())


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Rank 0 on host "a" and rank 1 on host "b", each rank the other's peer."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_dir = tmp_path / "run"
    kv = FakeKeyValue()
    a = _host(tmp_path / "a", run_dir, 0, kv, "a")
    b = _host(tmp_path / "b", run_dir, 1, kv, "b")
    yield tmp_path, a, b, kv
    a.close()
    b.close()
    # Each store is the one its Peers was made with, never the default (/dev/shm).
    monkeypatch.delenv("JAXTRAIN_MEMORY_DIR", raising=False)
    assert not os.path.exists(checkpoint_memory.store_path(str(run_dir)))


FILES = {"shard.bin": os.urandom(3 << 20) + b"tail", "sub/dir/step.json": b'{"step": 1}'}


def test_peers_are_the_same_local_rank_on_the_next_host():
    assert [peer_of(r, 8, 2) for r in range(8)] == [2, 3, 4, 5, 6, 7, 0, 1]
    assert peer_of(0, 4, 4) is None  # one host
    assert peer_of(0, 4, 0) is None


def test_a_copy_sent_to_the_peer_is_fetched_back_whole(hosts):
    tmp_path, a, b, _ = hosts
    copy_id, entries = _copy(a, tmp_path / "a", FILES)
    a.replicate(copy_id)
    # Host b keeps rank 0's copy as rank 0's own copies are kept.
    held = b.memory.root + "/rank0/a0-r1"
    assert json.loads(Path(held + ".json").read_text())["id"] == copy_id
    assert Path(held, "shard.bin").read_bytes() == FILES["shard.bin"]
    # Host a loses its memory; rank 0 fetches its part back from host b.
    for p in sorted(Path(a.memory.root).rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    expected = {e["path"]: (e["size"], e["crc32c"]) for e in entries}
    assert a.fetch(copy_id, expected) == sum(len(d) for d in FILES.values())
    record = json.loads(Path(a.memory.root, "rank0", "a0-r1.json").read_text())
    assert record["id"] == copy_id
    for path, data in FILES.items():
        assert Path(a.memory.root, "rank0", "a0-r1", path).read_bytes() == data


def test_a_fetch_of_a_copy_the_peer_does_not_hold_keeps_nothing(hosts):
    tmp_path, a, _, _ = hosts
    with pytest.raises(PeerError, match=r"rank 1's host: no copy deadbeef of rank 0 here"):
        a.fetch("deadbeef", {"shard.bin": (1, 2)})
    assert _nothing_in(Path(a.memory.root, "rank0"))


def test_a_copy_that_differs_from_the_manifest_is_not_kept(hosts):
    tmp_path, a, b, _ = hosts
    copy_id, entries = _copy(a, tmp_path / "a", FILES)
    a.replicate(copy_id)
    expected = {e["path"]: (e["size"], e["crc32c"] ^ 1) for e in entries}
    with pytest.raises(PeerError, match="does not list the committed files"):
        a.fetch(copy_id, expected)
    # Damaged on the peer's host (same size): the bytes fail their CRC-32C on the way in.
    shard = Path(b.memory.root, "rank0", "a0-r1", "shard.bin")
    data = bytearray(shard.read_bytes())
    data[7] ^= 0xFF
    shard.write_bytes(bytes(data))
    for p in sorted(Path(a.memory.root, "rank0").rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    with pytest.raises(PeerError, match="'shard.bin' arrived with CRC-32C"):
        a.fetch(copy_id, {e["path"]: (e["size"], e["crc32c"]) for e in entries})
    assert _nothing_in(Path(a.memory.root, "rank0"))


def _clear(directory: Path) -> None:
    for p in sorted(directory.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()


def test_a_peer_without_the_secret_is_neither_served_nor_believed(hosts):
    tmp_path, a, b, kv = hosts
    copy_id, entries = _copy(a, tmp_path / "a", FILES)
    a.replicate(copy_id)
    expected = {e["path"]: (e["size"], e["crc32c"]) for e in entries}
    # A requester without the secret: the server refuses it before reading any request.
    (tmp_path / "c").mkdir()
    impostor = _host(tmp_path / "c", tmp_path / "run", 0, FakeKeyValue(), "c",
                     secret=secrets.token_bytes(32))
    impostor._kv = kv
    impostor._addresses[1] = a.address(1)
    with pytest.raises(PeerError, match="do not hold the same secret"):
        impostor.fetch(copy_id, expected)
    impostor.close()
    # A server without the secret, its address written where rank 1's was (the coordination
    # service takes writes from anyone): the rank does not even connect to it.
    with socket.create_server(("127.0.0.1", 0)) as liar:
        kv.values["jaxtrain/peer/1"] = json.dumps(["127.0.0.1", liar.getsockname()[1], "c",
                                                   "00" * 32])
        a._addresses.clear()
        _clear(Path(a.memory.root, "rank0"))
        with pytest.raises(PeerError, match="not vouched for by this run's secret"):
            a.fetch(copy_id, expected)
    assert _nothing_in(Path(a.memory.root, "rank0"))


class _Flipper:
    """An on-path attacker between a rank and its peer's server: relays every byte, but flips
    one bit of the `nth` byte the server sends (after the handshake: in a copy's bytes, whose
    CRC-32C it cannot fix in a sealed record)."""

    def __init__(self, target: tuple[str, int], nth: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._target, self._nth = target, nth
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self._target)

        def pump(src, dst, flip: int | None) -> None:
            seen = 0
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    if flip is not None and seen <= flip < seen + len(data):
                        data = bytearray(data)
                        data[flip - seen] ^= 1
                    seen += len(data)
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        threading.Thread(target=pump, args=(client, server, None), daemon=True).start()
        pump(server, client, self._nth)


def test_a_copy_changed_on_the_way_is_refused_and_nothing_is_kept(hosts):
    tmp_path, a, b, _ = hosts
    copy_id, entries = _copy(a, tmp_path / "a", FILES)
    a.replicate(copy_id)
    _clear(Path(a.memory.root, "rank0"))
    # The attacker is on the path (its address published as the peer's, with the run's MAC, as
    # a network attacker between the hosts would be): the file bytes it changes fail their
    # record's check.
    host, port, name = a.address(1)
    flipper = _Flipper((host, port), nth=200_000)
    a._addresses[1] = ("127.0.0.1", flipper.port, name)
    with pytest.raises(PeerError, match="did not seal as its next one"):
        a.fetch(copy_id, {e["path"]: (e["size"], e["crc32c"]) for e in entries})
    assert _nothing_in(Path(a.memory.root, "rank0"))


def test_a_put_from_a_rank_that_is_not_the_donor_or_escapes_the_copy_is_refused(hosts):
    tmp_path, a, b, _ = hosts
    host, port, _ = a.address(1)

    def put(me: str, request: dict, body: bytes = b"") -> dict:
        with Connection.connect((host, port), SECRET, checkpoint_peers._PURPOSE, me, "rank-1",
                                10) as conn:
            conn.send_json(request)
            reply = conn.receive_json(10)
            if "ready" in reply:
                conn.send(body)
                reply = conn.receive_json(10)
            return reply

    entry = {"path": "x", "size": 1, "crc32c": _core.crc32c(b"x"), "mode": 0o644}
    put_ = {"op": "put", "local_world_size": 1, "name": "a0-r1", "id": "i", "files": [entry]}
    # The rank is the one the channel proved, whatever the request says.
    reply = put("rank-1", {**put_, "rank": 0, "host": "a"}, b"x")
    assert reply == {"error": "rank 1 is not rank 1's peer"}
    reply = put("rank-0", {**put_, "host": "b"}, b"x")
    assert reply == {"error": "rank 0 runs on this host (b) too"}
    with pytest.raises(OSError):  # the server drops the connection: nothing is written
        put("rank-0", {**put_, "host": "a", "files": [{**entry, "path": "../../escaped"}]}, b"x")
    for place in (Path(b.memory.root), Path(b.memory.root).parent):
        assert not (place / "escaped").exists()
    assert _nothing_in(Path(b.memory.root, "rank0"))  # no .writing-* left either


def test_hosts_of_uneven_sizes_send_to_the_peer_their_own_size_names(tmp_path):
    # Host a runs ranks 0 and 1, host b rank 2: rank 0's peer is rank 2 (0 + 2), rank 2's is
    # rank 0 (2 + 1, modulo 3), and rank 1's (1 + 2 = 0) is on its own host, so it has none.
    kv = FakeKeyValue()
    for name in "ab":
        (tmp_path / name).mkdir()
    run = tmp_path / "run"
    r0 = _host(tmp_path / "a", run, 0, kv, "a", world_size=3, local_world_size=2)
    r1 = _host(tmp_path / "a", run, 1, kv, "a", world_size=3, local_world_size=2)
    r2 = _host(tmp_path / "b", run, 2, kv, "b", world_size=3, local_world_size=1)
    try:
        for donor, memory_dir, keeper in ((r0, "a", r2), (r2, "b", r0)):
            copy_id, _ = _copy(donor, tmp_path / memory_dir, FILES)
            donor.replicate(copy_id)
            record = Path(keeper.memory.root, f"rank{donor.rank}", "a0-r1.json")
            assert json.loads(record.read_text())["id"] == copy_id
        copy_id, _ = _copy(r1, tmp_path / "a", FILES)
        with pytest.raises(PeerError, match=r"rank 0 runs on this host \(a\) too"):
            r1.replicate(copy_id)
        with pytest.raises(PeerError, match="runs on this host"):  # remembered: not asked again
            r1.address(0)
    finally:
        for peers in (r0, r1, r2):
            peers.close()


def test_a_message_larger_than_allowed_is_dropped_before_it_is_read(hosts):
    _, a, b, _ = hosts
    host, port, _ = a.address(1)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(struct.pack(">I", 1 << 30))
        assert s.recv(1) == b""  # closed


def _serving(peers: Peers) -> int:
    return sum(t.name == "jaxtrain-peer-request" and t.is_alive() for t in threading.enumerate())


def test_silent_connections_hold_at_most_a_few_slots_and_are_dropped_beyond(hosts):
    tmp_path, a, b, _ = hosts
    copy_id, entries = _copy(a, tmp_path / "a", FILES)
    host, port, _ = a.address(1)
    silent = [socket.create_connection((host, port), timeout=10)
              for _ in range(checkpoint_peers._MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 10
        while _serving(b) < checkpoint_peers._MAX_CONNECTIONS:  # each holds a slot
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with socket.create_connection((host, port), timeout=10) as extra:
            assert extra.recv(1) == b""  # no slot left: closed unanswered
        with pytest.raises(PeerError):
            a.replicate(copy_id)
    finally:
        for s in silent:
            s.close()
    # Once they are gone, the slots serve again.
    deadline = time.monotonic() + 10
    while True:
        try:
            a.replicate(copy_id)
            break
        except PeerError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert Path(b.memory.root, "rank0", "a0-r1.json").exists()


def _with_own_crc(data: bytes) -> bytes:
    """``data`` followed by its own CRC-32C: every such file of a given size has the same CRC-32C
    (as Orbax's OCDBT files), so a forged one passes a CRC check."""
    return data + struct.pack("<I", _core.crc32c(data))


def _sums(entries: list, files: dict[str, bytes]) -> dict:
    """What the committed manifest vouches for: path -> (size, CRC-32C, SHA-256)."""
    return {e["path"]: (e["size"], e["crc32c"], hashlib.sha256(files[e["path"]]).hexdigest())
            for e in entries}


def test_a_copy_with_the_committed_crc_but_other_bytes_fails_its_sha256(hosts):
    tmp_path, a, b, _ = hosts
    files = {"shard.bin": _with_own_crc(os.urandom(1 << 20))}
    copy_id, entries = _copy(a, tmp_path / "a", files)
    a.replicate(copy_id)
    record = json.loads(Path(b.memory.root, "rank0", "a0-r1.json").read_text())
    assert record["files"][0]["sha256"] == hashlib.sha256(files["shard.bin"]).hexdigest()
    # The peer's copy is replaced by other bytes with the same size and CRC-32C (what an
    # on-path relay, or a writer of that store, can make).
    forged = _with_own_crc(os.urandom(1 << 20))
    assert _core.crc32c(forged) == entries[0]["crc32c"]
    Path(b.memory.root, "rank0", "a0-r1", "shard.bin").write_bytes(forged)
    for p in sorted(Path(a.memory.root, "rank0").rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    with pytest.raises(PeerError, match=r"'shard.bin' arrived with SHA-256 [0-9a-f]{64}, not "
                                         r"[0-9a-f]{64} as the manifest lists it"):
        a.fetch(copy_id, _sums(entries, files))
    assert _nothing_in(Path(a.memory.root, "rank0"))
    # The genuine bytes are accepted, and the record keeps the hash of what this host wrote.
    Path(b.memory.root, "rank0", "a0-r1", "shard.bin").write_bytes(files["shard.bin"])
    assert a.fetch(copy_id, _sums(entries, files)) == len(files["shard.bin"])
    record = json.loads(Path(a.memory.root, "rank0", "a0-r1.json").read_text())
    assert record["files"][0]["sha256"] == hashlib.sha256(files["shard.bin"]).hexdigest()


@pytest.mark.parametrize("squatted", ["store", "user directory"])
def test_a_store_another_user_made_is_neither_served_nor_written(hosts, squatted):
    """The review's PoC A3: another user on the peer's host makes the store (or this user's
    directory above it) first, plants a record of the copy the manifest names and bytes with the
    committed CRC-32C. The peer server serves none of it and keeps nothing there."""
    tmp_path, a, b, _ = hosts
    files = {"params.bin": _with_own_crc(os.urandom(4096))}
    copy_id, entries = _copy(a, tmp_path / "a", files)
    Path(b.memory.root).parent.mkdir(mode=0o700, exist_ok=True)
    copy = Path(b.memory.root, "rank0", "a0-r1")
    copy.mkdir(parents=True)
    forged = _with_own_crc(b"ATTACKER" * 512)
    (copy / "params.bin").write_bytes(forged)
    planted = [{**entries[0], "mtime_ns": os.stat(copy / "params.bin").st_mtime_ns}]
    Path(str(copy) + ".json").write_text(json.dumps({"id": copy_id, "files": planted}))
    foreign = Path(b.memory.root) if squatted == "store" else Path(b.memory.root).parent
    for p in [foreign, *foreign.rglob("*")]:
        os.chown(p, 65534, 65534)
    foreign.chmod(0o755)
    for p in sorted(Path(a.memory.root, "rank0").rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    expected = {e["path"]: (e["size"], e["crc32c"]) for e in entries}  # without hashes
    with pytest.raises(PeerError, match="is not a private directory of this user's"):
        a.fetch(copy_id, expected)
    assert _nothing_in(Path(a.memory.root, "rank0"))
    # Nor does it take copies into that store.
    copy_id, _ = _copy(a, tmp_path / "a", files)
    with pytest.raises(PeerError, match="refused the copy: PermissionError: .* is not a private "
                                        "directory"):
        a.replicate(copy_id)
    assert sorted(p.name for p in Path(b.memory.root, "rank0").iterdir()) == ["a0-r1",
                                                                               "a0-r1.json"]
    for p in [foreign, *foreign.rglob("*")]:
        os.chown(p, 0, 0)  # the fixture's clean-up


def _ask(a: Peers, me: str, request: dict) -> dict:
    """``request`` sent to rank 1's server by a holder of the secret named ``me``."""
    host, port, _ = a.address(1)
    with Connection.connect((host, port), SECRET, checkpoint_peers._PURPOSE, me, "rank-1",
                            10) as conn:
        conn.send_json(request)
        return conn.receive_json(10)


@pytest.mark.parametrize("size", [False, 0.0, -1, 3, "1", None])
def test_a_put_whose_host_size_is_not_an_integer_of_the_run_is_refused(hosts, size):
    tmp_path, a, b, _ = hosts
    entry = {"path": "x", "size": 1, "crc32c": _core.crc32c(b"x"), "mode": 0o644}
    reply = _ask(a, "rank-0", {"op": "put", "local_world_size": size, "host": "a",
                               "name": "a0-r1", "id": "i", "files": [entry]})
    assert reply == {"error": f"a request whose local_world_size is {size!r}; an integer from 0 "
                              "to 2 is allowed"}
    assert not Path(b.memory.root).exists()


def test_a_request_of_a_rank_outside_the_run_is_refused(hosts):
    tmp_path, a, b, _ = hosts
    # The rank is the one the channel proved (a claimed one is ignored), and must be of the run.
    assert _ask(a, "rank-5", {"op": "get", "id": "i", "rank": 0}) == {
        "error": "a request whose rank is 5; an integer from 0 to 1 is allowed"}
    assert not Path(b.memory.root).exists()  # no rank5 made


def test_a_put_above_the_memory_budget_is_refused_and_said(hosts, monkeypatch, capfd):
    tmp_path, a, b, _ = hosts
    copy_id, _ = _copy(a, tmp_path / "a", FILES)
    monkeypatch.setenv("JAXTRAIN_MEMORY_BUDGET_MIB", "1")
    with pytest.raises(PeerError, match=r"refused the copy: MemoryBudgetError: a copy of 3\.0 MiB "
                                        r"with the 0\.0 MiB this host's store holds is above "
                                        r"JAXTRAIN_MEMORY_BUDGET_MIB=1"):
        a.replicate(copy_id)
    assert _nothing_in(Path(b.memory.root, "rank0"))
    assert "not keeping rank 0's copies: a copy of 3.0 MiB" in capfd.readouterr().err
