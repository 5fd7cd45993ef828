"""Benchmark: goodput under chaos, jaxtrain against Ray Train V2 on the same model and schedule.

    .venv/bin/python bench/chaos_goodput.py      # --minutes 2 --kill-every 30 --checkpoint-every 5

About 2 x (--minutes + 1) minutes on 2 cores. Makes bench/.venv-ray, as bench/compare_ray.sh
does, when it is missing or older than bench/requirements-ray.txt (``--no-ray``: jaxtrain alone).

Each side trains the Flax character LM of examples/flax_char_lm.py (its ``char_lm`` and
``corpus``; 2 layers, width 64, 32 characters, global batch 32) data-parallel on 4 CPU worker
processes for ``--minutes`` of wall time, from its driver's ``fit()`` (Ray: from ``ray.init``,
which ``fit()`` would otherwise do). Every ``--kill-every`` seconds of that time the driver
SIGKILLs one worker (ranks 0, 1, 2, 3 in turn), once the group it kills has taken a step; the
system restarts the group from its latest checkpoint (unlimited failures). Rank 0 saves the
state (``flax.serialization``) and reports it with the checkpoint every ``--checkpoint-every``
seconds; every rank reports once after its attempt's first step and with every checkpoint.
The decisions to checkpoint and to stop are voted inside the jitted step (a flag per rank, the
maximum returned), so every rank takes them at the same step. The training function is the
same code on both sides; only ``report``, ``get_checkpoint``, the rank and (on Ray, whose JAX
backend does not do it on CPU) ``jax.distributed.initialize`` come from the system.

Goodput, measured the same way on both sides from timestamps the training function records
itself (rank 0, ``time.time()``, one clock on one machine): each step's time from building its
batch to its loss on the host. A step is productive when its result survived: it is in the
final state's history (not redone after a restart) and it is not its attempt's first step
(which compiles). Goodput = productive time / wall time (the driver's ``fit()`` call to its
return); lost time = wall - productive. The rest of the wall time is split into: first steps
(compilation), checkpoints and reports (rank 0's time in saving and ``report``), steps redone
(steps run again after a restart) and the remainder (start-up, detecting the failure,
stopping and restarting the group, restoring, shutting down). jaxtrain's own accounting
(``Result.goodput``, docs/observability.md) is printed beside it.

Each system runs as its users get it: jaxtrain's workers keep JAX's persistent compilation cache
in the run directory (its default), so a restarted group loads the step it compiled before; Ray's
do not unless ``--ray-jax-cache`` sets ``JAX_COMPILATION_CACHE_DIR`` for them.

The figure: jaxtrain's lost time over Ray's (target <= 0.3 x). Each side's load average at its
start and end is printed beside it (the sides run one after the other on a machine that may be
shared). Results go to bench/results/chaos_goodput.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")
RAY_VENV = os.path.join(BENCH, ".venv-ray")
RAY_REQUIREMENTS = os.path.join(BENCH, "requirements-ray.txt")
# The environment jaxtrain gives its local CPU workers (src/placement/plan.cc); Ray's get it too.
CPU_ENV = {
    "JAX_PLATFORMS": "cpu",
    "JAX_NUM_CPU_DEVICES": "1",
    "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
}
MODEL = {"seq": 32, "width": 64, "layers": 2, "batch": 32, "lr": 3e-3}
TARGET = 0.3


# ---------------------------------------------------------------- the training function


def attempt_of(out: str) -> int:
    """The group's attempt: the kills so far (the driver records each before it kills)."""
    try:
        with open(os.path.join(out, "kills.jsonl")) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def train_body(config: dict, rank: int, world: int, report, checkpoint_cls, get_checkpoint,
               t_first: float) -> None:
    """What each rank runs on both sides, with the system's ``report`` and checkpoint API."""
    sys.path.insert(0, os.path.join(config["root"], "examples"))
    import flax.serialization
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax_char_lm import char_lm, corpus
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    out = config["out"]
    attempt = attempt_of(out)
    if not jax.distributed.is_initialized():  # Ray on CPU: its backend did not do it
        jax.distributed.initialize(f"127.0.0.1:{config['ports'][attempt]}", world, rank,
                                   cluster_detection_method="deactivate")
    m = MODEL
    text = corpus()
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], dtype=np.int32)
    model = char_lm(len(vocab), m["seq"], m["width"], m["layers"])
    optimizer = optax.adamw(m["lr"])
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data"))

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((1, m["seq"]), jnp.int32))["params"]
        return {"params": params, "opt": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    @jax.jit
    def train_step(state, x, y, votes):
        def loss_fn(params):
            logits = model.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt,
               "step": state["step"] + 1}
        return new, loss, votes.max(axis=0)

    checkpoint = get_checkpoint()
    if checkpoint is None:
        state = jax.jit(init, out_shardings=replicated)()
    else:
        with checkpoint.as_directory() as d, open(os.path.join(d, "state.msgpack"), "rb") as f:
            host = flax.serialization.from_bytes(jax.eval_shape(init), f.read())
        state = jax.tree.map(
            lambda a: jax.make_array_from_callback(np.shape(a), replicated,
                                                   lambda i, a=a: np.asarray(a)[i]), host)
    step = int(state["step"].addressable_data(0))
    restored = step
    per_rank = m["batch"] // world
    log = None
    if rank == 0:  # one line per group started (a failure other than the kills starts one too)
        with open(os.path.join(out, "groups.jsonl"), "a+") as f:
            f.seek(0)
            group = sum(1 for _ in f)
            f.write(json.dumps({"group": group, "attempt": attempt, "restored_step": restored,
                                "t_first": t_first}) + "\n")
        log = os.open(os.path.join(out, f"steps-g{group}.jsonl"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    last_checkpoint = time.time()
    while True:
        t0 = time.time()
        starts = np.random.default_rng(step).integers(0, len(ids) - m["seq"] - 1, m["batch"])
        mine = np.stack([ids[s:s + m["seq"] + 1] for s in starts])[rank * per_rank:
                                                                   (rank + 1) * per_rank]
        vote = [[float(t0 >= config["deadline"]),
                 float(rank == 0 and t0 - last_checkpoint >= config["checkpoint_every"])]]
        x, y, votes = (jax.make_array_from_process_local_data(rows, a)
                       for a in (mine[:, :-1], mine[:, 1:], np.array(vote, np.float32)))
        state, loss, decided = train_step(state, x, y, votes)
        loss = float(loss)
        stop, save = (bool(v) for v in np.asarray(decided.addressable_data(0)))
        t1 = time.time()
        first = step == restored
        metrics = {"step": step, "loss": loss}
        if save:
            with tempfile.TemporaryDirectory(prefix="chaos-ckpt-") as d:
                if rank == 0:
                    with open(os.path.join(d, "state.msgpack"), "wb") as f:
                        f.write(flax.serialization.to_bytes(jax.device_get(state)))
                    report(metrics, checkpoint=checkpoint_cls.from_directory(d))
                else:
                    report(metrics)
            last_checkpoint = time.time()
        elif first:
            report(metrics)
        if rank == 0:
            os.write(log, (json.dumps({"step": step, "t0": t0, "t1": t1, "t_end": time.time(),
                                       "first": first, "checkpoint": save}) + "\n").encode())
        if first:  # the group is training: the driver may kill this rank from now on
            write_json(os.path.join(out, f"pid-rank{rank}.json"),
                       {"pid": os.getpid(), "attempt": attempt})
        step += 1
        if stop:
            break
    if rank == 0:
        os.close(log)


def jaxtrain_func(config: dict) -> None:
    t_first = time.time()  # must stay the first line
    from jaxtrain import Checkpoint, get_checkpoint, get_context, report

    ctx = get_context()
    train_body(config, ctx.get_world_rank(), ctx.get_world_size(), report, Checkpoint,
               get_checkpoint, t_first)


def ray_func(config: dict) -> None:
    t_first = time.time()  # must stay the first line
    import ray.train

    ctx = ray.train.get_context()
    train_body(config, ctx.get_world_rank(), ctx.get_world_size(), ray.train.report,
               ray.train.Checkpoint, ray.train.get_checkpoint, t_first)


# ---------------------------------------------------------------- one side's driver


class Killer(threading.Thread):
    """SIGKILLs rank (i - 1) % workers at t0 + i * every, once that group has taken a step."""

    def __init__(self, config: dict, workers: int) -> None:
        super().__init__(daemon=True)
        self.config, self.workers = config, workers
        self.done = threading.Event()

    def run(self) -> None:
        out, every = self.config["out"], self.config["kill_every"]
        for i in range(1, self.config["kills"] + 1):
            rank = (i - 1) % self.workers
            if self.done.wait(max(0.0, self.config["t0"] + i * every - time.time())):
                return
            path = os.path.join(out, f"pid-rank{rank}.json")
            while not self.done.is_set():
                try:
                    with open(path) as f:
                        target = json.load(f)
                except (FileNotFoundError, json.JSONDecodeError):
                    target = None
                if target is not None and target["attempt"] == i - 1:
                    break
                time.sleep(0.01)
            else:
                return
            with open(os.path.join(out, "kills.jsonl"), "a") as f:
                f.write(json.dumps({"time": time.time(), "rank": rank, "pid": target["pid"],
                                    "scheduled": self.config["t0"] + i * every}) + "\n")
            try:
                os.kill(target["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(side: str, out: str, args_json: str) -> None:
    """Runs in the side's own environment: one fit() with the killer beside it."""
    args = json.loads(args_json)
    os.environ.update(CPU_ENV)  # the workers inherit it (jaxtrain would set the same)
    config = {"out": out, "root": ROOT, "checkpoint_every": args["checkpoint_every"],
              "kill_every": args["kill_every"], "ports": [free_port() for _ in range(64)]}
    # Kills on the schedule that fall at least one period before the end.
    config["kills"] = max(0, int(args["minutes"] * 60 // args["kill_every"]) - 1)
    killer = Killer(config, args["workers"])
    driver: dict = {"side": side}
    if side == "jaxtrain":
        from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

        config["t0"] = time.time()
        config["deadline"] = config["t0"] + args["minutes"] * 60
        killer.start()
        result = JaxTrainer(
            jaxtrain_func, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=args["workers"]),
            run_config=RunConfig(name="run", storage_path=out,
                                 failure_config=FailureConfig(max_failures=-1)),
        ).fit()
        driver["goodput"] = result.goodput.to_dict() if result.goodput else None
        driver["goodput_line"] = result.goodput.line() if result.goodput else None
    else:
        os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(args["ray_poll_s"]))
        if args["ray_jax_cache"]:  # JAX's persistent cache, as jaxtrain's workers keep it
            os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(out, "compilation-cache")
        config["t0"] = time.time()  # fit() starts Ray when the user has not: counted
        config["deadline"] = config["t0"] + args["minutes"] * 60
        killer.start()
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2.jax import JaxTrainer

        ray.init(num_cpus=args["workers"] + 1, include_dashboard=None, log_to_driver=False)
        JaxTrainer(
            ray_func, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=args["workers"], use_tpu=False),
            run_config=RunConfig(name="run", storage_path=out,
                                 failure_config=FailureConfig(max_failures=-1)),
        ).fit()
    driver["t_end"] = time.time()
    killer.done.set()
    driver.update(t0=config["t0"], deadline=config["deadline"], kills_scheduled=config["kills"])
    write_json(os.path.join(out, "driver.json"), driver)


# ---------------------------------------------------------------- figures


def figures(out: str) -> dict:
    """Self-timed goodput from one side's records (module docstring)."""
    with open(os.path.join(out, "driver.json")) as f:
        driver = json.load(f)
    kept: dict[int, dict] = {}  # step -> its surviving execution
    executed = []
    with open(os.path.join(out, "groups.jsonl")) as f:
        groups = [json.loads(line) for line in f if line.endswith("\n")]
    for g in groups:
        for s in [s for s in kept if s >= g["restored_step"]]:
            del kept[s]
        try:
            with open(os.path.join(out, f"steps-g{g['group']}.jsonl")) as f:
                lines = [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            lines = []
        for line in lines:
            executed.append(line)
            kept[line["step"]] = line
    attempts = len(groups)
    kills = attempt_of(out)
    wall = driver["t_end"] - driver["t0"]
    productive = sum(r["t1"] - r["t0"] for r in kept.values() if not r["first"])
    first = sum(r["t1"] - r["t0"] for r in executed if r["first"])
    reports = sum(r["t_end"] - r["t1"] for r in executed)
    redone = sum(r["t1"] - r["t0"] for r in executed if not r["first"]) - productive
    return {
        "wall_s": wall, "productive_s": productive, "lost_s": wall - productive,
        "goodput": productive / wall if wall > 0 else 0.0,
        "first_steps_s": first, "checkpoints_and_reports_s": reports, "redone_s": redone,
        "other_s": wall - productive - first - reports - redone,
        "steps": len(kept), "steps_executed": len(executed), "attempts": attempts,
        "kills": kills, "kills_scheduled": driver["kills_scheduled"],
        "jaxtrain_goodput": driver.get("goodput"),
        "jaxtrain_goodput_line": driver.get("goodput_line"),
    }


def ensure_ray_venv() -> str | None:
    """bench/.venv-ray's interpreter, made as bench/compare_ray.sh makes it; None if it fails."""
    python = os.path.join(RAY_VENV, "bin", "python")
    stamp = os.path.join(RAY_VENV, ".requirements")
    with open(RAY_REQUIREMENTS, "rb") as f:
        wanted = f.read()
    try:
        with open(stamp, "rb") as f:
            current = f.read() == wanted
    except FileNotFoundError:
        current = False
    if not current:
        print(f"chaos_goodput: installing bench/requirements-ray.txt into {RAY_VENV}",
              file=sys.stderr)
        made = subprocess.run([sys.executable, "-m", "venv", RAY_VENV]).returncode == 0 and \
            subprocess.run([os.path.join(RAY_VENV, "bin", "pip"), "install", "-q", "-r",
                            RAY_REQUIREMENTS]).returncode == 0
        if not made:
            return None
        shutil.copyfile(RAY_REQUIREMENTS, stamp)
    return python


def run(side: str, python: str, args: argparse.Namespace, tmp: str) -> dict:
    out = tempfile.mkdtemp(prefix=f"{side}-", dir=tmp)
    argv = [python, os.path.abspath(__file__), "--side", side, out,
            json.dumps({k: getattr(args, k) for k in
                        ("minutes", "kill_every", "checkpoint_every", "workers", "ray_poll_s",
                         "ray_jax_cache")})]
    print(f"chaos_goodput: {side}, {args.minutes:g} min ...", file=sys.stderr, flush=True)
    load_before = os.getloadavg()[0]  # the machine may be shared: said beside each side's figures
    with open(os.path.join(out, "console.log"), "wb") as log:
        code = subprocess.run(argv, stdout=log, stderr=log, cwd=out).returncode
    load_after = os.getloadavg()[0]
    if code != 0:
        with open(os.path.join(out, "console.log"), errors="replace") as f:
            tail = f.read()[-4000:]
        sys.exit(f"{side} failed ({code}); output ends:\n{tail}")
    return {**figures(out), "load_before": load_before, "load_after": load_after}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        run_side(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="training per side (2)")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--checkpoint-every", type=float, default=5.0, help="seconds (5)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ray-poll-s", type=float, default=0.1,
                        help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for Ray (0.1, as compare_ray; "
                             "Ray's own default is 2)")
    parser.add_argument("--ray-jax-cache", action="store_true",
                        help="give Ray's workers JAX's persistent compilation cache "
                             "(JAX_COMPILATION_CACHE_DIR), which jaxtrain's keep by default")
    parser.add_argument("--no-ray", action="store_true", help="jaxtrain alone")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args()
    for name in ("minutes", "kill_every", "checkpoint_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, not {getattr(args, name)}")
    if args.workers < 2:
        parser.error(f"--workers must be 2 or more, not {args.workers}")
    ray_python = None if args.no_ray else ensure_ray_venv()
    if not args.no_ray and ray_python is None:
        print("chaos_goodput: bench/.venv-ray could not be made; jaxtrain alone", file=sys.stderr)
    tmp = tempfile.mkdtemp(prefix="chaos-goodput-")
    try:
        results = {"jaxtrain": run("jaxtrain", sys.executable, args, tmp)}
        if ray_python:
            results["ray"] = run("ray", ray_python, args, tmp)
    finally:
        if args.keep:
            print(f"chaos_goodput: runs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(args, results)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "chaos_goodput.json"), "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "args": vars(args), "results": results}, f, indent=1)


def print_table(args: argparse.Namespace, results: dict) -> None:
    jt, ray = results["jaxtrain"], results.get("ray")
    print(f"{args.workers} CPU workers, Flax char LM, {args.minutes:g} min of wall time per side; "
          f"a rank SIGKILLed every {args.kill_every:g} s, checkpoints every "
          f"{args.checkpoint_every:g} s"
          + ("; Ray with JAX's compilation cache" if args.ray_jax_cache else ""))
    rows = [("wall time", "wall_s"), ("productive steps", "productive_s"),
            ("lost (wall - productive)", "lost_s"), ("  first steps (compile)", "first_steps_s"),
            ("  checkpoints and reports", "checkpoints_and_reports_s"),
            ("  steps redone", "redone_s"),
            ("  start-up, restarts, shutdown", "other_s")]
    print(f"{'figure':32}{'jaxtrain':>14}{'Ray Train V2':>14}")
    for label, key in rows:
        print(f"{label:32}{jt[key]:>12.1f} s" + (f"{ray[key]:>12.1f} s" if ray else ""))
    print(f"{'goodput':32}{100 * jt['goodput']:>12.1f} %"
          + (f"{100 * ray['goodput']:>12.1f} %" if ray else ""))
    for label, key in (("kills (scheduled)", "kills"), ("worker groups", "attempts"),
                       ("steps kept / run", "steps")):
        extra = {"kills": "kills_scheduled", "steps": "steps_executed"}.get(key)
        cell = [f"{r[key]}" + (f" / {r[extra]}" if extra else "") for r in (jt, ray) if r]
        print(f"{label:32}" + "".join(f"{c:>14}" for c in cell))
    print(f"{'load average (1 min), start/end':32}"
          + "".join(f"{r['load_before']:.1f} / {r['load_after']:.1f}".rjust(14)
                    for r in (jt, ray) if r))
    if jt["jaxtrain_goodput_line"]:
        print(f"jaxtrain's own accounting (Result.goodput): {jt['jaxtrain_goodput_line']}")
    if ray:
        ratio = jt["lost_s"] / ray["lost_s"] if ray["lost_s"] > 0 else float("inf")
        met = "met" if ratio <= TARGET else "NOT met"
        print(f"lost time jaxtrain / Ray: {ratio:.2f} x; target <= {TARGET} x: {met}")
        loads = [max(r["load_before"], r["load_after"]) for r in (jt, ray)]
        if abs(loads[0] - loads[1]) > 2:
            print(f"the sides ran under different loads (up to {loads[0]:.1f} and "
                  f"{loads[1]:.1f}): the ratio does not compare them fairly")
        results["ratio_lost"] = ratio


if __name__ == "__main__":
    main()
