"""Goodput accounting (jaxtrain.goodput): the parts of hand-written records with known numbers,
and of a real run of 2 workers whose rank 1 is SIGKILLed once, checked by their arithmetic only
(they add up to the wall time; which attempt has which parts), never by how long anything took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jaxtrain import Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig, goodput

# --- the pure function on hand-written records ---------------------------------------------------

# A run of two attempts: attempt 0 is ready at 104, reports at 110 (checkpoint 1), 120, 130
# (checkpoint 3) and 140, fails at 150 and is restarted at 155 from checkpoint 3; attempt 1 is
# ready at 157, reports at 160, 170 and 190 and ends at 198; the driver waited 5 s for Slurm,
# started at 100 and ended at 200.
STATE = {
    "name": "known", "status": "FINISHED", "start_time": 100.0, "end_time": 200.0,
    "queue_wait_s": 5.0,
    "attempts": [
        {"attempt": 0, "status": "ERRORED", "start_time": 101.0, "ready_time": 104.0,
         "end_time": 152.0, "restored_from": None,
         "failure": {"rank": 1, "cause": "signal", "time": 150.0,
                     "decision": {"action": "retry", "reason": "1 of 1"}}},
        {"attempt": 1, "status": "FINISHED", "start_time": 155.0, "ready_time": 157.0,
         "end_time": 198.0, "restored_from": "/runs/known/checkpoint_000003"},
    ],
}
ROUNDS = [
    {"round": 1, "time": 110.0, "metrics": {}, "checkpoint": "checkpoint_000001"},
    {"round": 2, "time": 120.0, "metrics": {}},
    {"round": 3, "time": 130.0, "metrics": {}, "checkpoint": "checkpoint_000003"},
    {"round": 4, "time": 140.0, "metrics": {}},
    {"round": 5, "time": 160.0, "metrics": {}},
    {"round": 6, "time": 170.0, "metrics": {}},
    {"round": 7, "time": 190.0, "metrics": {}},
]


def test_the_parts_of_known_records():
    g = goodput.compute(STATE, ROUNDS)
    first, second = g.attempts
    assert first.parts() == {"queue": 0, "startup": 3, "compile": 6, "training": 20,
                             "checkpoint_blocked": 0, "restart": 5, "lost": 20, "shutdown": 0}
    assert (first.attempt, first.status, first.cause, first.wall) == (0, "ERRORED", "signal", 54)
    assert second.parts() == {"queue": 0, "startup": 2, "compile": 3, "training": 30,
                              "checkpoint_blocked": 0, "restart": 0, "lost": 0, "shutdown": 8}
    assert g.parts() == {"queue": 5, "startup": 6, "compile": 9, "training": 50,
                         "checkpoint_blocked": 0, "restart": 5, "lost": 20, "shutdown": 10}
    assert g.wall == 105 and g.fraction == pytest.approx(50 / 105)
    assert not g.live and g.attempt is None
    assert g.line() == ("goodput 47.6 % (training 50.0 s of 105.0 s; queue 5.0 s, start-up "
                        "6.0 s, compile 9.0 s, restarts 5.0 s, lost 20.0 s, shutdown 10.0 s)")
    table = g.table()
    assert table[0].split()[:3] == ["status", "queue", "start-up"]
    assert table[1].split() == ["run", "FINISHED", "5.0", "6.0", "9.0", "50.0", "0.0", "5.0",
                                "20.0", "10.0", "105.0", "47.6", "%"]
    assert table[2].split()[:4] == ["attempt", "0", "ERRORED", "(signal)"]
    assert table[3].split()[:3] == ["attempt", "1", "FINISHED"]
    d = g.to_dict()
    assert d["wall"] == 105 and len(d["attempts"]) == 2 and d["attempts"][0]["lost"] == 20
    json.dumps(d)


def test_a_live_run_counts_to_now_and_from_run_dir_reads_the_records(tmp_path: Path):
    state = json.loads(json.dumps(STATE))
    state["status"] = "RUNNING"
    del state["end_time"]
    del state["attempts"][1]["end_time"]
    state["attempts"][1]["status"] = "RUNNING"
    (tmp_path / "run.json").write_text(json.dumps(state))
    (tmp_path / "result.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROUNDS)
                                           + '{"round": 8, "ti')  # torn by a crash
    g = goodput.from_run_dir(str(tmp_path), now=195.0)
    assert g.live
    assert g.attempts[1].training == 35 and g.attempts[1].shutdown == 0  # 160 to now
    assert g.wall == 100 and g.shutdown == 0  # queue 5 + 95 s of driver
    with pytest.raises(FileNotFoundError, match="no run.json"):
        goodput.from_run_dir(str(tmp_path / "missing"))


def test_this_drivers_part_of_a_resumed_run_leaves_the_earlier_drivers_attempts_out():
    # A second driver started at 153 and resumed the run with attempt 1 (at 155): its fit() says
    # its own part, attempt 0 being the first driver's.
    state = json.loads(json.dumps(STATE))
    state["start_time"] = 153.0
    own = goodput.compute(state, ROUNDS, this_driver=True)
    assert [a.attempt for a in own.attempts] == [1]
    assert own.parts() == {"queue": 5, "startup": 2 + 2, "compile": 3, "training": 30,
                           "checkpoint_blocked": 0, "restart": 0, "lost": 0, "shutdown": 8 + 2}
    assert own.wall == 52
    whole = goodput.compute(state, ROUNDS)
    assert len(whole.attempts) == 2 and whole.wall == own.wall + 54


def test_records_without_the_split_times_count_start_up_until_the_first_report():
    state = json.loads(json.dumps(STATE))
    for a in state["attempts"]:
        del a["ready_time"]
    g = goodput.compute(state, ROUNDS)
    assert g.attempts[0].startup == 9 and g.attempts[0].compile == 0
    assert g.wall == 105


def test_steps_after_the_last_report_are_training_until_the_functions_returned():
    # Attempt 1's last report is at 190; its last function returned at 195, it ended at 198.
    state = json.loads(json.dumps(STATE))
    state["attempts"][1]["returned_time"] = 195.0
    second = goodput.compute(state, ROUNDS).attempts[1]
    assert (second.training, second.shutdown) == (35, 3)
    # A time outside the span it can fall in is bounded by the last report and the end.
    state["attempts"][1]["returned_time"] = 185.0
    assert goodput.compute(state, ROUNDS).attempts[1].shutdown == 8


def test_an_attempts_queue_wait_is_queue_not_start_up():
    # Attempt 1's launch waited 1.5 s of its 2 s start-up for Kueue to admit its JobSet.
    state = json.loads(json.dumps(STATE))
    state["attempts"][1]["queue_wait_s"] = 1.5
    state["attempts"][0]["queue_wait_s"] = 0.0
    g = goodput.compute(state, ROUNDS)
    first, second = g.attempts
    assert first.queue == 0 and first.startup == 3
    assert second.queue == 1.5 and second.startup == 0.5 and second.wall == 43
    assert g.queue == 5 + 1.5 and g.startup == 6 - 1.5 and g.wall == 105
    assert sum(g.parts().values()) == pytest.approx(g.wall)
    assert "queue 6.5 s" in g.line()


def test_an_attempt_queued_now_has_waited_all_its_time():
    state = json.loads(json.dumps(STATE))
    state["status"] = "RUNNING"
    del state["end_time"]
    queued = state["attempts"][1]
    for name in ("end_time", "ready_time"):
        del queued[name]
    queued.update(status="RUNNING", phase="queued", queue_wait_s=0.0)
    g = goodput.compute(state, ROUNDS[:4], now=165.0)
    assert g.attempts[1].queue == 10 and g.attempts[1].startup == 0
    assert g.attempts[1].wall == 10
    assert g.queue == 15


def test_a_function_that_never_reported_has_no_training_and_says_goodput_was_not_measured():
    # One attempt, ready at 104, its function returned at 190, ended at 198; no round.
    state = json.loads(json.dumps(STATE))
    state["attempts"] = [dict(state["attempts"][1], start_time=101.0, ready_time=104.0,
                              returned_time=190.0, end_time=198.0, restored_from=None)]
    g = goodput.compute(state, [])
    (only,) = g.attempts
    assert (only.startup, only.compile, only.training, only.shutdown) == (3, 86, 0, 8)
    assert not g.reported and not only.reported and g.training == 0
    assert g.line() == ("goodput not measured: the training function never called report(), so "
                        "training cannot be told from import and compilation (105.0 s in all: "
                        "queue 5.0 s, start-up 4.0 s, compile 86.0 s, shutdown 10.0 s)")
    # Running, before its first report: compilation so far, not training.
    state["status"] = only_status = "RUNNING"
    del state["end_time"]
    state["attempts"][0].update(status=only_status)
    for name in ("end_time", "returned_time"):
        del state["attempts"][0][name]
    live = goodput.compute(state, [], now=150.0)
    assert (live.attempts[0].compile, live.attempts[0].training) == (46, 0)
    # Rounds, once reported, are training as before.
    assert goodput.compute(STATE, ROUNDS).reported


# --- a real run ----------------------------------------------------------------------------------

STEPS = 6
FAIL_AT = 5  # steps 0-4 are rounds 1-5 of attempt 0; the checkpoint of step 2 is round 3's


def _train(config):
    import time

    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    start = 0
    if get_checkpoint() is not None:
        with get_checkpoint().as_directory() as d:
            start = int(Path(d, "step").read_text()) + 1
    for step in range(start, STEPS):
        if step == FAIL_AT and ctx.get_attempt() == 0 and ctx.get_world_rank() == 1:
            # Rounds 4 and 5, after the checkpoint, are recorded before the rank dies: their
            # time is lost to the restart.
            result = Path(config["run_dir"], "result.jsonl")
            while not result.exists() or result.read_text().count("\n") < FAIL_AT:
                time.sleep(0.05)
            os.kill(os.getpid(), 9)
        if step == 2 and ctx.get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as d:
                Path(d, "step").write_text(str(step))
                report({"step": step}, checkpoint=Checkpoint.from_directory(d))
        else:
            report({"step": step})


def _no_report():
    import jax.numpy as jnp

    return float(jnp.arange(4).sum())


def test_a_fit_without_reports_ends_saying_goodput_was_not_measured_and_where_the_run_is(
        tmp_path: Path, capfd):
    result = JaxTrainer(_no_report, scaling_config=ScalingConfig(num_workers=1),
                        run_config=RunConfig(name="quiet", storage_path=str(tmp_path))).fit()
    err = capfd.readouterr().err
    assert result.goodput.training == 0 and not result.goodput.reported
    assert "jaxtrain: goodput not measured: the training function never called report()" in err
    assert (f"jaxtrain: run 'quiet' finished; its metrics, checkpoints and logs are in "
            f"{tmp_path / 'quiet'}\n") in err, err


def test_a_run_with_a_killed_rank(tmp_path: Path, capfd):
    storage = str(tmp_path)
    run_dir = os.path.join(storage, "killed")
    result = JaxTrainer(
        _train, train_loop_config={"run_dir": run_dir},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="killed", storage_path=storage,
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    state = json.loads(Path(run_dir, "run.json").read_text())
    g = result.goodput
    assert g is not None and not g.live
    first, second = g.attempts
    assert (first.status, first.cause, second.status) == ("ERRORED", "signal", "FINISHED")

    # The parts add up to the wall time: the run's, and each attempt's.
    a0, a1 = state["attempts"]
    assert g.wall == pytest.approx(
        state["end_time"] - state["start_time"] + state["queue_wait_s"], abs=1e-6)
    assert first.wall == pytest.approx(a1["start_time"] - a0["start_time"], abs=1e-6)
    assert second.wall == pytest.approx(a1["end_time"] - a1["start_time"], abs=1e-6)
    driver = {"queue": state["queue_wait_s"], "startup": a0["start_time"] - state["start_time"],
              "shutdown": state["end_time"] - a1["end_time"]}
    for name in goodput.PARTS:
        assert getattr(first, name) >= 0 and getattr(second, name) >= 0, name
        assert getattr(g, name) == pytest.approx(
            getattr(first, name) + getattr(second, name) + driver.get(name, 0.0), abs=1e-6)
    # Only the failed attempt restarted and lost progress.
    assert first.restart > 0 and first.lost > 0
    assert second.restart == 0 and second.lost == 0
    assert first.training > 0 and second.training > 0
    assert 0 < g.fraction < 1
    assert state["queue_wait_s"] == 0  # no Slurm: nothing waited
    # The finished attempt recorded when its last function returned, after its last round.
    last_round = json.loads(Path(run_dir, "result.jsonl").read_text().splitlines()[-1])
    assert "returned_time" not in a0
    assert last_round["time"] <= a1["returned_time"] <= a1["end_time"], a1

    # fit() said it once.
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("jaxtrain: goodput ")]
    assert lines == [f"jaxtrain: {g.line()}"], err

    # jaxtrain show prints the table: the run and each attempt.
    shown = subprocess.run([sys.executable, "-m", "jaxtrain", "show", run_dir],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("goodput "))
    assert out[at].startswith(f"goodput    {100 * g.fraction:.1f} %")
    header, run, shown_first, shown_second = (line.strip() for line in out[at + 1:at + 5])
    assert header.split()[:2] == ["status", "queue"] and header.endswith("wall  goodput")
    assert run.split()[:2] == ["run", "FINISHED"]
    assert shown_first.split()[:4] == ["attempt", "0", "ERRORED", "(signal)"]
    assert shown_second.split()[:3] == ["attempt", "1", "FINISHED"]
