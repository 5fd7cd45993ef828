"""Warm workers (docs/warm-workers.md): standby worker processes, started ahead and past
``import jax``, serve a restart and a second fit() in the same driver. Real worker processes and
real JAX (multi-process CPU), each driver in a child process so that its pool is its own.

A worker proves it was a standby by its start time: /proc/self/stat's start time and
/proc/uptime are both seconds since boot, so "started before the failure" needs no clock of
another process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_command, start_driver, wait_for
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig

NO_HANG_S = 240  # bounds every wait only so that a bug fails a test instead of hanging it

DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys
    from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig


    def since_boot():
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])


    def started_since_boot():
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")


    def train(config):
        import tempfile
        import numpy as np
        from jax.experimental import multihost_utils
        from jaxtrain import Checkpoint, get_checkpoint, get_context, report

        ctx = get_context()
        rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
        name = f"{config['fit']}-a{attempt}-r{rank}.json"
        with open(os.path.join(config["out"], name), "w") as f:
            json.dump({"started": started_since_boot(), "pid": os.getpid()}, f)
        first = 0
        if get_checkpoint() is not None:
            with get_checkpoint().as_directory() as d:
                first = json.load(open(os.path.join(d, f"r{rank}.json")))["step"] + 1
        for step in range(first, 4):
            values = multihost_utils.process_allgather(np.float32(rank + step))
            with tempfile.TemporaryDirectory() as d:
                json.dump({"step": step}, open(os.path.join(d, f"r{rank}.json"), "w"))
                report({"step": step, "loss": float(np.sum(values))},
                       checkpoint=Checkpoint.from_directory(d))
            if config["kill"] and attempt == 0 and rank == 1 and step == 1:
                with open(os.path.join(config["out"], "kill.json"), "w") as f:
                    json.dump({"at": since_boot()}, f)
                os.kill(os.getpid(), signal.SIGKILL)


    settings = json.loads(sys.argv[1])
    results = []
    for fit in range(settings["fits"]):
        start = since_boot()
        result = JaxTrainer(
            train,
            train_loop_config={"out": settings["out"], "fit": fit, "kill": settings["kill"]},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name=f"warm{fit}", storage_path=settings["storage"],
                                 failure_config=FailureConfig(max_failures=1)),
        ).fit()
        run = json.load(open(os.path.join(result.path, "run.json")))
        results.append({"start": start, "losses": list(result.metrics_dataframe["loss"]),
                        "steps": list(result.metrics_dataframe["step"]),
                        "attempts": len(run["attempts"]),
                        "restored": [a["restored_from"] for a in run["attempts"]]})
    print(json.dumps(results))
    """
)


def _drive(tmp_path: Path, *, fits: int, kill: bool, env: dict | None = None):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    settings = {"out": str(out), "storage": str(tmp_path / "runs"), "fits": fits, "kill": kill}
    proc = run_command([sys.executable, str(script), json.dumps(settings)], cwd=tmp_path,
                       env={**os.environ, **(env or {})}, capture_output=True, text=True,
                       timeout=NO_HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, out


def _worker(out: Path, fit: int, attempt: int, rank: int) -> dict:
    return json.loads((out / f"{fit}-a{attempt}-r{rank}.json").read_text())


def test_a_restart_after_a_killed_worker_uses_standbys_and_resumes_from_the_checkpoint(tmp_path):
    results, stderr, out = _drive(tmp_path, fits=1, kill=True)
    (run,) = results
    assert run["attempts"] == 2
    assert run["restored"][1] is not None
    # Attempt 1 went on after the checkpoint it restored (step 0 or 1) up to step 3; every loss
    # is the sum over both ranks.
    assert set(run["steps"]) == {0, 1, 2, 3} and run["steps"][-2:] == [2, 3], run
    assert run["losses"] == [2.0 * s + 1 for s in run["steps"]], run
    killed_at = json.loads((out / "kill.json").read_text())["at"]
    for rank in range(2):
        assert _worker(out, 0, 1, rank)["started"] < killed_at, "a fresh process, not a standby"
    # How the restart was made is said only with JAXTRAIN_VERBOSE=1.
    assert "standby" not in stderr, stderr[-4000:]


def test_a_second_fit_in_the_same_driver_takes_the_pooled_standbys(tmp_path):
    results, stderr, out = _drive(tmp_path, fits=2, kill=False, env={"JAXTRAIN_VERBOSE": "1"})
    assert [r["losses"] for r in results] == [[1.0, 3.0, 5.0, 7.0]] * 2
    assert [r["attempts"] for r in results] == [1, 1]
    for rank in range(2):
        assert _worker(out, 1, 0, rank)["started"] < results[1]["start"]
        assert _worker(out, 1, 0, rank)["pid"] != _worker(out, 0, 0, rank)["pid"]
    assert stderr.count("ranks 0,1 started from standby workers") == 1, stderr[-4000:]


def test_warm_workers_off_starts_every_attempt_afresh_and_says_so(tmp_path):
    results, stderr, out = _drive(tmp_path, fits=1, kill=True, env={"JAXTRAIN_WARM_WORKERS": "0"})
    assert results[0]["losses"] == [1.0, 3.0, 5.0, 7.0]
    killed_at = json.loads((out / "kill.json").read_text())["at"]
    for rank in range(2):
        assert _worker(out, 0, 1, rank)["started"] >= killed_at
    assert "warm workers are off (JAXTRAIN_WARM_WORKERS=0)" in stderr
    assert "standby" not in stderr


def test_a_bad_warm_workers_value_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_WARM_WORKERS", "yes")
    trainer = JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="bad", storage_path=str(tmp_path)))
    refused = r"JAXTRAIN_WARM_WORKERS='yes' is not allowed: use 1 .* or 0"
    with pytest.raises(ValueError, match=refused):
        trainer.fit()


# The pids of the standby workers of the driver `driver` (their JAXTRAIN_STANDBY=1 in /proc).
STANDBYS_OF = textwrap.dedent(
    """
    def standbys_of(driver):
        found = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\\0")
            except (OSError, ValueError):
                continue
            if ppid == driver and b"JAXTRAIN_STANDBY=1" in env:
                found.append(int(pid))
        return found
    """
)

HOLD = textwrap.dedent(
    """
    import json, os, sys, time
    from jaxtrain import JaxTrainer, RunConfig, ScalingConfig

    STANDBYS_OF

    def train(config):
        from jaxtrain import get_context
        if get_context().get_world_rank() == 0:
            deadline = time.monotonic() + 120
            while len(standbys_of(config["driver"])) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            tmp = config["pids"] + ".tmp"
            json.dump(standbys_of(config["driver"]), open(tmp, "w"))
            os.rename(tmp, config["pids"])
        time.sleep(3600)

    JaxTrainer(train, train_loop_config={"pids": sys.argv[1], "driver": os.getpid()},
               scaling_config=ScalingConfig(num_workers=2),
               run_config=RunConfig(name="held", storage_path=sys.argv[2])).fit()
    """
).replace("STANDBYS_OF\n", STANDBYS_OF)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_driver_killed_with_sigkill_leaves_no_standby_alive(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    pids_file = tmp_path / "pids.json"
    with open(tmp_path / "driver.err", "w") as err:
        driver = start_driver([sys.executable, str(script), str(pids_file), str(tmp_path)],
                              stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + NO_HANG_S
        while not pids_file.exists():
            assert driver.poll() is None, (tmp_path / "driver.err").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        standbys = json.loads(pids_file.read_text())
        assert len(standbys) == 2 and all(_alive(p) for p in standbys)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in standbys) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in standbys if _alive(p)], "standbys outlived their driver"


PRELOAD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig


    STANDBYS_OF


    def train(config):
        imported_before = "preload_probe" in sys.modules  # before this function imports it
        import preload_probe
        from jaxtrain import get_context

        ctx = get_context()
        rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
        with open(os.path.join(config["out"], f"a{attempt}-r{rank}.json"), "w") as f:
            json.dump({"imported_before": imported_before, "probe": preload_probe.INFO,
                       "pid": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0)}, f)
        if attempt == 0 and rank == 1:
            while len(standbys_of(config["driver"])) < 2:  # the restart's standbys exist
                time.sleep(0.05)
            if os.environ.get("PROBE_WATCH_NICE") == "1":  # and are importing the probe
                while len([n for n in os.listdir(config["out"]) if n.startswith("in-")]) < 2:
                    time.sleep(0.05)
            open(os.path.join(config["out"], "killing"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


    extra = {}
    if os.environ.get("PROBE_FUSSY_CONFIG") == "1":
        import preload_probe
        extra["fussy"] = preload_probe.Fussy()
    result = JaxTrainer(
        train, train_loop_config={"out": sys.argv[1], "driver": os.getpid(), **extra},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="preload", storage_path=sys.argv[2],
                             failure_config=FailureConfig(max_failures=1)),
    ).fit()
    print(json.dumps({"path": result.path}))
    """
).replace("STANDBYS_OF\n", STANDBYS_OF)

# Imported by the training function; records how it was imported.
PROBE = textwrap.dedent(
    """
    import os
    from jax._src import xla_bridge

    if os.environ.get("PROBE_TOUCHES_DEVICE") == "1":
        import jax
        jax.devices()
    INFO = {"attempt_env": os.environ.get("JAXTRAIN_ATTEMPT"), "pid": os.getpid(),
            "backends_initialized": xla_bridge.backends_are_initialized()}
    if os.environ.get("PROBE_WATCH_NICE") == "1" and INFO["attempt_env"] is None:
        # Imported ahead: still importing when the restart activates this standby.
        import threading, time
        tid = threading.get_native_id()
        INFO["nice_before"] = os.getpriority(os.PRIO_PROCESS, tid)
        open(os.path.join(os.environ["PROBE_OUT"], f"in-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (
                not os.path.exists(os.path.join(os.environ["PROBE_OUT"], "killing"))
                or os.getpriority(os.PRIO_PROCESS, tid) == INFO["nice_before"]):
            time.sleep(0.02)
        INFO["nice_after"] = os.getpriority(os.PRIO_PROCESS, tid)


    def make_fussy():
        if "JAXTRAIN_ATTEMPT" not in os.environ:
            raise RuntimeError("unpickled before the attempt began")
        return Fussy()


    class Fussy:
        def __reduce__(self):
            return make_fussy, ()
    """
)


def _drive_preload(tmp_path: Path, env: dict | None = None):
    (tmp_path / "preload_probe.py").write_text(PROBE)
    script = tmp_path / "driver.py"
    script.write_text(PRELOAD)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_command([sys.executable, str(script), str(out), str(tmp_path / "runs")],
                       cwd=tmp_path, env={**os.environ, **(env or {})}, capture_output=True,
                       text=True, timeout=NO_HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = Path(json.loads(proc.stdout.strip().splitlines()[-1])["path"])
    logs = "".join((run_dir / "logs" / f"rank-{r}.log").read_text() for r in range(2))
    ranks = [json.loads((out / f"a1-r{r}.json").read_text()) for r in range(2)]
    return ranks, logs, out


def test_a_standby_imports_the_functions_modules_before_its_activation(tmp_path):
    ranks, logs, out = _drive_preload(tmp_path, env={"JAXTRAIN_VERBOSE": "1"})
    for rank in ranks:
        assert rank["imported_before"], rank
        # Imported by the standby before its activation (no attempt yet), no device touched,
        # in the process that then ran the function.
        assert rank["probe"] == {"attempt_env": None, "pid": rank["pid"],
                                 "backends_initialized": False}, rank
    assert logs.count("preloaded the training function") == 2, logs[-4000:]
    # A fresh worker (attempt 0) imports them in the function, as before.
    assert not json.loads((out / "a0-r0.json").read_text())["imported_before"]


def test_the_rank_logs_say_nothing_of_a_preload_that_worked_without_verbose(tmp_path):
    ranks, logs, _ = _drive_preload(tmp_path)
    assert all(rank["imported_before"] for rank in ranks), ranks
    assert "standby" not in logs and "preload" not in logs, logs[-4000:]


def test_a_preload_that_touches_a_device_starts_the_standby_again_without_it(tmp_path):
    ranks, logs, _ = _drive_preload(tmp_path, env={"PROBE_TOUCHES_DEVICE": "1"})
    for rank in ranks:
        assert not rank["imported_before"], rank  # the function imported it, after activation
        assert rank["probe"]["attempt_env"] == "1", rank
    assert logs.count("preloading the training function asked for JAX's 'cpu' backend (a "
                      "device) before the activation; starting again without the preload") == 2, \
        logs[-4000:]


def test_a_standby_still_preloading_at_activation_goes_on_at_the_workers_priority(tmp_path):
    out = tmp_path / "out"
    ranks, _, _ = _drive_preload(tmp_path, env={"PROBE_WATCH_NICE": "1", "PROBE_OUT": str(out)})
    for rank in ranks:
        assert rank["probe"]["attempt_env"] is None, rank  # imported ahead
        assert rank["probe"]["nice_before"] == min(19, rank["nice"] + 10), rank
        assert rank["probe"]["nice_after"] == rank["nice"], rank


def test_a_task_that_cannot_be_unpickled_ahead_is_unpickled_at_activation(tmp_path):
    _, logs, _ = _drive_preload(tmp_path, env={"PROBE_FUSSY_CONFIG": "1"})  # attempt 1 ran
    assert logs.count("the training function could not be unpickled before activation "
                      "(RuntimeError: unpickled before the attempt began); it is unpickled at "
                      "activation") == 2, logs[-4000:]


def test_preload_off_leaves_the_import_to_the_function(tmp_path):
    ranks, logs, _ = _drive_preload(tmp_path, env={"JAXTRAIN_PRELOAD_TASK": "0"})
    assert not any(rank["imported_before"] for rank in ranks)
    assert "preload" not in logs


def test_a_bad_preload_value_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_PRELOAD_TASK", "yes")
    trainer = JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="bad", storage_path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"JAXTRAIN_PRELOAD_TASK='yes' is not allowed; use 1"):
        trainer.fit()


def _helper_that_imports():
    import json.decoder  # noqa: F401


def test_the_modules_a_function_imports_are_found_in_its_code():
    from jaxtrain.worker.entry import _imported_modules

    def train(config):
        import os.path  # noqa: F401
        from collections import abc  # noqa: F401

        def nested():
            import email.parser  # noqa: F401
        _helper_that_imports()

    # Its nested functions and the functions of its module it calls; relative imports are left
    # to the function (a standby cannot know its package).
    relative = compile("def f():\n    from . import x\n    from .y import z\n", "rel", "exec")
    namespace: dict = {"__name__": "pkg.mod"}
    exec(relative, namespace)
    assert _imported_modules(train) == ["os.path", "collections", "email.parser", "json.decoder"]
    assert _imported_modules(namespace["f"]) == []


def _autogroups_writable() -> bool:
    """Whether a process in a new session here may set its autogroup's nice (a kernel with
    autogroups, a /proc that takes the write)."""
    if not Path("/proc/self/autogroup").exists():
        return False
    probe = subprocess.run([sys.executable, "-c", "open('/proc/self/autogroup', 'w').write('0')"],
                           start_new_session=True, capture_output=True)
    return probe.returncode == 0


AUTOGROUPS = _autogroups_writable()


def _session_nice(pid: int | str) -> str:
    """The nice of `pid`'s session autogroup, or "none" where its session is still the one the
    system started with (the kernel then shows nothing: no autogroup of its own)."""
    words = Path(f"/proc/{pid}/autogroup").read_text().split()  # "/autogroup-25 nice 0"
    return words[-1] if words else "none"


def _watch_standby_session(tmp_path: Path, session: str, watch_s: float) -> tuple[list, int]:
    """Starts a standby worker (no preload) and notes the autogroup nice values its session has
    while it imports jax: until it has been lowered and put back, or for `watch_s`. Then ends it
    (EOF). `session`: "own" (it leads a new one), "this" (the test's), or "step" (a new one that
    a shell leads, the standby its child, as a Slurm step's slurmstepd and task)."""
    r, w = os.pipe()
    env = {**os.environ, "JAXTRAIN_STANDBY": "1", "JAXTRAIN_RUN_SECRET_FD": str(r),
           "JAXTRAIN_STANDBY_NO_PRELOAD": "1", "TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "jaxtrain.worker"]
    if session == "step":
        env["JAXTRAIN_STANDBY_SESSION"] = "step"
        argv = ["sh", "-c", '"$@"; exit $?', "sh", *argv]
    proc = subprocess.Popen(argv, env=env, pass_fds=(r,), start_new_session=session != "this",
                            cwd=tmp_path)
    os.close(r)
    pid = proc.pid
    if session == "step":
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        wait_for("the shell's child", lambda: children.read_text().split(), timeout=30)
        pid = int(children.read_text().split()[0])
    seen: list[str] = []
    try:
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline and seen[-2:] != ["10", "0"]:
            nice = _session_nice(pid)
            if not seen or seen[-1] != nice:
                seen.append(nice)
            time.sleep(0.005)
    finally:
        os.close(w)  # EOF: an unactivated standby exits 0
        code = proc.wait(timeout=60)
    return seen, code


@pytest.mark.skipif(not AUTOGROUPS, reason="no autogroup to set here")
def test_a_standby_in_a_session_of_its_own_imports_at_a_lower_session_priority(tmp_path):
    """Linux shares the CPU between sessions before it looks at nice: a standby whose session is
    its own (an ssh agent's, a pod holder's) lowers the session's priority while it imports and
    puts it back once done, so that it takes little CPU from the group training beside it."""
    seen, code = _watch_standby_session(tmp_path, "own", watch_s=120)
    assert code == 0
    assert seen[0] in ("0", "10") and "10" in seen and seen[-1] == "0", seen


@pytest.mark.skipif(not AUTOGROUPS, reason="no autogroup to set here")
def test_a_standby_steps_task_lowers_its_steps_session_while_it_imports(tmp_path):
    seen, code = _watch_standby_session(tmp_path, "step", watch_s=120)
    assert code == 0
    assert "10" in seen and seen[-1] == "0", seen


@pytest.mark.skipif(not AUTOGROUPS, reason="no autogroup to set here")
def test_a_standby_sharing_its_session_leaves_the_sessions_priority_alone(tmp_path):
    own = _session_nice("self")
    seen, code = _watch_standby_session(tmp_path, "this", watch_s=8)
    assert code == 0
    assert seen == [own], seen


IDLE = textwrap.dedent(
    """
    import json, os, sys, time
    import jaxtrain
    from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, report


    def standbys():
        # This driver's children that are jaxtrain workers and not yet reaped.
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\\0")
            except OSError:
                continue
            if int(ppid) == os.getpid() and state != "Z" and b"jaxtrain.worker" in argv:
                found.append(int(pid))
        return found


    def fit(name, idle_s):
        os.environ["JAXTRAIN_WARM_WORKERS_IDLE_S"] = idle_s
        JaxTrainer(lambda: report({"x": 1}), scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name=name, storage_path=sys.argv[1])).fit()


    seen = {}
    fit("kept", "600")
    seen["kept"] = len(standbys())  # waiting for a next fit()
    jaxtrain.shutdown()  # Ray's: ends them at once
    seen["after_shutdown"] = len(standbys())
    fit("idle", "0.5")
    deadline = time.monotonic() + 120
    while standbys() and time.monotonic() < deadline:
        time.sleep(0.05)
    seen["after_idle"] = len(standbys())
    print(json.dumps(seen))
    """
)


def test_standbys_a_fit_leaves_are_ended_after_the_idle_time_or_by_shutdown(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(IDLE)
    proc = run_command([sys.executable, str(script), str(tmp_path / "runs")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=NO_HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"kept": 2, "after_shutdown": 0, "after_idle": 0}, seen


def test_a_bad_idle_time_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_WARM_WORKERS_IDLE_S", "1m")
    trainer = JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="bad", storage_path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"JAXTRAIN_WARM_WORKERS_IDLE_S='1m' is not allowed; "
                                         r"use a number of seconds >= 0"):
        trainer.fit()
