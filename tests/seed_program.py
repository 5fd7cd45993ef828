"""The seed's linear-regression program (examples/linear_regression.py), prepared for tests on a
cluster: before training, every rank joins a cross-process psum (which only one JAX job across all
workers can compute) and writes what it saw to seen-rank-<rank>.json in its working directory."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SEED = (REPO / "examples" / "linear_regression.py").read_text()

# Injected into the seed's program before its ScalingConfig: the seed's training function runs
# after a cross-process psum, which only a single JAX job across all workers can compute.
PSUM_FIRST = '''
_seed_train_func = train_func


def train_func():
    import json, os, socket
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxtrain import get_context

    ctx = get_context()
    mesh = Mesh(np.array(jax.devices()), ("workers",))
    local = np.array([float(ctx.get_world_rank())])
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("workers")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(arr)
    seen = {
        "rank": ctx.get_world_rank(), "world_size": ctx.get_world_size(),
        "local_rank": ctx.get_local_rank(), "local_world_size": ctx.get_local_world_size(),
        "node_rank": ctx.get_node_rank(), "host": socket.gethostname(),
        "process_count": jax.process_count(), "psum": float(total),
        "job": os.environ.get("SLURM_JOB_ID"),
        "pod_index": os.environ.get("JOB_COMPLETION_INDEX"),
        "pid": os.getpid(), "ppid": os.getppid(),
    }
    with open(f"seen-rank-{ctx.get_world_rank()}.json", "w") as f:
        json.dump(seen, f)
    _seed_train_func()

'''
MARK = "# Define the hardware configuration"


def with_psum_first(num_workers: int | None, scaling_options: str = "") -> str:
    """The seed's linear-regression program with the psum first; with `num_workers`, its
    ScalingConfig becomes num_workers CPU workers (with `scaling_options`, e.g.
    'placement_strategy="SPREAD"')."""
    program = SEED.replace(MARK, PSUM_FIRST + MARK, 1)
    if num_workers is not None:
        options = f", {scaling_options}" if scaling_options else ""
        program, n = re.subn(
            r"scaling_config = ScalingConfig\(.*?\n\)",
            f"scaling_config = ScalingConfig(num_workers={num_workers}{options})",
            program, count=1, flags=re.S)
        assert n == 1
    return program
