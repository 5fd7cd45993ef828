"""jaxtrain.data: sharding by process, and global batches built across 4 real JAX processes that
equal the batches of a single process."""

from __future__ import annotations

import numpy as np
import pytest

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, data


def test_an_array_is_split_by_rows_with_equal_parts():
    x = np.arange(10)
    assert [data.shard(x, index=i, count=4).tolist() for i in range(4)] == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    assert data.shard(x, index=1, count=4, drop_remainder=False).tolist() == [1, 5, 9]


def test_files_and_iterables_are_split_by_position():
    files = [f"part-{i}.parquet" for i in range(5)]
    assert data.shard(files, index=0, count=2) == ["part-0.parquet", "part-2.parquet",
                                                    "part-4.parquet"]
    assert list(data.shard((i * i for i in range(7)), index=2, count=3)) == [4, 25]


@pytest.mark.parametrize("kwargs,fragment", [
    ({"index": 4, "count": 4}, "need 0 <= index < count"),
    ({"index": 1}, "give both index and count"),
    ({"index": 0, "count": True}, "count=True is not allowed"),
])
def test_bad_positions_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        data.shard([1, 2], **kwargs)


def test_iter_batches_gives_each_process_its_rows_of_every_global_batch():
    x = {"x": np.arange(20), "y": -np.arange(20)}
    parts = [list(data.iter_batches(x, 8, index=i, count=4)) for i in range(4)]
    assert [len(p) for p in parts] == [2, 2, 2, 2]  # 20 rows: 2 full batches, 4 dropped
    for step in range(2):
        joined = np.concatenate([parts[i][step]["x"] for i in range(4)])
        assert joined.tolist() == list(range(step * 8, step * 8 + 8))
    with pytest.raises(ValueError, match="global_batch_size=6 is not allowed with 4 processes"):
        next(data.iter_batches(x, 6, index=0, count=4))
    with pytest.raises(ValueError, match="last batch has 4 rows"):
        list(data.iter_batches(np.arange(12), 8, index=0, count=8, drop_last=False))


def _global_batches(config):
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxtrain import data, report

    x = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)  # every process has the dataset
    mesh = data.mesh()
    for step, local in enumerate(data.iter_batches(x, global_batch_size=16)):
        batch = data.global_batch(local, mesh)
        assert batch.shape == (16, 3) and len(batch.addressable_shards) == 1
        whole = multihost_utils.process_allgather(batch, tiled=True)
        # The global batch is the one a single process reading x in order would see.
        np.testing.assert_array_equal(whole, x[step * 16:(step + 1) * 16])
        total = jax.jit(lambda b: b.sum())(batch)
        report({"step": step, "sum": float(total), "processes": jax.process_count(),
                "rows": int(local.shape[0])})


def test_global_batches_over_four_processes_equal_the_single_process_batches(storage):
    result = JaxTrainer(
        _global_batches, scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(name="data", storage_path=storage),
    ).fit()
    x = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)
    frame = result.metrics_dataframe
    assert frame["sum"].tolist() == [float(x[s * 16:(s + 1) * 16].sum()) for s in range(3)]
    assert result.metrics["processes"] == 4 and result.metrics["rows"] == 4
