"""Stragglers end to end: three real workers, one of them slower at every step; the controller
names it once on the console, records it in run.json, and a driver-side callback is told."""

from __future__ import annotations

import json
from pathlib import Path

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, UserCallback


class Stragglers(UserCallback):
    def __init__(self):
        self.events = []

    def on_straggler(self, run_context, event):
        self.events.append((run_context.attempt, event.rank, event.slow,
                            event.step_time_s > event.median_step_time_s))


def _train(config):
    import time

    import jax.numpy as jnp

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    x = jnp.ones((8, 8))
    for step in range(config["steps"]):
        x = (x @ x) / 8.0
        # The workload of a slow host: rank 2 takes longer per step than the others.
        time.sleep(config["slow_s"] if rank == 2 else config["fast_s"])
        report({"step": step, "x": float(x[0, 0])})


def test_a_persistently_slow_rank_is_named_once_and_told_to_callbacks(storage, capfd):
    seen = Stragglers()
    result = JaxTrainer(
        _train, train_loop_config={"steps": 12, "slow_s": 0.3, "fast_s": 0.01},
        scaling_config=ScalingConfig(num_workers=3),
        run_config=RunConfig(name="slow_rank", storage_path=storage, callbacks=[seen]),
    ).fit()
    assert result.error is None
    # Rank 2's step time is judged once its window of intervals is full (6 reports), and it is
    # a straggler after 3 consecutive slow rounds; it stays one until the end of the attempt.
    assert seen.events == [(0, 2, True, True)]
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "straggler" in line]
    assert len(said) == 1, err
    assert said[0].startswith("jaxtrain: rank 2 (host ") and "is a straggler: its step time is" \
        in said[0]
    [attempt] = json.loads(Path(result.path, "run.json").read_text())["attempts"]
    [event] = attempt["stragglers"]
    assert (event["rank"], event["slow"]) == (2, True)
    assert event["step_time_s"] > 1.5 * event["median_step_time_s"]
