"""Preemption with real JAX workers: a SIGTERM the run did not send is a notice. Every rank sees
it at the same get_preemption_info() call, the just-in-time checkpoint is committed, the group is
restarted from it against its own budget, and the run ends as an undisturbed one does."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import pytest

from jaxtrain import (
    Checkpoint,
    FailureConfig,
    JaxTrainer,
    PreemptionError,
    PreemptionInfo,
    RunConfig,
    ScalingConfig,
)

STEPS = 24


def _train(config):
    """Ray Train V2's documented pattern, imports changed: a periodic checkpoint every
    config["every"] steps, and on a preemption notice one just-in-time checkpoint. On attempt 0,
    rank 2 gets a SIGTERM from outside at step config["signal_at"] (as a reclaimed VM's shutdown
    sends it)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxtrain as train

    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    state, start = 1.0, 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = json.loads(Path(d, "state.json").read_text())
            state, start = saved["state"], saved["step"] + 1
    saved_on_preemption = False
    for step in range(start, STEPS):
        # A real collective each step: every rank's share of the update.
        share = multihost_utils.process_allgather(jnp.asarray([rank + 1.0]))
        state = float(state * 0.9 + np.sum(np.asarray(share)) / (step + 1))
        if step == config["signal_at"] and attempt == 0 and rank == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        metrics = {"step": step, "state": state, "attempt": attempt}
        info = train.get_preemption_info()
        due = (step + 1) % config["every"] == 0
        time.sleep(config["step_s"])
        if info is not None and not saved_on_preemption and config["save_on_notice"]:
            Path(config["out"], f"seen-{attempt}-{rank}").write_text(json.dumps(
                {"step": step, "ranks": info.preempted_ranks, "nodes": info.preempted_node_ids,
                 "deadline_ms": info.deadline_ms}))
            saved_on_preemption = due = True
        if due:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    Path(d, "state.json").write_text(json.dumps({"state": state, "step": step}))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
    jax.block_until_ready(jnp.zeros(()))


def _fit(tmp_path, name, *, signal_at=11, save_on_notice=True, every=8, step_s=0.0,
         **failure):
    return JaxTrainer(
        _train,
        train_loop_config={"out": str(tmp_path), "signal_at": signal_at,
                           "save_on_notice": save_on_notice, "every": every, "step_s": step_s},
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(name=name, storage_path=str(tmp_path / "results"),
                             failure_config=FailureConfig(max_failures=0, **failure)),
    ).fit()


def _rows(result):
    return [json.loads(line)["metrics"]
            for line in Path(result.path, "result.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The final state of the same training without a preemption."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    return _fit(tmp, "undisturbed", signal_at=-1).metrics["state"]


def test_a_preempted_run_saves_just_in_time_and_finishes_as_an_undisturbed_one(
        tmp_path, undisturbed):
    result = _fit(tmp_path, "preempted")

    run = json.loads(Path(result.path, "run.json").read_text())
    attempts = run["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"]
    failure = attempts[0]["failure"]
    assert failure["cause"] == "preemption", failure
    assert failure["rank"] == 2
    assert "by SIGTERM" in failure["message"] and "was committed" in failure["message"], failure
    assert failure["preemption"]["drain_timed_out"] is False
    host = attempts[0]["failure"]["host"]
    assert failure["preemption"]["preempted_node_to_ranks"] == {host: [0, 1, 2, 3]}
    assert failure["decision"]["action"] == "retry"
    assert "max_preemption_failures" in failure["decision"]["reason"]

    # Every rank saw the notice at the same step, with the same content.
    seen = [json.loads((tmp_path / f"seen-0-{rank}").read_text()) for rank in range(4)]
    assert all(s == seen[0] for s in seen), seen
    assert seen[0]["ranks"] == [0, 1, 2, 3] and seen[0]["nodes"] == [host]
    assert seen[0]["deadline_ms"] > 0
    jit_step = seen[0]["step"]
    assert 11 <= jit_step <= 13, jit_step  # the notice is agreed within a step or two

    # The restart resumed from the just-in-time checkpoint; at most one step was redone.
    rows = _rows(result)
    first = [r["step"] for r in rows if r["attempt"] == 0]
    second = [r["step"] for r in rows if r["attempt"] == 1]
    assert second[0] == jit_step + 1, (first, second)
    assert first[-1] == jit_step, (first, second)  # nothing past the just-in-time checkpoint
    assert second[-1] == STEPS - 1
    assert result.metrics["state"] == pytest.approx(undisturbed, rel=1e-12)
    assert result.error is None


def test_without_a_checkpoint_the_deadline_stops_the_group_and_the_run_goes_on(tmp_path,
                                                                              undisturbed):
    # No checkpoint after the notice for 10 steps of 0.25 s, past a grace of 1 s.
    result = _fit(tmp_path, "deadline", save_on_notice=False, every=12, signal_at=13,
                  step_s=0.25, preemption_grace_s=1.0)
    attempts = json.loads(Path(result.path, "run.json").read_text())["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"]
    failure = attempts[0]["failure"]
    assert failure["cause"] == "preemption"
    assert failure["preemption"]["drain_timed_out"] is True
    assert "its deadline passed" in failure["message"], failure
    assert attempts[1]["restored_from"].endswith("checkpoint_000012")
    assert not list(tmp_path.glob("seen-*"))
    assert result.metrics["state"] == pytest.approx(undisturbed, rel=1e-12)


def test_preemptions_past_their_budget_raise_a_preemption_error(tmp_path):
    with pytest.raises(PreemptionError) as caught:
        _fit(tmp_path, "budget", max_preemption_failures=0)
    e = caught.value
    assert e.cause == "preemption" and e.rank == 2
    assert isinstance(e.preemption_info, PreemptionInfo)
    assert e.preemption_info.preempted_ranks == [0, 1, 2, 3]
    assert e.drain_timed_out is False
    assert "over the 0 restarts that FailureConfig.max_preemption_failures allows" in str(e) or \
        "preempted" in str(e)


def test_failure_config_checks_the_preemption_fields():
    with pytest.raises(ValueError, match="max_preemption_failures"):
        FailureConfig(max_preemption_failures=-2)
    with pytest.raises(ValueError, match="preemption_grace_s"):
        FailureConfig(preemption_grace_s=0)
    with pytest.raises(ValueError, match="preemption_grace_s"):
        FailureConfig(preemption_grace_s="30")
    assert FailureConfig().max_preemption_failures == -1
    assert FailureConfig().preemption_grace_s == 30.0


def test_get_preemption_info_outside_a_training_function_is_refused():
    import jaxtrain

    with pytest.raises(RuntimeError, match="get_preemption_info"):
        jaxtrain.get_preemption_info()
