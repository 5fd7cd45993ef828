"""Checkpoints held in host memory (JAXTRAIN_CHECKPOINT_IN_MEMORY=1): a restarted group restores
from the copies its ranks kept on the host's memory filesystem, file by file only where the
committed manifest vouches for the copy, from storage otherwise; the copies are freed when fit()
ends. End to end with real JAX workers, and the store's rules on their own."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import tempfile
import time
from pathlib import Path

import pytest

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError, _core
from jaxtrain.driver.options import EngineOptions
from jaxtrain.worker import checkpoint_memory
from jaxtrain.worker.checkpoint_memory import HostMemory

SHARD_BYTES = 4 << 20


def _shard(rank: int, step: int) -> bytes:
    return hashlib.sha256(f"{rank}-{step}".encode()).digest() * (SHARD_BYTES // 32)


def _train(config):
    import shutil
    import time

    from jaxtrain import Checkpoint, get_checkpoint, get_context, report
    from jaxtrain.worker import checkpoint_memory

    ctx = get_context()
    rank = ctx.get_world_rank()
    out = Path(config["out"])
    start = get_checkpoint()
    first = 1
    if start is not None:
        seen = {"path": start.path, "files": {}}
        for name in sorted(os.listdir(start.path)):
            p = Path(start.path, name)
            seen["files"][name] = {"link": p.is_symlink(), "sha": hashlib.sha256(
                p.read_bytes()).hexdigest()}
        copied = Path(start.to_directory())
        seen["to_directory"] = sorted(p.name for p in copied.iterdir())
        shutil.rmtree(copied)
        (out / f"a{ctx.get_attempt()}-rank{rank}.json").write_text(json.dumps(seen))
        first = int(Path(start.path, f"step-{rank}.txt").read_text()) + 1
    for step in range(first, 4):
        src = out / f"src-{rank}-{step}-a{ctx.get_attempt()}"
        src.mkdir()
        (src / f"shard-{rank}.bin").write_bytes(_shard(rank, step))
        (src / f"step-{rank}.txt").write_text(str(step))
        report({"step": step}, checkpoint=Checkpoint.from_directory(str(src)))
        shutil.rmtree(src)
        if ctx.get_attempt() == 0 and step == 2:
            # Both ranks' copies of this round are kept before a rank fails.
            store = Path(checkpoint_memory.store_path(ctx.run_dir))
            deadline = time.monotonic() + 60
            while len(list(store.glob("rank*/a0-r2.json"))) < 2:
                assert time.monotonic() < deadline, list(store.rglob("*"))
                time.sleep(0.01)
            while not (Path(ctx.run_dir) / "checkpoint_000002").exists():
                time.sleep(0.01)
            if rank == 0 and config["drop_rank1"]:
                shutil.rmtree(store / "rank1")  # as if rank 1's copies were lost
            if rank == 0 and config.get("sabotage"):
                # The committed file damaged in storage (same size), and no view can be built:
                # the restart reads storage although the controller checked sizes only.
                shard = Path(ctx.run_dir) / "checkpoint_000002" / "shard-1.bin"
                data = bytearray(shard.read_bytes())
                data[0] ^= 0xFF
                shard.write_bytes(bytes(data))
                (store / "views").write_text("in the way")
            if rank == 1:
                time.sleep(0.2)
                raise RuntimeError("rank 1 fails after round 2")


def _fit(storage, tmp_path, monkeypatch, drop_rank1: bool):
    memory_dir = tmp_path / "shm"
    memory_dir.mkdir()
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_IN_MEMORY", "1")
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(memory_dir))
    out = tmp_path / "out"
    out.mkdir()
    result = JaxTrainer(
        _train,
        train_loop_config={"out": str(out), "drop_rank1": drop_rank1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="held", storage_path=storage,
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert result.metrics["step"] == 3
    run_dir = Path(storage, "held")
    seen = [json.loads((out / f"a1-rank{rank}.json").read_text()) for rank in (0, 1)]
    logs = [(run_dir / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1)]
    # Local rank 0 freed the host's copies when the run ended normally (as it does on every
    # host), and so did fit(): only the user's own (empty) directory is left.
    assert "this host's checkpoint copies in memory are freed" in logs[0]
    assert [p.name for p in memory_dir.iterdir()] == [f"jaxtrain-{os.geteuid()}"]
    assert list((memory_dir / f"jaxtrain-{os.geteuid()}").iterdir()) == []
    # The final checkpoint is whole in storage, restored or not, and its manifest vouches for
    # every file with its SHA-256 (each part has its copy).
    _core.verify_checkpoint(str(result.checkpoint.path), True)
    manifest = json.loads((Path(result.checkpoint.path) / ".jaxtrain_manifest.json").read_text())
    assert {e["path"]: e["sha256"] for e in manifest["file_list"]} == {
        e["path"]: hashlib.sha256((Path(result.checkpoint.path) / e["path"]).read_bytes())
        .hexdigest() for e in manifest["file_list"]}
    return run_dir, seen, logs


def _expected(rank: int) -> dict:
    return {f"shard-{rank}.bin": hashlib.sha256(_shard(rank, 2)).hexdigest(),
            f"step-{rank}.txt": hashlib.sha256(b"2").hexdigest()}


def test_a_restart_restores_every_file_from_host_memory(storage, tmp_path, monkeypatch):
    run_dir, seen, logs = _fit(storage, tmp_path, monkeypatch, drop_rank1=False)
    for rank in (0, 1):
        view = seen[rank]
        assert Path(view["path"]).name == "checkpoint_000002"
        assert str(tmp_path / "shm") in view["path"]  # not the storage
        files = {name: f for name, f in view["files"].items() if not name.startswith(".")}
        assert {name: f["sha"] for name, f in files.items()} == {**_expected(0), **_expected(1)}
        assert not any(f["link"] for f in files.values())  # every file from memory
        assert ".jaxtrain_manifest.json" in view["files"]
        assert view["to_directory"] == sorted([*_expected(0), *_expected(1)])
        assert "restoring 'checkpoint_000002' from host memory: 4 of 4 files" in logs[rank]


def test_files_whose_copies_are_gone_are_read_from_storage(storage, tmp_path, monkeypatch):
    run_dir, seen, logs = _fit(storage, tmp_path, monkeypatch, drop_rank1=True)
    for rank in (0, 1):
        files = seen[rank]["files"]
        assert {name: f["sha"] for name, f in files.items() if not name.startswith(".")} == {
            **_expected(0), **_expected(1)}
        assert {name for name, f in files.items() if f["link"]} == set(_expected(1))
        # to_directory() copies the committed checkpoint, links to storage included.
        assert seen[rank]["to_directory"] == sorted([*_expected(0), *_expected(1)])
        assert ("from host memory: 2 of 4 files (4.0 MiB), the others from storage"
                in logs[rank])


def test_a_rank_that_reads_storage_after_a_sizes_only_check_checks_checksums_first(
        storage, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_IN_MEMORY", "1")
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(
            _train,
            train_loop_config={"out": str(out), "drop_rank1": False, "sabotage": True},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="held", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=1,
                                                              controller_failure_limit=0)),
        ).fit()
    # Every part had its copy here, so the controller checked sizes only (had it not recognised
    # the workers' store, it would have passed over the damaged checkpoint for checkpoint_000001
    # and the run would have succeeded); the ranks, reading storage, checked and refused it.
    message = str(e.value)
    assert "failed its check before rank" in message, message
    assert "shard-1.bin" in message, message


def test_a_bad_switch_is_refused_naming_it(monkeypatch, storage):
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_IN_MEMORY", "yes")
    with pytest.raises(ValueError, match=r"JAXTRAIN_CHECKPOINT_IN_MEMORY='yes' is not allowed; "
                                         r"use 1 .* or 0"):
        JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                   run_config=RunConfig(name="x", storage_path=storage)).fit()
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_IN_MEMORY", "1")
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", "/nonexistent/shm")
    with pytest.raises(ValueError, match="JAXTRAIN_MEMORY_DIR='/nonexistent/shm' is not a "
                                         "directory"):
        JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                   run_config=RunConfig(name="x", storage_path=storage)).fit()


# The store's rules, without workers.

def _hold(memory: HostMemory, attempt: int, round_: int, files: dict[str, bytes]) -> str:
    src = tempfile.mkdtemp()
    for name, data in files.items():
        Path(src, name).write_bytes(data)
    snapshot = _core.snapshot_directory(src, 1 << 30)
    written = memory.prepare(attempt, round_, snapshot.bytes)
    copy_id = f"id-{attempt}-{round_}"
    memory.keep(written, attempt, round_, snapshot.write(written, sha256=True), copy_id)
    return copy_id


def _commit(run_dir: Path, name: str, files: dict[str, bytes], copy_id: str,
            hashes: bool = False) -> Path:
    """A committed checkpoint of rank 0's ``files`` whose part's copy is ``copy_id``; with
    ``hashes``, its manifest carries each file's SHA-256, as one staged with its copy does."""
    staging = run_dir / ".staging" / f"a0-r1-rank0-{name}"
    staging.mkdir(parents=True)
    for f, data in files.items():
        (staging / f).write_bytes(data)
    entries = _core.stage_directory(str(staging), str(staging) + "-staged", durable=False)
    if hashes:
        entries = [{**e, "sha256": hashlib.sha256(files[e["path"]]).hexdigest()} for e in entries]
    manifest = {"file_list": [{**e, "rank": 0} for e in entries],
                "copies": [{"rank": 0, "id": copy_id}]}
    ckpt = run_dir / name
    ckpt.mkdir()
    for f, data in files.items():
        (ckpt / f).write_bytes(data)
    (ckpt / ".jaxtrain_manifest.json").write_text(json.dumps(manifest))
    return ckpt


def test_a_rank_keeps_its_two_newest_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path))
    memory = HostMemory(str(tmp_path / "run"), 0)
    for attempt, round_ in ((0, 1), (0, 2), (0, 3), (1, 1)):
        _hold(memory, attempt, round_, {"a": f"{attempt}-{round_}".encode()})
    kept = sorted(p.name for p in Path(memory.dir).iterdir())
    assert kept == ["a0-r3", "a0-r3.json", "a1-r1", "a1-r1.json"]
    assert oct(os.stat(memory.root).st_mode & 0o777) == "0o700"


def test_a_rank_keeps_the_copy_its_restore_came_from(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    run_dir = tmp_path / "run"
    memory = HostMemory(str(run_dir), 0)
    restored = _hold(memory, 0, 4, {"a": b"4"})
    _hold(memory, 0, 5, {"a": b"5"})  # never committed: the restart restores round 4
    ckpt = _commit(run_dir, "checkpoint_000004", {"a": b"4"}, restored)
    assert memory.view(str(ckpt), attempt=1).in_memory == 1
    _hold(memory, 1, 1, {"a": b"6"})
    _hold(memory, 1, 2, {"a": b"7"})
    kept = sorted(p.name for p in Path(memory.dir).iterdir() if not p.name.endswith(".json"))
    assert kept == ["a0-r4", "a1-r1", "a1-r2"]
    # The next attempt's view of another checkpoint no longer protects it.
    later = _commit(run_dir, "checkpoint_000007", {"a": b"7"}, "id-1-2")
    assert memory.view(str(later), attempt=2).in_memory == 1
    _hold(memory, 2, 1, {"a": b"8"})
    kept = sorted(p.name for p in Path(memory.dir).iterdir() if not p.name.endswith(".json"))
    assert kept == ["a1-r2", "a2-r1"]
    assert sorted(os.listdir(Path(memory.root) / "views")) == ["rank0-a2"]


def test_a_copy_changed_through_a_view_is_not_used_again(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    run_dir = tmp_path / "run"
    memory = HostMemory(str(run_dir), 0)
    copy_id = _hold(memory, 0, 1, {"a": b"1" * 100})
    ckpt = _commit(run_dir, "checkpoint_000001", {"a": b"1" * 100}, copy_id)
    view = memory.view(str(ckpt), attempt=1)
    time.sleep(0.01)
    Path(view.path, "a").write_bytes(b"2" * 100)  # the training function writes into it
    assert memory.view(str(ckpt), attempt=2) is None  # from storage, where it is intact


def test_a_copy_the_manifest_does_not_vouch_for_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    run_dir = tmp_path / "run"
    memory = HostMemory(str(run_dir), 0)
    copy_id = _hold(memory, 0, 1, {"same": b"x" * 100, "changed": b"old" * 100})
    ckpt = _commit(run_dir, "checkpoint_000001", {"same": b"x" * 100, "changed": b"new" * 100},
                   copy_id)
    view = memory.view(str(ckpt), attempt=1)
    assert (view.in_memory, view.files) == (1, 2)
    assert not os.path.islink(os.path.join(view.path, "same"))
    assert os.readlink(os.path.join(view.path, "changed")) == str(ckpt / "changed")
    assert Path(view.path, "changed").read_bytes() == b"new" * 100
    # The same files, sizes and checksums, but another part than the copy: not used.
    same = _commit(run_dir, "checkpoint_000002", {"same": b"x" * 100}, "another-part")
    assert memory.view(str(same), attempt=2) is None
    # A checkpoint committed without copies: the storage is read.
    other = _commit(run_dir, "checkpoint_000003", {"same": b"x" * 100}, copy_id)
    manifest = json.loads((other / ".jaxtrain_manifest.json").read_text())
    del manifest["copies"]
    (other / ".jaxtrain_manifest.json").write_text(json.dumps(manifest))
    assert memory.view(str(other), attempt=3) is None


def _hold_lock(run_dir: Path) -> int:
    """Takes the run's lock as a live driver holds it (an open-file-description lock on LOCK)."""
    fd = os.open(run_dir / "LOCK", os.O_RDWR | os.O_CREAT)
    os.write(fd, json.dumps({"host": "h", "pid": os.getpid()}).encode())
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET,
                                                   0, 0, 0))
    return fd


def test_the_sweep_frees_the_stores_of_runs_that_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    runs = {}
    locks = []
    for name, status in (("ended", "FINISHED"), ("running", "RUNNING"), ("gone", None),
                         ("driver-killed", "RUNNING"), ("own", "RUNNING")):
        run_dir = tmp_path / name
        if status is not None:
            run_dir.mkdir()
            (run_dir / "run.json").write_text(json.dumps({"status": status}))
        if name == "running":
            locks.append(_hold_lock(run_dir))
        memory = HostMemory(str(run_dir), 0)
        _hold(memory, 0, 1, {"a": b"1"})
        runs[name] = Path(memory.root)
    checkpoint_memory.sweep(str(tmp_path / "own"))
    assert {name for name, root in runs.items() if root.exists()} == {"running", "own"}
    for fd in locks:
        os.close(fd)


def test_a_store_another_user_could_have_made_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path))
    run_dir = tmp_path / "run"
    memory = HostMemory(str(run_dir), 0)
    copy_id = _hold(memory, 0, 1, {"a": b"1"})
    ckpt = _commit(run_dir, "checkpoint_000001", {"a": b"1"}, copy_id)
    assert memory.view(str(ckpt), attempt=1).in_memory == 1
    os.chmod(memory.root, 0o755)  # as a store made by someone else would be: open to others
    assert memory.view(str(ckpt), attempt=2) is None
    with pytest.raises(PermissionError, match="is not a private directory of this user's"):
        memory.prepare(0, 2)


def test_a_copy_left_unfinished_is_removed_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path))
    memory = HostMemory(str(tmp_path / "run"), 0)
    _hold(memory, 0, 1, {"a": b"1"})
    written = memory.prepare(0, 2)
    os.makedirs(written)  # a worker killed while writing it
    Path(memory.dir, "a0-r9").mkdir()  # a copy whose record was never written
    _hold(memory, 0, 3, {"a": b"3"})
    assert sorted(os.listdir(memory.dir)) == ["a0-r1", "a0-r1.json", "a0-r3", "a0-r3.json"]



def _with_own_crc(data: bytes) -> bytes:
    """``data`` followed by its own CRC-32C: every such file of a given size has the same CRC-32C
    (as Orbax's OCDBT files)."""
    return data + struct.pack("<I", _core.crc32c(data))


def test_a_copy_is_used_only_with_the_sha256_the_manifest_vouches_for(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    run_dir = tmp_path / "run"
    memory = HostMemory(str(run_dir), 0)
    kept, committed = _with_own_crc(b"k" * 100), _with_own_crc(b"c" * 100)
    assert _core.crc32c(kept) == _core.crc32c(committed)
    copy_id = _hold(memory, 0, 1, {"a": kept})
    record = json.loads(Path(memory.dir, "a0-r1.json").read_text())
    assert record["files"][0]["sha256"] == hashlib.sha256(kept).hexdigest()  # as written
    # The same id, size and CRC-32C, other bytes: the manifest's SHA-256 refuses the copy.
    ckpt = _commit(run_dir, "checkpoint_000001", {"a": committed}, copy_id, hashes=True)
    assert memory.view(str(ckpt), attempt=1) is None
    assert memory.missing_part(str(ckpt)) == (copy_id, {"a": (
        len(committed), _core.crc32c(committed), hashlib.sha256(committed).hexdigest())})
    # The bytes it vouches for are used.
    same = _commit(run_dir, "checkpoint_000002", {"a": kept}, copy_id, hashes=True)
    assert memory.view(str(same), attempt=2).in_memory == 1
    assert memory.missing_part(str(same)) is None
    # A manifest from before hashes vouches with the id, the size and the CRC-32C only.
    old = _commit(run_dir, "checkpoint_000003", {"a": committed}, copy_id)
    assert memory.view(str(old), attempt=3).in_memory == 1
    # A copy kept before hashes were recorded is hashed when it is linked.
    record_path = Path(memory.dir, "a0-r1.json")
    del record["files"][0]["sha256"]
    record_path.write_text(json.dumps(record))
    assert memory.view(str(ckpt), attempt=4) is None
    assert memory.view(str(same), attempt=5).in_memory == 1


def test_stores_are_in_the_users_own_private_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    memory = HostMemory(str(tmp_path / "run"), 0)
    _hold(memory, 0, 1, {"a": b"1"})
    user = tmp_path / "shm" / f"jaxtrain-{os.geteuid()}"
    assert Path(memory.root).parent == user
    assert oct(os.stat(user).st_mode & 0o777) == "0o700"
    # A memory directory where others could replace it (writable by all, not sticky): refused.
    os.chmod(tmp_path / "shm", 0o777)
    with pytest.raises(PermissionError, match="lets other users replace what is in it"):
        memory.prepare(0, 2)
    os.chmod(tmp_path / "shm", 0o1777)  # as /dev/shm
    memory.prepare(0, 2)


def _views_linked_to_another_store(tmp_path: Path, monkeypatch):
    """A run's store, with a copy and its committed checkpoint, whose ``views`` is a link to the
    ``views`` of another store of this user's, which holds a view in use (``victim``)."""
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path))
    other = HostMemory(str(tmp_path / "other-run"), 0)
    _hold(other, 0, 1, {"a": b"1"})
    victim = Path(other.root, "views", "rank0-a5")
    victim.mkdir(parents=True)
    (victim / "live").write_text("a view in use")
    run_dir = tmp_path / "run"
    memory = HostMemory(str(run_dir), 0)
    copy_id = _hold(memory, 0, 1, {"a": b"1"})
    ckpt = _commit(run_dir, "checkpoint_000001", {"a": b"1"}, copy_id)
    os.symlink(Path(other.root, "views"), Path(memory.root, "views"))
    return other, victim, run_dir, memory, copy_id, ckpt


@pytest.mark.parametrize("squatted", ["store", "user directory"])
def test_a_store_another_user_made_is_neither_read_nor_cleaned(tmp_path, monkeypatch, squatted):
    """The review's PoC A4, and the readers of H2: in a store another user made (or under a
    user directory they made), whose ``views`` links to this user's other store, nothing is read,
    written or removed."""
    other, victim, run_dir, memory, copy_id, ckpt = _views_linked_to_another_store(
        tmp_path, monkeypatch)
    foreign = Path(memory.root) if squatted == "store" else Path(memory.root).parent
    for p in [foreign, *foreign.rglob("*")]:
        os.chown(p, 65534, 65534, follow_symlinks=False)
    foreign.chmod(0o755)
    assert memory.view(str(ckpt), attempt=7) is None
    assert (victim / "live").read_text() == "a view in use"
    assert memory.missing_part(str(ckpt)) is None
    with pytest.raises(PermissionError, match="is not a private directory of this user's"):
        memory.copy_named(copy_id)
    with pytest.raises(PermissionError, match="is not a private directory of this user's"):
        memory.prepare(0, 2)
    checkpoint_memory.remove_store(str(run_dir))
    assert Path(memory.dir, "a0-r1.json").exists()
    if squatted == "store":
        assert Path(other.root).exists()  # the user's own directory and its other store serve


def test_a_views_link_in_a_private_store_is_not_followed(tmp_path, monkeypatch):
    other, victim, _, memory, _, ckpt = _views_linked_to_another_store(tmp_path, monkeypatch)
    assert memory.view(str(ckpt), attempt=7) is None
    assert (victim / "live").read_text() == "a view in use"
    assert sorted(os.listdir(Path(other.root, "views"))) == ["rank0-a5"]


class _Client:
    def __init__(self) -> None:
        self.reports: list[dict] = []

    def report_checkpoint(self, round_: int, description: str, text: str) -> None:
        self.reports.append(json.loads(description))


def _stage_one(memory: HostMemory, tmp_path: Path) -> dict:
    """One checkpoint through the rank's background stager; what its report said."""
    from jaxtrain.worker.stager import Stager

    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "a").write_bytes(b"abc")
    client = _Client()

    def fail(message):
        raise AssertionError(message)

    stager = Stager(client, 0, fail, memory)
    staging = tmp_path / "run" / ".staging" / "a0-r1-rank0"
    stager.checkpoint(1, "{}", _core.snapshot_directory(str(src), 1 << 20),
                      {"staging": str(staging), "dir_name": None})
    stager.drain()
    return client.reports[0]


def test_the_report_names_a_copy_only_when_it_was_kept(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    memory = HostMemory(str(tmp_path / "run"), 0)
    report = _stage_one(memory, tmp_path)
    assert report["copy_id"] == json.loads(Path(memory.dir, "a0-r1.json").read_text())["id"]
    assert report["files"][0]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    # A store that is not this user's: nothing kept, so the report names no copy that an
    # attacker could plant.
    os.chmod(memory.root, 0o755)
    report = _stage_one(memory, tmp_path)
    assert "copy_id" not in report
    assert "keeping the checkpoint of round 1 in host memory failed (PermissionError" in \
        capfd.readouterr().err


def test_a_copy_above_the_memory_budget_is_skipped_with_one_line(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    memory = HostMemory(str(tmp_path / "run"), 0)
    monkeypatch.setenv("JAXTRAIN_MEMORY_BUDGET_MIB", "1")
    _hold(memory, 0, 1, {"a": b"x" * (600 << 10)})
    with pytest.raises(checkpoint_memory.MemoryBudgetError,
                       match=r"a copy of 0\.6 MiB with the 0\.6 MiB this host's store holds is "
                             r"above JAXTRAIN_MEMORY_BUDGET_MIB=1"):
        _hold(memory, 0, 2, {"a": b"x" * (600 << 10)})
    monkeypatch.setenv("JAXTRAIN_MEMORY_BUDGET_MIB", "0")
    report = _stage_one(memory, tmp_path)
    assert "copy_id" not in report
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "is above JAXTRAIN_MEMORY_BUDGET_MIB=0" in err, err
    # Unset: a copy may take at most half the filesystem's free space.
    monkeypatch.delenv("JAXTRAIN_MEMORY_BUDGET_MIB")
    real = os.statvfs(memory.root)
    small = os.statvfs_result((real.f_bsize, 1024, 1000, 1000, 5, 5, 0, 0, 0, 255))
    monkeypatch.setattr(checkpoint_memory.os, "statvfs", lambda path: small)
    with pytest.raises(checkpoint_memory.MemoryBudgetError,
                       match=r"a copy of 0\.0 MiB is above half the 0\.0 MiB free in .*"
                             r"\(set JAXTRAIN_MEMORY_BUDGET_MIB to allow more\)"):
        memory.prepare(0, 3, 4096)
    memory.prepare(0, 3, 2048)


def test_a_bad_memory_budget_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_IN_MEMORY", "1")
    monkeypatch.setenv("JAXTRAIN_MEMORY_BUDGET_MIB", "lots")
    with pytest.raises(ValueError, match=r"JAXTRAIN_MEMORY_BUDGET_MIB='lots' is not allowed; use "
                                         r"a whole number of MiB"):
        EngineOptions.read()


def test_local_rank_0_frees_its_hosts_store_at_the_runs_normal_end(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path))
    memory = HostMemory(str(tmp_path / "run"), 1)
    _hold(memory, 0, 1, {"a": b"1"})
    checkpoint_memory.end_of_run(str(tmp_path / "run"), local_rank=1)
    assert Path(memory.root).exists()
    checkpoint_memory.end_of_run(str(tmp_path / "run"), local_rank=0)
    assert not Path(memory.root).exists()
