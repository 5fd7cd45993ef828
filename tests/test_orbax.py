"""Orbax checkpoints through jaxtrain: a state sharded over a 2x2 mesh of 4 processes, saved by
every process (each writing its own shards), committed by jaxtrain with its manifest, and
restored with its sharding after a rank fails and the group restarts; on shared storage, and
straight into a gs:// bucket (the GCS emulator, tests/gcs_server.py) in a run whose hosts write
their checkpoints to the store themselves."""

from __future__ import annotations

import json
import os
import posixpath
import re
import signal
from pathlib import Path

import pytest

from jaxtrain import (
    Checkpoint,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    _core,
    storage,
)

pytest.importorskip("orbax.checkpoint")
pytest_plugins = ["s3_server", "gcs_server", "ssh_fixtures"]


def _train_sharded(config):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import get_context, session
    from jaxtrain import orbax as jt_orbax

    ctx = get_context()
    mesh = jax.make_mesh((2, 2), ("x", "y"))
    shardings = {"w": NamedSharding(mesh, P("x", "y")), "step": NamedSharding(mesh, P())}
    abstract = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=shardings["w"]),
                "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings["step"])}
    delta = np.arange(64, dtype=np.float32).reshape(8, 8) + 1

    state = jt_orbax.restore(abstract)
    restored_step = -1
    if state is None:
        state = jax.jit(lambda: {"w": jnp.zeros((8, 8)), "step": jnp.zeros((), jnp.int32)},
                        out_shardings=shardings)()
    else:
        restored_step = int(state["step"].addressable_data(0))
        assert state["w"].sharding == shardings["w"]
        # Each process holds its quarter of w, as saved.
        [shard] = state["w"].addressable_shards
        np.testing.assert_array_equal(np.asarray(shard.data), (restored_step * delta)[shard.index])
    update = jax.jit(lambda s: {"w": s["w"] + delta, "step": s["step"] + 1},
                     out_shardings=shardings)
    for step in range(int(state["step"].addressable_data(0)), config["steps"]):
        if step == config["fail_at"] and ctx.get_attempt() == 0:
            # The last round's checkpoint is committed before rank 1 fails: the restart restores
            # it (every rank's report of it has gone, however long staging took).
            session.require("report").wait_checkpoints_settled()
            multihost_utils.sync_global_devices("before rank 1 fails")
            if ctx.get_world_rank() == 1:
                if config.get("kill"):
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("rank 1 fails on purpose")
        state = update(state)
        jt_orbax.save(state, {"step": step + 1, "restored_step": restored_step,
                              "w_sum": float(jnp.sum(state["w"]))})


@pytest.mark.parametrize("in_memory", [False, True], ids=["from-storage", "from-host-memory"])
def test_a_state_sharded_over_four_processes_is_saved_committed_and_restored(
        storage, tmp_path, monkeypatch, in_memory):
    if in_memory:  # docs/checkpoint-memory.md
        monkeypatch.setenv("JAXTRAIN_CHECKPOINT_IN_MEMORY", "1")
        monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path))
    result = JaxTrainer(
        _train_sharded, train_loop_config={"steps": 5, "fail_at": 3},
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(name="orbax", storage_path=storage,
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    import numpy as np

    delta_sum = float(np.sum(np.arange(64) + 1))
    frame = result.metrics_dataframe
    assert frame["step"].tolist() == [1, 2, 3, 4, 5]
    # Attempt 1 restored the state saved after step 3 (round 3).
    assert frame["restored_step"].tolist() == [-1, -1, -1, 3, 3]
    assert frame["w_sum"].tolist() == [k * delta_sum for k in range(1, 6)]

    latest = Path(result.checkpoint.path)
    _core.verify_checkpoint(str(latest), True)  # every rank's files, in jaxtrain's manifest
    state = latest / "state"
    # Each process wrote its own shards; the primary the metadata.
    processes = sorted(p.name for p in state.iterdir() if p.name.startswith("ocdbt.process_"))
    assert processes == [f"ocdbt.process_{i}" for i in range(4)]
    for p in processes:
        assert any(files for _, _, files in os.walk(state / p)), p
    assert (state / "_METADATA").exists()
    assert not [p for p in (Path(result.path) / ".staging").glob("*")
                if p.name.startswith("orbax-")]
    if in_memory:
        # Orbax's OCDBT files end with their own CRC-32C, so all of a size share one checksum:
        # restored from memory, the views took the very copies the manifest names (the restored
        # values above), every one of them.
        for rank in range(4):
            log = (Path(result.path) / "logs" / f"rank-{rank}.log").read_text()
            assert re.search(r"restoring 'checkpoint_000003' from host memory: (\d+) of \1 "
                             r"files", log), log


def _train_sharded_on_store(config):
    import socket

    from jaxtrain import get_checkpoint, get_context

    rank = get_context().get_world_rank()
    Path(config["out"], f"host-{rank}").write_text(socket.gethostname())
    checkpoint = get_checkpoint()
    if checkpoint is not None:  # what restore() reads: the checkpoint on the store, no copy
        Path(config["out"], f"restored-by-{rank}").write_text(repr(checkpoint))
    _train_sharded(config)


def test_a_sharded_state_is_saved_straight_to_the_bucket_and_restored_from_it(
        gcs_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_STORE_DIRECT", "1")  # what a run across hosts does by itself
    result = JaxTrainer(
        _train_sharded_on_store,
        train_loop_config={"steps": 5, "fail_at": 3, "kill": True, "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(name="orbax", storage_path=f"{gcs_bucket}/exp",
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    frame = result.metrics_dataframe
    _check_straight_to_bucket({k: frame[k].tolist() for k in frame}, result.filesystem,
                              result.path, tmp_path,
                              Path(storage.staging_dir(result.filesystem, result.path)))


def _check_straight_to_bucket(metrics: dict, fs, root: str, out: Path, local: Path) -> None:
    """What a run of _train_sharded_on_store (killed after round 3) leaves: its `metrics` (name:
    the rounds' values) as an uninterrupted run's, a restore that read the bucket, each Orbax
    file on the bucket once and listed by the manifest with the rank that wrote it, and none in
    the driver's copy of the run (`local`)."""
    import numpy as np

    delta_sum = float(np.sum(np.arange(64) + 1))
    assert metrics["step"] == [1, 2, 3, 4, 5]
    assert metrics["restored_step"] == [-1, -1, -1, 3, 3]  # values and shardings checked
    assert metrics["w_sum"] == [k * delta_sum for k in range(1, 6)]
    restored = repr(Checkpoint(f"{root}/checkpoint_000003", fs))
    for rank in range(4):
        assert Path(out, f"restored-by-{rank}").read_text() == restored

    fs.invalidate_cache()
    stored = sorted(posixpath.relpath(p, root) for p in fs.find(root))
    # Each Orbax file is on the bucket once, where Orbax wrote it: no staging copy, no second
    # upload.
    assert not [p for p in stored if ".staging" in p or "orbax-" in p]
    ckpt = "checkpoint_000005"
    written = sorted(p[len(ckpt) + 1:] for p in stored if p.startswith(f"{ckpt}/"))
    manifest = json.loads(fs.cat_file(f"{root}/{ckpt}/.jaxtrain_manifest.json"))
    assert manifest["location"] == "store"
    listed = {f["path"]: f for f in manifest["file_list"]}
    assert sorted(listed) == [p for p in written if p != ".jaxtrain_manifest.json"]
    for path, f in listed.items():
        process = re.search(r"/ocdbt\.process_(\d+)/", path)
        assert f["rank"] == (int(process.group(1)) if process else 0), path
        assert len(f["sha256"]) == 64
        assert f["size"] == fs.size(f"{root}/{ckpt}/{path}")
    assert {f["rank"] for f in listed.values()} == {0, 1, 2, 3}
    assert "state/_METADATA" in listed
    # The files never passed through the driver: its staging copy holds no Orbax file.
    assert local.is_dir()
    assert not [p for p in local.rglob("*") if p.is_file() and "state" in p.parts]


def _save_once(config):
    import jax.numpy as jnp

    from jaxtrain import orbax as jt_orbax

    jt_orbax.save({"w": jnp.zeros((4,))}, {"step": 1})


def test_orbax_in_a_run_that_writes_straight_to_s3_is_refused_with_the_reason(
        bucket, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_STORE_DIRECT", "1")
    trainer = JaxTrainer(_save_once, scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(name="orbax-s3", storage_path=f"s3://{bucket}/exp"))
    with pytest.raises(TrainingFailedError) as e:
        trainer.fit()
    assert f"this run keeps its checkpoints on s3://{bucket}/exp/orbax-s3" in str(e.value)
    assert "Orbax writes straight only to gs://" in str(e.value)


ACROSS_HOSTS = """
import json, os, sys

sys.path.insert(0, os.environ["TESTS"])
from test_orbax import _train_sharded_on_store

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

result = JaxTrainer(
    _train_sharded_on_store,
    train_loop_config={"steps": 5, "fail_at": 3, "kill": True, "out": os.getcwd()},
    scaling_config=ScalingConfig(num_workers=4),
    run_config=RunConfig(name="orbax", storage_path=os.environ["STORE"],
                         worker_runtime_env={"env_vars": json.loads(os.environ["HOST_ENV"])},
                         failure_config=FailureConfig(max_failures=1)),
).fit()
frame = result.metrics_dataframe
with open("metrics.json", "w") as f:
    json.dump({k: frame[k].tolist() for k in ("step", "restored_step", "w_sum")}, f)
print("root", result.path)
"""


def test_a_sharded_state_on_two_hosts_is_saved_straight_to_the_bucket_and_restored(
        ssh_hosts, ssh_shared_dir, gcs_bucket, gcs_endpoint, tmp_path):
    shared_dir = ssh_shared_dir
    import fsspec
    from s3_server import BRIDGES, endpoint_on
    from test_ssh import drive

    tests = str(Path(__file__).resolve().parent)
    host_env = {"STORAGE_EMULATOR_HOST": endpoint_on(gcs_endpoint, BRIDGES["ssh"]),
                "FSSPEC_GS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "PYTHONPATH": tests}
    # The driver's home (its staging copy of the run) is its own; nothing is declared shared:
    # the hosts write the checkpoints to the bucket themselves.
    home = tmp_path / "driver-home"
    home.mkdir()
    proc = drive(ssh_hosts, shared_dir, ACROSS_HOSTS, timeout=300, TESTS=tests,
                 JAXTRAIN_SSH_HOSTS="host1,host2",
                 STORE=f"{gcs_bucket}/runs", HOST_ENV=json.dumps(host_env),
                 JAXTRAIN_SHARED_STORAGE="", HOME=str(home))

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [Path(shared_dir, f"host-{r}").read_text() for r in range(4)] == [
        "host1", "host1", "host2", "host2"]
    root = re.search(r"^root (\S+)$", proc.stdout, re.M).group(1)
    _check_straight_to_bucket(
        json.loads((shared_dir / "metrics.json").read_text()), fsspec.filesystem("gs"), root,
        shared_dir,
        home / ".cache" / "jaxtrain" / "staging" / "gs" / root)
