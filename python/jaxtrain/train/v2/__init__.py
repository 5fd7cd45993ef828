"""``jaxtrain.train.v2``, where Ray Train V2 code imports from ``ray.train.v2``: its ``jax``
module."""
