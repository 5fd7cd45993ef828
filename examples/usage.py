# The README's usage example, as it is there: a linear model trained SPMD on 2 CPU processes,
# gradients averaged across them, a checkpoint every step. Run it again to resume the run.
import json
import tempfile
from pathlib import Path

import numpy as np

from jaxtrain import (JaxTrainer, ScalingConfig, RunConfig, FailureConfig, CheckpointConfig,
                      Checkpoint, report, get_context, get_checkpoint)


def train_func(config):
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    # jax.distributed is already initialised: jax.process_count() == 2 here.
    rank = get_context().get_world_rank()
    x = np.random.default_rng(rank).normal(size=(64, 3))  # this rank's data
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    params, start = {"w": jnp.zeros(3), "b": jnp.zeros(())}, 0
    if (ckpt := get_checkpoint()) is not None:      # after a restart, or when resuming by name
        with ckpt.as_directory() as d:
            start = json.loads(Path(d, "step.json").read_text())["step"] + 1
            params = {k: jnp.asarray(v) for k, v in np.load(Path(d, f"rank-{rank}.npz")).items()}

    def loss_fn(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    for step in range(start, config["steps"]):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        # Every rank's gradients, averaged: the same update on every rank.
        grads = jax.tree.map(lambda g: multihost_utils.process_allgather(g).mean(0), grads)
        params = jax.tree.map(lambda p, g: p - config["lr"] * g, params, grads)
        with tempfile.TemporaryDirectory() as d:
            np.savez(Path(d, f"rank-{rank}.npz"), **params)  # each rank its own files
            if rank == 0:
                Path(d, "step.json").write_text(json.dumps({"step": step}))
            report({"loss": float(loss), "step": step}, checkpoint=Checkpoint.from_directory(d),
                   checkpoint_dir_name=f"step_{step}")  # else checkpoint_<round>, from 1


result = JaxTrainer(
    train_func,
    train_loop_config={"steps": 20, "lr": 0.1},
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(
        name="my_run",  # storage_path: ~/jaxtrain_results; across hosts NFS, s3://, gs://
        failure_config=FailureConfig(max_failures=3),
        checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                                           checkpoint_score_order="min"),
    ),
).fit()
print(result.metrics, result.checkpoint, result.best_checkpoints)
print(result.metrics_dataframe)
