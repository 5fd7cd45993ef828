"""Failures with real JAX workers: each kind is detected, the whole group restarts from the latest
committed checkpoint, and nothing is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import pid_alive, start_driver
from jaxtrain import (
    Checkpoint,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)

STEPS = 6


def _faulty(config):
    """Trains STEPS steps with a checkpoint each step; on attempt 0, rank 1 fails at step 3 in
    the way config["fault"] says."""
    import jax  # noqa: F401
    from jax.experimental import multihost_utils

    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    Path(config["out"], f"pid-{attempt}-{rank}").write_text(str(os.getpid()))
    start = 0
    if get_checkpoint() is not None:
        with get_checkpoint().as_directory() as d:
            start = int(Path(d, "step").read_text()) + 1
    for step in range(start, STEPS):
        if step == 3 and attempt < config.get("fail_attempts", 1):
            multihost_utils.sync_global_devices("reports of steps 0-2 are sent")
            if rank == 1:
                fault = config["fault"]
                if fault == "raise":
                    raise RuntimeError("injected failure")
                if fault == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault == "sigstop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if fault == "exit0":
                    os._exit(0)
            else:
                time.sleep(3600)  # waits in "a collective" until the group is stopped
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                Path(d, "step").write_text(str(step))
            report({"step": step, "attempt": attempt},
                   checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)


def _fit(storage, tmp_path, name, fault, **failure):
    return JaxTrainer(
        _faulty,
        train_loop_config={"out": str(tmp_path), "fault": fault,
                           "fail_attempts": failure.pop("fail_attempts", 1)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage,
                             failure_config=FailureConfig(**failure)),
    ).fit()


def _assert_recovered(result, tmp_path, cause):
    run = json.loads(Path(result.path, "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    failure = run["attempts"][0]["failure"]
    assert failure["cause"] == cause
    if cause == "watchdog":
        # Rank 0 waits for the stopped rank 1: both may stall past the limit, so the message names
        # every stale rank with its host. Each is pinged: rank 0, waiting, answers; rank 1,
        # stopped, does not, and is blamed whichever reported last longest ago.
        host = re.escape(socket.gethostname())
        said = re.search(rf"from rank\(s\) (?:0, )?1 on {host}; rank\(s\) 1 on {host} did not "
                         r"answer a ping within 2 s: stopped \(SIGSTOP\)", failure["message"])
        assert said, failure["message"]
    assert failure["rank"] == 1
    assert run["attempts"][1]["restored_from"].endswith("checkpoint_000003")
    # Steps 0-2 from attempt 0, then 3-5 from attempt 1, resumed from step 2's checkpoint.
    lines = [json.loads(x) for x in Path(result.path, "result.jsonl").read_text().splitlines()]
    assert [(x["metrics"]["step"], x["metrics"]["attempt"]) for x in lines] == [
        (0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert [x.get("checkpoint") for x in lines] == [f"checkpoint_{r:06d}" for r in range(1, 7)]
    assert result.metrics == {"step": 5, "attempt": 1}
    assert result.checkpoint.path.endswith("checkpoint_000006")
    for pid_file in tmp_path.glob("pid-*"):
        assert not pid_alive(int(pid_file.read_text())), pid_file.name


@pytest.mark.parametrize("fault,cause", [("raise", "exception"), ("sigkill", "signal"),
                                         ("exit0", "exit")])
def test_the_group_restarts_from_the_latest_checkpoint_after(fault, cause, storage, tmp_path):
    result = _fit(storage, tmp_path, fault, fault, max_failures=1)
    _assert_recovered(result, tmp_path, cause)


def _fails_right_after_its_report(config):
    """Four steps; rank 0 reports checkpoints at steps 0 and 1, rank 1 metrics only. On attempt 0
    rank 1 raises right after its report of step 1, while rank 0's part of that round (and maybe
    of step 0's) is still being staged: its report() has returned, the part is not yet sent."""
    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    start = 0
    if get_checkpoint() is not None:
        with get_checkpoint().as_directory() as d:
            start = int(Path(d, "step").read_text()) + 1
    for step in range(start, 4):
        if rank == 0 and step < 2:
            with tempfile.TemporaryDirectory() as d:
                Path(d, "step").write_text(str(step))
                Path(d, "weights").write_bytes(os.urandom(1 << 20))
                report({"step": step, "attempt": attempt},
                       checkpoint=Checkpoint.from_directory(d))
        else:
            report({"step": step, "attempt": attempt})
        if rank == 1 and step == 1 and attempt == 0:
            raise RuntimeError("injected failure right after the report of step 1")


def test_a_round_every_rank_reported_is_committed_when_a_rank_fails_right_after(storage):
    result = JaxTrainer(
        _fails_right_after_its_report,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="right-after", storage_path=storage,
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    run = json.loads(Path(result.path, "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    assert run["attempts"][0]["failure"]["rank"] == 1
    # Both rounds of attempt 0 were reported by every rank: recorded, committed, restored from.
    lines = [json.loads(x) for x in Path(result.path, "result.jsonl").read_text().splitlines()]
    assert [(x["metrics"]["step"], x["metrics"]["attempt"], x.get("checkpoint"))
            for x in lines[:2]] == [(0, 0, "checkpoint_000001"), (1, 0, "checkpoint_000002")]
    assert run["attempts"][1]["restored_from"].endswith("checkpoint_000002")
    assert [x["metrics"]["step"] for x in lines[2:]] == [2, 3]
    assert result.metrics == {"step": 3, "attempt": 1}


def test_a_stopped_rank_is_caught_by_the_progress_watchdog(storage, tmp_path):
    result = _fit(storage, tmp_path, "stopped", "sigstop", max_failures=1,
                  progress_timeout_s=2.0)
    _assert_recovered(result, tmp_path, "watchdog")


def test_a_start_up_failure_is_retried_on_its_own_budget(storage, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    try:
        import importlib

        marker = tmp_path / "imported-once"
        os.environ["FLAKY_IMPORT_MARKER"] = str(marker)
        marker.touch()
        flaky = importlib.import_module("flaky_import")  # imports fine here: the marker exists
        marker.unlink()  # the first worker to import it fails
        result = JaxTrainer(
            flaky.train, scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="startup", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=0,
                                                              controller_failure_limit=2)),
        ).fit()
    finally:
        sys.path.pop(0)
        os.environ.pop("FLAKY_IMPORT_MARKER", None)
    run = json.loads(Path(result.path, "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    assert run["attempts"][0]["failure"]["cause"] == "start-up"
    assert "flaky_import: the first import fails on purpose" in \
        run["attempts"][0]["failure"]["message"]
    assert result.metrics == {"started": 1}


def test_a_rank_that_cannot_make_its_registration_says_why(tmp_path, monkeypatch):
    # Rank 0 reserves the coordinator's port before it joins (its registration carries the
    # address); an address that is not this host's cannot be bound, and the rank still reports it.
    monkeypatch.setenv("JAXTRAIN_COORDINATOR_HOST", "192.0.2.1")

    def train():
        pass

    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="unbindable", storage_path=str(tmp_path),
                                        failure_config=FailureConfig(
                                            max_failures=0, controller_failure_limit=0))).fit()
    assert e.value.rank == 0 and e.value.cause == "start-up"
    assert "start-up failed: OSError" in str(e.value)
    assert "_reserve_coordinator" in e.value.worker_traceback


def test_a_spent_budget_raises_with_every_attempt_listed(storage, tmp_path):
    with pytest.raises(TrainingFailedError) as e:
        _fit(storage, tmp_path, "spent", "raise", max_failures=1, fail_attempts=99)
    err = e.value
    assert err.rank == 1 and err.attempt == 0 and err.cause == "exception"
    assert "RuntimeError: injected failure" in err.worker_traceback
    assert "Every failed attempt (2; the restart budget is spent)" in str(err)
    assert "attempt 1: rank 1, exception: RuntimeError: injected failure" in str(err)
    run = json.loads(Path(storage, "spent", "run.json").read_text())
    assert run["status"] == "ERRORED"
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "ERRORED"]
    error_txt = Path(storage, "spent", "error.txt").read_text()
    assert "attempt 0: rank 1" in error_txt and "attempt 1: rank 1" in error_txt


def test_killing_the_driver_leaves_no_worker_running(tmp_path):
    out = tmp_path / "pids"
    out.mkdir()
    driver = start_driver([sys.executable, "-c", f"""
import os, time
from jaxtrain import JaxTrainer, ScalingConfig, RunConfig
def train():
    from jaxtrain import get_context
    rank = get_context().get_world_rank()
    open(os.path.join({str(out)!r}, str(rank)), "w").write(str(os.getpid()))
    while True:
        time.sleep(0.1)
JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="orphans", storage_path={str(tmp_path)!r})).fit()
"""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(out.iterdir())) < 2:
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in out.iterdir()]
    driver.kill()
    driver.wait()
    # The workers notice the controller's connection closing and exit by themselves.
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if pid_alive(p)] == []
