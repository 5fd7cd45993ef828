"""``from jaxtrain.train.v2.jax import JaxTrainer``, as Ray's ``from ray.train.v2.jax import
JaxTrainer``: the same trainer as ``jaxtrain.JaxTrainer``. Ray's ``JaxConfig`` is not here:
importing it fails at once with what to do instead."""

from typing import Any

from jaxtrain.driver import ray_args
from jaxtrain.driver.trainer import JaxTrainer

__all__ = ["JaxTrainer"]


def __getattr__(name: str) -> Any:
    if name == "JaxConfig":
        raise ray_args.no_jax_config(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
