"""JaxTrainer's arguments that come from Ray: ``resume_from_checkpoint``, and the Ray-only ones
that jaxtrain refuses with a message (docs/ray-differences.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxtrain.checkpoint import Checkpoint

# What to do instead of Ray's JaxConfig (JaxTrainer(jax_config=...), ``from ... import JaxConfig``).
JAX_CONFIG_INSTEAD = (
    "jaxtrain sets up jax.distributed on every worker from scaling_config (use_tpu / use_gpu, or "
    "CPU processes by default); drop jax_config and JaxConfig")


def no_jax_config(module: str, name: str) -> ImportError:
    """The error of ``from <module> import <name>`` for Ray's JaxConfig: what to do instead."""
    return ImportError(f"{module}.{name}: jaxtrain has no {name}: {JAX_CONFIG_INSTEAD} "
                       "(docs/ray-differences.md)", name=module)


class StartFrom:
    """The training function of a trainer given ``resume_from_checkpoint``: runs in the worker,
    where it makes ``get_checkpoint()`` return that checkpoint while the run has none of its
    own."""

    def __init__(self, fn: Callable[..., Any], checkpoint: Checkpoint) -> None:
        self.fn = fn
        self.checkpoint = checkpoint

    def __call__(self, *args: Any) -> Any:
        from jaxtrain import session

        current = session.require("get_checkpoint")
        if current.checkpoint is None:
            current.checkpoint = self.checkpoint
        return self.fn(*args)


def check(resume_from_checkpoint: Any, jax_config: Any, datasets: Any,
          dataset_config: Any) -> None:
    """Refuses what jaxtrain does not take, each with what to do instead."""
    if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint,
                                                             Checkpoint):
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not allowed; pass a "
            "jaxtrain.Checkpoint (Checkpoint.from_directory(path), or Result.checkpoint)"
        )
    if jax_config is not None:
        raise ValueError(
            f"JaxTrainer(jax_config={jax_config!r}) is not supported: {JAX_CONFIG_INSTEAD}"
        )
    if datasets is not None or dataset_config is not None:
        given = "datasets" if datasets is not None else "dataset_config"
        raise ValueError(
            f"JaxTrainer({given}=...) is not supported: jaxtrain has no Ray Data. Pass arrays, "
            "file lists or a loader in train_loop_config and give each process its shard with "
            "jaxtrain.data.shard() / jaxtrain.data.iter_batches() (see docs/data.md)"
        )
