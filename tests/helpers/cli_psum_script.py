"""A plain JAX script for `jaxtrain run`: it initialises jax.distributed itself, as scripts written
without a trainer do, then sums the process indices across every process (6 for 4 processes) and
prints and reports the sum."""

import jax
import jax.numpy as jnp

import jaxtrain

jax.distributed.initialize()  # a no-op under `jaxtrain run`: the worker already did it

total = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(
    jnp.array([jax.process_index()] * jax.local_device_count())
)
psum = int(total[0])
print(f"psum={psum} process_count={jax.process_count()}")
jaxtrain.report({"psum": psum, "process_count": jax.process_count()})
