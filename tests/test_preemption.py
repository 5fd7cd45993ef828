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


# --- Automatic save: a training function that never calls get_preemption_info() -------------


def _train_registered(config):
    """Registers its just-in-time save once (on_preemption: the files of rank 0's state;
    orbax.save_on_preemption: a state sharded over both processes) and otherwise only reports
    metrics: no periodic checkpoint, no get_preemption_info(). On attempt 0, rank 1 gets a SIGTERM
    from outside at step config["signal_at"]."""
    import time

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxtrain as train
    from jaxtrain import orbax as jt_orbax

    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    last = {}
    mesh = jax.make_mesh((2,), ("x",))
    shardings = {"w": NamedSharding(mesh, P("x")), "step": NamedSharding(mesh, P())}

    def init():
        return {"w": jnp.arange(8.0), "step": jnp.zeros((), jnp.int32)}

    step_fn = jax.jit(lambda s: {"w": s["w"] * 0.9 + jnp.sum(s["w"]) / (s["step"] + 1.0),
                                 "step": s["step"] + 1}, out_shardings=shardings)
    if config["orbax"]:
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                jax.eval_shape(init), shardings)
        state = jt_orbax.restore(abstract)
        jt_orbax.save_on_preemption(lambda: state)
    else:
        state = None
        checkpoint = train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                saved = json.loads(Path(d, "state.json").read_text())
            state = jax.jit(lambda: {"w": jnp.asarray(saved["w"]),
                                     "step": jnp.asarray(saved["step"], jnp.int32)},
                            out_shardings=shardings)()

        def save(directory):
            if rank == 0:  # process_allgather gave every process the whole state
                Path(directory, "state.json").write_text(json.dumps(last))

        train.on_preemption(save)
    if state is None:
        state = jax.jit(init, out_shardings=shardings)()
    start = int(state["step"].addressable_data(0))
    if attempt > 0:
        Path(config["out"], f"resumed-{rank}").write_text(str(start))
    for step in range(start, config["steps"]):
        state = step_fn(state)
        if step == config["signal_at"] and attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        w = [float(x) for x in multihost_utils.process_allgather(state["w"], tiled=True)]
        last.update(w=w, step=step + 1)
        train.report({"step": step, "w": w, "attempt": attempt})


def _fit_registered(tmp_path, name, *, orbax, signal_at=6):
    return JaxTrainer(
        _train_registered,
        train_loop_config={"out": str(tmp_path), "signal_at": signal_at, "orbax": orbax,
                           "steps": 20},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path / "results"),
                             failure_config=FailureConfig(max_failures=0)),
    ).fit()


@pytest.mark.parametrize("orbax", [False, True], ids=["on_preemption", "orbax"])
def test_a_registered_save_is_the_just_in_time_checkpoint_without_code_for_it(tmp_path, orbax):
    if orbax:
        pytest.importorskip("orbax.checkpoint")
    undisturbed = _fit_registered(tmp_path / "undisturbed", "undisturbed", orbax=orbax,
                                  signal_at=-1).metrics
    result = _fit_registered(tmp_path, "registered", orbax=orbax)

    attempts = json.loads(Path(result.path, "run.json").read_text())["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"], attempts
    failure = attempts[0]["failure"]
    assert failure["cause"] == "preemption" and failure["rank"] == 1, failure
    assert "by SIGTERM" in failure["message"] and "was committed" in failure["message"], failure
    assert failure["preemption"]["drain_timed_out"] is False
    # The only checkpoint of the run is the registered save's, made at the agreed report.
    rows = _rows(result)
    first = [r["step"] for r in rows if r["attempt"] == 0]
    second = [r["step"] for r in rows if r["attempt"] == 1]
    jit_step = first[-1]
    # The notice is agreed at a report after it, before the run's end: a step or two later on
    # an idle machine, more on a busy one (how many is the machine's latency, not asserted).
    assert 6 <= jit_step < 19, first
    assert attempts[1]["restored_from"].endswith(f"checkpoint_{jit_step + 1:06d}"), attempts[1]
    assert [(tmp_path / f"resumed-{r}").read_text() for r in range(2)] == [str(jit_step + 1)] * 2
    assert second[0] == jit_step + 1, (first, second)  # nothing redone
    assert first == list(range(jit_step + 1)) and second[-1] == 19
    logs = Path(result.path, "logs")
    for rank in range(2):
        assert "saving the just-in-time checkpoint" in (logs / f"rank-{rank}.log").read_text()
    assert result.metrics["w"] == pytest.approx(undisturbed["w"], rel=1e-6)
    assert result.metrics["step"] == undisturbed["step"] == 19


def test_on_preemption_checks_its_argument(tmp_path):
    def train_func(config):
        import jaxtrain as train
        from jaxtrain import orbax as jt_orbax

        for call, expected in ((lambda: train.on_preemption("save"), "save_fn='save'"),
                               (lambda: jt_orbax.save_on_preemption(3), "state_fn=3"),
                               (lambda: jt_orbax.save_on_preemption(lambda: 1, item="a/b"),
                                "item='a/b'")):
            try:
                call()
            except (TypeError, ValueError) as e:
                assert expected in str(e), e
            else:
                raise AssertionError(f"{expected} was accepted")
        train.on_preemption(lambda d: None)
        train.on_preemption(None)
        train.report({"ok": 1})

    result = JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers=1),
                        run_config=RunConfig(name="args", storage_path=str(tmp_path))).fit()
    assert result.metrics == {"ok": 1}
    with pytest.raises(RuntimeError, match="on_preemption"):
        import jaxtrain

        jaxtrain.on_preemption(lambda d: None)
