"""TPU slices and GPUs without the hardware: a host description (JAXTRAIN_HOSTS) describes hosts,
chips and slices this machine does not have, placement plans for them exactly as for real ones, and
the simulate switch (JAXTRAIN_SIMULATE=1) runs the planned workers as real JAX CPU processes with
the planned environment. Every end-to-end run has each rank report its environment and join one
collective with the others; the test asserts both."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, _core

# What a worker reports of its environment.
_REPORTED_PREFIXES = ("TPU_", "MEGASCALE_")
_REPORTED_NAMES = ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")


def _report_environment(config):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import get_context
    from jaxtrain.worker.entry import _local_device_ids

    ctx = get_context()
    mesh = Mesh(np.array(jax.devices()), ("ranks",))
    local = np.array([float(ctx.get_world_rank())])
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("ranks")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(arr)
    seen = {
        "rank": ctx.get_world_rank(),
        "local_rank": ctx.get_local_rank(),
        "local_world_size": ctx.get_local_world_size(),
        "node_rank": ctx.get_node_rank(),
        "process_index": jax.process_index(),
        "platform": jax.devices()[0].platform,
        "psum": float(total),
        "cuda_local_device_ids": _local_device_ids("cuda"),
        "env": {
            k: v for k, v in os.environ.items()
            if k.startswith(_REPORTED_PREFIXES) or k in _REPORTED_NAMES
        },
    }
    Path(config["out"], f"rank-{ctx.get_world_rank()}.json").write_text(json.dumps(seen))


@pytest.fixture
def clean_env(monkeypatch):
    """No accelerator variables inherited from whoever runs the tests."""
    for name in list(os.environ):
        if name.startswith(_REPORTED_PREFIXES) or name in _REPORTED_NAMES or name in (
            "JAXTRAIN_HOSTS", "JAXTRAIN_SIMULATE"
        ):
            monkeypatch.delenv(name)
    return monkeypatch


def _describe(tmp_path: Path, hosts: list[dict]) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"hosts": hosts}))
    return str(path)


def _tpu_slice(name: str, ip_prefix: str, hosts: int, chips: int, accelerator_type: str,
               topology: str, worker_ids=None) -> list[dict]:
    return [
        {"name": f"{name}-{w}", "address": f"{ip_prefix}.{w + 1}",
         "tpu": {"chips": chips, "slice": name, "worker_id": w,
                 "accelerator_type": accelerator_type, "topology": topology}}
        for w in (worker_ids if worker_ids is not None else range(hosts))
    ]


def _tpu(num_workers: int, topology: str, accelerator_type: str, **kwargs) -> ScalingConfig:
    return ScalingConfig(num_workers=num_workers, use_tpu=True, topology=topology,
                         accelerator_type=accelerator_type, **kwargs)


def _simulate(tmp_path, storage, env, hosts, scaling_config, name, inherited=None) -> list[dict]:
    """Runs _report_environment on the described hosts, simulated; returns each rank's report."""
    env.setenv("JAXTRAIN_HOSTS", _describe(tmp_path, hosts))
    env.setenv("JAXTRAIN_SIMULATE", "1")
    for key, value in (inherited or {}).items():
        env.setenv(key, value)
    out = tmp_path / name
    out.mkdir()
    JaxTrainer(
        _report_environment,
        train_loop_config={"out": str(out)},
        scaling_config=scaling_config,
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()
    reports = [json.loads((out / f"rank-{r}.json").read_text())
               for r in range(scaling_config.num_workers)]
    n = scaling_config.num_workers
    for r, seen in enumerate(reports):
        assert seen["rank"] == seen["process_index"] == r
        assert seen["platform"] == "cpu"
        assert seen["psum"] == n * (n - 1) / 2  # one jax.distributed job despite the TPU variables
        assert seen["env"]["JAX_PLATFORMS"] == "cpu"
    return reports


def test_one_v6e_8_host_gives_its_worker_the_whole_host(tmp_path, storage, clean_env):
    hosts = [{"name": "v6e-0", "address": "10.0.0.1",
              "tpu": {"chips": 8, "accelerator_type": "v6e-8", "topology": "2x4"}}]
    scaling = _tpu(1, "2x4", "TPU-V6E")
    # Left over from some earlier partial-host or multi-slice job: must not reach the worker.
    stale = {"TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1",
             "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_ID": "3"}
    [seen] = _simulate(tmp_path, storage, clean_env, hosts, scaling, "v6e", stale)
    assert seen["env"] == {
        "JAX_PLATFORMS": "cpu",
        "TPU_ACCELERATOR_TYPE": "v6e-8",
        "TPU_TOPOLOGY": "2x4",
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "10.0.0.1",
        "TPU_SKIP_MDS_QUERY": "1",
    }
    assert (seen["local_rank"], seen["local_world_size"], seen["node_rank"]) == (0, 1, 0)
    plan = _core.plan_local(scaling._core).to_dict()
    assert plan["workers"][0]["devices"] == [str(c) for c in range(8)]
    assert plan["workers"][0]["slice"] == "v6e-0"


def test_a_v4_2x2x4_slice_spans_four_hosts_one_worker_each(tmp_path, storage, clean_env):
    hosts = _tpu_slice("v4", "10.1.0", 4, 4, "v4-32", "2x2x4")
    scaling = _tpu(4, "2x2x4", "TPU-V4")
    stale = {"MEGASCALE_COORDINATOR_ADDRESS": "10.9.9.9", "MEGASCALE_NUM_SLICES": "2",
             "MEGASCALE_SLICE_ID": "1"}
    reports = _simulate(tmp_path, storage, clean_env, hosts, scaling, "v4", stale)
    for rank, seen in enumerate(reports):
        assert seen["env"] == {
            "JAX_PLATFORMS": "cpu",
            "TPU_ACCELERATOR_TYPE": "v4-32",
            "TPU_TOPOLOGY": "2x2x4",
            "TPU_WORKER_ID": str(rank),
            "TPU_WORKER_HOSTNAMES": "10.1.0.1,10.1.0.2,10.1.0.3,10.1.0.4",
            "TPU_SKIP_MDS_QUERY": "1",
        }
        assert (seen["local_rank"], seen["local_world_size"], seen["node_rank"]) == (0, 1, rank)


def test_two_v4_2x2x2_slices_form_one_multislice_job(tmp_path, storage, clean_env):
    # Listed interleaved and out of worker-id order: each slice still gets a contiguous rank range.
    a = _tpu_slice("slice-a", "10.2.0", 2, 4, "v4-16", "2x2x2")
    b = _tpu_slice("slice-b", "10.2.1", 2, 4, "v4-16", "2x2x2", worker_ids=[1, 0])
    hosts = [a[1], b[0], a[0], b[1]]
    scaling = _tpu(4, "2x2x2", "TPU-V4")
    assert scaling.num_slices == 2
    reports = _simulate(tmp_path, storage, clean_env, hosts, scaling, "multislice")
    expected = [  # (slice id, worker id, hostnames)
        (0, 0, "10.2.0.1,10.2.0.2"), (0, 1, "10.2.0.1,10.2.0.2"),
        (1, 0, "10.2.1.1,10.2.1.2"), (1, 1, "10.2.1.1,10.2.1.2"),
    ]
    for rank, seen in enumerate(reports):
        slice_id, worker_id, hostnames = expected[rank]
        assert seen["env"] == {
            "JAX_PLATFORMS": "cpu",
            "TPU_ACCELERATOR_TYPE": "v4-16",
            "TPU_TOPOLOGY": "2x2x2",
            "TPU_WORKER_ID": str(worker_id),
            "TPU_WORKER_HOSTNAMES": hostnames,
            "TPU_SKIP_MDS_QUERY": "1",
            "MEGASCALE_COORDINATOR_ADDRESS": "10.2.0.1",  # rank 0's host
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(slice_id),
            "MEGASCALE_PORT": "8081",
        }
        assert seen["node_rank"] == rank


def test_one_chip_per_worker_puts_four_workers_on_a_2x2x1_host(tmp_path, storage, clean_env):
    hosts = [{"name": "v4-8", "address": "10.3.0.1",
              "tpu": {"chips": 4, "accelerator_type": "v4-8", "topology": "2x2x1"}}]
    scaling = ScalingConfig(num_workers=4, use_tpu=True, topology="2x2x1",
                            accelerator_type="TPU-V4", resources_per_worker={"TPU": 1})
    reports = _simulate(tmp_path, storage, clean_env, hosts, scaling, "per-chip")
    for rank, seen in enumerate(reports):
        assert seen["env"] == {
            "JAX_PLATFORMS": "cpu",
            "TPU_ACCELERATOR_TYPE": "v4-8",
            "TPU_TOPOLOGY": "2x2x1",
            "TPU_VISIBLE_CHIPS": str(rank),
            "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1",
            "TPU_HOST_BOUNDS": "1,1,1",
            "TPU_WORKER_ID": "0",
            "TPU_WORKER_HOSTNAMES": "10.3.0.1",
            "TPU_SKIP_MDS_QUERY": "1",
        }
        assert (seen["local_rank"], seen["local_world_size"], seen["node_rank"]) == (rank, 4, 0)


def test_stale_megascale_values_are_overwritten_and_a_users_port_kept(tmp_path, storage,
                                                                       clean_env):
    hosts = (_tpu_slice("a", "10.4.0", 2, 4, "v4-16", "2x2x2")
             + _tpu_slice("b", "10.4.1", 2, 4, "v4-16", "2x2x2"))
    scaling = _tpu(4, "2x2x2", "TPU-V4")
    inherited = {"MEGASCALE_COORDINATOR_ADDRESS": "10.9.9.9", "MEGASCALE_NUM_SLICES": "8",
                 "MEGASCALE_SLICE_ID": "7", "MEGASCALE_PORT": "9999"}
    reports = _simulate(tmp_path, storage, clean_env, hosts, scaling, "stale", inherited)
    for rank, seen in enumerate(reports):
        megascale = {k: v for k, v in seen["env"].items() if k.startswith("MEGASCALE_")}
        assert megascale == {
            "MEGASCALE_COORDINATOR_ADDRESS": "10.4.0.1",
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(rank // 2),
            "MEGASCALE_PORT": "9999",
        }


def test_an_uneven_worker_count_is_refused_before_anything_starts(tmp_path, storage, clean_env):
    with pytest.raises(ValueError, match="num_workers=3 must be a multiple of 2"):
        ScalingConfig(num_workers=3, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4")
    with pytest.raises(ValueError, match="num_workers=6 must be a multiple of 4"):
        ScalingConfig(num_workers=6, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4",
                      resources_per_worker={"TPU": 2})
    # A description with one slice where two are needed: refused whole, before any process.
    clean_env.setenv("JAXTRAIN_HOSTS",
                     _describe(tmp_path, _tpu_slice("a", "10.5.0", 2, 4, "v4-16", "2x2x2")))
    clean_env.setenv("JAXTRAIN_SIMULATE", "1")
    scaling = _tpu(4, "2x2x2", "TPU-V4")
    with pytest.raises(RuntimeError, match=r"needs 2 whole v4-16 slices .* has 1 that fits"):
        JaxTrainer(_report_environment, train_loop_config={"out": str(tmp_path)},
                   scaling_config=scaling,
                   run_config=RunConfig(name="refused", storage_path=storage)).fit()
    assert os.listdir(storage) == []


def test_gpu_workers_get_disjoint_gpus_mapped_through_the_inherited_list(tmp_path, storage,
                                                                         clean_env):
    hosts = [{"name": "gpu-box", "address": "10.6.0.1", "gpus": 4}]
    scaling = ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2})
    reports = _simulate(tmp_path, storage, clean_env, hosts, scaling, "gpus",
                        {"CUDA_VISIBLE_DEVICES": "3,1,2,0"})
    # (TPU_SKIP_MDS_QUERY=1 is JAX's own doing: it writes it when it finds no TPU chips.)
    assert [seen["env"] for seen in reports] == [
        {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "3,1", "TPU_SKIP_MDS_QUERY": "1"},
        {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "2,0", "TPU_SKIP_MDS_QUERY": "1"},
    ]
    # On the GPUs, each worker would initialise jax.distributed with its own devices, renumbered.
    assert [seen["cuda_local_device_ids"] for seen in reports] == [[0, 1], [0, 1]]
    assert [seen["local_rank"] for seen in reports] == [0, 1]


def test_gpu_placement_follows_the_strategy_and_the_real_platform():
    hosts = json.dumps({"hosts": [{"name": "g0", "gpus": 4}, {"name": "g1", "gpus": 4}]})
    spread = ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2},
                           placement_strategy="SPREAD")
    plan = _core.plan(spread._core, hosts, {"CUDA_VISIBLE_DEVICES": "1,0,3,2"}, False).to_dict()
    assert plan["platform"] == "cuda"
    assert [(w["host"], w["devices"], w["env"]) for w in plan["workers"]] == [
        ("g0", ["1", "0"], {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "1,0"}),
        ("g1", ["1", "0"], {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "1,0"}),
    ]
    strict = ScalingConfig(num_workers=3, use_gpu=True, resources_per_worker={"GPU": 2},
                           placement_strategy="STRICT_PACK")
    with pytest.raises(RuntimeError, match="no host can take all 3"):
        _core.plan(strict._core, hosts, {}, False)
    with pytest.raises(ValueError, match="GPU'\\]=0.5"):
        _core.plan(ScalingConfig(use_gpu=True, resources_per_worker={"GPU": 0.5})._core, hosts,
                   {}, False)


def test_local_device_ids_follow_the_planned_environment(monkeypatch):
    from jaxtrain.worker.entry import _local_device_ids

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "1")
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "2,3")
    assert _local_device_ids("cuda") == [0, 1]
    assert _local_device_ids("cpu") == [0]
    assert _local_device_ids("tpu") is None  # libtpu sees only the worker's chips already


def test_the_plan_prints_without_running_anything(tmp_path, clean_env):
    hosts = (_tpu_slice("a", "10.7.0", 2, 4, "v4-16", "2x2x2")
             + _tpu_slice("b", "10.7.1", 2, 4, "v4-16", "2x2x2"))
    clean_env.setenv("JAXTRAIN_HOSTS", _describe(tmp_path, hosts))
    scaling = _tpu(4, "2x2x2", "TPU-V4")
    # Without the simulate switch these hosts are not this machine: the local launcher refuses.
    with pytest.raises(RuntimeError, match="other than this machine .a-0, a-1, b-0, b-1."):
        _core.plan_local(scaling._core)
    clean_env.setenv("JAXTRAIN_SIMULATE", "1")
    plan = json.loads(json.dumps(_core.plan_local(scaling._core).to_dict()))
    assert {k: plan[k] for k in plan if k != "workers"} == {
        "platform": "cpu", "accelerator": "tpu", "simulated": True,
        "hosts_source": f"JAXTRAIN_HOSTS={tmp_path / 'hosts.json'}", "num_slices": 2,
    }
    worker = plan["workers"][3]
    assert worker == {
        "rank": 3, "local_rank": 0, "local_world_size": 1, "node_rank": 3,
        "host": "b-1", "address": "10.7.1.2", "slice": "b", "devices": ["0", "1", "2", "3"],
        "env": {
            "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_TOPOLOGY": "2x2x2", "TPU_WORKER_ID": "1",
            "TPU_WORKER_HOSTNAMES": "10.7.1.1,10.7.1.2", "TPU_SKIP_MDS_QUERY": "1",
            "MEGASCALE_COORDINATOR_ADDRESS": "10.7.0.1", "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": "1", "MEGASCALE_PORT": "8081",
        },
        "unset_env": ["TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS"],
    }


def test_simulating_without_a_description_plans_the_smallest_fitting_hosts(clean_env):
    clean_env.setenv("JAXTRAIN_SIMULATE", "1")
    scaling = _tpu(4, "4x4", "TPU-V6E")
    plan = _core.plan_local(scaling._core).to_dict()
    assert plan["hosts_source"] == "the simulated hosts"
    assert [w["host"] for w in plan["workers"]] == [f"sim-slice-0-host-{h}" for h in range(4)]
    assert plan["workers"][2]["env"]["TPU_WORKER_ID"] == "2"


def test_a_broken_description_names_the_file_and_the_field(tmp_path, clean_env):
    clean_env.setenv("JAXTRAIN_HOSTS", _describe(tmp_path, [{"name": "a", "gpu": 4}]))
    with pytest.raises(ValueError, match=r'hosts\[0\] \("a"\): unknown key "gpu"'):
        _core.plan_local(ScalingConfig()._core)
    clean_env.setenv("JAXTRAIN_HOSTS", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json cannot be read"):
        _core.plan_local(ScalingConfig()._core)
