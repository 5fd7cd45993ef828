"""Chaos run: trains while killing random ranks at random times, then checks that the job finished
with the metrics of an undisturbed run, that every committed checkpoint verifies, and that no
process of the run is left.

    .venv/bin/python tests/chaos.py --kills 10 --workers 4 --steps 60 --seed 1

Prints one summary line: failures injected, recovered, checkpoints verified, orphans. Exits 1 if
any check fails. The test suite runs a short version (tests/test_chaos.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from jaxtrain import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    _core,
)


def train(config: dict) -> None:
    """x <- (x * 31 + step) mod 1e9+7 per step, checkpointed every step; the final x depends on
    every step having run exactly once from a correctly restored state."""
    import jax  # noqa: F401

    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    Path(config["pids"], f"{ctx.get_attempt()}-{ctx.get_world_rank()}").write_text(
        str(os.getpid()))
    step, x = 0, 1
    restored = get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            step, x = json.loads(Path(d, "state.json").read_text())
    while step < config["steps"]:
        x = (x * 31 + step) % 1_000_000_007
        step += 1
        time.sleep(config["step_time"])
        with tempfile.TemporaryDirectory() as d:
            if ctx.get_world_rank() == 0:
                Path(d, "state.json").write_text(json.dumps([step, x]))
            report({"step": step, "x": x},
                   checkpoint=Checkpoint.from_directory(d) if ctx.get_world_rank() == 0 else None)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _fit(storage: str, name: str, config: dict, workers: int, max_failures: int):
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return JaxTrainer(
            train,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=workers),
            run_config=RunConfig(name=name, storage_path=storage,
                                 failure_config=FailureConfig(max_failures=max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=3)),
        ).fit()


def run(kills: int, workers: int, steps: int, seed: int, step_time: float) -> bool:
    rng = random.Random(seed)
    storage = tempfile.mkdtemp(prefix="jaxtrain-chaos-")
    pids_dir = Path(storage, "pids")
    pids_dir.mkdir()
    config = {"steps": steps, "step_time": step_time, "pids": str(pids_dir)}

    undisturbed = _fit(storage, "undisturbed", dict(config, pids=tempfile.mkdtemp()), workers, 0)

    injected = 0
    done = threading.Event()

    def chaos() -> None:
        nonlocal injected
        while injected < kills and not done.wait(rng.uniform(0.5, 2.5)):
            alive = [int(p.read_text()) for p in pids_dir.iterdir()]
            alive = [p for p in alive if _alive(p)]
            if alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rng.choice(alive), signal.SIGKILL)
                    injected += 1

    killer = threading.Thread(target=chaos, daemon=True)
    killer.start()
    result = _fit(storage, "chaos", config, workers, kills)
    done.set()
    killer.join()

    run_state = json.loads(Path(result.path, "run.json").read_text())
    recovered = sum(1 for a in run_state["attempts"] if a["status"] == "ERRORED")
    verified = 0
    for checkpoint, _ in result.best_checkpoints:
        _core.verify_checkpoint(checkpoint.path, True)
        verified += 1
    all_pids = [int(p.read_text()) for p in pids_dir.iterdir()]
    orphans = [p for p in all_pids if _alive(p)]
    same = result.metrics == undisturbed.metrics
    print(f"chaos: failures injected {injected}, recovered {recovered}, "
          f"checkpoints verified {verified}, orphans {len(orphans)}; final metrics "
          f"{result.metrics} {'==' if same else '!='} undisturbed {undisturbed.metrics}")
    ok = same and not orphans and verified > 0 and recovered == len(run_state["attempts"]) - 1
    if ok:
        import shutil

        shutil.rmtree(storage, ignore_errors=True)
    else:
        print(f"chaos: run directories kept in {storage}", file=sys.stderr)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="ranks to kill (default 10)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds a step takes")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the chaos")
    args = parser.parse_args()
    return 0 if run(args.kills, args.workers, args.steps, args.seed, args.step_time) else 1


if __name__ == "__main__":
    sys.exit(main())
