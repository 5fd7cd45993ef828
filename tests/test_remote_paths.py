"""Remote names never become paths outside the local copy: object keys with '..' under logs/ or
inside a checkpoint, a dir_name of the remote index that leaves the run, and a symbolic link
planted in the local copy. Against the real S3-protocol server of tests/s3_server.py; no workers."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from jaxtrain import Checkpoint, _core, storage

pytest_plugins = ["s3_server"]  # the fixtures s3_endpoint and bucket

RUN_JSON = json.dumps({"name": "exp", "status": "FINISHED", "attempts": [], "rounds": 0})


@pytest.fixture
def s3(bucket):
    """(s3fs filesystem, boto3 client) for the test's bucket; boto3 writes keys as they are."""
    import boto3
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs, boto3.client("s3")


def _put(client, bucket, key, body=b"x"):
    client.put_object(Bucket=bucket, Key=key, Body=body)


def _run(client, bucket, extra_keys=(), index=None):
    """A finished run at runs/exp with one log, plus `extra_keys`."""
    _put(client, bucket, "runs/exp/run.json", RUN_JSON.encode())
    _put(client, bucket, "runs/exp/logs/rank-0.log", b"hello\n")
    if index is not None:
        _put(client, bucket, "runs/exp/checkpoints.json", json.dumps(index).encode())
    for key in extra_keys:
        _put(client, bucket, key, b"planted")


def test_log_keys_with_dotdot_are_not_copied_by_pull(s3, bucket, tmp_path, capfd, monkeypatch):
    fs, client = s3
    escape = "runs/exp/logs/" + "../" * 5 + "escaped.txt"
    absolute = "runs/exp/logs/" + "../" * 40 + str(tmp_path / "abs_escaped.txt").lstrip("/")
    _run(client, bucket, [escape, absolute])
    monkeypatch.chdir(tmp_path)  # where a path resolved against the working directory lands
    local = tmp_path / "a" / "b" / "c" / "staging" / "exp"
    storage.Mirror(fs, f"{bucket}/runs/exp", str(local)).pull()

    assert (local / "logs" / "rank-0.log").read_bytes() == b"hello\n"
    assert sorted(p.name for p in tmp_path.rglob("*escaped*")) == []
    err = capfd.readouterr().err
    assert f"not copying 's3://{bucket}/{escape}': its key is not a plain relative path" in err
    assert f"not copying 's3://{bucket}/{absolute}'" in err


def test_log_keys_with_dotdot_are_not_copied_by_local_view(s3, bucket, tmp_path, capfd,
                                                           monkeypatch):
    fs, client = s3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "views"))  # where local_view copies
    (tmp_path / "views").mkdir()
    absolute = "runs/exp/logs/" + "../" * 40 + str(tmp_path / "abs_escaped.txt").lstrip("/")
    _run(client, bucket, [absolute, "runs/exp/logs/sub/./x.log"])
    view = storage.local_view(fs, f"{bucket}/runs/exp")
    try:
        assert sorted(os.listdir(Path(view, "logs"))) == ["rank-0.log"]
    finally:
        storage.shutil.rmtree(view)
    assert not (tmp_path / "abs_escaped.txt").exists()
    err = capfd.readouterr().err
    assert f"not copying 's3://{bucket}/{absolute}'" in err
    assert f"not copying 's3://{bucket}/runs/exp/logs/sub/./x.log'" in err


def test_an_index_dir_name_outside_the_run_is_ignored(s3, bucket, tmp_path, capfd, monkeypatch):
    fs, client = s3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "views"))  # where local_view copies
    (tmp_path / "views").mkdir()
    record = {"dir_name": "../outside", "round": 1, "time": 0, "metrics": {}, "bytes": 0,
              "files": 0}
    manifest = json.dumps({"file_list": [], "dirs": [], "links": []}).encode()
    _run(client, bucket, index={"checkpoints": [record], "latest": "../outside"})
    # Both spellings a client may send for the manifest's key.
    _put(client, bucket, "runs/exp/../outside/.jaxtrain_manifest.json", manifest)
    _put(client, bucket, "runs/outside/.jaxtrain_manifest.json", manifest)

    view = storage.local_view(fs, f"{bucket}/runs/exp")
    try:
        assert sorted(os.listdir(view)) == ["checkpoints.json", "logs", "run.json"]
        assert json.loads(Path(view, "checkpoints.json").read_text())["checkpoints"] == []
        assert not (tmp_path / "outside").exists()
    finally:
        storage.shutil.rmtree(view)
    local = tmp_path / "staging" / "exp"
    storage.Mirror(fs, f"{bucket}/runs/exp", str(local)).pull()
    assert not (tmp_path / "staging" / "outside").exists()
    assert json.loads((local / "checkpoints.json").read_text())["checkpoints"] == []
    assert "ignoring the record" in capfd.readouterr().err


def _checkpoint(client, bucket, files):
    """A committed checkpoint at runs/exp/checkpoint_000001 holding `files` (path -> bytes)."""
    manifest = {"file_list": [{"path": p, "size": len(b), "crc32c": _core.crc32c(b), "mode": 0o644}
                              for p, b in files.items()], "dirs": [], "links": []}
    for path, body in files.items():
        _put(client, bucket, f"runs/exp/checkpoint_000001/{path}", body)
    _put(client, bucket, "runs/exp/checkpoint_000001/.jaxtrain_manifest.json",
         json.dumps(manifest).encode())
    return f"{bucket}/runs/exp/checkpoint_000001"


def test_download_tree_refuses_a_key_with_dotdot(s3, bucket, tmp_path):
    fs, client = s3
    root = _checkpoint(client, bucket, {"a.bin": b"a"})
    _put(client, bucket, "runs/exp/checkpoint_000001/sub/../../../../escaped.txt")
    with pytest.raises(ValueError, match=r"names the file 'sub/\.\./\.\./\.\./\.\./escaped\.txt'"):
        storage.download_tree(fs, root, str(tmp_path / "a" / "b" / "copy"))
    assert sorted(p.name for p in tmp_path.rglob("escaped*")) == []


def test_a_symlink_planted_in_the_local_copy_never_redirects_a_write(s3, bucket, tmp_path):
    fs, client = s3
    root = _checkpoint(client, bucket, {"keys/k.bin": b"key", "data.bin": b"data"})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"mine")
    copy = tmp_path / "copy"
    copy.mkdir()
    os.symlink(outside, copy / "keys")  # a directory on the way
    with pytest.raises(ValueError, match=r"copy/keys' is a symbolic link .*refusing to write"):
        Checkpoint(root, fs).to_directory(copy)
    assert not (outside / "k.bin").exists()

    os.unlink(copy / "keys")
    (copy / "data.bin").unlink(missing_ok=True)  # when it was copied before the refusal
    os.symlink(outside / "data.bin", copy / "data.bin")  # the file itself
    with pytest.raises(ValueError, match=r"copy/data.bin' is a symbolic link"):
        Checkpoint(root, fs).to_directory(copy)
    assert (outside / "data.bin").read_bytes() == b"mine"

    os.unlink(copy / "data.bin")
    Checkpoint(root, fs).to_directory(copy)  # plain files and directories: copied
    assert (copy / "keys" / "k.bin").read_bytes() == b"key"
    assert (copy / "data.bin").read_bytes() == b"data"


def test_a_checkpoint_whose_manifest_lacks_a_checksum_is_refused_naming_it(s3, bucket, tmp_path):
    fs, client = s3
    root = f"{bucket}/runs/exp/checkpoint_000002"
    _put(client, bucket, "runs/exp/checkpoint_000002/a.bin", b"a")
    _put(client, bucket, "runs/exp/checkpoint_000002/.jaxtrain_manifest.json",
         json.dumps({"file_list": [{"path": "a.bin", "size": 1}]}).encode())
    with pytest.raises(ValueError, match=r"damaged manifest .*\"a.bin\".* whole-number size and "
                                         r"crc32c"):
        Checkpoint(root, fs).to_directory(tmp_path / "copy")
    assert not (tmp_path / "copy" / "a.bin").exists()
