"""The data position in the checkpoint, end to end with real JAX workers: Ray Train (2026) scripts
with their imports changed to jaxtrain, on 2 CPU workers, iterating N distinct samples with a
checkpoint every K steps.

A rank is SIGKILLed in the middle of an epoch (once, in attempt 0), or the run stops mid-epoch
and a second fit() resumes it by name. Every report carries the ids of the samples each rank
trained on in that step (gathered to rank 0, whose metrics are the run's), so result.jsonl says
what each rank consumed: counting the rounds up to the restored checkpoint and then those of the
next attempt or run, every sample of every epoch is seen exactly once, with or without shuffling,
for a jaxtrain.data.DataLoader and for a Grain DataLoader registered with data.track()."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

N = 32  # distinct samples
GLOBAL_BATCH = 4
STEPS_PER_EPOCH = N // GLOBAL_BATCH
EPOCHS = 2
EVERY = 3  # steps between checkpoints
WORKERS = 2

# --- the Ray Train scripts (imports changed: `import ray` -> `import jaxtrain as ray`,
# `from ray.train import ...` -> `from jaxtrain.train import ...`, TorchTrainer -> JaxTrainer;
# Ray Data's get_dataset_shard -> jaxtrain.data) -------------------------------------------------


def train_func(config):
    import os
    import signal
    import tempfile
    import time

    import numpy as np
    from jax.experimental import multihost_utils

    import jaxtrain as ray
    from jaxtrain import data
    from jaxtrain.train import Checkpoint

    context = ray.train.get_context()
    rank = context.get_world_rank()
    samples = {"id": np.arange(config["n"])}
    loader = data.DataLoader(samples, global_batch_size=config["batch"],
                             shuffle=config["shuffle"], seed=1234)

    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            with open(os.path.join(checkpoint_dir, "state.json")) as f:
                step = json.load(f)["step"]

    for epoch in range(loader.epoch, config["epochs"]):  # the loader knows where it stopped
        for batch in loader:
            step += 1
            ids = multihost_utils.process_allgather(batch["id"])  # every rank's samples
            metrics = {"epoch": epoch, "step": step, "attempt": context.get_attempt(),
                       "ids": np.asarray(ids).reshape(context.get_world_size(), -1).tolist()}
            if step % config["every"] == 0:
                with tempfile.TemporaryDirectory() as checkpoint_dir:
                    checkpoint = None
                    if rank == 0:  # Ray's pattern: one rank saves the (replicated) model
                        with open(os.path.join(checkpoint_dir, "state.json"), "w") as f:
                            json.dump({"step": step}, f)
                        checkpoint = Checkpoint.from_directory(checkpoint_dir)
                    ray.train.report(metrics, checkpoint=checkpoint)
            else:
                ray.train.report(metrics)
            if step == config.get("kill_at") and context.get_attempt() == 0:
                multihost_utils.sync_global_devices("reported")
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)  # "in a collective" until the group is stopped
            if step == config.get("stop_at"):
                return


def train_func_grain(config):
    import os
    import signal
    import tempfile
    import time

    import grain
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxtrain as ray
    from jaxtrain import data
    from jaxtrain.train import Checkpoint

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    sampler = grain.samplers.IndexSampler(
        num_records=config["n"], num_epochs=config["epochs"], shuffle=True, seed=99,
        shard_options=grain.sharding.ShardOptions(shard_index=rank, shard_count=world,
                                                  drop_remainder=True))
    loader = grain.DataLoader(
        data_source=np.arange(config["n"]), sampler=sampler, worker_count=0,
        operations=[grain.transforms.Batch(batch_size=config["batch"] // world)])
    iterator = data.track(iter(loader))  # positioned from get_checkpoint() after a restart

    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            with open(os.path.join(checkpoint_dir, "state.json")) as f:
                step = json.load(f)["step"]

    steps_per_epoch = config["n"] // config["batch"]
    for batch in iterator:
        step += 1
        ids = multihost_utils.process_allgather(batch)
        metrics = {"epoch": (step - 1) // steps_per_epoch, "step": step,
                   "attempt": context.get_attempt(),
                   "ids": np.asarray(ids).reshape(world, -1).tolist()}
        if step % config["every"] == 0:
            # Every rank passes its part: a Grain iterator's position differs by rank.
            with tempfile.TemporaryDirectory() as checkpoint_dir:
                if rank == 0:
                    with open(os.path.join(checkpoint_dir, "state.json"), "w") as f:
                        json.dump({"step": step}, f)
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(checkpoint_dir))
        else:
            ray.train.report(metrics)
        if step == config.get("kill_at") and context.get_attempt() == 0:
            multihost_utils.sync_global_devices("reported")
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # "in a collective" until the group is stopped


# --- the tests ----------------------------------------------------------------------------------


def _config(**extra):
    return dict({"n": N, "batch": GLOBAL_BATCH, "epochs": EPOCHS, "every": EVERY,
                 "shuffle": False}, **extra)


def _fit(func, storage, name, config, max_failures=0):
    return JaxTrainer(
        func, train_loop_config=config, scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(name=name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures)),
    ).fit()


def _lines(result):
    return [json.loads(x) for x in Path(result.path, "result.jsonl").read_text().splitlines()]


def _round_of(lines, checkpoint):
    return next(x["round"] for x in lines if x.get("checkpoint") == checkpoint)


def _assert_each_sample_once_per_epoch(kept):
    """`kept`: the result.jsonl lines of the training that counts. Every rank consumed its
    share of every epoch, and together they saw each sample of every epoch once."""
    assert [x["metrics"]["step"] for x in kept] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    for epoch in range(EPOCHS):
        rows = [x["metrics"] for x in kept if x["metrics"]["epoch"] == epoch]
        assert len(rows) == STEPS_PER_EPOCH, epoch
        per_rank = collections.Counter()
        seen = collections.Counter()
        for m in rows:
            for rank, ids in enumerate(m["ids"]):
                per_rank[rank] += len(ids)
                seen.update(ids)
        assert per_rank == {r: N // WORKERS for r in range(WORKERS)}, epoch
        assert seen == {i: 1 for i in range(N)}, (epoch, seen)


def _assert_restarted_mid_epoch(result, kill_at):
    run = json.loads(Path(result.path, "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    assert run["attempts"][0]["failure"]["rank"] == 1
    lines = _lines(result)
    restored = Path(run["attempts"][1]["restored_from"]).name
    cut = _round_of(lines, restored)
    before = [x for x in lines if x["metrics"]["attempt"] == 0]
    after = [x for x in lines if x["metrics"]["attempt"] == 1]
    # Attempt 0 trained past its last checkpoint, in the middle of the epoch, before the kill.
    last = kill_at // EVERY * EVERY
    assert [x["metrics"]["step"] for x in before][-1] >= kill_at - 1 > last
    assert last % STEPS_PER_EPOCH != 0 and [x["metrics"]["step"] for x in before
                                            if x["round"] == cut] == [last]
    assert after[0]["metrics"]["step"] == last + 1
    _assert_each_sample_once_per_epoch([x for x in before if x["round"] <= cut] + after)


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_a_rank_killed_mid_epoch_resumes_its_epoch_where_the_checkpoint_was(
        shuffle, storage):
    kill_at = 5  # epoch 0 has steps 1-8; the checkpoint of step 3 is restored
    result = _fit(train_func, storage, f"killed-{shuffle}",
                  _config(shuffle=shuffle, kill_at=kill_at), max_failures=1)
    _assert_restarted_mid_epoch(result, kill_at)
    if shuffle:  # the epochs are drawn anew, and the same in every run
        epochs = [[i for x in _lines(result) if x["metrics"]["epoch"] == e
                   and x["metrics"]["attempt"] == 1 for ids in x["metrics"]["ids"] for i in ids]
                  for e in range(EPOCHS)]
        assert epochs[1] != sorted(epochs[1])


def test_a_run_resumed_by_name_goes_on_mid_epoch(storage):
    first = _fit(train_func, storage, "resumed", _config(shuffle=True, stop_at=12))
    assert first.metrics["step"] == 12 and first.checkpoint.path.endswith("checkpoint_000012")
    second = _fit(train_func, storage, "resumed", _config(shuffle=True))
    lines = _lines(second)
    assert lines[11]["metrics"]["step"] == 12 and lines[12]["metrics"]["step"] == 13
    _assert_each_sample_once_per_epoch(lines)
    # The position is in rank 0's part, and committed with it.
    manifest = json.loads(Path(first.checkpoint.path, ".jaxtrain_manifest.json").read_text())
    assert {f["path"] for f in manifest["file_list"]} == {"state.json",
                                                           ".jaxtrain_data/rank-0.json"}


def test_a_tracked_grain_iterator_resumes_mid_epoch(storage):
    pytest.importorskip("grain")
    kill_at = 11  # epoch 1 has steps 9-16; the checkpoint of step 9 is restored
    result = _fit(train_func_grain, storage, "grain", _config(kill_at=kill_at), max_failures=1)
    _assert_restarted_mid_epoch(result, kill_at)
    manifest = json.loads(Path(result.checkpoint.path, ".jaxtrain_manifest.json").read_text())
    assert {f["path"] for f in manifest["file_list"]} >= {
        f".jaxtrain_data/rank-{r}.json" for r in range(WORKERS)}


def test_positions_are_read_from_the_rank_or_else_the_lowest_rank_on_any_filesystem(tmp_path):
    import fsspec

    from jaxtrain import Checkpoint, data

    def write(fs, root, rank, positions):
        fs.makedirs(f"{root}/.jaxtrain_data", exist_ok=True)
        fs.pipe_file(f"{root}/.jaxtrain_data/rank-{rank}.json",
                     json.dumps({"version": 1, "rank": rank, "positions": positions}).encode())

    local = fsspec.filesystem("file")
    memory = fsspec.filesystem("memory")
    for fs, root, remote in ((local, str(tmp_path / "c"), None),
                             (memory, "/datapos/c", memory)):
        write(fs, root, 1, {"#0": data._encode(b"grain state of 1")})
        write(fs, root, 3, {"#0": data._encode({"next_index": 3})})
        checkpoint = Checkpoint(root, filesystem=remote)
        positions, rank, _ = data._read_positions(checkpoint, 3)
        assert rank == 3 and data._decode(positions["#0"]) == {"next_index": 3}
        positions, rank, _ = data._read_positions(checkpoint, 0)  # none of its own: rank 1's
        assert rank == 1 and data._decode(positions["#0"]) == b"grain state of 1"
    assert data._read_positions(Checkpoint(str(tmp_path)), 0) == ({}, None, None)


class _Position:
    """An iterator with a position, as a Grain one has: get_state / set_state."""

    def __init__(self, state=None):
        self.state = state

    def __iter__(self):
        return self

    def __next__(self):
        raise StopIteration

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def test_a_shards_position_saved_at_another_world_size_is_refused_after_a_resize(tmp_path):
    import types

    import numpy as np

    from jaxtrain import Checkpoint, data

    def registry(rank, world_size, checkpoint=None):
        context = types.SimpleNamespace(world_rank=rank, world_size=world_size)
        return data._Registry(types.SimpleNamespace(context=context, checkpoint=checkpoint))

    saved = tmp_path / "c"
    for rank in range(4):  # a checkpoint of 4 processes, each with its shard's position
        writer = registry(rank, 4)
        writer.tracked = {"#0": _Position({"shard": rank, "next": 7}),
                          "loader": data.DataLoader(np.arange(16), 8, index=rank, count=4)}
        writer.save(str(tmp_path / f"staged-{rank}"))  # each rank's part, then committed
        (saved / ".jaxtrain_data").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"staged-{rank}/.jaxtrain_data/rank-{rank}.json").rename(
            saved / f".jaxtrain_data/rank-{rank}.json")
    assert json.loads((saved / ".jaxtrain_data/rank-1.json").read_text())["world_size"] == 4
    checkpoint = Checkpoint(str(saved))
    same = registry(1, 4, checkpoint)
    restored = _Position()
    same.restore("#0", restored)
    assert restored.state == {"shard": 1, "next": 7}
    resized = registry(1, 2, checkpoint)  # the run shrank to 2 processes
    loader = data.DataLoader(np.arange(16), 8, index=1, count=2)
    resized.restore("loader", loader)  # a DataLoader's position is the same at any count
    with pytest.raises(RuntimeError, match=r"iterator '#0' .* is that of rank 1's shard of 4 "
                                           r"processes, and this attempt has 2 \(the run was "
                                           r"resized"):
        resized.restore("#0", _Position())


def test_a_data_loader_resumes_its_epoch_and_refuses_a_position_of_other_data():
    import numpy as np

    from jaxtrain import data

    x = np.arange(12)
    first = data.DataLoader(x, 4, shuffle=True, seed=5, index=1, count=2)
    whole = [b.tolist() for b in first]  # epoch 0
    batches = iter(first)
    done = [next(batches).tolist()]  # epoch 1, one batch
    state = first.get_state()
    assert (state["epoch"], state["step"]) == (1, 1)
    second = data.DataLoader(x, 4, shuffle=True, seed=5, index=1, count=2)
    second.set_state(state)
    assert second.epoch == 1
    rest = [b.tolist() for b in second]
    assert len(rest) == 2 and done + rest != whole  # epoch 1 is drawn anew
    assert done + rest == [b.tolist() for b in data.iter_batches(
        x, 4, index=1, count=2, shuffle=True, seed=5, epoch=1)]
    assert [b.tolist() for b in first] == [  # the pass left early is over: epoch 2 comes
        b.tolist() for b in data.iter_batches(x, 4, index=1, count=2, shuffle=True, seed=5,
                                              epoch=2)]
    assert (first.get_state()["epoch"], first.get_state()["step"]) == (3, 0)
    with pytest.raises(ValueError, match="seed=5, and this loader has seed=6"):
        data.DataLoader(x, 4, shuffle=True, seed=6).set_state(state)
    with pytest.raises(TypeError, match="a list has no get_state"):
        data.track([1, 2])
