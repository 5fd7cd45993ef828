"""A hung run says which rank stopped and where: every rank's stacks are kept in the run
directory and the failure blames the rank the others wait for (docs/failure-detection.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import finish_driver, start_driver
from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError
from jaxtrain.cli import main

# Long enough for a step under a loaded machine, short enough for the suite.
WATCHDOG_S = 4.0


def _blocks_at_step_5(config):
    """The issue's scenario: at step 5 rank 1 calls a function that never returns while rank 0
    waits for it in multihost_utils.process_allgather."""
    import threading

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from jaxtrain import get_context, report

    def block_forever():
        threading.Event().wait()

    rank = get_context().get_world_rank()
    for step in range(100):
        if step == 5 and rank == 1:
            block_forever()
        multihost_utils.process_allgather(jnp.float32(step))
        report({"step": step})


def _loader_stops_at_batch_5(config):
    """Rank 1's data loader stops at batch 5 while rank 0 computes and then waits for it."""
    import queue

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()

    def next_batch(i):
        if rank == 1 and i == 5:
            return queue.Queue().get()  # a read that never returns
        return jnp.ones((8,)) * i

    for step in range(100):
        batch = next_batch(step)
        loss = (batch * batch).sum()
        multihost_utils.process_allgather(loss)
        report({"step": step})


def _blocks_at_step_5_for_a_while(config):
    """As _blocks_at_step_5, but rank 1 gives up after a deadline far beyond the watchdog's (so
    that a run whose watchdog is off fails, rather than hangs)."""
    import threading

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    for step in range(100):
        if step == 5 and rank == 1:
            threading.Event().wait(120)
            raise RuntimeError("the watchdog did not stop the hung group")
        multihost_utils.process_allgather(jnp.float32(step))
        report({"step": step})


def _slow_compile_then_a_long_checkpoint(config):
    """Quick steps (a median step time of milliseconds), but a first compilation, a later one
    and a checkpoint each far slower than 10 steps, though under the floor."""
    import tempfile
    import time

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from jaxtrain import Checkpoint, report

    slow_s = config["slow_s"]
    time.sleep(slow_s)  # the first compilation: before the first report()
    for step in range(12):
        if step == 6:
            time.sleep(slow_s)  # a later compilation
        multihost_utils.process_allgather(jnp.float32(step))
        if step == 9:
            with tempfile.TemporaryDirectory() as d:
                time.sleep(slow_s)  # writing a large checkpoint
                Path(d, "step").write_text(str(step))
                report({"step": step}, checkpoint=Checkpoint.from_directory(d))
        else:
            report({"step": step})


def _fit_hung(fn, storage: str, name: str,
              failure_config: FailureConfig | None = None) -> tuple[dict, Path]:
    if failure_config is None:
        failure_config = FailureConfig(max_failures=0, progress_timeout_s=WATCHDOG_S)
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(
            fn, scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name=name, storage_path=storage, failure_config=failure_config),
        ).fit()
    run_dir = Path(storage, name)
    failure = json.loads((run_dir / "run.json").read_text())["attempts"][0]["failure"]
    assert failure["cause"] == "watchdog", failure
    assert failure["message"] in str(e.value)
    return failure, run_dir


def test_the_rank_that_never_arrives_is_blamed_with_every_ranks_stacks(tmp_path, capsys):
    failure, run_dir = _fit_hung(_blocks_at_step_5, str(tmp_path), "blocked")
    assert failure["rank"] == 1, failure["message"]
    assert "the others wait for 1 on " in failure["message"]
    assert "block_forever" in failure["message"]
    assert failure["stacks"] == "stacks/attempt-0"
    stacks = run_dir / failure["stacks"]
    assert f"every rank's stacks: {stacks}" in failure["message"]
    rank0 = (stacks / "rank-0.txt").read_text()
    rank1 = (stacks / "rank-1.txt").read_text()
    assert "# report() calls in this attempt: 5" in rank0
    assert "in JAX at multihost_utils.py" in rank0 and "process_allgather" in rank0
    assert "in block_forever" in rank1
    assert "# where: at test_hang.py" in rank1
    capsys.readouterr()
    assert main(["show", str(run_dir)]) == 0
    assert f"stacks: {stacks}/ rank-0.txt rank-1.txt" in capsys.readouterr().out


def test_a_rank_stopped_in_its_data_loader_is_blamed(tmp_path):
    failure, run_dir = _fit_hung(_loader_stops_at_batch_5, str(tmp_path), "loader")
    assert failure["rank"] == 1, failure["message"]
    assert "in next_batch" in failure["message"]
    rank1 = (run_dir / failure["stacks"] / "rank-1.txt").read_text()
    assert "in next_batch" in rank1 and "queue.py" in rank1


def test_the_default_watchdog_stops_a_hung_run(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_PROGRESS_TIMEOUT_FLOOR_S", str(WATCHDOG_S))
    failure, _ = _fit_hung(_blocks_at_step_5_for_a_while, str(tmp_path), "default",
                           FailureConfig())
    assert failure["rank"] == 1, failure["message"]
    assert (f"no report() for {WATCHDOG_S:g} s (the progress watchdog's automatic limit: 10 x the "
            "median step time") in failure["message"]


def test_the_default_watchdog_lets_slow_compilations_and_a_long_checkpoint_pass(
        tmp_path, monkeypatch):
    # Each slow part takes a third of the floor: far over 10 quick steps, under the floor.
    slow_s = 2.0
    monkeypatch.setenv("JAXTRAIN_PROGRESS_TIMEOUT_FLOOR_S", str(3 * slow_s))
    result = JaxTrainer(
        _slow_compile_then_a_long_checkpoint, train_loop_config={"slow_s": slow_s},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="slow", storage_path=str(tmp_path)),
    ).fit()
    assert result.error is None
    assert result.metrics == {"step": 11}
    run = json.loads(Path(result.path, "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["FINISHED"]


LIVE_DRIVER = """
import os, sys, time
from pathlib import Path
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, get_context, report

OUT = Path(sys.argv[1])

def waiting_for_the_test():
    deadline = time.monotonic() + 120
    while not (OUT / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)

def train():
    report({"step": 0})
    (OUT / f"reported-{get_context().get_world_rank()}").touch()
    waiting_for_the_test()
    report({"step": 1})

JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="live", storage_path=str(OUT))).fit()
"""


def test_jaxtrain_stack_prints_every_ranks_stacks_of_a_live_run_without_stopping_it(
        tmp_path, capsys):
    script = tmp_path / "driver.py"
    script.write_text(LIVE_DRIVER)
    driver = start_driver([sys.executable, str(script), str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"reported-{r}").exists() for r in (0, 1)):
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "the ranks never reported"
        time.sleep(0.05)
    capsys.readouterr()
    assert main(["stack", str(tmp_path / "live")]) == 0
    out, err = capsys.readouterr()
    assert "# rank 0 on " in out and "# rank 1 on " in out
    assert out.count("# where: at driver.py:") == 2, out
    assert "in waiting_for_the_test" in out
    assert "stacks/attempt-0/live-1" in err
    (tmp_path / "go").touch()
    done = finish_driver(driver, timeout=120)
    assert done.returncode == 0, done.stderr


def test_jaxtrain_stack_of_a_run_without_a_live_driver_says_so(tmp_path, capsys):
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "run.json").write_text(json.dumps({"status": "FINISHED"}))
    assert main(["stack", str(tmp_path / "gone")]) == 2
    assert "no driver of the run in" in capsys.readouterr().err


PROFILED_DRIVER = """
import sys, time
from pathlib import Path
import jax, jax.numpy as jnp
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, get_context, report

OUT = Path(sys.argv[1])

def train():
    step = jax.jit(lambda x: (x @ x).sum())
    deadline = time.monotonic() + 120
    i = 0
    while not (OUT / "go").exists() and time.monotonic() < deadline:
        report({"step": i, "loss": float(step(jnp.ones((64, 64)) * i))})
        if i == 0:
            (OUT / f"reported-{get_context().get_world_rank()}").touch()
        i += 1
        time.sleep(0.02)

JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="profiled", storage_path=str(OUT))).fit()
"""


def _wait_for(condition, driver, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_jaxtrain_profile_traces_n_steps_on_every_rank_into_the_run_directory(tmp_path, capsys):
    script = tmp_path / "driver.py"
    script.write_text(PROFILED_DRIVER)
    driver = start_driver([sys.executable, str(script), str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: all((tmp_path / f"reported-{r}").exists() for r in (0, 1)), driver,
              "the ranks never reported")
    capsys.readouterr()
    assert main(["profile", str(tmp_path / "profiled"), "--steps", "3"]) == 0
    out, err = capsys.readouterr()
    folder = Path(out.strip())
    assert folder == tmp_path / "profiled" / "profiles" / "attempt-0" / "profile-1"
    assert f"tensorboard --logdir {folder}" in err
    for rank in (0, 1):
        _wait_for(lambda r=rank: list((folder / f"rank-{r}").glob(
            "plugins/profile/*/perfetto_trace.json.gz")), driver, f"rank {rank} wrote no trace")
        assert list((folder / f"rank-{rank}").glob("plugins/profile/*/*.xplane.pb"))
    (tmp_path / "go").touch()
    done = finish_driver(driver, timeout=120)
    assert done.returncode == 0, done.stderr
