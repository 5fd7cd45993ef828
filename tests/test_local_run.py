"""End-to-end runs of JaxTrainer on real local worker processes doing real jax.distributed work."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    Fifo,
    end_unreaped_drivers,
    finish_driver,
    live_processes,
    pid_alive,
    run_driver,
    start_driver,
)
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError


def _psum_of_ranks(config):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import get_context, report

    ctx = get_context()
    mesh = Mesh(np.array(jax.devices()), ("ranks",))
    local = np.array([float(ctx.get_world_rank())])
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("ranks")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(arr)
    seen = {
        "rank": ctx.get_world_rank(),
        "world_size": ctx.get_world_size(),
        "local_rank": ctx.get_local_rank(),
        "local_world_size": ctx.get_local_world_size(),
        "node_rank": ctx.get_node_rank(),
        "experiment_name": ctx.get_experiment_name(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "psum": float(total),
        "lr": config["lr"],
    }
    Path(config["out"], f"rank-{ctx.get_world_rank()}.json").write_text(json.dumps(seen))
    for step in range(3):
        report({"step": step, "psum": float(total), "rank": ctx.get_world_rank()})


def test_four_workers_form_one_jax_job_and_report(storage, tmp_path):
    result = JaxTrainer(
        _psum_of_ranks,
        train_loop_config={"lr": 0.5, "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(name="psum", storage_path=storage),
    ).fit()

    for rank in range(4):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert seen == {
            "rank": rank, "world_size": 4, "local_rank": rank, "local_world_size": 4,
            "node_rank": 0, "experiment_name": "psum", "process_index": rank,
            "process_count": 4, "device_count": 4, "psum": 6.0, "lr": 0.5,
        }
    assert result.error is None
    assert result.metrics == {"step": 2, "psum": 6.0, "rank": 0}
    assert result.path == os.path.join(storage, "psum")
    assert result.checkpoint is None
    frame = result.metrics_dataframe
    assert list(frame["jaxtrain/round"]) == [1, 2, 3]
    assert list(frame["step"]) == [0, 1, 2]
    assert set(frame["rank"]) == {0}
    run = json.loads(Path(result.path, "run.json").read_text())
    assert run["status"] == "FINISHED"
    assert run["world_size"] == 4
    assert run["config"]["scaling_config"]["num_workers"] == 4
    csv = Path(result.path, "progress.csv").read_text().splitlines()
    assert csv[0] == "jaxtrain/round,jaxtrain/time,psum,rank,step"
    assert len(csv) == 4
    for rank in range(4):
        assert Path(result.path, "logs", f"rank-{rank}.log").exists()


def _fail_on_rank_2(config):

    from jax.experimental import multihost_utils

    from jaxtrain import get_context, report

    rank = get_context().get_world_rank()
    Path(config["out"], f"pid-{rank}").write_text(str(os.getpid()))
    multihost_utils.sync_global_devices("every rank has written its pid")
    report({"ok": 1})
    if rank == 2:
        raise ValueError("boom at rank 2")
    while True:  # the others would wait in a collective forever
        time.sleep(0.1)


def test_an_exception_on_one_rank_stops_the_others_and_names_it(storage, tmp_path):
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(
            _fail_on_rank_2,
            train_loop_config={"out": str(tmp_path)},
            scaling_config=ScalingConfig(num_workers=4),
            run_config=RunConfig(name="fails", storage_path=storage),
        ).fit()
    err = e.value
    assert err.rank == 2
    assert err.cause == "exception"
    assert "ValueError: boom at rank 2" in str(err)
    assert "Traceback" in err.worker_traceback and "boom at rank 2" in err.worker_traceback
    assert err.log_path == os.path.join(storage, "fails", "logs", "rank-2.log")
    assert "boom at rank 2" in Path(err.log_path).read_text()
    for rank in range(4):
        assert not pid_alive(int((tmp_path / f"pid-{rank}").read_text()))
    run = json.loads(Path(storage, "fails", "run.json").read_text())
    assert run["status"] == "ERRORED"
    assert run["attempts"][0]["failure"]["rank"] == 2
    assert "boom at rank 2" in Path(storage, "fails", "error.txt").read_text()


def _killed_on_rank_1():
    import jax  # noqa: F401

    from jaxtrain import get_context

    if get_context().get_world_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(0.1)


def test_a_worker_killed_by_a_signal_is_named(storage):
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(
            _killed_on_rank_1,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="killed", storage_path=storage),
        ).fit()
    assert e.value.rank == 1
    assert e.value.cause == "signal"
    assert (e.value.signal, e.value.exit_code) == (signal.SIGKILL, None)
    assert "killed by signal 9 (SIGKILL)" in str(e.value)


def _exit_zero_early():
    from jaxtrain import get_context

    if get_context().get_world_rank() == 1:
        os._exit(0)
    while True:
        time.sleep(0.1)


def test_a_worker_that_exits_zero_before_returning_is_a_failure(storage):
    with pytest.raises(TrainingFailedError) as e:
        JaxTrainer(
            _exit_zero_early,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="early", storage_path=storage),
        ).fit()
    assert e.value.rank == 1
    assert e.value.cause == "exit"
    assert (e.value.exit_code, e.value.signal) == (0, None)
    assert "before its training function returned" in str(e.value)
    # Result.from_path reads the same fields back from run.json.
    from jaxtrain import Result

    again = Result.from_path(os.path.join(storage, "early")).error
    assert (again.cause, again.exit_code, again.signal) == ("exit", 0, None)


def test_ctrl_c_on_the_driver_leaves_no_worker_running(tmp_path):
    out = tmp_path / "pids"
    out.mkdir()
    driver = start_driver(
        [sys.executable, "-c", f"""
import os, time
from jaxtrain import JaxTrainer, ScalingConfig, RunConfig
def train():
    from jaxtrain import get_context
    rank = get_context().get_world_rank()
    open(os.path.join({str(out)!r}, str(rank)), "w").write(str(os.getpid()))
    while True:
        time.sleep(0.1)
JaxTrainer(train, scaling_config=ScalingConfig(num_workers=3),
           run_config=RunConfig(name="interrupted", storage_path={str(tmp_path)!r})).fit()
"""],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while len(list(out.iterdir())) < 3:
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in out.iterdir()]
    assert all(pid_alive(p) for p in pids)

    driver.send_signal(signal.SIGINT)
    _, stderr = driver.communicate(timeout=60)
    assert driver.returncode != 0
    assert "KeyboardInterrupt" in stderr
    # fit() returns only after every worker has been reaped.
    assert [p for p in pids if pid_alive(p)] == []
    run = json.loads((tmp_path / "interrupted" / "run.json").read_text())
    assert run["status"] == "ABORTED"


def _start_a_run_that_never_ends(tmp_path) -> subprocess.Popen:
    """A driver (through conftest.start_driver) whose 2 workers wait forever, once they are up."""
    ready = Fifo(tmp_path / "ready")
    driver = start_driver([sys.executable, "-c", f"""
import os, threading
from jaxtrain import JaxTrainer, ScalingConfig, RunConfig
def train():
    with open({ready.path!r}, "w") as f:
        f.write(str(os.getpid()) + "\\n")
    threading.Event().wait()
JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="forever", storage_path={str(tmp_path)!r})).fit()
"""], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = [int(ready.read_line()) for _ in range(2)]
    ready.close()
    # The workers run in a process group of their own, in the driver's session.
    ids = [(os.getpgid(p) != driver.pid, os.getsid(p)) for p in workers]
    assert ids == [(True, driver.pid)] * 2, ids
    return driver


def _left_of(driver: subprocess.Popen) -> dict[int, tuple[int, int]]:
    """The processes of `driver`'s session still running: its workers' groups, standbys too."""
    return {pid: ids for pid, ids in live_processes().items() if ids[1] == driver.pid}


# The suite's own hygiene: a test that times out leaves no driver or worker group behind.


def test_a_driver_that_outlives_its_timeout_is_killed_with_its_workers_groups(tmp_path):
    driver = _start_a_run_that_never_ends(tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        finish_driver(driver, timeout=0.1)  # as run_driver waits
    assert driver.returncode == -signal.SIGKILL
    assert _left_of(driver) == {}


def test_a_driver_a_test_gave_up_waiting_for_ends_with_the_test(tmp_path):
    driver = _start_a_run_that_never_ends(tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        driver.communicate(timeout=0.1)  # the test's own wait, which then fails the test
    end_unreaped_drivers()  # what the end of every test does
    assert driver.returncode == -signal.SIGKILL
    assert _left_of(driver) == {}


def _probe_the_control_port():
    import socket

    from jaxtrain import get_context, report

    assert "JAXTRAIN_RUN_SECRET" not in os.environ  # never visible to user code
    if get_context().get_world_rank() == 0:
        host, port = os.environ["JAXTRAIN_CONTROLLER_ADDR"].rsplit(":", 1)
        outcomes = []
        # 1. A well-formed hello whose MAC is forged.
        hello = b"JXTR\x00\x03" + (1).to_bytes(4, "big") + (0).to_bytes(4, "big") + \
            (4242).to_bytes(4, "big") + b"n" * 32 + b"f" * 32
        with socket.create_connection((host, int(port))) as s:
            s.sendall(len(hello + b"x").to_bytes(4, "big") + b"\x01" + hello)
            answer = s.recv(1024)
            outcomes.append((answer[4], s.recv(1024)))
        # 2. Garbage.
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            outcomes.append(s.recv(1024))
        # 3. A frame announcing 2 GiB.
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"\x7f\xff\xff\xff\x04")
            outcomes.append(s.recv(1024))
        report({"outcomes": [[outcomes[0][0], outcomes[0][1].decode()], outcomes[1].decode(),
                             outcomes[2].decode()]})
    else:
        report({"outcomes": None})


def test_connections_without_the_secret_are_refused_and_the_run_is_unaffected(storage):
    result = JaxTrainer(
        _probe_the_control_port,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="probe", storage_path=storage),
    ).fit()
    # The forged peer got a refusal (type 11) instead of a challenge, and then a closed
    # connection; the others got nothing but the close.
    assert result.metrics == {"outcomes": [[11, ""], "", ""]}


def test_report_count_mismatch_is_named_in_a_warning(tmp_path):
    proc = run_driver(
        f"""
        from jaxtrain import JaxTrainer, ScalingConfig, RunConfig, report, get_context
        def train():
            report({{"a": 1}})
            if get_context().get_world_rank() == 1:
                report({{"a": 2}})
        r = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                       run_config=RunConfig(name="mismatch", storage_path={str(tmp_path)!r})).fit()
        print("METRICS", r.metrics)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "METRICS {'a': 1}" in proc.stdout
    assert "rank 0: 1; rank 1: 2" in proc.stderr
    assert "every rank must call report() the same number of times" in proc.stderr


def test_functions_and_closures_defined_in_main_reach_the_workers(tmp_path):
    proc = run_driver(
        f"""
        from jaxtrain import JaxTrainer, ScalingConfig, RunConfig, report
        scale = 3
        def helper(x):
            return x * scale
        train = lambda config: report({{"value": helper(config["x"])}})
        r = JaxTrainer(train, train_loop_config={{"x": 7}},
                       scaling_config=ScalingConfig(num_workers=2),
                       run_config=RunConfig(name="closure", storage_path={str(tmp_path)!r})).fit()
        print("METRICS", r.metrics)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "METRICS {'value': 21}" in proc.stdout
    assert "(rank=0)" not in proc.stderr


def test_worker_output_is_prefixed_on_the_console_and_kept_in_logs(tmp_path):
    proc = run_driver(
        f"""
        from jaxtrain import JaxTrainer, ScalingConfig, RunConfig, get_context
        def train():
            print("hello from", get_context().get_world_rank())
        JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="out", storage_path={str(tmp_path)!r})).fit()
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "(rank=0) hello from 0" in proc.stdout
    assert "(rank=1) hello from 1" in proc.stdout
    assert "hello from 1" in (tmp_path / "out" / "logs" / "rank-1.log").read_text()


def test_a_storage_path_blocked_by_a_file_fails_before_any_worker_starts(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # A ValueError naming the field, raised before anything starts (it was a RuntimeError from
    # the controller, naming no field).
    with pytest.raises(ValueError) as e:
        JaxTrainer(lambda: None,
                   run_config=RunConfig(name="run", storage_path=str(blocker))).fit()
    assert f"RunConfig.storage_path={str(blocker)!r} cannot be used" in str(e.value)
    assert "is a file, not a directory" in str(e.value)


def test_an_unsupported_storage_scheme_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="storage_path='gopher://x'.*scheme 'gopher://'"):
        JaxTrainer(lambda: None, run_config=RunConfig(name="r", storage_path="gopher://x")).fit()


def test_rank_0_holds_the_coordinator_port_until_jax_has_bound_it():
    # Between rank 0's registration and its jax.distributed.initialize, the port it published
    # must stay out of other programs' reach, and JAX's coordinator must still be able to bind it.
    code = """
import socket, sys
import jax
from jaxtrain.worker.entry import _reserve_coordinator

held, address = _reserve_coordinator("127.0.0.1")
port = int(address.rsplit(":", 1)[1])
other = socket.socket()
try:
    other.bind(("127.0.0.1", port))
    sys.exit("another program took the reserved port")
except OSError:
    pass
finally:
    other.close()
jax.distributed.initialize(coordinator_address=address, num_processes=1, process_id=0,
                           cluster_detection_method="deactivate", initialization_timeout=60)
held.close()
print("process_count", jax.process_count(), "devices", len(jax.devices()))
jax.distributed.shutdown()
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "process_count 1 devices 1" in proc.stdout


def test_ranks_above_0_wait_until_the_coordinator_listens(monkeypatch):
    # A rank that calls jax.distributed.initialize before rank 0's coordinator listens is refused,
    # and gRPC waits about a second before it tries again: the others wait for the port instead.
    from jaxtrain.worker import entry as worker

    held, address = worker._reserve_coordinator("127.0.0.1")
    tries = []
    connect = socket.create_connection

    def connect_counting(where, timeout):
        tries.append(where)
        if len(tries) == 3:
            held.listen()  # the coordinator binds the port and listens
        return connect(where, timeout=timeout)

    monkeypatch.setattr(worker.socket, "create_connection", connect_counting)
    try:
        worker._wait_for_coordinator(address, timeout_s=240)
    finally:
        held.close()
    assert len(tries) == 3  # refused twice while the port was only reserved, then accepted


def test_a_coordinator_that_never_listens_is_left_to_jax_to_report():
    from jaxtrain.worker import entry as worker

    held, address = worker._reserve_coordinator("127.0.0.1")
    try:
        worker._wait_for_coordinator(address, timeout_s=0.05)  # returns; initialize then fails
    finally:
        held.close()
