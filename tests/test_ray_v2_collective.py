"""ray.train.collective as a Ray Train V2 script of 2026 uses it, with its imports changed:
barrier() and broadcast_from_rank_zero() on 4 CPU workers, through the controller (before and
after JAX collectives), and the ways a group can get them wrong: ranks making different calls, a
rank that fails while the others wait, data too large, a call outside the training function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_driver

# The Ray script's imports, changed:
#   import ray.train
#   from ray.train import RunConfig, ScalingConfig, FailureConfig
#   from ray.train.v2.jax import JaxTrainer
#   from ray.train.collective import barrier, broadcast_from_rank_zero
IMPORTS = """
import json, os, random, uuid

import jaxtrain as train
from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig
from jaxtrain.collective import barrier, broadcast_from_rank_zero
"""


def test_rank_zero_broadcasts_a_seed_and_a_path_and_barriers_order_the_files(tmp_path: Path):
    out = tmp_path / "out"
    proc = run_driver(IMPORTS + f"""
def train_func(config):
    rank = train.get_context().get_world_rank()
    world_size = train.get_context().get_world_size()
    # Before any JAX use: rank 0 picks the seed and the directory every rank writes to.
    if rank == 0:
        try:  # too large for a broadcast: refused on rank 0 before anything is sent
            broadcast_from_rank_zero(b"x" * (2 << 20))
        except ValueError as e:
            too_large = str(e)
        plan = {{"seed": random.randrange(1 << 30),
                 "dir": os.path.join(config["out"], uuid.uuid4().hex)}}
        os.makedirs(plan["dir"])
    else:
        plan = None
    plan = broadcast_from_rank_zero(plan)
    with open(os.path.join(plan["dir"], f"before-{{rank}}"), "w") as f:
        f.write(str(plan["seed"]))
    barrier()
    # Every rank wrote its file before any rank passed the barrier.
    seen = sorted(n for n in os.listdir(plan["dir"]) if n.startswith("before-"))
    assert seen == [f"before-{{r}}" for r in range(world_size)], seen

    # A JAX collective, then the controller's again.
    import jax
    import jax.numpy as jnp
    total = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(
        jnp.array([jax.process_index()] * jax.local_device_count()))
    step = broadcast_from_rank_zero(int(total[0]) if rank == 0 else None)
    barrier()
    with open(os.path.join(plan["dir"], f"after-{{rank}}"), "w") as f:
        json.dump({{"seed": plan["seed"], "step": step}}, f)
    barrier()
    train.report({{"seed": plan["seed"], "dir": plan["dir"], "psum": step,
                   "too_large": too_large if rank == 0 else None}})


trainer = JaxTrainer(
    train_func,
    train_loop_config={{"out": {str(out)!r}}},
    scaling_config=ScalingConfig(num_workers=4),
    run_config=RunConfig(name="collective", storage_path={str(tmp_path / "runs")!r}),
)
result = trainer.fit()
print("METRICS", json.dumps(result.metrics))
""", tmp_path)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(proc.stdout.split("METRICS ", 1)[1])
    assert metrics["psum"] == 6  # 0 + 1 + 2 + 3
    assert "2097" in metrics["too_large"] and "limit of 1048576" in metrics["too_large"]
    assert "write large data to a file and broadcast its path" in metrics["too_large"]
    shared = Path(metrics["dir"])
    assert shared.parent == out
    for rank in range(4):
        assert (shared / f"before-{rank}").read_text() == str(metrics["seed"])
        after = json.loads((shared / f"after-{rank}").read_text())
        assert after == {"seed": metrics["seed"], "step": 6}


def run_failing(train_func: str, tmp_path: Path, num_workers: int = 4) -> str:
    """Runs the script with `train_func`, which must fail the run (no restarts); the driver's
    stdout: "FAILED <cause> <rank>" and the error's text."""
    proc = run_driver(IMPORTS + train_func + f"""

trainer = JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers={num_workers}),
                     run_config=RunConfig(name="fails", storage_path={str(tmp_path)!r},
                                          failure_config=FailureConfig(max_failures=0)))
try:
    trainer.fit()
except train.TrainingFailedError as e:
    print("FAILED", e.cause, e.rank)
    print(e)
""", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "FAILED " in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_ranks_calling_different_collectives_fail_naming_the_ranks_and_calls(tmp_path: Path):
    out = run_failing("""
def train_func():
    if train.get_context().get_world_rank() == 2:
        barrier()
    else:
        broadcast_from_rank_zero("a value")
    train.report({"done": 1})
""", tmp_path)
    assert "FAILED exception" in out
    assert "the ranks made different collective calls as their call 1" in out
    assert "called barrier()" in out
    assert "called broadcast_from_rank_zero()" in out
    assert "every rank must make the same jaxtrain.collective calls in the same order" in out


def test_a_rank_that_raises_while_the_others_wait_ends_the_run_with_its_error(tmp_path: Path):
    out = run_failing("""
def train_func():
    if train.get_context().get_world_rank() == 2:
        raise RuntimeError("rank 2 could not load its shard")
    barrier()
    train.report({"passed": 1})
""", tmp_path)
    assert "FAILED exception 2" in out
    assert "RuntimeError: rank 2 could not load its shard" in out


def test_a_rank_that_returns_while_the_others_wait_fails_the_run(tmp_path: Path):
    out = run_failing("""
def train_func():
    if train.get_context().get_world_rank() != 1:
        barrier()
""", tmp_path, num_workers=2)
    assert "FAILED exception 1" in out
    # Whichever the controller hears first, rank 1's return or rank 0's call, rank 1 is blamed.
    assert ("rank 1's training function returned without calling barrier() (collective call 1); "
            "waiting in it: rank 0") in out or \
        ("rank 0 called barrier() (collective call 1) after rank 1's training function had "
         "returned without making it") in out, out


@pytest.mark.parametrize("name,args", [("barrier", ()), ("broadcast_from_rank_zero", (1,))])
def test_a_collective_outside_the_training_function_says_where_it_works(name, args):
    import jaxtrain.collective

    with pytest.raises(RuntimeError, match=rf"jaxtrain\.collective\.{name}\(\) works only inside "
                                           "the training function"):
        getattr(jaxtrain.collective, name)(*args)
