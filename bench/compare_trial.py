"""One trial of the Ray comparison (bench/compare_ray.py runs these; each in a fresh process).

    python bench/compare_trial.py SIDE PROGRAM OUT_DIR WORKERS [--reports N] [--epochs N]

SIDE is the system that starts the workers; each is run by the interpreter of its own
environment (jaxtrain: .venv; Ray: bench/.venv-ray; the floor: .venv):

* ``jaxtrain``: ``jaxtrain.JaxTrainer(...).fit()``; the worker runtime initialises
  ``jax.distributed`` before the training function's first line.
* ``ray``: Ray Train V2's ``ray.train.v2.jax.JaxTrainer`` with ``use_tpu=False``. On CPU its JAX
  backend does not initialise ``jax.distributed`` (ray 2.60.0), so the function calls
  ``jax.distributed.initialize`` itself when it finds it uninitialised; the trial records which.
* ``floor``: this script starts WORKERS bare processes (``floor-rank``) that import JAX,
  initialise ``jax.distributed`` and run the function; nothing else.

PROGRAM is what the function does:

* ``step``: notes when the rank is ready (its first line with ``jax.distributed`` initialised),
  trains the seed's linear regression for --epochs epochs, then times --reports metrics-only
  ``report()`` calls (the floor: ``json.dumps`` + one ``os.write`` to a file).
* ``seed``: the seed linear-regression program (examples/linear_regression.py) on WORKERS CPU
  workers: 100 epochs, one report per epoch; the orchestrator times the whole process.
* ``failure``: reports every 50 ms; at report 20 of the first attempt the last rank SIGKILLs
  itself. The system restarts the group once (the floor: its launcher kills the survivors and
  starts the group again); the restarted group notes when it is ready, reports 3 times, returns.

Every rank writes what it measured to OUT_DIR (``rank<r>-a<attempt>.json``); the driver writes
``driver.json``. All times are ``time.time()``: one clock on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from bare_worker import time_calls  # the same timing loop as startup_and_report.py's floor

# The environment jaxtrain gives its local CPU workers (src/placement/plan.cc); every side gets it.
CPU_ENV = {
    "JAX_PLATFORMS": "cpu",
    "JAX_NUM_CPU_DEVICES": "1",
    "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
}
KILL_AT_REPORT = 20
FAILURE_INTERVAL_S = 0.05
REPORTS_AFTER_RESTART = 3


def seed_train(report, epochs: int = 100) -> float:
    """The seed's training function (examples/linear_regression.py), with ``report`` passed in."""
    import jax
    import jax.numpy as jnp
    import optax

    key = jax.random.PRNGKey(jax.process_index())
    X = jax.random.normal(key, (100, 1))
    noise = jax.random.normal(key, (100, 1)) * 0.1
    y = 2 * X + 1 + noise

    def linear_model(params, x):
        return x @ params["w"] + params["b"]

    def loss_fn(params, x, y):
        preds = linear_model(params, x)
        return jnp.mean((preds - y) ** 2)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    key, w_key, b_key = jax.random.split(key, 3)
    params = {"w": jax.random.normal(w_key, (1, 1)), "b": jax.random.normal(b_key, (1,))}
    optimizer = optax.adam(learning_rate=0.01)
    opt_state = optimizer.init(params)
    loss = float("nan")
    for epoch in range(epochs):
        params, opt_state, loss = train_step(params, opt_state, X, y)
        report({"loss": float(loss), "epoch": epoch})
    return float(loss)


def save(out_dir: str, name: str, data: dict) -> None:
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(out_dir, name))


def rank_body(config: dict, rank: int, world: int, report, t_first: float) -> None:
    """What every side runs once its rank is ready; ``t_first`` is its function's first line."""
    import jax

    if not jax.distributed.is_initialized():  # Ray on CPU: its backend did not do it
        port = config["ports"][1 if os.path.exists(kill_path(config)) else 0]
        jax.distributed.initialize(
            f"127.0.0.1:{port}", world, rank, cluster_detection_method="deactivate"
        )
        self_init = True
    else:
        self_init = False
    t_ready = time.time()
    attempt = 1 if os.path.exists(kill_path(config)) else 0
    figures = {"t_first": t_first, "t_ready": t_ready, "self_init": self_init}
    save(config["out_dir"], f"ready-rank{rank}-a{attempt}.json", figures)
    if config["program"] == "step":
        seed_train(report, config["epochs"])
        figures["report_ns"] = time_calls(report, config["reports"])
    elif config["program"] == "seed":
        figures["loss"] = seed_train(report)
    else:  # failure
        killing = attempt == 0 and rank == world - 1
        steps = REPORTS_AFTER_RESTART if attempt else sys.maxsize  # the others run until stopped
        for step in range(1, steps + 1):
            time.sleep(FAILURE_INTERVAL_S)
            if killing and step == KILL_AT_REPORT:
                save(config["out_dir"], "kill.json", {"time": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            report({"step": step})
    save(config["out_dir"], f"rank{rank}-a{attempt}.json", figures)


def kill_path(config: dict) -> str:
    return os.path.join(config["out_dir"], "kill.json")


def jaxtrain_func(config: dict) -> None:
    t_first = time.time()  # must stay the first line
    from jaxtrain import get_context, report

    ctx = get_context()
    rank_body(config, ctx.get_world_rank(), ctx.get_world_size(), report, t_first)


def ray_func(config: dict) -> None:
    t_first = time.time()  # must stay the first line
    import ray.train

    ctx = ray.train.get_context()
    rank_body(config, ctx.get_world_rank(), ctx.get_world_size(), ray.train.report, t_first)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jaxtrain(config: dict, workers: int) -> None:
    from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

    config["t0"] = time.time()
    result = JaxTrainer(
        jaxtrain_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name="run",
            storage_path=config["out_dir"],
            failure_config=FailureConfig(max_failures=1),
        ),
    ).fit()
    print(f"Training finished. Final metrics: {result.metrics}")


def run_ray(config: dict, workers: int) -> None:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    config["t0"] = time.time()  # fit() starts Ray when the user has not: counted, as ray.init
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    # Logical CPUs: one per worker and one spare, whatever the machine has, so that every worker
    # count runs; workers and Ray's actors then share the real cores as the other sides' do.
    ray.init(num_cpus=workers + 1, include_dashboard=None, log_to_driver=False)
    config["t_fit"] = time.time()
    result = JaxTrainer(
        ray_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_tpu=False),
        run_config=RunConfig(
            name="run",
            storage_path=config["out_dir"],
            failure_config=FailureConfig(max_failures=1),
        ),
    ).fit()
    print(f"Training finished. Final metrics: {result.metrics}")


def run_floor(config: dict, workers: int) -> None:
    """The minimal launcher: N bare processes; on a rank's death, kill the rest, start again."""
    config["t0"] = time.time()
    config_path = os.path.join(config["out_dir"], "config.json")
    save(config["out_dir"], "config.json", config)
    env = {**os.environ, **CPU_ENV}
    for _ in range(2):  # attempts
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "floor-rank", config_path, str(workers), str(rank)],
                env=env,
            )
            for rank in range(workers)
        ]
        failed = False
        for _ in procs:
            pid, status = os.wait()
            if status != 0 and not failed:
                failed = True
                for p in procs:
                    if p.pid != pid and p.poll() is None:
                        p.kill()
        for p in procs:
            p.wait()
        if not failed:
            return
    sys.exit("the floor's group failed twice")


def floor_rank(config_path: str, workers: int, rank: int) -> None:
    with open(config_path) as f:
        config = json.load(f)
    import jax

    port = config["ports"][1 if os.path.exists(kill_path(config)) else 0]
    jax.distributed.initialize(
        f"127.0.0.1:{port}", workers, rank, cluster_detection_method="deactivate"
    )
    t_first = time.time()  # the first line after initialize
    # The cheapest way to emit a metric: one JSON line, one write(2) into the page cache.
    fd = os.open(
        os.path.join(config["out_dir"], f"metrics-rank{rank}.jsonl"),
        os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    )

    def emit_line(metrics: dict) -> None:
        os.write(fd, json.dumps(metrics).encode() + b"\n")

    rank_body(config, rank, workers, emit_line, t_first)
    os.close(fd)
    jax.distributed.shutdown()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "floor-rank":
        floor_rank(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("side", choices=["jaxtrain", "ray", "floor"])
    parser.add_argument("program", choices=["step", "seed", "failure"])
    parser.add_argument("out_dir")
    parser.add_argument("workers", type=int)
    parser.add_argument("--reports", type=int, default=10_000, help="timed report() per rank")
    parser.add_argument("--epochs", type=int, default=10, help="seed epochs before the timing")
    args = parser.parse_args()
    os.environ.update(CPU_ENV)  # the workers inherit it (jaxtrain would set the same)
    config = {
        "out_dir": os.path.abspath(args.out_dir),
        "program": args.program,
        "reports": args.reports,
        "epochs": args.epochs,
        "ports": [free_port(), free_port()],  # per attempt, where the function initialises JAX
    }
    runner = {"jaxtrain": run_jaxtrain, "ray": run_ray, "floor": run_floor}[args.side]
    runner(config, args.workers)
    save(config["out_dir"], "driver.json", {"t0": config["t0"], "t_fit": config.get("t_fit")})


if __name__ == "__main__":
    main()
