"""``jaxtrain.jax.JaxTrainer``, where Ray users find ``ray.train.v2.jax.JaxTrainer``."""

from jaxtrain.driver.trainer import JaxTrainer

__all__ = ["JaxTrainer"]
