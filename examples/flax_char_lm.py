"""A small character-level transformer language model in Flax (linen) + optax, trained
data-parallel on 4 CPU processes with jaxtrain.

The text is the source of a few Python standard-library modules (every Python has it; nothing is
downloaded). Each process feeds its rows of every global batch (jaxtrain.data), the state is
saved with Orbax every few steps and committed by jaxtrain (jaxtrain.orbax), TensorBoard logs
are written from the driver (jaxtrain.loggers), and the loss curve is drawn as a PNG at the end.

    python examples/flax_char_lm.py                   # 4 workers, 120 steps
    python examples/flax_char_lm.py --kill-at 25      # rank 2 is killed once; the group restarts
                                                      # from the latest checkpoint
    tensorboard --logdir ~/jaxtrain_results/flax_char_lm/tensorboard

Needs flax, optax, orbax-checkpoint, tensorboardX and matplotlib.
"""

from __future__ import annotations

import argparse
import os


def corpus() -> str:
    import argparse as a
    import textwrap
    import typing

    return "".join(open(m.__file__, encoding="utf-8").read() for m in (textwrap, a, typing))


def char_lm(vocab_size: int, seq: int, width: int, layers: int):
    """The model: a causal transformer over characters (bench/chaos_goodput.py trains it too)."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            h = nn.MultiHeadDotProductAttention(num_heads=4)(
                h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + h
            h = nn.Dense(4 * width)(nn.LayerNorm()(x))
            return x + nn.Dense(width)(nn.gelu(h))

    class CharLM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab_size, width)(tokens)
            x = x + self.param("pos", nn.initializers.normal(0.02), (seq, width))
            for _ in range(layers):
                x = Block()(x)
            return nn.Dense(vocab_size)(nn.LayerNorm()(x))

    return CharLM()


def train_func(config: dict) -> None:
    import signal

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import data, get_context, report
    from jaxtrain import orbax as jt_orbax

    seq, width = config["seq_len"], config["width"]
    text = corpus()
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], dtype=np.int32)

    model = char_lm(len(vocab), seq, width, config["layers"])
    optimizer = optax.adamw(config["lr"])
    mesh = data.mesh()  # every device of every process, along "data"
    replicated = NamedSharding(mesh, P())

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"]
        return {"params": params, "opt": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    state_shardings = jax.tree.map(lambda _: replicated, jax.eval_shape(init))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(init), state_shardings)
    state = jt_orbax.restore(abstract)  # the latest committed checkpoint, after a restart
    if state is None:
        state = jax.jit(init, out_shardings=state_shardings)()

    @jax.jit
    def train_step(state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
                "step": state["step"] + 1}, loss

    # Windows of seq+1 characters; every process has them all and feeds its rows of each batch.
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - seq - 1, size=config["steps"] * config["batch"])
    windows = np.stack([ids[s:s + seq + 1] for s in starts])
    batches = data.iter_batches({"x": windows[:, :-1], "y": windows[:, 1:]},
                                global_batch_size=config["batch"])
    ctx = get_context()
    first = int(state["step"].addressable_data(0))
    for step, local in enumerate(batches):
        if step < first:
            continue  # done before the checkpoint this attempt started from
        if step == config.get("kill_at") and ctx.get_attempt() == 0:
            multihost_utils.sync_global_devices("before the kill")  # earlier rounds are in
            if ctx.get_world_rank() == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        state, loss = train_step(state, data.global_batch(local, mesh))
        metrics = {"step": step, "loss": float(loss), "attempt": ctx.get_attempt()}
        if (step + 1) % config["checkpoint_every"] == 0:
            jt_orbax.save(state, metrics)
        else:
            report(metrics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=None,
                        help="kill rank 2 once at this step, to show the restart")
    parser.add_argument("--name", default="flax_char_lm")
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args(argv)
    # Imported here, so that the model and the corpus import without jaxtrain.
    from jaxtrain import CheckpointConfig, FailureConfig, JaxTrainer, RunConfig, ScalingConfig
    from jaxtrain.loggers import TensorBoardLogger


    result = JaxTrainer(
        train_func,
        train_loop_config={"steps": args.steps, "batch": args.batch, "seq_len": 32, "width": 64,
                           "layers": 2, "lr": 3e-3, "checkpoint_every": args.checkpoint_every,
                           "kill_at": args.kill_at},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(
            name=args.name, storage_path=args.storage_path,
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=[TensorBoardLogger(step_metric="step")],
        ),
    ).fit()
    frame = result.metrics_dataframe
    png = result.plot(os.path.join(result.path, "loss.png"), metrics=["loss"])
    print(f"loss: first {frame['loss'].iloc[0]:.3f}, last {frame['loss'].iloc[-1]:.3f}")
    print(f"loss curve: {png}")
    print(f"TensorBoard: tensorboard --logdir {result.path}/tensorboard")


if __name__ == "__main__":
    main()
