"""Benchmark: the first training step after a restart, with JAX's persistent compilation cache
(jaxtrain's default) and without it (JAXTRAIN_COMPILATION_CACHE=0).

    .venv/bin/python bench/compile_cache.py [--workers 2] [--repeats 3] [--layers 4] [--width 128]

The model is a stack of ``--layers`` pre-norm transformer blocks (Flax linen: self-attention and
an MLP), scanned and unrolled (``nn.scan(..., unroll=layers)``, as large models' layers often
are: traced once, compiled as a whole), with an optax AdamW step, trained data-parallel: the
parameters replicated, the batch split across ``--workers`` local CPU ranks, one jit of loss,
gradients and update. Its first step's compilation takes over ten seconds on a small CPU, far
more than JAX's 1 s threshold for writing a cache entry; tracing and lowering it again after a
restart (which no cache saves) takes about a second.

Each repeat runs, in turn (ABAB... so that machine noise hits both), in a fresh run directory
(a cold cache):

* cache: ``fit()`` with ``FailureConfig(max_failures=1)``. Every rank initialises the model, then
  times its first training step (``time.time()`` before the call, after ``block_until_ready``).
  On attempt 0, after the second step, rank ``--workers - 1`` writes ``time.time()`` to a file
  and SIGKILLs itself. Attempt 1 starts from scratch and times its first step the same way.
* no cache: the same with ``JAXTRAIN_COMPILATION_CACHE=0``.

Figures, on the last rank to get there (the step ends in a collective, so the ranks finish it
together): first step of attempt 0 (cold cache), first step of attempt 1 (warm cache, or a
second compilation without the cache), and failure -> next step: the kill to the end of attempt
1's first step (detection, teardown, new processes, jax.distributed, model init and the step).
The table printed last gives each as median [min-max] over the repeats, and the ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from startup_and_report import console_to, measure, spread

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError

FIRST_STEP_TARGET_RATIO = 0.2


@dataclass
class Figures:
    """One fit() with a failure."""

    first_step_s: float  # attempt 0's first step, last rank
    restarted_step_s: float  # attempt 1's first step, last rank
    failure_to_step_s: float  # the kill -> the end of attempt 1's first step, last rank


def train_func(config: dict) -> None:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import get_context, report

    ctx = get_context()
    rank, world, attempt = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_attempt()
    width, seq, batch = config["width"], 32, 4 * world

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            x = x + nn.SelfAttention(num_heads=4)(nn.LayerNorm()(x))
            h = nn.Dense(4 * width)(nn.LayerNorm()(x))
            return x + nn.Dense(width)(nn.gelu(h)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(width)(x)
            layers = config["layers"]
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=layers, unroll=layers)()(x, None)
            return nn.Dense(1)(nn.LayerNorm()(x))

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model, optimizer = Model(), optax.adamw(1e-3)
    rows = np.random.default_rng(rank).normal(size=(batch // world, seq, 8)).astype(np.float32)
    x = jax.make_array_from_process_local_data(split, rows)
    y = jax.make_array_from_process_local_data(split, rows[..., :1] * 2.0)
    params = jax.jit(model.init, out_shardings=replicated)(
        jax.random.key(0), np.zeros((1, seq, 8), np.float32))
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    out = config["out_dir"]
    t_start = time.time()
    params, opt_state, loss = step(params, opt_state, x, y)
    loss.block_until_ready()
    t_end = time.time()
    with open(os.path.join(out, f"step-a{attempt}-rank{rank}.json"), "w") as f:
        json.dump({"start": t_start, "end": t_end}, f)
    for i in range(1, 3):
        params, opt_state, loss = step(params, opt_state, x, y)
        report({"step": i, "loss": float(loss)})
        if attempt == 0 and i == 2 and rank == world - 1:
            with open(os.path.join(out, "kill.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 0:
        time.sleep(3600)  # the other ranks wait "in a collective" until the group is stopped


def read(path: str) -> dict:
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing: a rank did not get as far as the benchmark needs")
    with open(path) as f:
        return json.load(f)


def run(cache: bool, args: argparse.Namespace, out_dir: str) -> Figures:
    os.environ["JAXTRAIN_COMPILATION_CACHE"] = "1" if cache else "0"
    try:
        with console_to(os.path.join(out_dir, "console.log")):
            JaxTrainer(
                train_func,
                train_loop_config={"out_dir": out_dir, "layers": args.layers,
                                   "width": args.width},
                scaling_config=ScalingConfig(num_workers=args.workers),
                run_config=RunConfig(name="run", storage_path=out_dir,
                                     failure_config=FailureConfig(max_failures=1)),
            ).fit()
    except TrainingFailedError as e:
        sys.exit(f"jaxtrain fit() failed during the benchmark: {e}")
    finally:
        del os.environ["JAXTRAIN_COMPILATION_CACHE"]
    cache_dir = os.path.join(out_dir, "run", "compilation-cache")
    if cache != os.path.isdir(cache_dir):
        sys.exit(f"{cache_dir} should {'' if cache else 'not '}exist")
    steps = [[read(os.path.join(out_dir, f"step-a{a}-rank{r}.json")) for r in range(args.workers)]
             for a in (0, 1)]
    return Figures(
        first_step_s=max(s["end"] for s in steps[0]) - max(s["start"] for s in steps[0]),
        restarted_step_s=max(s["end"] for s in steps[1]) - max(s["start"] for s in steps[1]),
        failure_to_step_s=max(s["end"] for s in steps[1]) - read(
            os.path.join(out_dir, "kill.json"))["time"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="measured pairs (default 3)")
    parser.add_argument("--warmup", type=int, default=0, help="unmeasured pairs first (default 0)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    args = parser.parse_args()
    if min(args.workers, args.repeats, args.layers, args.width) < 1 or args.warmup < 0:
        parser.error("--workers, --repeats, --layers and --width must be >= 1, --warmup >= 0")
    if args.workers < 2:
        parser.error("--workers must be >= 2: one rank is killed, the others wait for it")

    results: dict[bool, list[Figures]] = {True: [], False: []}
    others: list[float] = []
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as tmp:
        for i in range(args.warmup + args.repeats):
            warm = i < args.warmup
            label = (f"warm-up {i + 1}/{args.warmup}" if warm
                     else f"repeat {i - args.warmup + 1}/{args.repeats}")
            line = []
            for cache in (True, False):
                out_dir = tempfile.mkdtemp(prefix=f"{'cache' if cache else 'none'}-{i}-", dir=tmp)
                figures, other = measure(functools.partial(run, cache, args, out_dir))
                if not warm:
                    results[cache].append(figures)
                    others.append(other)
                line.append(
                    f"{'cache' if cache else 'no cache'}: first step {figures.first_step_s:.2f} s, "
                    f"after restart {figures.restarted_step_s:.2f} s, failure -> step "
                    f"{figures.failure_to_step_s:.2f} s, others busy {other:.1f} cores")
            print(f"{label}: " + "; ".join(line), flush=True)

    cached, uncached = results[True], results[False]
    print(f"\n{args.workers} workers, {args.layers} blocks of width {args.width}, "
          f"{args.repeats} repeats; median [min-max] over repeats")
    print(f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy during the "
          "runs; well above 0, the figures measure the machine's load more than jaxtrain")
    print("first step: the call to block_until_ready, last rank; failure -> step: the SIGKILL "
          "to the end of attempt 1's first step, last rank")
    step_ratios = [c.restarted_step_s / c.first_step_s for c in cached]
    median_ratio = statistics.median(step_ratios)
    verdict = "met" if median_ratio <= FIRST_STEP_TARGET_RATIO else "NOT met"
    print(f"target first step after restart / first step (cache) <= "
          f"{FIRST_STEP_TARGET_RATIO:.2f} x: {verdict} (median {median_ratio:.2f} x)")
    print(f"{'figure':<34}{'cache':<26}{'no cache':<26}cache/no cache")
    rows = [
        ("first step, attempt 0 (cold)", lambda f: f.first_step_s),
        ("first step after restart", lambda f: f.restarted_step_s),
        ("failure -> next step", lambda f: f.failure_to_step_s),
    ]
    for title, get in rows:
        a, b = [get(f) for f in cached], [get(f) for f in uncached]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        print(f"{title:<34}{spread(a, 's'):<26}{spread(b, 's'):<26}{spread(ratios, 'x')}")
    print(f"{'after restart / first step':<34}{spread(step_ratios, 'x'):<26}"
          f"{spread([f.restarted_step_s / f.first_step_s for f in uncached], 'x')}")


if __name__ == "__main__":
    main()
