"""Checkpoints that the workers upload to object storage themselves (checkpoint_store.py): the
driver's staging copy holds only manifests, the manifest is the commit on the store, a restart
and a resume read from the store, an earlier attempt's leftovers are swept. Real JAX workers on
this host against a real S3-protocol server (tests/s3_server.py) and a GCS emulator
(tests/gcs_server.py), with JAXTRAIN_STORE_DIRECT=1
(the choice a run across hosts makes by itself; tests/test_ssh.py runs one across hosts)."""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path

import pytest
from test_checkpoints import _train_with_checkpoints, _trainer

from jaxtrain import (
    Checkpoint,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    storage,
)

pytest_plugins = ["s3_server", "gcs_server"]


@pytest.fixture(autouse=True)
def _direct(monkeypatch):
    monkeypatch.setenv("JAXTRAIN_STORE_DIRECT", "1")


def _listing(fs, root):
    fs.invalidate_cache()
    return sorted(posixpath.relpath(p, root) for p in fs.find(root))


def _ckpt_files(name):
    return [f"{name}/.jaxtrain_manifest.json", f"{name}/shard-0.npy", f"{name}/shard-1.npy",
            f"{name}/step.txt"]


def _local_files(fs, root):
    """The files of the driver's staging copy of the run, relative to it."""
    local = storage.staging_dir(fs, root)
    return sorted(str(p.relative_to(local)) for p in Path(local).rglob("*") if p.is_file())


def test_workers_upload_their_own_files_and_a_restart_reads_the_store(store_bucket, tmp_path,
                                                                      monkeypatch):
    url = f"{store_bucket}/exp"
    # The hosts' own caches (here this host's), and every program cached.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "host-cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    result = _trainer(url, tmp_path, "run", steps=5, every=1, keep=2, max_failures=1,
                      die_at=3).fit()

    fs, root = result.filesystem, result.path
    assert result.metrics == {"step": 4, "score": 4}
    assert result.checkpoint == Checkpoint(f"{root}/checkpoint_000005", fs)
    # Rounds 1-3 of the first attempt (rank 0's part of round 4 was uploaded, rank 1 died
    # before its own: swept at the restart), then 4-5: it restarted from round 3's checkpoint.
    assert Path(tmp_path, "started-attempt-1").read_text() == f"{root}/checkpoint_000003"
    assert [p for p in _listing(fs, root) if p.startswith("checkpoint_")] == [
        *_ckpt_files("checkpoint_000004"), *_ckpt_files("checkpoint_000005")]
    manifest = json.loads(fs.cat_file(f"{root}/checkpoint_000005/.jaxtrain_manifest.json"))
    assert manifest["location"] == "store"
    assert {f["path"]: f["rank"] for f in manifest["file_list"]} == {
        "shard-0.npy": 0, "step.txt": 0, "shard-1.npy": 1}
    assert all(len(f["sha256"]) == 64 for f in manifest["file_list"])
    index = json.loads(fs.cat_file(f"{root}/checkpoints.json"))
    assert [c["dir_name"] for c in index["checkpoints"]] == ["checkpoint_000004",
                                                             "checkpoint_000005"]
    # The checkpoints' files never passed through the driver: its copy has their manifests only.
    local = [p for p in _local_files(fs, root) if p.startswith("checkpoint_")]
    assert local == ["checkpoint_000004/.jaxtrain_manifest.json",
                     "checkpoint_000005/.jaxtrain_manifest.json"]
    with result.checkpoint.as_directory() as d:
        assert Path(d, "step.txt").read_text() == "4"
    # The compilation cache is the host's own, not in the driver's copy of the run.
    assert any((tmp_path / "host-cache" / "jaxtrain" / "compilation-cache" / "run").iterdir())
    assert not any(p.startswith("compilation-cache") for p in _local_files(fs, root))

    # A second fit() of the same name resumes from the store.
    resumed = _trainer(url, tmp_path, "run", steps=7, every=1, keep=2).fit()
    assert Path(tmp_path, "started-attempt-2").read_text() == f"{root}/checkpoint_000005"
    assert resumed.metrics == {"step": 6, "score": 6}
    assert resumed.metrics_dataframe["jaxtrain/round"].tolist() == list(range(1, 8))
    assert resumed.checkpoint == Checkpoint(f"{root}/checkpoint_000007", fs)


def _leave_an_upload_behind(config):
    """Rank 1 of the first attempt leaves a part of a round that never completes on the store
    (as a host killed mid-upload does), then dies; the rest trains as usual."""
    import signal

    import s3fs

    from jaxtrain import get_context

    ctx = get_context()
    if ctx.get_attempt() == 0 and ctx.get_world_rank() == 1:
        s3fs.S3FileSystem().pipe_file(f"{config['root']}/checkpoint_000077/shard-1.npy", b"half")
        os.kill(os.getpid(), signal.SIGKILL)
    _train_with_checkpoints(config)


def test_what_a_failed_attempt_left_on_the_store_is_swept_before_the_next_uploads(
        bucket, tmp_path, capfd):
    root = f"{bucket}/exp/sweep"
    result = JaxTrainer(
        _leave_an_upload_behind,
        train_loop_config={"out": str(tmp_path), "steps": 2, "every": 1, "scores": [0, 1],
                           "root": root},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="sweep", storage_path=f"s3://{bucket}/exp",
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    out = capfd.readouterr().out  # rank 0's output, on the console
    said = f"(rank=0) jaxtrain worker: removed from s3://{root} what an earlier attempt left: "
    swept = next(line for line in out.splitlines() if line.startswith(said))
    # Rank 1's leftover, and rank 0's part of the round rank 1 never reported when rank 0 got
    # as far as uploading it before the group was stopped.
    assert swept[len(said):].split(", ") in (["checkpoint_000077"],
                                             ["checkpoint_000001", "checkpoint_000077"])
    assert [p for p in _listing(result.filesystem, root) if p.startswith("checkpoint_")] == [
        *_ckpt_files("checkpoint_000001"), *_ckpt_files("checkpoint_000002")]


def _reuses_a_name(config):
    import tempfile

    from jaxtrain import report

    for step in range(2):
        with tempfile.TemporaryDirectory() as d:
            Path(d, "w.txt").write_text(str(step))
            report({"step": step}, checkpoint=Checkpoint.from_directory(d),
                   checkpoint_dir_name="latest")


def test_a_checkpoint_name_already_committed_on_the_store_is_refused(bucket, tmp_path):
    trainer = JaxTrainer(_reuses_a_name, scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="reuse", storage_path=f"s3://{bucket}/exp"))
    with pytest.raises(TrainingFailedError) as e:
        trainer.fit()
    assert "report(checkpoint_dir_name='latest')" in str(e.value)
    assert "cannot be replaced in place" in str(e.value)


def _one_checkpoint_per_rank(config):
    import tempfile

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        Path(d, f"rank-{rank}.txt").write_text(str(rank))
        report({"done": 1}, checkpoint=Checkpoint.from_directory(d))


def test_a_filesystem_object_reaches_the_workers_with_the_payload(bucket, s3_endpoint, tmp_path,
                                                                  monkeypatch):
    import s3fs

    # The workers know the endpoint only from the filesystem object the driver passes them.
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    result = JaxTrainer(
        _one_checkpoint_per_rank, scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="object", storage_path=f"{bucket}/exp",
                             storage_filesystem=fs)).fit()
    root = f"{bucket}/exp/object"
    assert result.checkpoint == Checkpoint(f"{root}/checkpoint_000001", fs)
    assert [p for p in _listing(fs, root) if p.startswith("checkpoint_")] == [
        "checkpoint_000001/.jaxtrain_manifest.json", "checkpoint_000001/rank-0.txt",
        "checkpoint_000001/rank-1.txt"]


def _sees_its_manifest_on_the_store(config):
    """Each rank reports one checkpoint and then, while the run goes on, waits for the
    checkpoint's manifest to appear on the store."""
    import tempfile
    import time

    import s3fs

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        Path(d, f"shard-{rank}.bin").write_bytes(bytes([rank]) * 1000)
        report({"done": 1}, checkpoint=Checkpoint.from_directory(d))
    fs = s3fs.S3FileSystem()
    manifest = f"{config['root']}/checkpoint_000001/.jaxtrain_manifest.json"
    deadline = time.monotonic() + 60
    while not fs.exists(manifest):
        assert time.monotonic() < deadline, f"{manifest} did not appear while the run went on"
        fs.invalidate_cache()
        time.sleep(0.05)
    Path(config["out"], f"seen-{rank}").touch()


def test_a_part_goes_up_from_memory_and_its_manifest_when_the_commit_ends(
        bucket, tmp_path, monkeypatch):
    """No staging directory on the hosts for a part read into memory, and the manifest is on
    the store while the run still goes on, with the driver's periodic push an hour away: the
    commit, not a poll, sends it."""
    monkeypatch.setattr(storage, "_PUSH_EVERY_S", 3600.0)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    root = f"{bucket}/exp/event"
    result = JaxTrainer(
        _sees_its_manifest_on_the_store,
        train_loop_config={"out": str(tmp_path), "root": root},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="event", storage_path=f"s3://{bucket}/exp")).fit()
    assert (tmp_path / "seen-0").exists() and (tmp_path / "seen-1").exists()
    fs = result.filesystem
    for rank in range(2):
        assert fs.cat_file(f"{root}/checkpoint_000001/shard-{rank}.bin") == (
            bytes([rank]) * 1000)
    assert not list((tmp_path / "tmp").glob("jaxtrain-*/staging"))


def test_a_file_of_several_parts_goes_up_from_memory_in_a_multipart_upload(bucket, tmp_path,
                                                                          monkeypatch):
    import hashlib

    import s3fs

    from jaxtrain import _core
    from jaxtrain.worker import checkpoint_store

    monkeypatch.setattr(checkpoint_store, "_PART", 5 << 20)  # S3's smallest part
    data = os.urandom((12 << 20) + 3)  # three parts
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    (tmp_path / "src" / "small.txt").write_text("small")
    fs = s3fs.S3FileSystem()
    store = checkpoint_store.Store(fs, f"{bucket}/exp", rank=0, attempt=0, first_round=1,
                                   committed=[], experiment_name="exp")
    snapshot = _core.snapshot_directory(str(tmp_path / "src"), 1 << 30)
    files = store.upload_snapshot(snapshot, "checkpoint_000001")
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/exp/checkpoint_000001/big.bin") == data
    assert fs.cat_file(f"{bucket}/exp/checkpoint_000001/small.txt") == b"small"
    # An object put in parts has the ETag of a multipart upload: "<md5 of the parts' md5s>-3".
    assert fs.info(f"{bucket}/exp/checkpoint_000001/big.bin")["ETag"].strip('"').endswith("-3")
    assert {f["path"]: f["sha256"] for f in files}["big.bin"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("error", "code", "hint"), [
    (PermissionError("Access Denied"), "PERMISSION_DENIED", "permission denied"),
    (OSError("An error occurred (AccessDenied) when calling PutObject"), "PERMISSION_DENIED",
     "permission denied"),
    (FileNotFoundError("The specified bucket does not exist"), "NOT_FOUND",
     "the bucket does not exist"),
    (OSError("NoCredentialsError: Unable to locate credentials"), "UNAUTHENTICATED",
     "no credentials for the store"),
    # A staged file gone (not the bucket) is no missing bucket.
    (FileNotFoundError(2, "No such file or directory", "/tmp/x/a0-r1-rank0/w.bin"),
     "UNAVAILABLE", None),
    (OSError("RequestTimeTooSkewed: the difference between the request time and the server's "
             "time is too large"), "UNAVAILABLE", "clock is far from the store's"),
    (ConnectionError("Connection reset by peer"), "UNAVAILABLE", None),
])
def test_a_failure_of_the_store_is_classified_and_named(error, code, hint):
    from jaxtrain.worker import checkpoint_store

    assert checkpoint_store.status_code(error) == code
    text = checkpoint_store._failure("uploading", "s3://b/run/checkpoint_000001/w.bin", error)
    assert text.startswith(f"uploading s3://b/run/checkpoint_000001/w.bin from host "
                           f"{os.uname().nodename} failed: {type(error).__name__}: ")
    if hint is None:  # no hint that would send the user the wrong way
        assert not any(h in text for h in checkpoint_store._HINTS.values())
        assert "clock" not in text
    else:
        assert hint in text


def test_a_file_of_several_parts_goes_up_from_memory_in_a_resumable_upload(gcs_bucket, tmp_path,
                                                                          monkeypatch):
    import fsspec

    from jaxtrain import _core
    from jaxtrain.worker import checkpoint_store

    monkeypatch.setattr(checkpoint_store, "_PART", 256 << 10)  # GCS's chunk unit
    data = os.urandom((600 << 10) + 3)  # three parts
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    fs = fsspec.filesystem("gs")
    root = gcs_bucket.removeprefix("gs://") + "/exp"
    store = checkpoint_store.Store(fs, root, rank=0, attempt=0, first_round=1, committed=[],
                                   experiment_name="exp")
    files = store.upload_snapshot(_core.snapshot_directory(str(tmp_path / "src"), 1 << 30),
                                  "checkpoint_000001")
    fs.invalidate_cache()
    assert fs.cat_file(f"{root}/checkpoint_000001/big.bin") == data
    assert [f["size"] for f in files] == [len(data)]
