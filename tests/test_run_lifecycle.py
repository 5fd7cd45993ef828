"""A run's lifecycle and records, end to end with real driver and worker processes and real JAX:
one driver per run directory, a killed driver's run marked crashed and resumed, a full disk that
fails the run instead of losing metrics, the run secret kept out of every worker's environment,
SIGTERM stopping a run cleanly, and requests that cannot be met refused before anything starts.

The tests synchronise with the workers through FIFOs (a worker writes to one when it has reached a
point, and waits on another until the test lets it go), never by sleeping.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from conftest import REPO, Fifo, pid_alive, start_driver
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, _core
from jaxtrain.errors import TrainingFailedError

JAXTRAIN = [sys.executable, "-m", "jaxtrain"]
NO_HANG_S = 120


# Each rank writes "<rank> <pid>" to READY once it has reported round 1, then waits for a byte on
# GATE before it returns.
GATED_TRAIN = """
import os
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, get_context, report

def train(config):
    report({"step": 1})
    with open(config["ready"], "w") as f:
        f.write(f"{get_context().get_world_rank()} {os.getpid()}\\n")
    with open(config["gate"], "rb", buffering=0) as f:  # one byte per rank, not a buffer
        f.read(1)
    report({"step": 2})
"""


def gated_driver(tmp_path: Path, storage: str, name: str, workers: int, ready: Fifo,
                 gate: Fifo) -> subprocess.Popen:
    script = tmp_path / f"driver_{name}.py"
    script.write_text(textwrap.dedent(GATED_TRAIN) + textwrap.dedent(f"""
        JaxTrainer(train, train_loop_config={{"ready": {ready.path!r}, "gate": {gate.path!r}}},
                   scaling_config=ScalingConfig(num_workers={workers}),
                   run_config=RunConfig(name={name!r}, storage_path={storage!r})).fit()
        print("driver finished")
    """))
    # A test that fails half way leaves no gated driver (and workers) waiting: see start_driver.
    return start_driver([sys.executable, str(script)], cwd=tmp_path, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def worker_pids(ready: Fifo, workers: int) -> list[int]:
    return [int(ready.read_line().split()[1]) for _ in range(workers)]


def quick_train():
    from jaxtrain import report

    report({"step": 1})


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*JAXTRAIN, *args], capture_output=True, text=True, timeout=NO_HANG_S,
                          cwd=REPO)


@pytest.fixture
def fifos(tmp_path: Path):
    ready, gate = Fifo(tmp_path / "ready"), Fifo(tmp_path / "gate")
    yield ready, gate
    ready.close()
    gate.close()


def test_a_second_fit_of_a_live_run_is_refused_naming_its_driver(tmp_path, storage, fifos):
    ready, gate = fifos
    first = gated_driver(tmp_path, storage, "shared", 2, ready, gate)
    worker_pids(ready, 2)

    with pytest.raises(RuntimeError) as refused:
        JaxTrainer(quick_train, run_config=RunConfig(name="shared", storage_path=storage)).fit()
    message = str(refused.value)
    assert f"pid {first.pid}" in message and "in use by another driver" in message, message
    assert "RunConfig.name" in message
    ls = cli("ls", storage)
    assert "RUNNING" in ls.stdout, ls

    gate.write("gg")  # the first run goes on undisturbed
    out, err = first.communicate(timeout=NO_HANG_S)
    assert first.returncode == 0, err
    state = json.loads((Path(storage) / "shared" / "run.json").read_text())
    assert state["status"] == "FINISHED"
    assert len(state["attempts"]) == 1
    rounds = (Path(storage) / "shared" / "result.jsonl").read_text().splitlines()
    assert [json.loads(r)["metrics"]["step"] for r in rounds] == [1, 2]


def test_a_killed_drivers_run_shows_as_crashed_and_resumes(tmp_path, storage, fifos):
    ready, gate = fifos
    driver = gated_driver(tmp_path, storage, "killed", 2, ready, gate)
    worker_pids(ready, 2)
    driver.send_signal(signal.SIGKILL)
    driver.communicate(timeout=NO_HANG_S)

    run_dir = Path(storage) / "killed"
    assert json.loads((run_dir / "run.json").read_text())["status"] == "RUNNING"
    ls = cli("ls", storage)
    assert ls.returncode == 0, ls
    assert "CRASHED" in ls.stdout and "RUNNING" not in ls.stdout, ls.stdout
    show = cli("show", str(run_dir))
    assert "CRASHED (its driver ended without recording" in show.stdout, show.stdout

    # The workers of the dead driver end on their own once its connection is gone; the resumed
    # run does not wait for them.
    result = JaxTrainer(quick_train, scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name="killed", storage_path=storage)).fit()
    assert result.error is None
    state = json.loads((run_dir / "run.json").read_text())
    assert state["status"] == "FINISHED"
    assert [a["status"] for a in state["attempts"]] == ["CRASHED", "FINISHED"]
    crashed = state["attempts"][0]["failure"]
    assert crashed["cause"] == "driver"
    assert f"pid {driver.pid}" in crashed["message"], crashed
    assert "FINISHED" in cli("ls", storage).stdout


def test_the_run_secret_is_in_no_workers_environment_or_command_line(storage):
    def scan_the_group():
        import os
        import re

        from jaxtrain import report

        # The run's own variables only: the user's (AWS_SECRET_ACCESS_KEY, ...) are theirs.
        assert not [k for k in os.environ if k.startswith("JAXTRAIN_RUN_SECRET")]
        found = []
        group = os.getpgid(0)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getpgid(int(entry)) != group:
                    continue
                for part in ("environ", "cmdline"):
                    with open(f"/proc/{entry}/{part}", "rb") as f:
                        text = f.read().decode(errors="replace")
                    if "RUN_SECRET=" in text.replace("RUN_SECRET_FD=", "") or re.search(
                            r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])", text):
                        found.append(f"{entry}/{part}")
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
        report({"found": found, "scanned_group": group})

    result = JaxTrainer(scan_the_group, scaling_config=ScalingConfig(num_workers=3),
                        run_config=RunConfig(name="secret", storage_path=storage)).fit()
    assert result.metrics == {"found": [], "scanned_group": result.metrics["scanned_group"]}


def test_sigterm_stops_the_run_cleanly_and_ends_the_driver_as_sigterm_does(
        tmp_path, storage, fifos):
    ready, gate = fifos
    driver = gated_driver(tmp_path, storage, "terminated", 2, ready, gate)
    pids = worker_pids(ready, 2)
    assert all(pid_alive(p) for p in pids)
    driver.send_signal(signal.SIGTERM)
    out, err = driver.communicate(timeout=NO_HANG_S)
    assert driver.returncode == -signal.SIGTERM, err
    assert "driver finished" not in out
    # fit() returned only after every worker had been reaped.
    assert [p for p in pids if pid_alive(p)] == []
    state = json.loads((Path(storage) / "terminated" / "run.json").read_text())
    assert state["status"] == "ABORTED"
    assert "end_time" in state
    assert _core.run_lock_holder(str(Path(storage) / "terminated")) is None


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs of its own, so that filling it touches nothing else."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill_the_disk_then_report(config):
    import os

    from jaxtrain import get_context, report

    report({"step": 1})
    if get_context().get_world_rank() == 0:
        try:
            with open(os.path.join(config["disk"], "filler"), "wb") as f:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
        except OSError:
            pass  # the disk is full
    report({"step": 2, "note": "x" * 4096})


def test_metrics_that_cannot_be_written_fail_the_run_instead_of_being_lost(small_disk):
    trainer = JaxTrainer(
        fill_the_disk_then_report, train_loop_config={"disk": str(small_disk)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="full", storage_path=str(small_disk)))
    with pytest.raises(TrainingFailedError) as failed:
        trainer.fit()
    e = failed.value
    assert e.cause == "storage", str(e)
    assert e.rank == -1
    message = str(e)
    assert "the driver" in message
    # Round 1 or 2, as the ranks' reports and the filling of the disk happen to interleave.
    lost = re.search(r"report round (\d+) could not be recorded", message)
    assert lost, message
    assert "No space left on device" in message and "result.jsonl" in message, message
    # The rounds before it are on disk, whole; the lost one is in no file, not even torn.
    rounds = (small_disk / "full" / "result.jsonl").read_text()
    assert rounds == "" or rounds.endswith("\n")
    recorded = [json.loads(line)["round"] for line in rounds.splitlines()]
    assert recorded == list(range(1, int(lost.group(1))))

    # Once there is room again, the run resumes and records its rounds.
    (small_disk / "filler").unlink()
    result = JaxTrainer(quick_train, run_config=RunConfig(name="full",
                                                          storage_path=str(small_disk))).fit()
    assert result.metrics == {"step": 1}
    state = json.loads((small_disk / "full" / "run.json").read_text())
    assert state["status"] == "FINISHED"


def test_an_unpicklable_training_function_is_named_with_what_it_captures(storage):
    lock = threading.Lock()

    def train_with_a_lock():
        with lock:
            pass

    trainer = JaxTrainer(train_with_a_lock,
                         run_config=RunConfig(name="unpicklable", storage_path=storage))
    with pytest.raises(ValueError) as refused:
        trainer.fit()
    message = str(refused.value)
    assert "train_loop_per_worker=" in message and "train_with_a_lock" in message, message
    assert "'lock' (a _thread.lock)" in message, message
    assert not (Path(storage) / "unpicklable").exists()  # refused before anything started


def test_an_unpicklable_train_loop_config_names_its_key(storage):
    def train(config):
        pass

    trainer = JaxTrainer(train, train_loop_config={"ok": 1, "bad": threading.Lock()},
                         run_config=RunConfig(name="unpicklable", storage_path=storage))
    with pytest.raises(ValueError, match=r"train_loop_config .*\(key 'bad'\)"):
        trainer.fit()


@pytest.mark.parametrize("workers", [10**9, 10**12])
def test_a_huge_num_workers_is_refused_at_construction(workers):
    with pytest.raises(ValueError, match=rf"ScalingConfig.num_workers={workers} is not allowed.*"
                                         rf"at most {_core.MAX_WORKERS}"):
        ScalingConfig(num_workers=workers)


def test_a_local_run_larger_than_the_machine_is_refused_before_it_starts(storage):
    limit = max(64, 8 * len(os.sched_getaffinity(0)))
    trainer = JaxTrainer(quick_train, scaling_config=ScalingConfig(num_workers=limit + 1),
                         run_config=RunConfig(name="huge", storage_path=storage))
    with pytest.raises(ValueError, match=rf"ScalingConfig.num_workers={limit + 1} .* at most "
                                         rf"{limit} worker processes"):
        trainer.fit()
    assert not (Path(storage) / "huge").exists()


def test_default_run_names_differ_for_runs_started_together():
    names = {RunConfig().name for _ in range(100)}
    assert len(names) == 100
