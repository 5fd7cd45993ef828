"""What a checkpoint holds, end to end: file modes kept (never wider than the umask), links inside
the checkpoint kept as links, links out of it refused and never followed, private runs, paths in a
worker's message checked, content verified on restore, ranks at different steps never committed
together, and an index that cannot be written; real JAX workers, real files."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

from jaxtrain import (
    Checkpoint,
    JaxTrainer,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    _core,
)

MANIFEST = ".jaxtrain_manifest.json"


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _write_contents(d: str, rank: int, outside: str | None) -> None:
    """A checkpoint with a private key, an executable, a private directory and links inside."""
    Path(d, f"secret-{rank}.key").write_text(f"token {rank}")
    os.chmod(Path(d, f"secret-{rank}.key"), 0o600)
    Path(d, f"run-{rank}.sh").write_text("#!/bin/sh\n")
    os.chmod(Path(d, f"run-{rank}.sh"), 0o755)
    Path(d, f"keys-{rank}").mkdir()
    Path(d, f"keys-{rank}", "inner.bin").write_bytes(b"inner")
    os.chmod(Path(d, f"keys-{rank}"), 0o700)
    os.symlink(f"secret-{rank}.key", Path(d, f"current-{rank}.key"))
    os.symlink(f"keys-{rank}", Path(d, f"keys-alias-{rank}"))
    if outside is not None:
        os.symlink(outside, Path(d, f"escape-{rank}"))


def _train_contents(config):
    import jax  # noqa: F401

    from jaxtrain import get_checkpoint, get_context, report

    rank = get_context().get_world_rank()
    restored = get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            # The links restored as links, to the files beside them.
            assert os.readlink(Path(d, f"current-{rank}.key")) == f"secret-{rank}.key"
            assert Path(d, f"current-{rank}.key").read_text() == f"token {rank}"
            Path(config["out"], f"restored-{rank}").write_text(d)
    with tempfile.TemporaryDirectory() as d:
        _write_contents(d, rank, config.get("outside") if rank == config.get("bad_rank") else None)
        report({"step": 0}, checkpoint=Checkpoint.from_directory(d))


def _contents_trainer(storage, name, **config):
    return JaxTrainer(_train_contents, train_loop_config=config,
                      scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=name, storage_path=storage))


def test_modes_are_kept_and_links_inside_stay_links_also_through_to_directory(
        storage, tmp_path, umask_022):
    result = _contents_trainer(storage, "modes", out=str(tmp_path)).fit()
    ckpt = Path(result.checkpoint.path)
    for r in (0, 1):
        assert mode(ckpt / f"secret-{r}.key") == 0o600
        assert mode(ckpt / f"run-{r}.sh") == 0o755
        assert mode(ckpt / f"keys-{r}") == 0o700
        assert os.readlink(ckpt / f"current-{r}.key") == f"secret-{r}.key"
        assert os.readlink(ckpt / f"keys-alias-{r}") == f"keys-{r}"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    modes = {f["path"]: f["mode"] for f in manifest["file_list"]}
    assert modes["secret-1.key"] == 0o600 and modes["run-0.sh"] == 0o755
    assert "current-0.key" not in modes  # a link is not a second copy of its file
    links = {x["path"]: (x["target"], x["rank"]) for x in manifest["links"]}
    assert links == {"current-0.key": ("secret-0.key", 0), "keys-alias-0": ("keys-0", 0),
                     "current-1.key": ("secret-1.key", 1), "keys-alias-1": ("keys-1", 1)}

    copy = Path(result.checkpoint.to_directory(tmp_path / "copy"))
    assert mode(copy / "secret-0.key") == 0o600
    assert mode(copy / "keys-1") == 0o700
    assert os.readlink(copy / "current-1.key") == "secret-1.key"
    assert not (copy / MANIFEST).exists()

    # Resumed by name: the checkpoint with its links verifies and is handed to the workers.
    _contents_trainer(storage, "modes", out=str(tmp_path)).fit()
    assert Path(tmp_path, "restored-1").read_text() == str(ckpt)


@pytest.mark.parametrize("outside", ["/etc", "../../../../../../etc/passwd", "DIR"])
def test_a_link_out_of_the_checkpoint_is_refused_naming_it_and_never_followed(
        storage, tmp_path, outside):
    if outside == "DIR":
        outside = str(tmp_path / "elsewhere")
        Path(outside).mkdir()
        Path(outside, "weights.bin").write_bytes(b"w" * 100)
    with pytest.raises(TrainingFailedError) as e:
        _contents_trainer(storage, "escape", out=str(tmp_path), outside=outside,
                          bad_rank=1).fit()
    assert e.value.rank == 1
    assert f"symbolic link 'escape-1' -> '{outside}'" in str(e.value)
    assert "outside" in str(e.value)
    run = Path(storage, "escape")
    assert not [p for p in run.iterdir() if (p / MANIFEST).exists()]
    assert not (run / ".staging").exists()


def test_to_directory_refuses_a_link_out_of_the_checkpoint(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("ok")
    os.symlink("/etc", src / "etc")
    with pytest.raises(ValueError, match=r"'etc' -> '/etc'.*outside"):
        Checkpoint.from_directory(src).to_directory(tmp_path / "dst")
    assert not (tmp_path / "dst" / "etc").exists()


def test_a_private_run_keeps_its_directory_and_every_file_to_its_owner(
        storage, tmp_path, umask_022, monkeypatch):
    # Without private mode the run's files follow the umask ...
    plain = _contents_trainer(storage, "plain", out=str(tmp_path)).fit()
    assert mode(Path(plain.path, "run.json")) == 0o644
    assert mode(Path(plain.path, "logs", "rank-0.log")) == 0o644
    assert mode(plain.path) == 0o755
    # ... with it, the run directory is 0700 and everything in it 0700 / 0600.
    monkeypatch.setenv("JAXTRAIN_PRIVATE", "1")
    result = _contents_trainer(storage, "private", out=str(tmp_path)).fit()
    run = Path(result.path)
    assert mode(run) == 0o700
    for path in [run / "run.json", run / "result.jsonl", run / "checkpoints.json",
                 run / "progress.csv", run / "logs" / "rank-0.log", run / "logs" / "rank-1.log"]:
        assert mode(path) == 0o600, path
    assert mode(run / "logs") == 0o700
    ckpt = Path(result.checkpoint.path)
    assert mode(ckpt) == 0o700
    assert mode(ckpt / "run-0.sh") == 0o700  # 0755 within the private umask
    assert mode(ckpt / MANIFEST) == 0o600
    assert os.umask(0o022) == 0o022  # the driver's umask is back after fit()

    # An existing run resumed in private mode becomes private too.
    _contents_trainer(storage, "plain", out=str(tmp_path)).fit()
    assert mode(plain.path) == 0o700


def test_a_run_that_keeps_checkpoints_in_host_memory_is_private_unless_told_otherwise(
        storage, tmp_path, umask_022, monkeypatch):
    monkeypatch.delenv("JAXTRAIN_PRIVATE", raising=False)
    monkeypatch.setenv("JAXTRAIN_CHECKPOINT_IN_MEMORY", "1")
    monkeypatch.setenv("JAXTRAIN_MEMORY_DIR", str(tmp_path))
    run = Path(_contents_trainer(storage, "in-memory", out=str(tmp_path)).fit().path)
    assert mode(run) == 0o700
    assert mode(run / "run.json") == 0o600
    monkeypatch.setenv("JAXTRAIN_PRIVATE", "0")  # said outright: not private
    run = Path(_contents_trainer(storage, "in-memory-shared", out=str(tmp_path)).fit().path)
    assert mode(run) == 0o755


def _forged_checkpoint(config):
    import jax  # noqa: F401

    from jaxtrain import get_context, report, session

    ctx = get_context()
    if ctx.get_world_rank() == 0:
        report({"step": 0})
        return
    s = session.current()
    files = [{"path": "precious.bin", "size": 7, "crc32c": 0}]
    staging = config["victim"]
    if config["how"] == "dotdot":
        # Its own staging directory, but a file path that climbs out of it.
        staging = os.path.join(ctx.run_dir, ".staging", f"a{ctx.attempt}-r1-rank1")
        with tempfile.TemporaryDirectory() as d:
            Path(d, "model.bin").write_text("m")
            files = _core.stage_directory(d, staging)
        files.append({"path": "../../../victim/precious.bin", "size": 7, "crc32c": 0})
    s.client.report_checkpoint(1, json.dumps({"staging": staging, "files": files}), "{}")


@pytest.mark.parametrize("how", ["victim", "dotdot"])
def test_a_forged_checkpoint_path_from_a_worker_is_refused_and_nothing_deleted(
        storage, tmp_path, how):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.bin").write_text("keep me")
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(_forged_checkpoint, train_loop_config={"victim": str(victim), "how": how},
                   scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="forged", storage_path=storage)).fit()
    assert e.value.rank == 1
    if how == "victim":
        assert f"names the staging directory '{victim}', not its own" in str(e.value)
    else:
        assert "'../../../victim/precious.bin', which is not a clean relative path" in str(
            e.value)
    assert (victim / "precious.bin").read_text() == "keep me"
    assert not [p for p in Path(storage, "forged").iterdir() if (p / MANIFEST).exists()]


def _train_big(config):
    import jax  # noqa: F401
    import numpy as np

    from jaxtrain import get_checkpoint, get_context, report

    rank = get_context().get_world_rank()
    restored = get_checkpoint()
    if restored is not None and rank == 0:
        Path(config["out"], "restored").write_text(restored.path)
    for step in range(config["steps"]):
        with tempfile.TemporaryDirectory() as d:
            np.full(config["mib"] << 18, step + 10 * rank, dtype=np.int32).tofile(
                Path(d, f"shard-{rank}.bin"))
            report({"step": step}, checkpoint=Checkpoint.from_directory(d))


def _big_trainer(storage, tmp_path, steps):
    return JaxTrainer(_train_big, train_loop_config={"out": str(tmp_path), "steps": steps,
                                                     "mib": 40},
                      scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name="big", storage_path=storage))


def _flip_one_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_flipped_byte_in_a_checkpoint_over_64_mib_is_refused_on_resume(
        storage, tmp_path, capfd):
    _big_trainer(storage, tmp_path, steps=2).fit()
    run = Path(storage, "big")
    _flip_one_byte(run / "checkpoint_000002" / "shard-1.bin")  # 80 MiB checkpoint, same size
    capfd.readouterr()
    _big_trainer(storage, tmp_path, steps=1).fit()
    err = capfd.readouterr().err
    assert "not restoring checkpoint checkpoint_000002" in err
    assert "does not match its checksum" in err
    assert Path(tmp_path, "restored").read_text() == str(run / "checkpoint_000001")

    # When every checkpoint is refused, the run says it starts from scratch.
    for name in ("checkpoint_000001", "checkpoint_000003"):
        _flip_one_byte(run / name / "shard-0.bin")
    os.unlink(Path(tmp_path, "restored"))
    capfd.readouterr()
    _big_trainer(storage, tmp_path, steps=1).fit()
    err = capfd.readouterr().err
    assert "none of the run's 3 checkpoints can be restored; the run starts from scratch" in err
    assert not Path(tmp_path, "restored").exists()


def _ranks_at_different_steps():
    import jax  # noqa: F401

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    start = 3 + rank  # as if rank 1 had restored a later state than rank 0
    with tempfile.TemporaryDirectory() as d:
        Path(d, f"shard-{rank}.bin").write_text(str(start))
        report({"step": start}, checkpoint=Checkpoint.from_directory(d),
               checkpoint_dir_name=f"step_{start}")


def test_ranks_at_different_steps_in_one_round_are_an_error_and_never_committed(storage):
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(_ranks_at_different_steps, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="split", storage_path=storage)).fit()
    assert e.value.cause == "checkpoint"
    assert "rank 0 names it 'step_3' and rank 1 'step_4'" in str(e.value)
    assert "none of them was committed" in str(e.value)
    run = Path(storage, "split")
    assert not (run / "step_3").exists() and not (run / "step_4").exists()
    assert json.loads((run / "run.json").read_text())["status"] == "ERRORED"


def _index_blocked(config):
    import jax  # noqa: F401

    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    if get_checkpoint() is not None:
        Path(config["out"], f"restored-{ctx.get_world_rank()}").write_text(get_checkpoint().path)
        report({"step": 1})
        return
    if ctx.get_world_rank() == 0:
        # A directory where the controller (this worker's parent, the driver) writes the new
        # index before renaming it into place: checkpoints.json cannot be written, as on a full
        # disk.
        Path(ctx.run_dir, f"checkpoints.json.tmp.{os.getppid()}").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        Path(d, f"shard-{ctx.get_world_rank()}.bin").write_text("s")
        report({"step": 0}, checkpoint=Checkpoint.from_directory(d))


def test_an_index_that_cannot_be_written_is_reported_as_what_it_is(storage, tmp_path):
    def trainer():
        return JaxTrainer(_index_blocked, train_loop_config={"out": str(tmp_path)},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="noindex", storage_path=storage))

    with pytest.raises(TrainingFailedError) as e:
        trainer().fit()
    run = Path(storage, "noindex")
    ckpt = run / "checkpoint_000001"
    message = str(e.value)
    assert f"is committed as '{ckpt}', but the index checkpoints.json could not be updated" in (
        message)
    assert "could not be committed" not in message
    # What the message says is true: the checkpoint is complete, and its round is recorded.
    _core.verify_checkpoint(str(ckpt), True)
    lines = [json.loads(x) for x in (run / "result.jsonl").read_text().splitlines()]
    assert lines[-1]["checkpoint"] == "checkpoint_000001"
    # With the obstacle gone, resuming by name picks the checkpoint up.
    [obstacle] = run.glob("checkpoints.json.tmp.*")
    obstacle.rmdir()
    trainer().fit()
    assert Path(tmp_path, "restored-1").read_text() == str(ckpt)
    assert Result.from_path(run).checkpoint.path == str(ckpt)  # the index was rewritten
