"""Ray Train V2's checkpoint upload options of report(), end to end with real JAX workers:
scripts written for Ray Train (2026) with their imports changed to jaxtrain, run on 2 CPU workers.

    SYNC (the default)  report() returns once the rank's files are read; the directory is free
    ASYNC               staged from the directory in the background, then the directory deleted
                        (delete_local_checkpoint_after_upload defaults to True), or kept (False)
    NO_UPLOAD           written straight into the run's storage; jaxtrain only commits it
    checkpoint_upload_fn(checkpoint, checkpoint_dir_name) -> Checkpoint: the user's own upload,
                        whose result jaxtrain commits

and the refusals of bad input, naming the argument and its value. docs/checkpoints.md maps
each mode onto jaxtrain's background commit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from jaxtrain import TrainingFailedError, _core
from jaxtrain.checkpoint import MANIFEST_NAME

pytest_plugins = ["s3_server"]  # bucket, on a local S3 server

# --- the Ray Train scripts (imports changed: `import ray` -> `import jaxtrain as ray`,
# `from ray.train...` -> `from jaxtrain...`, TorchTrainer -> JaxTrainer) ---------------------


def train_func_sync_and_async(config):
    import tempfile

    import jaxtrain as ray
    from jaxtrain.train import Checkpoint, CheckpointUploadMode

    rank = ray.train.get_context().get_world_rank()
    seen = {}
    # Round 1: SYNC, the default, in a temporary directory that goes right after.
    with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
        Path(temp_checkpoint_dir, f"sync-{rank}.txt").write_text(f"sync {rank}")
        ray.train.report({"epoch": 1}, checkpoint=Checkpoint.from_directory(temp_checkpoint_dir),
                         checkpoint_upload_mode=CheckpointUploadMode.SYNC)
    # Round 2: SYNC deleting the directory once read: gone when report() returns.
    keep = tempfile.mkdtemp(dir=config["out"])
    Path(keep, f"sync-delete-{rank}.txt").write_text(f"sync delete {rank}")
    ray.train.report({"epoch": 2}, checkpoint=Checkpoint.from_directory(keep),
                     delete_local_checkpoint_after_upload=True)
    seen["sync_deleted_on_return"] = not os.path.exists(keep)
    # Round 3: ASYNC with Ray's default: the directory is deleted after the upload.
    gone = os.path.join(config["out"], f"async-{rank}")
    os.makedirs(gone)
    Path(gone, f"async-{rank}.txt").write_text(f"async {rank}")
    ray.train.report({"epoch": 3}, checkpoint=Checkpoint.from_directory(gone),
                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
    # Round 4: ASYNC keeping it.
    kept = os.path.join(config["out"], f"async-kept-{rank}")
    os.makedirs(kept)
    Path(kept, f"async-kept-{rank}.txt").write_text(f"async kept {rank}")
    ray.train.report({"epoch": 4}, checkpoint=Checkpoint.from_directory(kept),
                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                     delete_local_checkpoint_after_upload=False)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(seen))


def train_func_no_upload(config):
    from jax.experimental import multihost_utils

    import jaxtrain as ray
    from jaxtrain.train import Checkpoint, CheckpointUploadMode

    context = ray.train.get_context()
    rank = context.get_world_rank()
    # Every rank writes its shard straight into the run's storage (as Orbax would) ...
    checkpoint_dir = context.get_storage().build_checkpoint_path_from_name("my_checkpoint_dir")
    os.makedirs(checkpoint_dir, exist_ok=True)
    Path(checkpoint_dir, f"shard_{rank}").write_text(f"contents of rank {rank}")
    multihost_utils.sync_global_devices("all shards written")
    # ... and reports it without an upload.
    ray.train.report({"score": 1}, Checkpoint(checkpoint_dir),
                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    # Ray's pattern with one writer: rank 0 reports the directory, the others no checkpoint.
    if rank == 0:
        single = context.get_storage().build_checkpoint_path_from_name("rank0_only")
        os.makedirs(single)
        Path(single, "model.txt").write_text("rank 0's model")
        ray.train.report({"score": 2}, Checkpoint(single),
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
                         delete_local_checkpoint_after_upload=True)
    else:
        ray.train.report({"score": 2}, None)


def train_func_upload_fn(config):
    import shutil
    import tempfile

    import jaxtrain as ray
    from jaxtrain.train import Checkpoint, CheckpointUploadMode

    rank = ray.train.get_context().get_world_rank()

    def record(*call):  # ASYNC calls it on jaxtrain's thread, so into a file as it happens
        with open(os.path.join(config["out"], f"calls{rank}.jsonl"), "a") as f:
            f.write(json.dumps(call) + "\n")

    def checkpoint_upload_fn(checkpoint, checkpoint_dir_name):
        record(checkpoint.path, checkpoint_dir_name)
        full_checkpoint_path = (
            ray.train.get_context()
            .get_storage()
            .build_checkpoint_path_from_name(checkpoint_dir_name)
        )
        shutil.copytree(checkpoint.path, full_checkpoint_path, dirs_exist_ok=True)
        return Checkpoint.from_directory(full_checkpoint_path)

    if rank == 0:
        with tempfile.TemporaryDirectory() as checkpoint_dir:
            Path(checkpoint_dir, "checkpoint_key").write_text("checkpoint_value")
            ray.train.report(metrics={}, checkpoint=Checkpoint.from_directory(checkpoint_dir),
                             checkpoint_dir_name="my_checkpoint_dir_name",
                             checkpoint_upload_fn=checkpoint_upload_fn)
            Path(config["out"], "reported").write_text(checkpoint_dir)
    else:
        ray.train.report(metrics={}, checkpoint=None)

    # ASYNC: called in the background, with jaxtrain's name of the round's checkpoint; the
    # user's directory deleted after the upload (Ray's default for ASYNC).
    def copy_elsewhere(checkpoint, checkpoint_dir_name):
        record(checkpoint.path, checkpoint_dir_name)
        target = os.path.join(config["out"], f"uploaded-{rank}")
        shutil.copytree(checkpoint.path, target)
        return Checkpoint.from_directory(target)

    source = os.path.join(config["out"], f"async-src-{rank}")
    os.makedirs(source)
    Path(source, f"part-{rank}").write_text(f"part {rank}")
    ray.train.report(metrics={"step": 2}, checkpoint=Checkpoint.from_directory(source),
                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                     checkpoint_upload_fn=copy_elsewhere)
    ray.train.report(metrics={"step": 3})  # waits behind the ASYNC checkpoint, in order


def train_func_bad_input(config):
    import tempfile

    import jaxtrain as ray
    from jaxtrain.train import Checkpoint, CheckpointUploadMode

    context = ray.train.get_context()
    rank = context.get_world_rank()
    directory = tempfile.mkdtemp()
    Path(directory, "f").write_text("x")
    checkpoint = Checkpoint.from_directory(directory)
    bad = [
        dict(checkpoint_upload_mode="ASYNC"),
        dict(checkpoint_upload_mode=None),
        dict(delete_local_checkpoint_after_upload="yes"),
        dict(checkpoint_upload_fn="upload"),
        dict(checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD),  # not in the run's storage
        dict(checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
             checkpoint_upload_fn=lambda c, n: c),
    ]
    messages = []
    for kwargs in bad:
        try:
            ray.train.report({}, checkpoint=checkpoint, **kwargs)
        except (TypeError, ValueError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    in_storage = context.get_storage().build_checkpoint_path_from_name("named")
    os.makedirs(in_storage, exist_ok=True)
    try:
        ray.train.report({}, checkpoint=Checkpoint(in_storage), checkpoint_dir_name="other",
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    except ValueError as e:
        messages.append(f"ValueError: {e}")
    Path(config["out"], f"messages{rank}.json").write_text(json.dumps(messages))
    # Every rank's messages are written before either rank's failing report below ends the run.
    from jaxtrain.collective import barrier

    barrier()
    # Nothing refused counted a round: the next report is every rank's first.
    ray.train.report({"ok": 1})
    # An upload function that returns no Checkpoint fails the run, naming it (Ray: ValueError).
    ray.train.report({}, checkpoint=checkpoint, checkpoint_upload_fn=lambda c, n: None)


def train_func_store(config):
    import jaxtrain as ray
    from jaxtrain.train import Checkpoint, CheckpointUploadMode

    context = ray.train.get_context()
    rank = context.get_world_rank()
    source = os.path.join(config["out"], f"store-async-{rank}")
    os.makedirs(source)
    Path(source, f"part-{rank}").write_text(f"stored {rank}")
    ray.train.report({"epoch": 1}, checkpoint=Checkpoint.from_directory(source),
                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
    try:  # the run's hosts write to the store: a directory left there is not taken over
        ray.train.report({"epoch": 2}, checkpoint=Checkpoint(config["out"]),
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    except ValueError as e:
        Path(config["out"], f"refused{rank}").write_text(str(e))
    ray.train.report({"epoch": 2})


# --- the tests ------------------------------------------------------------------------------


def _fit(fn, storage, out, name):
    from jaxtrain import JaxTrainer, RunConfig, ScalingConfig

    return JaxTrainer(
        fn,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()


def _files(checkpoint_dir: Path) -> dict[str, str]:
    _core.verify_checkpoint(str(checkpoint_dir), True)  # manifest, sizes and CRC-32C agree
    return {p.name: p.read_text() for p in checkpoint_dir.rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME}


def test_sync_and_async_commit_the_files_and_delete_the_directory_as_ray_says(storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = _fit(train_func_sync_and_async, storage, out, "modes")
    run = Path(storage, "modes")
    assert _files(run / "checkpoint_000001") == {"sync-0.txt": "sync 0", "sync-1.txt": "sync 1"}
    assert _files(run / "checkpoint_000002") == {
        "sync-delete-0.txt": "sync delete 0", "sync-delete-1.txt": "sync delete 1"}
    assert _files(run / "checkpoint_000003") == {"async-0.txt": "async 0",
                                                 "async-1.txt": "async 1"}
    assert _files(run / "checkpoint_000004") == {"async-kept-0.txt": "async kept 0",
                                                 "async-kept-1.txt": "async kept 1"}
    assert Path(result.checkpoint.path).name == "checkpoint_000004"
    for rank in (0, 1):
        assert json.loads((out / f"rank{rank}.json").read_text()) == {
            "sync_deleted_on_return": True}
        assert not (out / f"async-{rank}").exists()  # ASYNC deletes after the upload by default
        assert (out / f"async-kept-{rank}" / f"async-kept-{rank}.txt").exists()


def test_no_upload_commits_the_directory_written_into_the_run_storage(storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = _fit(train_func_no_upload, storage, out, "in-place")
    run = Path(storage, "in-place")
    assert _files(run / "my_checkpoint_dir") == {"shard_0": "contents of rank 0",
                                                 "shard_1": "contents of rank 1"}
    # NO_UPLOAD deletes nothing: the directory is the stored checkpoint.
    assert _files(run / "rank0_only") == {"model.txt": "rank 0's model"}
    assert Path(result.checkpoint.path).name == "rank0_only"
    index = json.loads((run / "checkpoints.json").read_text())
    assert [c["dir_name"] for c in index["checkpoints"]] == ["my_checkpoint_dir", "rank0_only"]


def test_upload_fn_is_called_with_the_checkpoint_and_its_name_and_its_result_committed(
        storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = _fit(train_func_upload_fn, storage, out, "upload-fn")
    run = Path(storage, "upload-fn")
    assert _files(run / "my_checkpoint_dir_name") == {"checkpoint_key": "checkpoint_value"}
    assert _files(run / "checkpoint_000002") == {"part-0": "part 0", "part-1": "part 1"}
    assert Path(result.checkpoint.path).name == "checkpoint_000002"
    assert result.metrics["step"] == 3
    def calls(rank):
        return [json.loads(line) for line in (out / f"calls{rank}.jsonl").read_text().splitlines()]

    assert calls(0) == [[(out / "reported").read_text(), "my_checkpoint_dir_name"],
                        [str(out / "async-src-0"), "checkpoint_000002"]]
    assert calls(1) == [[str(out / "async-src-1"), "checkpoint_000002"]]
    for rank in (0, 1):
        assert not (out / f"async-src-{rank}").exists()  # ASYNC's default deletes it


def test_bad_upload_arguments_are_refused_naming_the_argument_and_value(storage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(TrainingFailedError) as info:
        _fit(train_func_bad_input, storage, out, "bad")
    # Both ranks' functions return None; whichever fails first is named.
    assert re.search(r"ValueError: report\(checkpoint_upload_fn='<lambda>'\) on rank [01]: .*"
                     r"it returned None", str(info.value)), str(info.value)
    messages = json.loads((out / "messages0.json").read_text())
    expected = [
        r"ValueError: report\(checkpoint_upload_mode='ASYNC'\) is not allowed; use one of "
        r"CheckpointUploadMode.ASYNC, CheckpointUploadMode.SYNC, CheckpointUploadMode.NO_UPLOAD",
        r"ValueError: report\(checkpoint_upload_mode=None\) is not allowed",
        r"TypeError: report\(delete_local_checkpoint_after_upload='yes'\) takes True, False or "
        r"None",
        r"TypeError: report\(checkpoint_upload_fn='upload'\) takes a function",
        r"ValueError: report\(checkpoint=Checkpoint\('.*'\), "
        r"checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD\) on rank 0: a NO_UPLOAD "
        r"checkpoint must already be in the run's storage",
        r"ValueError: report\(checkpoint_upload_fn='<lambda>', "
        r"checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD\): a NO_UPLOAD checkpoint is "
        r"already in the run's storage",
        r"ValueError: .* with checkpoint_dir_name='other' on rank 0: a NO_UPLOAD checkpoint "
        r"keeps the name of its directory, 'named'",
    ]
    assert len(messages) == len(expected), messages
    for message, pattern in zip(messages, expected, strict=True):
        assert re.match(pattern, message), (pattern, message)


def test_async_in_a_run_whose_hosts_upload_to_the_store_and_no_upload_refused_there(
        bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_STORE_DIRECT", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where a staging copy would go
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    result = _fit(train_func_store, f"s3://{bucket}/runs", out, "store")
    # The ASYNC parts were read into memory and uploaded from there, never staged.
    assert not list((tmp_path / "tmp").glob("jaxtrain-*/staging"))
    assert result.metrics == {"epoch": 2}
    fs, root = result.filesystem, result.path
    manifest = json.loads(fs.cat_file(f"{root}/checkpoint_000001/{MANIFEST_NAME}"))
    assert manifest["location"] == "store"
    assert {f["path"]: f["rank"] for f in manifest["file_list"]} == {"part-0": 0, "part-1": 1}
    with result.checkpoint.as_directory() as d:
        assert sorted(p.name for p in Path(d).iterdir() if p.name != MANIFEST_NAME) == [
            "part-0", "part-1"]
        assert Path(d, "part-1").read_text() == "stored 1"
    for rank in (0, 1):
        assert not (out / f"store-async-{rank}").exists()
        assert re.match(r"report\(checkpoint=Checkpoint\('.*'\), checkpoint_upload_mode="
                        r"CheckpointUploadMode.NO_UPLOAD\) on rank \d: this run's hosts write "
                        r"its checkpoints to s3://.* themselves",
                        (out / f"refused{rank}").read_text())
