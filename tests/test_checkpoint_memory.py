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

from jaxtrain import (
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    _core,
    checkpoint_memory,
)
from jaxtrain.checkpoint_memory import HostMemory

SHARD_BYTES = 4 << 20


def _shard(rank: int, step: int) -> bytes:
    return hashlib.sha256(f"{rank}-{step}".encode()).digest() * (SHARD_BYTES // 32)


def _train(config):
    import shutil
    import time

    from jaxtrain import Checkpoint, checkpoint_memory, get_checkpoint, get_context, report

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
    assert list(memory_dir.iterdir()) == []  # fit() freed the host's copies
    # The final checkpoint is whole in storage, restored or not.
    _core.verify_checkpoint(str(result.checkpoint.path), True)
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
    written = memory.prepare(attempt, round_)
    copy_id = f"id-{attempt}-{round_}"
    memory.keep(written, attempt, round_, snapshot.write(written), copy_id)
    return copy_id


def _commit(run_dir: Path, name: str, files: dict[str, bytes], copy_id: str) -> Path:
    staging = run_dir / ".staging" / f"a0-r1-rank0-{name}"
    staging.mkdir(parents=True)
    for f, data in files.items():
        (staging / f).write_bytes(data)
    entries = _core.stage_directory(str(staging), str(staging) + "-staged", durable=False)
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

