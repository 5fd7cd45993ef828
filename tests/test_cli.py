"""The `jaxtrain` command end to end: real runs of unmodified scripts with real JAX workers, and the
inspection commands on the run directories those runs made."""

from __future__ import annotations

import csv
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import run_command, start_driver
from jaxtrain import JaxTrainer, RunConfig, TrainingFailedError
from jaxtrain.cli import launch, main
from jaxtrain.cli.common import UsageError
from jaxtrain.cli.launch import failed_run_status, parse_resources

REPO = Path(__file__).resolve().parent.parent
PLAIN_SCRIPT = REPO / "examples" / "plain_jax_script.py"
PSUM_SCRIPT = REPO / "tests" / "helpers" / "cli_psum_script.py"
_CONSOLE_SCRIPT = Path(sys.executable).parent / "jaxtrain"
JAXTRAIN = (
    [str(_CONSOLE_SCRIPT)] if _CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "jaxtrain"]
)

# Reports a checkpoint per step (rank 0: the step; every rank: a shard) and resumes from the
# checkpoint it is given. Rank 1 raises at --fail-at (unless resumed) or exits at --exit-at, after
# a barrier, so every earlier report has reached the controller.
CHECKPOINT_SCRIPT = """\
import argparse
import os
import sys
import tempfile

import jax
from jax.experimental import multihost_utils

import jaxtrain

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--fail-at", type=int, default=-1)
parser.add_argument("--exit-at", type=int, default=-1)
parser.add_argument("--exit-code", type=int, default=3)
args = parser.parse_args()

rank = jax.process_index()
restored = jaxtrain.get_checkpoint()
start = 0
if restored is not None:
    start = int(open(os.path.join(restored.path, "step.txt")).read()) + 1
    print(f"resumed at step {start}")
for step in range(start, args.steps):
    loss = 1.0 / (step + 1)
    with tempfile.TemporaryDirectory() as d:
        if rank == 0:
            open(os.path.join(d, "step.txt"), "w").write(str(step))
        open(os.path.join(d, f"shard-{rank}.txt"), "w").write(str(step))
        jaxtrain.report({"loss": loss, "step": step},
                        checkpoint=jaxtrain.Checkpoint.from_directory(d))
    print(f"step {step} loss {loss}")
    if step in (args.fail_at, args.exit_at):
        multihost_utils.sync_global_devices("before rank 1 fails")
    if rank == 1 and step == args.fail_at and restored is None:
        raise RuntimeError(f"planned failure at step {step}")
    if rank == 1 and step == args.exit_at:
        sys.exit(args.exit_code)
sys.exit(0)  # a script's sys.exit(0) is a success
"""

# Prints "ready", waits for the marker file, prints "go on", then waits until it is stopped.
WAITING_SCRIPT = """\
import os
import sys
import time

print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("go on", flush=True)
while True:
    time.sleep(0.05)
"""


def jaxtrain(*args, env: dict | None = None, cwd=None, timeout: float = 120):
    return run_command([*JAXTRAIN, *map(str, args)], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=timeout)


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The lines of `proc`'s stdout, as they come (None at the end)."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def wait_for_line(q: queue.Queue, text: str, timeout: float = 120) -> list[str]:
    seen = []
    while True:
        line = q.get(timeout=timeout)
        assert line is not None, f"the output ended without {text!r}: {''.join(seen)}"
        seen.append(line)
        if line.rstrip("\n") == text:
            return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories made by real `jaxtrain run`s: finished (with scored checkpoints), failed
    (rank 1 exits with status 3), and resumed (fails, then runs again by name and finishes)."""
    root = tmp_path_factory.mktemp("cli")
    script = root / "checkpoints.py"
    script.write_text(CHECKPOINT_SCRIPT)
    storage = root / "runs"
    common = ["-n", "2", "--storage-path", storage]
    procs = {
        "finished": jaxtrain("run", *common, "--name", "finished", "--num-to-keep", "2",
                             "--checkpoint-score-attribute", "loss",
                             "--checkpoint-score-order", "min", script),
        "failed": jaxtrain("run", *common, "--name", "failed", script, "--exit-at", "1"),
        "resumed_first": jaxtrain("run", *common, "--name", "resumed", script, "--fail-at", "1"),
        "resumed": jaxtrain("run", *common, "--name", "resumed", script, "--fail-at", "1"),
    }
    return storage, procs


# --- jaxtrain run -------------------------------------------------------------------------------


@pytest.mark.parametrize("workers, how", [(2, "module"), (4, "path")])
def test_run_starts_the_unmodified_plain_jax_script_on_every_worker(workers, how, tmp_path):
    # As a module: found in the working directory, as `python -m` finds it.
    shutil.copy(PLAIN_SCRIPT, tmp_path)
    target = ["-m", "plain_jax_script"] if how == "module" else [PLAIN_SCRIPT]
    proc = jaxtrain("run", "-n", workers, "--storage-path", tmp_path / "runs", "--name", "plain",
                    *target, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for rank in range(workers):
        assert f"(rank={rank}) Starting training..." in proc.stdout
        assert re.search(rf"^\(rank={rank}\) Learned parameters: w=", proc.stdout, re.M)
    state = json.loads((tmp_path / "runs" / "plain" / "run.json").read_text())
    assert (state["status"], state["world_size"]) == ("FINISHED", workers)
    assert state["config"]["train_loop_config"] == (
        {"module": "plain_jax_script", "args": []} if how == "module"
        else {"script": str(PLAIN_SCRIPT), "args": []})


def test_processes_of_a_run_form_one_jax_job_and_report(tmp_path):
    # Through `python -m jaxtrain`; the script calls jax.distributed.initialize() itself.
    proc = run_command(
        [sys.executable, "-m", "jaxtrain", "run", "-n", "4", "--storage-path", str(tmp_path),
         "--name", "psum", str(PSUM_SCRIPT)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rank in range(4):
        assert f"(rank={rank}) psum=6 process_count=4" in proc.stdout
    rounds = jaxtrain("metrics", tmp_path / "psum", "--json").stdout.splitlines()
    assert [json.loads(r)["metrics"] for r in rounds] == [{"psum": 6, "process_count": 4}]


STATUS_SCRIPT = """\
import time
import jaxtrain
for step in range(3):
    print("training step", step)
    time.sleep(0.3)
    jaxtrain.report({"loss": 1.0 / (step + 1), "step": step})
"""


def _run_on_a_terminal(args: list, cwd: Path, columns: int = 200) -> str:
    """Everything `jaxtrain run` writes to a pseudo-terminal of `columns` columns."""
    import fcntl
    import pty
    import struct
    import termios

    main_fd, term_fd = pty.openpty()
    fcntl.ioctl(term_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = start_driver([*JAXTRAIN, *map(str, args)], cwd=cwd, stdin=subprocess.DEVNULL,
                        stdout=term_fd, stderr=term_fd)
    os.close(term_fd)
    out = b""
    while True:
        try:
            data = os.read(main_fd, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not data:
            break
        out += data
    os.close(main_fd)
    assert proc.wait(timeout=120) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def test_run_keeps_a_live_status_line_on_a_terminal_and_none_on_a_pipe(tmp_path):
    script = tmp_path / "status.py"
    script.write_text(STATUS_SCRIPT)
    out = _run_on_a_terminal(["run", "-n", "2", "--storage-path", tmp_path / "runs", "--name",
                              "tty", script], tmp_path)
    erase = "\r\x1b[K"
    drawn = [part.split("\r")[0].split("\n")[0] for part in out.split(erase)[1:]]
    statuses = [d for d in drawn if d.startswith("[jaxtrain] ")]
    assert "[jaxtrain] attempt 0 | 0/2 ranks up" in statuses
    assert "[jaxtrain] attempt 0 | 2/2 ranks up" in statuses
    assert "[jaxtrain] attempt 0 | 2/2 ranks up | round 1 | loss=1 step=0" in statuses
    last = [d for d in statuses if "round 3" in d]
    assert last and re.fullmatch(r"\[jaxtrain\] attempt 0 \| 2/2 ranks up \| round 3 \| "
                                 r"loss=0.3333 step=2 \| [0-9.]+ rounds/s", last[-1]), statuses
    # Rank output is written on a fresh line, with the status line redrawn below it.
    assert re.search(r"\r\x1b\[K\(rank=[01]\) training step 2\r?\n\[jaxtrain\] attempt 0",
                     out), out
    # The status line is erased at the end, before the closing messages (fit()'s goodput line,
    # then the command's).
    assert re.search(r"\r\x1b\[Kjaxtrain: goodput [^\r\n]*\r?\njaxtrain: run 'tty' finished",
                     out), out[-500:]

    piped = jaxtrain("run", "-n", "2", "--storage-path", tmp_path / "runs", "--name", "pipe",
                     script)
    assert piped.returncode == 0, piped.stderr
    assert "\x1b[" not in piped.stdout + piped.stderr
    assert "(rank=1) training step 2" in piped.stdout

    plain = _run_on_a_terminal(["run", "-n", "1", "--no-status-line", "--storage-path",
                                tmp_path / "runs", "--name", "plain", script], tmp_path)
    assert "\x1b[" not in plain and "(rank=0) training step 2" in plain


# Prints, waits until the file given has appeared, then prints more and fails (rank 0) or ends.
AFTER_THE_READER_SCRIPT = """\
import os
import sys
import time

import jax

print("started", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
for i in range(200):
    print("after the reader left", i, flush=True)
if jax.process_index() == 0:
    raise RuntimeError("planned failure after the reader left")
"""


@pytest.mark.parametrize("workers", ["2", "0"])
def test_run_exits_with_its_status_when_its_reader_leaves_early(tmp_path, workers):
    # `jaxtrain run ... 2>&1 | head -3`: the driver's closing messages, the workers' output
    # (-n 2, through the controller) and the script's own (-n 0, local mode, in the driver) all
    # meet a closed pipe; the command still exits with the run's status.
    script = tmp_path / "late.py"
    script.write_text(AFTER_THE_READER_SCRIPT)
    go = tmp_path / "go"
    proc = start_driver([*JAXTRAIN, "run", "-n", workers, "--storage-path", tmp_path / "runs",
                         script, go], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    line = b""
    while b"started" not in line:
        line = proc.stdout.readline()
        assert line, "the run ended before its script started"
    proc.stdout.close()
    go.touch()
    assert proc.wait(timeout=180) == 1


def test_run_returns_the_status_a_rank_exited_with_and_names_the_rank(runs):
    proc = runs[1]["failed"]
    assert proc.returncode == 3, proc.stderr
    assert "rank 1" in proc.stderr and "exited with status 3" in proc.stderr


def test_run_returns_1_when_a_rank_raises_and_names_the_rank(runs):
    proc = runs[1]["resumed_first"]
    assert proc.returncode == 1, proc.stderr
    assert "Training failed: rank 1" in proc.stderr
    assert "RuntimeError: planned failure at step 1" in proc.stderr


def test_run_again_by_name_resumes_from_the_latest_checkpoint(runs):
    proc = runs[1]["resumed"]
    assert proc.returncode == 0, proc.stderr
    assert "(rank=0) resumed at step 2" in proc.stdout


def test_logs_follow_prints_new_output_and_ctrl_c_stops_the_run(tmp_path):
    script = tmp_path / "waiting.py"
    script.write_text(WAITING_SCRIPT)
    marker = tmp_path / "go"
    run = start_driver([*JAXTRAIN, "run", "-n", "1", "--storage-path", str(tmp_path),
                        "--name", "live", str(script), str(marker)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    follow = None
    try:
        wait_for_line(lines_of(run), "(rank=0) ready")
        follow = start_driver([*JAXTRAIN, "logs", str(tmp_path / "live"), "--rank", "0", "-f"],
                              stdout=subprocess.PIPE, text=True)
        followed = lines_of(follow)
        wait_for_line(followed, "ready")
        marker.touch()
        wait_for_line(followed, "go on")  # written after `logs -f` started
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) == 130
        assert follow.wait(timeout=60) == 0  # it ends with the run
    finally:
        for p in (run, follow):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert "interrupted" in run.stderr.read()
    assert json.loads((tmp_path / "live" / "run.json").read_text())["status"] == "ABORTED"


# --- inspection -----------------------------------------------------------------------------


def test_ls_lists_each_run_with_status_and_attempts(runs):
    storage, _ = runs
    proc = jaxtrain("ls", storage)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[1:]}
    assert proc.stdout.split()[:7] == ["NAME", "STATUS", "ATTEMPTS", "WORKERS", "ROUNDS", "START",
                                       "DURATION"]
    assert rows["finished"][1:5] == ["FINISHED", "1", "2", "4"]
    assert rows["failed"][1:3] == ["ERRORED", "1"]
    assert rows["resumed"][1:3] == ["FINISHED", "2"]


def test_names_resolve_under_the_default_storage_path(runs, tmp_path):
    storage, _ = runs
    shutil.copytree(storage / "finished", tmp_path / "jaxtrain_results" / "finished")
    env = dict(os.environ, HOME=str(tmp_path))
    listed = jaxtrain("ls", env=env)
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:2] == [
        "finished", "FINISHED"]
    shown = jaxtrain("show", "finished", env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"path       {tmp_path}/jaxtrain_results/finished" in shown.stdout


def test_show_gives_config_last_metrics_and_checkpoints_best_first(runs):
    storage, _ = runs
    proc = jaxtrain("show", storage / "finished")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "status     FINISHED" in out
    assert "num_workers=2" in out and "checkpoint_score_attribute=loss" in out
    assert re.search(r"last metrics \(round 4\)\n  loss\s+0\.25\n  step\s+3\n", out)
    # num_to_keep=2, the lowest loss first; the newest is also the best.
    assert "checkpoints (2, best first by loss (min))" in out
    assert re.search(r"checkpoint_000004\s+round 4\s+loss=0\.25\s+latest\n"
                     r"\s+checkpoint_000003\s+round 3\s+loss=0\.333333\n", out)
    assert "error" not in out


def test_show_of_a_failed_run_names_the_rank_and_gives_the_error(runs):
    storage, _ = runs
    proc = jaxtrain("show", storage / "failed")
    assert proc.returncode == 0, proc.stderr
    assert "status     ERRORED" in proc.stdout
    assert ("error      Training failed: rank 1 (host " in proc.stdout
            and "its process exited with status 3" in proc.stdout)
    assert f"logs: jaxtrain logs {storage / 'failed'} --rank 1" in proc.stdout


def test_show_of_a_resumed_run_lists_both_attempts(runs):
    storage, _ = runs
    out = jaxtrain("show", storage / "resumed").stdout
    assert "attempts (2)" in out
    assert re.search(r"  0  ERRORED .* rank 1 exception: RuntimeError: planned failure", out)
    assert re.search(r"  1  FINISHED .* restored from checkpoint_000002\n", out)
    assert "status     FINISHED" in out and "error      " not in out


def test_ls_and_show_give_times_in_utc_and_say_so(tmp_path):
    # 2025-12-02 11:45:21 UTC; the machine's zone is another, and ignored.
    run = tmp_path / "runs" / "timed"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({
        "name": "timed", "status": "FINISHED", "start_time": 1764675921.5,
        "end_time": 1764675931.5, "world_size": 1, "platform": "cpu",
        "attempts": [{"attempt": 0, "status": "FINISHED", "start_time": 1764675921.5,
                      "ready_time": 1764675922.0, "end_time": 1764675931.5}]}))
    env = dict(os.environ, TZ="America/New_York")
    listed = jaxtrain("ls", tmp_path / "runs", env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[5:8] == ["2025-12-02", "11:45:21", "UTC"]
    shown = jaxtrain("show", run, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "started    2025-12-02 11:45:21 UTC\n" in shown.stdout
    assert "\n  0  FINISHED  2025-12-02 11:45:21 UTC  10.0s" in shown.stdout


def test_a_storage_path_that_cannot_be_made_is_said_before_the_run_starts(tmp_path):
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "runs"
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    proc = jaxtrain("run", "--storage-path", bad, script)
    assert proc.returncode == 2
    assert (f"jaxtrain run: error: --storage-path '{bad}' cannot be used: Not a directory "
            f"('{bad}')") in proc.stderr
    assert " on 1 worker(s)" not in proc.stderr and "ran" not in proc.stdout
    with pytest.raises(ValueError, match=re.escape(
            f"RunConfig.storage_path='{bad}' cannot be used: Not a directory")):
        JaxTrainer(lambda: None, run_config=RunConfig(name="r", storage_path=str(bad))).fit()


def test_run_names_its_own_options_where_the_api_names_run_config_fields(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    proc = jaxtrain("run", "--name", "a/b", "--storage-path", tmp_path, script)
    assert proc.returncode == 2
    assert "jaxtrain run: error: --name 'a/b' is not allowed" in proc.stderr
    assert launch.as_options(
        "the run directory '/r/x' is in use by another driver (host h, pid 1): ... or choose "
        "another RunConfig.name") == ("the run directory '/r/x' is in use by another driver "
                                      "(host h, pid 1): ... or choose another --name")


def test_show_gives_an_attempts_queue_wait_and_counts_it_as_queue(tmp_path):
    # run.json written by hand: attempt 0's launch waited 25 s for Kueue to admit its JobSet.
    run = tmp_path / "queued"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({
        "name": "queued", "status": "FINISHED", "start_time": 100.0, "end_time": 200.0,
        "world_size": 1, "platform": "cpu",
        "attempts": [{"attempt": 0, "status": "FINISHED", "start_time": 100.0,
                      "ready_time": 130.0, "end_time": 199.0, "queue_wait_s": 25.0}]}))
    proc = jaxtrain("show", run)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\n  0  FINISHED .*  queued 25\.0 s\n", proc.stdout), proc.stdout
    # The goodput table's queue and start-up columns: the wait is queue, not start-up.
    assert re.search(r"\n  attempt 0\s+FINISHED\s+25\.0\s+5\.0\s", proc.stdout), proc.stdout


def test_logs_prefix_every_rank_or_print_one_rank_as_it_is(runs):
    storage, _ = runs
    every = jaxtrain("logs", storage / "resumed")
    assert every.returncode == 0, every.stderr
    assert every.stdout.count("(rank=0) ===== jaxtrain: attempt ") == 2
    assert "(rank=1) step 0 loss 1.0\n" in every.stdout
    one = jaxtrain("logs", storage / "resumed", "--rank", "1")
    assert one.stdout.startswith("===== jaxtrain: attempt 0 =====\n")
    assert "RuntimeError: planned failure at step 1" in one.stdout and "(rank=" not in one.stdout


def test_metrics_as_table_csv_and_json_lines(runs):
    storage, _ = runs
    table = jaxtrain("metrics", storage / "finished")
    assert table.returncode == 0, table.stderr
    assert table.stdout.split("\n")[0].split() == [
        "jaxtrain/round", "jaxtrain/time", "loss", "step"]
    rows = list(csv.DictReader(io.StringIO(jaxtrain("metrics", storage / "finished",
                                                    "--csv").stdout)))
    assert [(r["jaxtrain/round"], float(r["loss"])) for r in rows] == [
        ("1", 1.0), ("2", 0.5), ("3", 1 / 3), ("4", 0.25)]
    lines = jaxtrain("metrics", storage / "resumed", "--json").stdout.splitlines()
    assert [json.loads(line)["metrics"]["step"] for line in lines] == [0, 1, 2, 3]


# --- bad input ------------------------------------------------------------------------------


def test_unknown_run_is_named_with_where_it_was_looked_for(tmp_path):
    proc = jaxtrain("show", "nope", "--storage-path", tmp_path, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no run 'nope'" in proc.stderr and f"{tmp_path}/nope/run.json" in proc.stderr


@pytest.mark.parametrize("option, message", [
    (["-n", "-1"], "ScalingConfig.num_workers=-1 is not allowed"),
    (["-n", "4:2"], "ScalingConfig.num_workers=(4, 2) is not allowed"),
    (["-n", "2:4", "--resize-interval", "0"],
     "ScalingConfig.elastic_resize_monitor_interval_s=0"),
    (["--placement-strategy", "RANDOM"], "ScalingConfig.placement_strategy='RANDOM'"),
    (["--resources-per-worker", "TPU=four"], "'TPU=four' is not NAME=AMOUNT"),
    (["--max-failures", "-2"], "FailureConfig.max_failures=-2 is not allowed"),
])
def test_bad_run_options_exit_2_with_the_config_validation_message(option, message, tmp_path):
    proc = jaxtrain("run", *option, "--storage-path", tmp_path, PLAIN_SCRIPT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("jaxtrain run: error: ") and message in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_a_worker_count_that_is_not_n_or_min_max_exits_2_saying_what_is_allowed(tmp_path):
    proc = jaxtrain("run", "-n", "two", "--storage-path", tmp_path, PLAIN_SCRIPT)
    assert proc.returncode == 2
    assert ("jaxtrain run: error: argument -n/--num-workers: 'two' is not allowed; give a number "
            "of workers N, or MIN:MAX") in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_script_and_missing_storage_path_exit_2(tmp_path):
    proc = jaxtrain("run", tmp_path / "nope.py")
    assert proc.returncode == 2 and "cannot find the script" in proc.stderr
    proc = jaxtrain("ls", tmp_path / "nowhere")
    assert proc.returncode == 2 and f"{tmp_path}/nowhere does not exist" in proc.stderr


def test_logs_of_a_rank_the_run_does_not_have_exit_2(runs):
    storage, _ = runs
    proc = jaxtrain("logs", storage / "finished", "--rank", "5")
    assert proc.returncode == 2 and "has ranks 0-1" in proc.stderr


@pytest.mark.parametrize("command", ["run", "ls", "show", "logs", "metrics", "dashboard"])
def test_every_subcommand_has_help_with_an_example_and_exit_codes(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"jaxtrain {command}" in out and "example:" in out and "130" in out


def test_a_mistyped_option_is_refused_with_the_closest_one(capsys):
    assert main(["run", "--num-workrs", "2", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: jaxtrain run "), err  # the command's usage, not the top level's
    assert "unrecognized arguments: --num-workrs" in err and "did you mean --num-workers?" in err
    assert main(["show", "my_run", "--storage-pth=/tmp"]) == 2
    assert "did you mean --storage-path?" in capsys.readouterr().err
    assert main(["ls", "--frobnicate"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_an_abbreviated_option_is_not_taken_for_the_whole(capsys, tmp_path):
    # `--num-worker 2` once ran as --num-workers 2.
    assert main(["run", "--num-worker", "2", str(tmp_path / "train.py")]) == 2
    assert "did you mean --num-workers?" in capsys.readouterr().err
    assert main(["metrics", "my_run", "--storage", str(tmp_path)]) == 2
    assert "did you mean --storage-path?" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_ls_takes_storage_path_as_an_option_too(runs):
    storage, _ = runs
    by_option = jaxtrain("ls", "--storage-path", storage)
    assert by_option.returncode == 0, by_option.stderr
    assert by_option.stdout == jaxtrain("ls", storage).stdout
    assert "finished" in by_option.stdout
    both = jaxtrain("ls", storage, "--storage-path", storage / "other")
    assert both.returncode == 2 and "differ; give one of them" in both.stderr


def test_ls_before_the_first_run_lists_none_and_says_where_it_looked(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))
    proc = jaxtrain("ls", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["NAME", "STATUS", "ATTEMPTS", "WORKERS", "ROUNDS", "START",
                                   "DURATION"]
    assert f"no runs under {tmp_path}/jaxtrain_results: it does not exist yet" in proc.stderr
    (tmp_path / "jaxtrain_results").mkdir()
    empty = jaxtrain("ls", env=env)
    assert empty.returncode == 0 and empty.stdout.split()[0] == "NAME"
    assert f"no runs under {tmp_path}/jaxtrain_results" in empty.stderr


def test_unknown_subcommand_is_a_usage_error(capsys):
    assert main(["fly"]) == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_resources_per_worker_read_as_pairs_or_json():
    assert parse_resources("TPU=4,CPU=0.5") == {"TPU": 4, "CPU": 0.5}
    assert parse_resources('{"TPU": 4}') == {"TPU": 4}
    for bad in ("TPU", "TPU=", "=4", '{"TPU": 4', "[4]"):
        with pytest.raises(UsageError, match="--resources-per-worker"):
            parse_resources(bad)


def test_the_exit_status_of_a_failed_run_is_the_rank_s_when_it_exited_with_one():
    def error(cause, message, **fields):
        return TrainingFailedError(
            f"Training failed: rank 1 (host h, attempt 0): {message}\n\nFull log: x", cause=cause,
            **fields)

    assert failed_run_status(error("exit", "its process exited with status 3", exit_code=3)) == 3
    assert failed_run_status(error("exit", "its process exited with status 0 before its "
                                            "training function returned", exit_code=0)) == 1
    assert failed_run_status(error("signal", "its process was killed by signal 9 (SIGKILL)",
                                   signal=9)) == 1
    assert failed_run_status(error("exception", "SystemExit: 3")) == 1
    # Decided from the structured field, never from the message's text.
    assert failed_run_status(error("exit", "its process exited with status 3")) == 1
    assert failed_run_status(error("exit", "a message that says nothing", exit_code=7)) == 7


def test_script_arguments_are_not_taken_for_jaxtrain_options():
    from jaxtrain.cli import build_parser

    args = build_parser().parse_args(["run", "-n", "2", "train.py", "-n", "5", "--help"])
    assert (args.num_workers, args.target, args.args) == (2, "train.py", ["-n", "5", "--help"])
    args = build_parser().parse_args(["run", "-n", "2:4", "train.py"])
    assert args.num_workers == (2, 4)  # torchrun's --nnodes MIN:MAX, as ScalingConfig takes it
    assert launch._run_argv(args)[:2] == ["--num-workers", "2:4"]  # passed on by submit
    args = build_parser().parse_args(["run", "-m", "pkg.train", "--lr", "3"])
    assert (args.module, args.target, args.args) == (True, "pkg.train", ["--lr", "3"])


def test_plan_prints_the_placement_without_starting_anything(tmp_path):
    proc = jaxtrain("plan", "-n", "4", "--use-tpu", "--topology", "2x2x2",
                    "--accelerator-type", "TPU-V4", "--json",
                    env={**os.environ, "JAXTRAIN_SIMULATE": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["simulated"] and plan["num_slices"] == 2
    assert [w["env"]["MEGASCALE_SLICE_ID"] for w in plan["workers"]] == ["0", "0", "1", "1"]
    assert not (tmp_path / "jaxtrain_results").exists()
    table = jaxtrain("plan", "-n", "2", env={**os.environ, "HOME": str(tmp_path)})
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[1].split() == ["RANK", "HOST", "SLICE", "DEVICES", "LOCAL",
                                                    "NODE"]


def test_plan_refuses_bad_values_and_missing_hardware():
    bad = jaxtrain("plan", "-n", "-1")
    assert bad.returncode == 2
    assert "ScalingConfig.num_workers=-1" in bad.stderr
    no_tpu = jaxtrain("plan", "-n", "4", "--use-tpu", "--topology", "4x4",
                      "--accelerator-type", "TPU-V6E", env={**os.environ, "JAXTRAIN_SIMULATE": "0"})
    assert no_tpu.returncode == 1
    assert "JAXTRAIN_SIMULATE=1" in no_tpu.stderr
    gpu_type = jaxtrain("plan", "-n", "2", "--accelerator-type", "H100")
    assert gpu_type.returncode == 2
    assert "ScalingConfig.accelerator_type='H100' is only used with use_gpu=True" in \
        gpu_type.stderr


def test_a_failed_scripts_traceback_starts_at_the_script_as_python_prints_it(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("def step():\n    raise KeyError('no such batch')\n\n\nstep()\n")
    proc = jaxtrain("run", "-n", "2", "--storage-path", tmp_path / "runs", script)
    assert proc.returncode == 1, proc.stderr
    expected = (f'Traceback (most recent call last):\n  File "{script}", line 5, in <module>\n'
                f'    step()\n  File "{script}", line 2, in step\n')
    assert expected in proc.stderr, proc.stderr
    assert "runpy" not in proc.stderr and "jaxtrain/worker" not in proc.stderr, proc.stderr


def test_the_error_examples_of_the_cli_docs_are_what_jaxtrain_says(tmp_path):
    docs = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    examples = re.findall(r"^\$ jaxtrain (run .*)\n(jaxtrain run: error: .*)$", docs, re.M)
    assert examples, "docs/cli.md shows no error of jaxtrain run"
    (tmp_path / "train.py").write_text("")
    for command, said in examples:
        proc = jaxtrain(*command.split(), cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.strip() == said, (command, proc.stderr)


def test_run_help_says_that_no_workers_is_local_mode(capsys):
    assert main(["run", "--help"]) == 0
    assert "0 for local mode: the script runs in this process" in \
        " ".join(capsys.readouterr().out.split())
