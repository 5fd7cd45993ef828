"""Result.return_value and local mode (ScalingConfig(num_workers=0)) as a Ray Train V2 script of
2026 uses them, with its imports changed: rank 0's return value on a 4-worker CPU run (a dict
with a numpy array; the other ranks' values are never pickled), the limit on its size and a value
that cannot be pickled; and the training function run in the driver's own process: it reports,
checkpoints (kept by CheckpointConfig), resumes from get_checkpoint() on a second fit of the same
name, returns a value, sees the driver's pid, stops at a pdb breakpoint, and fails without a
restart."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.conftest import run_command, run_driver

# The Ray script's imports, changed:
#   import ray.train
#   from ray.train import (Checkpoint, CheckpointConfig, FailureConfig, Result, RunConfig,
#                          ScalingConfig, UserCallback)
#   from ray.train.v2.jax import JaxTrainer
IMPORTS = """
import json, os, tempfile, threading

import numpy as np

import jaxtrain as train
from jaxtrain import (Checkpoint, CheckpointConfig, FailureConfig, JaxTrainer, Result, RunConfig,
                      ScalingConfig, TrainingFailedError, UserCallback)
"""


def _printed(stdout: str, tag: str):
    return json.loads(stdout.split(f"{tag} ", 1)[1].splitlines()[0])


def test_rank_zero_return_value_reaches_the_result_of_a_four_worker_run(tmp_path: Path):
    runs = tmp_path / "runs"
    proc = run_driver(IMPORTS + f"""
def train_func(config):
    rank = train.get_context().get_world_rank()
    import jax
    weights = np.arange(6, dtype=np.float32).reshape(2, 3) * (jax.process_count())
    train.report({{"loss": 1.0 / (rank + 1)}})
    if rank == 0:
        return {{"weights": weights, "ranks": jax.process_count(), "name": "best"}}
    return threading.Lock()  # not rank 0's: never pickled


trainer = JaxTrainer(
    train_func,
    train_loop_config={{}},
    scaling_config=ScalingConfig(num_workers=4),
    run_config=RunConfig(name="returns", storage_path={str(runs)!r}),
)
result = trainer.fit()
value = result.return_value
assert isinstance(value["weights"], np.ndarray) and value["weights"].dtype == np.float32
again = Result.from_path(result.path).return_value
assert (again["weights"] == value["weights"]).all()
print("VALUE", json.dumps({{"weights": value["weights"].tolist(), "ranks": value["ranks"],
                           "name": value["name"], "loss": result.metrics["loss"]}}))


def nothing():
    train.report({{"step": 1}})


print("NONE", json.dumps(JaxTrainer(
    nothing, scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(name="returns", storage_path={str(runs)!r})).fit().return_value))
""", tmp_path)
    assert proc.returncode == 0, proc.stderr
    value = _printed(proc.stdout, "VALUE")
    assert value == {"weights": [[0, 4, 8], [12, 16, 20]], "ranks": 4, "name": "best",
                     "loss": 1.0}
    # A later fit of the same run whose function returns nothing: None, not the earlier value.
    assert _printed(proc.stdout, "NONE") is None


def test_a_return_value_too_large_or_unpicklable_fails_the_run_naming_why(tmp_path: Path):
    proc = run_driver(IMPORTS + f"""
def too_large():
    return b"x" * (5 << 20)


def unpicklable():
    return threading.Lock()


for name, fn in (("large", too_large), ("lock", unpicklable)):
    try:
        JaxTrainer(fn, scaling_config=ScalingConfig(num_workers=1),
                   run_config=RunConfig(name=name, storage_path={str(tmp_path / "runs")!r}),
                   ).fit()
    except TrainingFailedError as e:
        print(name.upper(), json.dumps(str(e)))
    result = Result.from_path(os.path.join({str(tmp_path / "runs")!r}, name))
    assert result.return_value is None and result.error is not None
""", tmp_path)
    assert proc.returncode == 0, proc.stderr
    large = _printed(proc.stdout, "LARGE")
    assert "5242" in large and "limit of 4194304 bytes (4 MiB)" in large, large
    assert "Result.return_value" in large and "checkpoint" in large
    lock = _printed(proc.stdout, "LOCK")
    assert "_thread.lock" in lock and "cannot be pickled" in lock, lock


LOCAL_MODE = IMPORTS + """
import sys

DRIVER_PID = os.getpid()
MAIN = threading.main_thread().ident


class Rounds(UserCallback):
    def __init__(self):
        self.steps = []

    def after_report(self, run_context, metrics, checkpoint):
        self.steps.append(metrics[0]["step"])


def train_func(config):
    ctx = train.get_context()
    # The driver's own process and thread: a debugger's breakpoints stop here.
    assert os.getpid() == DRIVER_PID and threading.get_ident() == MAIN
    assert (ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()) == (0, 1, 0)
    import jax
    from jax._src.distributed import global_state
    assert global_state.client is None and jax.process_count() == 1  # no jax.distributed

    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            with open(os.path.join(d, "state.json")) as f:
                start = json.load(f)["step"] + 1
    for step in range(start, start + config["steps"]):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": step}, f)
            train.report({"step": step, "loss": 1.0 / (step + 1)},
                         checkpoint=Checkpoint.from_directory(d))
    return {"pid": os.getpid(), "resumed_at": start, "weights": np.ones(3) * start}


def fit(callback):
    return JaxTrainer(
        train_func,
        train_loop_config={"steps": 3},
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name="local", storage_path=sys.argv[1], callbacks=[callback],
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    ).fit()
"""


def test_local_mode_runs_the_function_in_the_driver_and_resumes_from_its_checkpoint(
        tmp_path: Path):
    runs = tmp_path / "runs"
    proc = run_driver((LOCAL_MODE + """
for fit_number in (1, 2):
    callback = Rounds()
    result = fit(callback)
    frame = result.metrics_dataframe
    print("FIT", json.dumps({
        "metrics": result.metrics, "checkpoint": os.path.basename(result.checkpoint.path),
        "kept": [os.path.basename(c.path) for c, _ in result.best_checkpoints],
        "returned": {"pid": result.return_value["pid"] == DRIVER_PID,
                     "resumed_at": result.return_value["resumed_at"],
                     "weights": result.return_value["weights"].tolist()},
        "rounds": frame["step"].tolist(), "callback": callback.steps}))
""").replace("sys.argv[1]", repr(str(runs))), tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, second = [json.loads(line.split("FIT ", 1)[1])
                     for line in proc.stdout.splitlines() if line.startswith("FIT ")]
    assert first["metrics"] == {"step": 2, "loss": 1 / 3}
    assert first["checkpoint"] == "checkpoint_000003"
    assert first["kept"] == ["checkpoint_000002", "checkpoint_000003"]  # num_to_keep=2
    assert first["returned"] == {"pid": True, "resumed_at": 0, "weights": [0, 0, 0]}
    assert first["rounds"] == [0, 1, 2] and first["callback"] == [0, 1, 2]
    # The second fit of the same name starts from the first one's latest checkpoint.
    assert second["returned"] == {"pid": True, "resumed_at": 3, "weights": [3, 3, 3]}
    assert second["checkpoint"] == "checkpoint_000006"
    assert second["kept"] == ["checkpoint_000005", "checkpoint_000006"]
    assert second["rounds"] == [0, 1, 2, 3, 4, 5] and second["callback"] == [3, 4, 5]
    state = json.loads((runs / "local" / "run.json").read_text())
    assert state["status"] == "FINISHED"
    assert state["config"]["scaling_config"]["num_workers"] == 0
    assert sorted(p.name for p in (runs / "local").glob("checkpoint_*")) == [
        "checkpoint_000005", "checkpoint_000006"]


def test_a_pdb_breakpoint_in_the_function_stops_the_driver(tmp_path: Path):
    """What local mode is for: `breakpoint()` in the training function opens pdb on the driver's
    own terminal (here its stdin), where the function's variables can be looked at."""
    script = tmp_path / "driver.py"
    script.write_text(IMPORTS + f"""
def train_func():
    secret = 6 * 7
    breakpoint()
    train.report({{"secret": secret}})
    return secret


result = JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers=0),
                    run_config=RunConfig(name="pdb", storage_path={str(tmp_path / "runs")!r}),
                    ).fit()
print("RETURNED", result.return_value)
""")
    env = dict(os.environ, PYTHONBREAKPOINT="pdb.set_trace")
    proc = run_command([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=180,
                       input="p 'seen', secret\nc\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "('seen', 42)" in proc.stdout, proc.stdout
    assert "RETURNED 42" in proc.stdout


def test_local_mode_raises_the_functions_error_without_a_restart(tmp_path: Path):
    runs = tmp_path / "runs"
    proc = run_driver(IMPORTS + f"""
def train_func():
    train.report({{"step": 0}})
    raise ValueError("bad batch 7")


try:
    JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers=0),
               run_config=RunConfig(name="fails", storage_path={str(runs)!r},
                                    failure_config=FailureConfig(max_failures=3))).fit()
except TrainingFailedError as e:
    assert isinstance(e.__cause__, ValueError), repr(e.__cause__)  # for a post-mortem
    print("ERROR", json.dumps(str(e)))
""", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ValueError: bad batch 7" in _printed(proc.stdout, "ERROR")
    state = json.loads((runs / "fails" / "run.json").read_text())
    assert state["status"] == "ERRORED" and len(state["attempts"]) == 1
