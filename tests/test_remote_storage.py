"""Runs on remote storage through fsspec: s3:// against a real S3-protocol server (moto's
standalone server, tests/s3_server.py), gs:// against a real GCS emulator (fake-gcs-server,
tests/gcs_server.py), memory://, and filesystem objects (s3fs, pyarrow) passed as
RunConfig(storage_filesystem=...). Real JAX workers; the checks read the bucket itself."""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from test_checkpoints import _trainer

from jaxtrain import (
    Checkpoint,
    CheckpointConfig,
    JaxTrainer,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    storage,
)
from jaxtrain.driver.run_dir import private_files

# the fixtures s3_endpoint and bucket; gcs_endpoint, gcs_bucket and store_bucket (s3:// and gs://)
pytest_plugins = ["s3_server", "gcs_server"]


def _listing(fs, root):
    return sorted(posixpath.relpath(p, root) for p in fs.find(root))


def _ckpt_files(name):
    return [f"{name}/.jaxtrain_manifest.json", f"{name}/shard-0.npy", f"{name}/shard-1.npy",
            f"{name}/step.txt"]


def _restored_from(tmp_path, attempt):
    """The checkpoint that rank 0 got from get_checkpoint() on `attempt` (the attempts of a run
    resumed by name continue its numbering)."""
    return Path(tmp_path, f"started-attempt-{attempt}").read_text()


def test_a_run_on_a_store_commits_keeps_two_and_resumes_by_name(store_bucket, tmp_path):
    url = f"{store_bucket}/exp"
    bucket = store_bucket.split("://", 1)[1]
    result = _trainer(url, tmp_path, "run", steps=6, every=1, keep=2).fit()

    fs = result.filesystem
    assert result.path == f"{bucket}/exp/run"
    assert _listing(fs, result.path) == [
        *_ckpt_files("checkpoint_000005"), *_ckpt_files("checkpoint_000006"),
        "checkpoints.json", "logs/rank-0.log", "logs/rank-1.log", "result.jsonl", "run.json"]
    index = json.loads(fs.cat_file(f"{result.path}/checkpoints.json"))
    assert [c["dir_name"] for c in index["checkpoints"]] == ["checkpoint_000005",
                                                             "checkpoint_000006"]
    assert index["latest"] == "checkpoint_000006"
    assert json.loads(fs.cat_file(f"{result.path}/run.json"))["status"] == "FINISHED"
    assert result.checkpoint == Checkpoint(f"{bucket}/exp/run/checkpoint_000006", fs)
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["shard-0.npy", "shard-1.npy", "step.txt"]
        assert Path(d, "step.txt").read_text() == "5"
        assert np.load(Path(d, "shard-1.npy")).tolist() == [5, 5, 5]
    assert not os.path.exists(d)  # the download is removed afterwards

    again = Result.from_path(f"{url}/run")
    assert again.metrics == result.metrics == {"step": 5, "score": 5}
    assert again.checkpoint.path == result.checkpoint.path
    assert [c.path.rsplit("/", 1)[1] for c, _ in again.best_checkpoints] == [
        "checkpoint_000005", "checkpoint_000006"]

    resumed = _trainer(url, tmp_path, "run", steps=9, every=1, keep=2).fit()
    assert _restored_from(tmp_path, 1).endswith("checkpoint_000006")
    assert resumed.metrics == {"step": 8, "score": 8}
    frame = resumed.metrics_dataframe
    assert frame["jaxtrain/round"].tolist() == list(range(1, 10))  # rounds continue their numbering
    assert frame["step"].tolist() == list(range(9))
    assert _listing(fs, resumed.path)[:8] == [*_ckpt_files("checkpoint_000008"),
                                              *_ckpt_files("checkpoint_000009")]


def test_a_rank_killed_mid_run_restarts_from_the_store(store_bucket, tmp_path):
    url = f"{store_bucket}/exp"
    result = _trainer(url, tmp_path, "run", steps=6, every=1, keep=2, die_at=3,
                      max_failures=1).fit()
    # Rank 1 died in round 4 (step 3): attempt 1 restarted from round 3, the last complete one.
    assert _restored_from(tmp_path, 1).endswith("checkpoint_000003")
    assert result.metrics == {"step": 5, "score": 5}
    again = Result.from_path(f"{url}/run")
    assert again.metrics == result.metrics
    assert again.checkpoint.path == result.checkpoint.path
    with again.checkpoint.as_directory() as d:
        assert Path(d, "step.txt").read_text() == "5"
        assert np.load(Path(d, "shard-1.npy")).tolist() == [5, 5, 5]
    run = json.loads(result.filesystem.cat_file(f"{result.path}/run.json"))
    assert run["status"] == "FINISHED"
    assert len(run["attempts"]) == 2


def test_an_interrupted_upload_is_swept_and_a_damaged_checkpoint_skipped(store_bucket, tmp_path,
                                                                          capfd):
    url = f"{store_bucket}/exp"
    scheme = store_bucket.split("://", 1)[0]
    result = _trainer(url, tmp_path, "run", steps=4, every=1, keep=2).fit()
    fs, root = result.filesystem, result.path
    # An upload cut off before its checkpoint reached the index, and a committed checkpoint
    # whose file changed size on the storage.
    fs.pipe_file(f"{root}/checkpoint_000099/shard-0.npy", b"partial")
    fs.pipe_file(f"{root}/checkpoint_000004/step.txt", b"31")
    assert [c.path.rsplit("/", 1)[1] for c, _ in Result.from_path(f"{url}/run").best_checkpoints
            ] == ["checkpoint_000003", "checkpoint_000004"]
    capfd.readouterr()

    resumed = _trainer(url, tmp_path, "run", steps=6, every=1, keep=2).fit()
    err = capfd.readouterr().err
    assert f"removing {scheme}://{root}/checkpoint_000099: an upload that did not finish" in err
    assert (f"checkpoint {scheme}://{root}/checkpoint_000004 is not restorable: 'step.txt' has 2 "
            "bytes, its manifest says 1") in err
    assert _restored_from(tmp_path, 1).endswith("checkpoint_000003")
    assert not fs.exists(f"{root}/checkpoint_000099")
    assert resumed.metrics == {"step": 5, "score": 5}
    with resumed.checkpoint.as_directory() as d:
        assert Path(d, "step.txt").read_text() == "5"


def _one_checkpoint(config):
    import tempfile

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        with open(Path(d, f"data-{rank}.bin"), "wb") as f:
            f.write(os.urandom(config["bytes"]))
        report({"done": 1}, checkpoint=Checkpoint.from_directory(d))


def _pyarrow_s3(endpoint):
    from pyarrow import fs

    return fs.S3FileSystem(endpoint_override=endpoint, access_key="testing",
                           secret_key="testing", region="us-east-1")


def _s3fs(endpoint):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")


@pytest.mark.parametrize("make_fs", [_pyarrow_s3, _s3fs], ids=["pyarrow", "s3fs"])
def test_a_filesystem_object_is_accepted_as_storage_filesystem(make_fs, bucket, s3_endpoint,
                                                               tmp_path):
    result = JaxTrainer(
        _one_checkpoint, train_loop_config={"bytes": 1000},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="fsobj", storage_path=f"{bucket}/p",
                             storage_filesystem=make_fs(s3_endpoint)),
    ).fit()
    assert result.path == f"{bucket}/p/fsobj"
    target = result.checkpoint.to_directory(tmp_path / "copy")
    assert sorted(os.listdir(target)) == ["data-0.bin", "data-1.bin"]
    assert os.path.getsize(Path(target, "data-1.bin")) == 1000


def test_a_memory_url_holds_a_run_in_the_driver_process(tmp_path):
    result = JaxTrainer(
        _one_checkpoint, train_loop_config={"bytes": 10},
        run_config=RunConfig(name="mem", storage_path="memory://runs"),
    ).fit()
    assert result.path == "/runs/mem"
    assert Result.from_path("memory://runs/mem").metrics == {"done": 1}
    with result.checkpoint.as_directory() as d:
        assert os.listdir(d) == ["data-0.bin"]


def test_a_large_upload_streams_and_shows_progress(bucket, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(storage, "_PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(storage, "_PROGRESS_EVERY_S", 0.0)
    size = 160 << 20
    tracemalloc.start()
    try:
        result = JaxTrainer(
            _one_checkpoint, train_loop_config={"bytes": size},
            run_config=RunConfig(name="big", storage_path=f"s3://{bucket}"),
        ).fit()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.filesystem.size(f"{result.checkpoint.path}/data-0.bin") == size
    # Never the whole file in memory: the upload holds a chunk and a multipart block or two.
    assert peak < size // 2, f"the driver's Python heap peaked at {peak >> 20} MiB"
    err = capfd.readouterr().err
    assert f"jaxtrain: uploading checkpoint_000001 to s3://{bucket}/big: " in err
    assert "160.0 MiB in " in err and "MiB/s), done" in err


def test_bad_remote_storage_is_refused_before_any_worker_starts(tmp_path):
    with pytest.raises(ValueError, match=r"RunConfig.storage_path='gopher://x' uses the scheme "
                                         r"'gopher://', which no fsspec filesystem handles"):
        RunConfig(storage_path="gopher://x")
    with pytest.raises(ValueError, match=r"RunConfig.storage_path='az://b/x' needs a package "
                                         r"that is not installed for 'az://': .*adlfs"):
        RunConfig(storage_path="az://b/x")  # adlfs is not installed here
    # HDFS (through pyarrow) needs a JVM, libhdfs and a namenode, which this machine lacks: the
    # filesystem fails as it opens, at fit(), in one line.
    config = RunConfig(name="r", storage_path="hdfs://namenode/runs")
    with pytest.raises(ValueError, match=r"^RunConfig.storage_path='hdfs://namenode/runs' cannot "
                                         r"be opened: OSError: [^\n]+$"):
        JaxTrainer(lambda: None, run_config=config).fit()
    with pytest.raises(ValueError, match=r"RunConfig.storage_filesystem=42 is not allowed; pass "
                                         r"an fsspec filesystem"):
        RunConfig(storage_path="b/p", storage_filesystem=42)

    import s3fs

    unreachable = s3fs.S3FileSystem(endpoint_url="http://127.0.0.1:9", key="k", secret="s",
                                    config_kwargs={"retries": {"max_attempts": 1}})
    started = tmp_path / "started"
    with pytest.raises(ValueError, match=r"RunConfig.storage_path: the run directory "
                                         r"'s3://b/p/r' cannot be written: .*127.0.0.1:9"):
        JaxTrainer(lambda: started.touch(),
                   run_config=RunConfig(name="r", storage_path="b/p",
                                        storage_filesystem=unreachable)).fit()
    assert not started.exists()


def test_remote_storage_keeps_the_checkpoint_config(bucket, tmp_path):
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="score",
                              checkpoint_score_order="min")
    result = JaxTrainer(
        _train_scores, train_loop_config={"scores": [3, 1, 2]},
        run_config=RunConfig(name="scored", storage_path=f"s3://{bucket}",
                             checkpoint_config=config),
    ).fit()
    # The best (lowest score, round 2) and the latest (round 3) are kept.
    assert [(c.path.rsplit("/", 1)[1], m["score"]) for c, m in result.best_checkpoints] == [
        ("checkpoint_000003", 2), ("checkpoint_000002", 1)]
    assert _listing(result.filesystem, result.path)[:2] == [
        "checkpoint_000002/.jaxtrain_manifest.json", "checkpoint_000002/x"]


def _train_scores(config):
    import tempfile

    from jaxtrain import report

    for score in config["scores"]:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "x").write_text(str(score))
            report({"score": score}, checkpoint=Checkpoint.from_directory(d))


def test_the_command_line_reads_a_run_on_a_store(store_bucket, tmp_path):
    url = f"{store_bucket}/exp"
    _trainer(url, tmp_path, "run", steps=3, every=1, keep=1).fit()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "jaxtrain", *args], capture_output=True,
                              text=True, timeout=60)

    listed = cli("ls", url)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:5] == ["run", "FINISHED", "1", "2", "3"]
    shown = cli("show", f"{url}/run")
    assert shown.returncode == 0, shown.stderr
    assert f"path       {url}/run" in shown.stdout
    assert "checkpoint_000003" in shown.stdout
    metrics = cli("metrics", "run", "--storage-path", url, "--csv")
    assert metrics.stdout.splitlines()[1:] and [
        line.split(",")[2] for line in metrics.stdout.splitlines()[1:]] == ["0", "1", "2"]
    logs = cli("logs", f"{url}/run", "--rank", "1")
    assert "===== jaxtrain: attempt 0 =====" in logs.stdout
    missing = cli("show", f"{url}/nope")
    assert missing.returncode == 2
    assert f"no run at {url}/nope: it has no run.json" in missing.stderr


def test_checkpoints_that_never_reached_the_storage_are_uploaded_by_the_next_fit(bucket,
                                                                                 tmp_path, capfd):
    url = f"s3://{bucket}/exp"
    result = _trainer(url, tmp_path, "run", steps=4, every=1, keep=2).fit()
    fs, root = result.filesystem, result.path
    # As if the driver had died before its last upload: the storage's index lacks the newest
    # checkpoint, whose files never arrived; the local staging copy has it.
    index = json.loads(fs.cat_file(f"{root}/checkpoints.json"))
    index["checkpoints"] = index["checkpoints"][:-1]
    index["latest"] = index["checkpoints"][-1]["dir_name"]
    fs.pipe_file(f"{root}/checkpoints.json", json.dumps(index).encode())
    fs.rm(f"{root}/checkpoint_000004", recursive=True)
    capfd.readouterr()

    resumed = _trainer(url, tmp_path, "run", steps=6, every=1, keep=2).fit()
    assert "lacks (an upload that did not finish); uploading them first" in capfd.readouterr().err
    assert _restored_from(tmp_path, 1).endswith("checkpoint_000004")
    assert resumed.metrics == {"step": 5, "score": 5}
    assert resumed.metrics_dataframe["step"].tolist() == list(range(6))

    # A run deleted from the storage starts afresh, whatever the staging copy holds.
    fs.rm(root, recursive=True)
    Path(tmp_path, "started-attempt-0").unlink()  # written by the first fit
    fresh = _trainer(url, tmp_path, "run", steps=2, every=1, keep=2).fit()
    assert _restored_from(tmp_path, 0) == ""
    assert fresh.metrics_dataframe["jaxtrain/round"].tolist() == [1, 2]


def test_modes_and_links_survive_s3_and_a_resume_by_name(bucket, tmp_path, umask_022):
    from test_checkpoint_contents import MANIFEST, _contents_trainer, mode

    url = f"s3://{bucket}/exp"
    result = _contents_trainer(url, "modes", out=str(tmp_path)).fit()
    fs, root = result.filesystem, result.checkpoint.path
    listing = _listing(fs, root)
    assert "secret-0.key" in listing and "current-0.key" not in listing  # no link objects
    manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    assert {x["path"]: x["target"] for x in manifest["links"]}["current-1.key"] == "secret-1.key"

    copy = Path(result.checkpoint.to_directory(tmp_path / "copy"))
    assert mode(copy / "secret-1.key") == 0o600
    assert mode(copy / "run-0.sh") == 0o755
    assert mode(copy / "keys-0") == 0o700
    assert os.readlink(copy / "current-0.key") == "secret-0.key"
    assert Path(copy, "keys-alias-1", "inner.bin").read_bytes() == b"inner"
    with result.checkpoint.as_directory() as d:
        assert os.readlink(Path(d, "keys-alias-0")) == "keys-0"

    # The staging copy that pull() rebuilds has the links again, so the checkpoint verifies and
    # is restored (the workers check the links they get).
    _contents_trainer(url, "modes", out=str(tmp_path)).fit()
    assert Path(tmp_path, "restored-1").read_text().endswith("checkpoint_000001")


def test_a_link_out_of_an_s3_checkpoint_is_never_created_on_download(bucket, tmp_path):
    from test_checkpoint_contents import MANIFEST, _contents_trainer

    result = _contents_trainer(f"s3://{bucket}/exp", "tampered", out=str(tmp_path)).fit()
    fs, root = result.filesystem, result.checkpoint.path
    manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    manifest["links"].append({"path": "escape", "target": "../../../../etc", "rank": 0})
    fs.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest).encode())
    with pytest.raises(ValueError, match=r"'escape' -> '../../../../etc'.*outside"):
        result.checkpoint.to_directory(tmp_path / "copy")
    assert not os.path.lexists(tmp_path / "copy" / "escape")


def test_a_link_out_of_the_checkpoint_is_refused_on_s3_too(bucket, tmp_path):
    import fsspec
    from test_checkpoint_contents import _contents_trainer

    with pytest.raises(TrainingFailedError) as e:
        _contents_trainer(f"s3://{bucket}/exp", "escape", out=str(tmp_path), outside="/etc",
                          bad_rank=0).fit()
    assert "symbolic link 'escape-0' -> '/etc'" in str(e.value)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert not [p for p in _listing(fs, f"{bucket}/exp/escape") if "checkpoint_" in p]


def test_a_private_run_on_s3_keeps_its_staging_copy_private(bucket, tmp_path, umask_022,
                                                            monkeypatch):
    from test_checkpoint_contents import _contents_trainer, mode

    monkeypatch.setenv("JAXTRAIN_PRIVATE", "1")
    monkeypatch.setenv("JAXTRAIN_STAGING_DIR", str(tmp_path / "staging"))
    result = _contents_trainer(f"s3://{bucket}/exp", "private", out=str(tmp_path)).fit()
    local = Path(storage.staging_dir(result.filesystem, result.path))
    assert mode(local) == 0o700
    for path in [local / "run.json", local / "result.jsonl", local / "logs" / "rank-0.log"]:
        assert mode(path) == 0o600, path
    assert mode(local / "checkpoint_000001" / "run-0.sh") == 0o700
    # Downloads in private mode are private too: the umask applies to the recorded modes.
    with private_files(True):
        copy = Path(result.checkpoint.to_directory(tmp_path / "copy"))
    assert mode(copy / "run-1.sh") == 0o700 and mode(copy / "secret-1.key") == 0o600


def _reused_name(config):
    import tempfile

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        Path(d, f"s-{rank}.txt").write_text(config["tag"])
        report({"tag": config["tag"]}, checkpoint=Checkpoint.from_directory(d),
               checkpoint_dir_name="latest")


def test_a_reused_checkpoint_name_leaves_the_remote_index_before_it_is_deleted(tmp_path):
    from fsspec.implementations.memory import MemoryFileSystem

    deleted_while_named: list[str] = []

    class IndexCheckingFS(MemoryFileSystem):
        """Records every deletion of a checkpoint directory that the index still names."""

        def rm(self, path, recursive=False, maxdepth=None):
            for p in [path] if isinstance(path, str) else path:
                p = p.rstrip("/")
                index = posixpath.join(posixpath.dirname(p), "checkpoints.json")
                if self.exists(index):
                    named = [c["dir_name"] for c in json.loads(self.cat_file(index))["checkpoints"]]
                    if posixpath.basename(p) in named:
                        deleted_while_named.append(p)
            return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    fs = IndexCheckingFS()

    def fit(tag):
        return JaxTrainer(_reused_name, train_loop_config={"tag": tag},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="reuse", storage_path="/reuse-runs",
                                               storage_filesystem=fs)).fit()

    fit("first")
    result = fit("second")  # commits "latest" again, replacing the first run's upload
    assert deleted_while_named == []
    assert fs.cat_file(f"{result.path}/latest/s-1.txt") == b"second"
    index = json.loads(fs.cat_file(f"{result.path}/checkpoints.json"))
    assert [(c["dir_name"], c["round"]) for c in index["checkpoints"]] == [("latest", 2)]


@pytest.mark.parametrize("stored", ["as listed", "longer", "shorter"])
def test_a_large_file_is_restored_in_ranged_reads_and_checked_whole(store_bucket, tmp_path,
                                                                    monkeypatch, stored):
    """A file above one range is read in ranges, several at once, and put together in order; one
    whose object on the store is longer or shorter than its manifest says is refused."""
    import fsspec

    from jaxtrain import _core, storage

    monkeypatch.setattr(storage, "_RANGE", 1000)
    data = os.urandom(4321)
    fs, bucket = fsspec.core.url_to_fs(store_bucket)
    root = f"{bucket}/checkpoint_000001"
    sent = {"as listed": data, "longer": data + b"x", "shorter": data[:-1]}[stored]
    fs.pipe_file(f"{root}/big.bin", sent)
    fs.pipe_file(f"{root}/{storage.MANIFEST_NAME}", json.dumps({"file_list": [
        {"path": "big.bin", "size": len(data), "crc32c": _core.crc32c(data), "mode": 0o644}]}
    ).encode())
    ranges = []
    cat_file = fs.cat_file

    def ranged(path, *args, start=None, end=None, **kwargs):
        if start is not None:
            ranges.append((start, end))
        return cat_file(path, *args, start=start, end=end, **kwargs)

    monkeypatch.setattr(fs, "cat_file", ranged)
    target = tmp_path / "restored"
    if stored == "as listed":
        storage.download_checkpoint(fs, root, str(target))
        assert (target / "big.bin").read_bytes() == data
        assert sorted(ranges) == [(0, 1000), (1000, 2000), (2000, 3000), (3000, 4000),
                                  (4000, 4321)]
    else:
        with pytest.raises(ValueError, match="'big.bin' does not match its manifest"):
            storage.download_checkpoint(fs, root, str(target))
