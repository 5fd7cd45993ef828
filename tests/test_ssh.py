"""JaxTrainer and `jaxtrain run` over real OpenSSH: test hosts on this machine, each sshd in its own
network namespace with its own address and hostname (tests/ssh_fixtures.py,
scripts/ssh_hosts.sh).

Every driver runs in the root namespace, as on a head node; the workers run on host1 and host2,
started over ssh, and reach the driver's controller over the bridge.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_slurm import (
    check_a_run_on_a_bucket,
    check_a_run_on_a_slow_link,
    connect_seconds,
    seed_program,
    seen,
)

import peer_copies
from conftest import run_command, start_driver

if TYPE_CHECKING:
    from ssh_fixtures import SshHosts

# ssh_hosts and ssh_shared_dir; s3_endpoint and bucket
pytest_plugins = ["ssh_fixtures", "s3_server"]

REPO = Path(__file__).resolve().parent.parent
PSUM_SCRIPT = REPO / "tests" / "helpers" / "cli_psum_script.py"


@pytest.fixture
def shared_dir(ssh_shared_dir: Path) -> Path:
    """The test's directory in the hosts' shared directory: its working directory and storage."""
    return ssh_shared_dir


def drive(hosts: SshHosts, cwd: Path, program: str, *, timeout: float = 180,
          **env: str) -> subprocess.CompletedProcess:
    """Runs `program` as a driver in `cwd` (HOME too, unless `env` names another: its default
    storage is shared)."""
    (cwd / "driver.py").write_text(program)
    return run_command([sys.executable, str(cwd / "driver.py")], cwd=cwd,
                       env=hosts.env(**{"HOME": str(cwd), **env}), capture_output=True,
                       text=True, timeout=timeout)


def run_dir(cwd: Path) -> Path:
    runs = list((cwd / "jaxtrain_results").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def workers_left(hosts: SshHosts, host: str) -> list[str]:
    """jaxtrain's processes on `host` (agents, workers, joined hosts): all Python. Once a run has
    ended they are gone; sshd's own per-session processes may still be finishing."""
    return [p for p in hosts.processes(host) if "python" in p]


def local_ssh_clients(hosts: SshHosts) -> list[str]:
    """The ssh processes on this machine that use the test hosts' config."""
    config = str(hosts.state / "ssh_config").encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"ssh\0") and config in cmdline and b"BatchMode=yes" in cmdline:
            found.append(f"{proc.name} {cmdline[:120]!r}")
    return found


def test_the_seeds_program_on_two_hosts_by_two_workers_is_one_jax_job(ssh_hosts, shared_dir):
    proc = drive(ssh_hosts, shared_dir, seed_program(4), JAXTRAIN_SSH_HOSTS="host1,host2")

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Training finished\. Final loss: \d+\.\d{4}", proc.stdout), proc.stdout
    ranks = seen(shared_dir, 4)
    assert [r["psum"] for r in ranks] == [6.0] * 4
    assert [r["process_count"] for r in ranks] == [4] * 4
    assert [r["host"] for r in ranks] == ["host1", "host1", "host2", "host2"]
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"]) for r in ranks] == [
        (0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert "(rank=3) [Gloo] Rank 3 is connected" in proc.stdout
    rundir = run_dir(shared_dir)
    for rank in range(4):
        log = (rundir / "logs" / f"rank-{rank}.log").read_text()
        assert f"[Gloo] Rank {rank} is connected" in log
    assert len((rundir / "result.jsonl").read_text().splitlines()) == 100
    assert workers_left(ssh_hosts, "host1") == [] and workers_left(ssh_hosts, "host2") == []


# Each step adds the psum of (rank + 1) over 4 workers (10) times (step + 1) to a value that is
# checkpointed with the step; rank 2, the first on host2, kills itself at step 5 of attempt 0.
# Restored from the checkpoint of step 4, the run ends where an uninterrupted one ends:
# step 7, value 10 * (1 + ... + 8) = 360.
KILLED_ON_HOST2 = '''
import json, os, signal, socket, tempfile
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import (Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig,
                      get_checkpoint, get_context, report)


def train():
    ctx = get_context()
    rank = ctx.get_world_rank()
    mesh = Mesh(np.array(jax.devices()), ("w",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    step, value = 0, 0.0
    if (ckpt := get_checkpoint()) is not None:
        with ckpt.as_directory() as d:
            with open(os.path.join(d, f"rank-{rank}.json")) as f:
                state = json.load(f)
        step, value = state["step"] + 1, state["value"]
    with open(f"attempt-{ctx.get_attempt()}-rank-{rank}.json", "w") as f:
        json.dump({"host": socket.gethostname(), "first_step": step}, f)
    for s in range(step, 8):
        if s == 5 and ctx.get_attempt() == 0 and rank == 2:
            print(f"killing myself on {socket.gethostname()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        local = np.array([rank + 1.0])
        arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("w")), local)
        value += float(total(arr)) * (s + 1)
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"rank-{rank}.json"), "w") as f:
                json.dump({"step": s, "value": value}, f)
            report({"step": s, "value": value}, checkpoint=Checkpoint.from_directory(d))


result = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=4),
                    run_config=RunConfig(name="killed", storage_path=os.getcwd(),
                                         failure_config=FailureConfig(max_failures=1))).fit()
print("final", json.dumps(result.metrics))
'''


def test_a_worker_killed_on_host2_restarts_the_group_from_its_checkpoint(ssh_hosts, shared_dir):
    # Verbose: the console says how the restart was made, the rank logs what was preloaded.
    proc = drive(ssh_hosts, shared_dir, KILLED_ON_HOST2, JAXTRAIN_SSH_HOSTS="host1,host2",
                 JAXTRAIN_VERBOSE="1")

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'final {"step": 7, "value": 360.0}' in proc.stdout
    assert "(rank=2) killing myself on host2" in proc.stdout
    # Which rank is blamed depends on what reaches the driver first: rank 2's end over ssh, or a
    # Gloo error of a rank that lost it in a collective.
    assert re.search(r"jaxtrain: attempt 0 failed: rank \d \(host host\d\): ", proc.stderr)
    restored = re.search(r"jaxtrain: restarting the worker group: attempt 1, from checkpoint "
                         r".*/killed/checkpoint_(\d+)", proc.stderr)
    assert restored, proc.stderr[-3000:]
    first = [json.loads((shared_dir / f"attempt-0-rank-{r}.json").read_text()) for r in range(4)]
    second = [json.loads((shared_dir / f"attempt-1-rank-{r}.json").read_text()) for r in range(4)]
    assert [a["host"] for a in first] == ["host1", "host1", "host2", "host2"]
    assert [a["host"] for a in second] == ["host1", "host1", "host2", "host2"]
    # Round n reported step n - 1: the new group goes on from the step after the checkpoint's.
    assert [a["first_step"] for a in second] == [int(restored.group(1))] * 4
    assert int(restored.group(1)) >= 4
    state = json.loads((shared_dir / "killed" / "run.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["ERRORED", "FINISHED"]
    rank2 = (shared_dir / "killed" / "logs" / "rank-2.log").read_text()
    assert "jaxtrain: the worker on host2 was killed by signal 9 (SIGKILL)" in rank2
    # The restart activated the standby workers the hosts held (docs/warm-workers.md): every
    # rank's, the killed one's too, since its host is still there.
    assert "jaxtrain: ranks 0,1,2,3 started from standby workers on their hosts" in proc.stderr
    # Each standby got the training function down its connection and imported what it imports.
    for rank in range(4):
        log = (shared_dir / "killed" / "logs" / f"rank-{rank}.log").read_text()
        assert "standby: preloaded the training function" in log, log[-2000:]
    # Once fit() has returned, nothing of the run is left on the hosts, standbys included.
    for host in ("host1", "host2"):
        assert not workers_left_after(ssh_hosts, host, 10), host


def workers_left_after(hosts: SshHosts, host: str, seconds: float) -> list[str]:
    """workers_left(hosts, host) once empty, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while (left := workers_left(hosts, host)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_host_that_lost_its_memory_restores_from_its_peers_then_from_storage(ssh_hosts,
                                                                             shared_dir):
    proc = drive(ssh_hosts, shared_dir, peer_copies.PROGRAM, JAXTRAIN_SSH_HOSTS="host1,host2",
                 JAXTRAIN_CHECKPOINT_IN_MEMORY="1")
    peer_copies.check(proc, shared_dir, ["host1", "host1", "host2", "host2"])


# Reports every 0.1 s for a minute; rank 0 marks that the run got going.
LONG_RUN = '''
import os, time
from pathlib import Path
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, get_context, report


def train():
    for i in range(600):
        report({"i": i})
        if i == 3 and get_context().get_world_rank() == 0:
            Path("ready").write_text("")
        time.sleep(0.1)


JaxTrainer(train, scaling_config=ScalingConfig(num_workers=4),
           run_config=RunConfig(name="long", storage_path=os.getcwd())).fit()
'''


def test_a_driver_killed_leaves_no_process_on_any_host_within_5_s(ssh_hosts, shared_dir):
    driver = start_long_run(ssh_hosts, shared_dir)
    assert len(ssh_hosts.processes("host2")) >= 2  # the run is there: sessions, agents, workers

    driver.kill()
    driver.wait(timeout=30)
    killed_at = time.monotonic()
    left: dict[str, list[str]] = {}
    while time.monotonic() - killed_at < 5:
        left = {h: ssh_hosts.processes(h) for h in ("host1", "host2")}
        left["here"] = local_ssh_clients(ssh_hosts)
        if not any(left.values()):
            break
        time.sleep(0.1)
    assert not any(left.values()), f"still running 5 s after the driver was killed: {left}"


def start_long_run(hosts: SshHosts, cwd: Path, program: str = LONG_RUN,
                   stdout: int = subprocess.DEVNULL) -> subprocess.Popen:
    """`program` driven on host1 and host2 from `cwd`, once it has written `ready`."""
    (cwd / "driver.py").write_text(program)
    driver = start_driver([sys.executable, "driver.py"], cwd=cwd,
                          env=hosts.env(HOME=str(cwd), JAXTRAIN_SSH_HOSTS="host1,host2"),
                          stdout=stdout, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (cwd / "ready").exists() and driver.poll() is None:
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.1)
    assert (cwd / "ready").exists(), driver.communicate(timeout=30)
    return driver


def said_until(driver: subprocess.Popen, words: str) -> str:
    """The driver's stderr up to and including the first line with `words` (or to its end)."""
    said = []
    for line in driver.stderr:
        said.append(line)
        if words in line:
            break
    return "".join(said)


def finish(driver: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
    """The driver's stdout and stderr once it ends; killed if it does not within `timeout`."""
    try:
        return driver.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.communicate()
        raise


def test_a_network_cut_to_host2_fails_the_run_and_its_workers_there_end(ssh_hosts, shared_dir):
    driver = start_long_run(ssh_hosts, shared_dir)
    with ssh_hosts.cut("host2"):
        _, err = driver.communicate(timeout=120)
        # The workers on host2 cannot hear from anyone: each ends once its control connection
        # times out (30 s of unacknowledged reports), and its agent with it.
        deadline = time.monotonic() + 90
        left = ssh_hosts.processes("host2")
        while any("python" in p for p in left) and time.monotonic() < deadline:
            time.sleep(0.5)
            left = ssh_hosts.processes("host2")

    assert driver.returncode != 0
    assert re.search(r"jaxtrain: attempt 0 failed: rank [23] \(host host2\)", err), err[-3000:]
    # The controller's keepalive (about 10 s) notices before ssh's (15 s), says so, and the stop
    # ends host2's ssh processes at once rather than signalling workers that cannot hear it.
    assert re.search(r"rank [23] \(host host2\): its control connection timed out: its host "
                     r"stopped answering", err), err[-3000:]
    assert "to host2 was ended at once" in err, err[-3000:]
    assert not [p for p in left if "python" in p], left
    assert workers_left(ssh_hosts, "host1") == []


OUTAGE_RUN = '''
import json, os, tempfile, time
from pathlib import Path
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import (Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig,
                      get_checkpoint, get_context, report)


def train():
    ctx = get_context()
    mesh = Mesh(np.array(jax.devices()), ("workers",))
    psum = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    start = 0
    if (checkpoint := get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            start = json.loads(Path(d, "step.json").read_text())["i"] + 1
    for i in range(start, 40):
        # Every step waits for every rank, as training does: a rank cut off stops the others.
        local = np.array([float(i)])
        total = psum(jax.make_array_from_process_local_data(NamedSharding(mesh, P("workers")),
                                                            local))
        with tempfile.TemporaryDirectory() as d:
            if ctx.get_world_rank() == 0:
                Path(d, "step.json").write_text(json.dumps({"i": i}))
            report({"i": i, "total": float(total), "attempt": ctx.get_attempt()},
                   checkpoint=Checkpoint.from_directory(d) if ctx.get_world_rank() == 0 else None)
        if i == 5 and ctx.get_attempt() == 0 and ctx.get_world_rank() == 0:
            Path("ready").write_text("")
        time.sleep(0.2 if ctx.get_attempt() == 0 else 0)


result = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(name="outage", storage_path=os.getcwd(),
                                         failure_config=FailureConfig(max_failures=1))).fit()
print("final", json.dumps(result.metrics))
'''


def test_a_restart_waits_for_a_host_whose_network_is_down_and_goes_on_once_it_is_back(
        ssh_hosts, shared_dir):
    """host2's network down mid-run: the attempt fails (ssh's keepalive), the restart waits for
    host2 instead of failing the run at its first probe, and once the link is up again the run
    resumes from its checkpoint and finishes; nothing of the first attempt is left on host2."""
    driver = start_long_run(ssh_hosts, shared_dir, OUTAGE_RUN, stdout=subprocess.PIPE)
    with ssh_hosts.cut("host2"):
        said = said_until(driver, "for a host to come back")  # the restart waits for host2
    out, err = finish(driver)
    err = said + err

    assert driver.returncode == 0, err[-3000:]
    assert re.search(r"jaxtrain: attempt 0 failed: rank 1 \(host host2\)", err), err[-3000:]
    assert ("jaxtrain: waiting up to 300 s (FailureConfig.unreachable_host_timeout_s) for a host "
            "to come back: cannot reach host host2 over ssh") in err, err[-3000:]
    assert "jaxtrain: the hosts answer again after " in err, err[-3000:]
    final = json.loads(out.split("final ", 1)[1])
    assert final["i"] == 39 and final["attempt"] == 1
    rounds = [json.loads(line) for line in (shared_dir / "outage" / "result.jsonl").open()]
    resumed = [r["metrics"]["i"] for r in rounds if r["metrics"]["attempt"] == 1]
    assert resumed[0] > 5, "the restart resumed from the checkpoint, not from the start"
    state = json.loads((shared_dir / "outage" / "run.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["ERRORED", "FINISHED"]
    # The first attempt's workers on host2 end once they learn that their connections are gone
    # (TCP retransmissions after the outage: up to a minute or so).
    deadline = time.monotonic() + 120
    while (left := workers_left(ssh_hosts, "host2")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []


FROZEN_RUN = OUTAGE_RUN.replace(
    "    ctx = get_context()\n",
    "    ctx = get_context()\n"
    "    Path(f'pid-{ctx.get_attempt()}-{ctx.get_world_rank()}').write_text(str(os.getpid()))\n",
).replace('name="outage"', 'name="frozen"').replace(
    "FailureConfig(max_failures=1)", "FailureConfig(max_failures=1, progress_timeout_s=5)")


def test_a_frozen_host_is_blamed_by_the_watchdog_and_its_stale_rank_stays_out_of_the_restart(
        ssh_hosts, shared_dir):
    """Every process of host2 stopped mid-run (a host that hangs; its kernel still answers TCP):
    the progress watchdog pings the stale ranks and blames host2's, which does not answer; the
    restart's ssh probe of host2 gets no answer (ConnectTimeout), so the restart waits for it.
    host2 continued then: the second attempt runs there and finishes, and the first attempt's
    process on host2 ends without reporting into the second."""
    driver = start_long_run(ssh_hosts, shared_dir, FROZEN_RUN, stdout=subprocess.PIPE)
    stale = int((shared_dir / "pid-0-1").read_text())  # attempt 0's rank 1, on host2
    with ssh_hosts.freeze("host2") as frozen:
        said = said_until(driver, "for a host to come back")  # the restart waits for host2
    out, err = finish(driver)
    err = said + err

    assert driver.returncode == 0, err[-3000:]
    assert stale in frozen
    assert re.search(r"jaxtrain: attempt 0 failed: rank 1 \(host host2\): no report\(\) for 5 s "
                     r"\(the progress watchdog's limit\) from rank\(s\) (0 on host1; )?1 on host2; "
                     r"rank\(s\) 1 on host2 did not answer a ping within 2 s: stopped \(SIGSTOP\), "
                     r"frozen or cut off", err), err[-3000:]
    assert re.search(r"jaxtrain: waiting up to 300 s \(FailureConfig.unreachable_host_timeout_s\) "
                     r"for a host to come back: .*host2", err), err[-3000:]
    assert "jaxtrain: the hosts answer again after " in err, err[-3000:]
    assert "not part of this attempt" not in err  # no hello of attempt 0 came back
    final = json.loads(out.split("final ", 1)[1])
    assert final["i"] == 39 and final["attempt"] == 1
    state = json.loads((shared_dir / "frozen" / "run.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["ERRORED", "FINISHED"]
    failure = state["attempts"][0]["failure"]
    assert (failure["cause"], failure["rank"], failure["host"]) == ("watchdog", 1, "host2")
    # Once the second attempt reports, every round is its own, one after another: the continued
    # rank of attempt 0 added nothing to it.
    results = shared_dir / "frozen" / "result.jsonl"
    rounds = [json.loads(line)["metrics"] for line in results.open()]
    attempts = [r["attempt"] for r in rounds]
    first = attempts.index(1)
    assert attempts[first:] == [1] * (len(rounds) - first)
    resumed = [r["i"] for r in rounds[first:]]
    assert resumed == list(range(resumed[0], 40)) and resumed[0] > 5
    assert int((shared_dir / "pid-1-1").read_text()) != stale
    # The first attempt's processes on host2, continued, end: their connections are gone.
    deadline = time.monotonic() + 60
    while (left := workers_left(ssh_hosts, "host2")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []
    assert not Path(f"/proc/{stale}").exists() or b"python" not in Path(
        f"/proc/{stale}/cmdline").read_bytes()


# 2 hosts x 2 workers: 40 steps, each a collective over every rank and a checkpoint of every
# rank's state; each step's duration in its metrics.
SLOW_LINK_RUN = '''
import json, os, tempfile, time
from pathlib import Path
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import (Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig,
                      get_checkpoint, get_context, report)


def train():
    rank = get_context().get_world_rank()
    mesh = Mesh(np.array(jax.devices()), ("w",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    value = 0.0
    for s in range(40):
        began = time.monotonic()
        local = np.array([rank + 1.0])
        value += float(total(jax.make_array_from_process_local_data(NamedSharding(mesh, P("w")),
                                                                    local)))
        with tempfile.TemporaryDirectory() as d:
            Path(d, f"rank-{rank}.json").write_text(json.dumps({"step": s, "value": value}))
            report({"step": s, "value": value, "seconds": time.monotonic() - began},
                   checkpoint=Checkpoint.from_directory(d))


result = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=4),
                    run_config=RunConfig(name="slow", storage_path=os.getcwd(),
                                         failure_config=FailureConfig(max_failures=1,
                                                                      progress_timeout_s=10))
                    ).fit()
print("final", json.dumps(result.metrics))
'''


def test_a_slow_lossy_link_to_host2_slows_the_run_but_fails_nothing(ssh_hosts, shared_dir):
    """host2's link 200 ms slower on every round trip (its packets out delayed) and losing 2 % of
    the packets each way, for the whole run, watchdog on (10 s): the run starts, trains,
    checkpoints and finishes in one attempt; no detector mistakes the slow link for a fault
    (docs/failure-detection.md "On a slow or lossy link")."""
    with ssh_hosts.slow("host2", delay_ms=200, loss=0.02):
        # The link is impaired: a round trip to host2 (its sshd's SYN-ACK) takes 200 ms more.
        assert min(connect_seconds("198.19.13.12", 22) for _ in range(3)) >= 0.2
        proc = drive(ssh_hosts, shared_dir, SLOW_LINK_RUN, timeout=400,
                     JAXTRAIN_SSH_HOSTS="host1,host2")

    check_a_run_on_a_slow_link(proc, shared_dir)
    for host in ("host1", "host2"):
        assert not workers_left_after(ssh_hosts, host, 10), host


@pytest.mark.parametrize(("host", "says"), [
    ("host3", "ssh: connect to host 198.19.13.13 port 22: Connection refused; check that it is "
              "up and runs sshd"),
    ("stranger", "Host key verification failed.; its host key is not known here (or has "
                 "changed): check it and add it to ~/.ssh/known_hosts (e.g. ssh-keyscan "
                 "stranger)"),
])
def test_a_host_that_refuses_ssh_fails_the_run_at_once_naming_it(ssh_hosts, shared_dir, host,
                                                                  says):
    program = seed_program(4)
    proc = drive(ssh_hosts, shared_dir, program, JAXTRAIN_SSH_HOSTS=f"host1,{host}")

    assert proc.returncode != 0
    assert f"ConnectionError: cannot reach host {host} over ssh (exited with status 255): " \
           in proc.stderr, proc.stderr[-3000:]
    assert says in proc.stderr
    assert not (shared_dir / "seen-rank-0.json").exists()  # no worker started anywhere
    assert workers_left(ssh_hosts, "host1") == []


def test_a_local_storage_path_is_refused_before_any_host_is_contacted(ssh_hosts, shared_dir,
                                                                      tmp_path):
    program = f'''
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig
JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="refused", storage_path={str(tmp_path)!r})).fit()
'''
    proc = drive(ssh_hosts, shared_dir, program, JAXTRAIN_SSH_HOSTS="host1,host3")

    assert proc.returncode != 0
    assert f"ValueError: RunConfig.storage_path '{tmp_path}' is on a local filesystem" \
           in proc.stderr, proc.stderr[-3000:]
    assert "cannot reach host" not in proc.stderr  # refused before host3 was tried
    assert not (tmp_path / "refused").exists()


def test_a_staging_directory_the_hosts_cannot_see_is_refused_for_a_bucket_run(
        ssh_hosts, shared_dir, tmp_path, bucket, s3_endpoint):
    program = f'''
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig
JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="refused", storage_path="s3://{bucket}/runs")).fit()
'''
    proc = drive(ssh_hosts, shared_dir, program, JAXTRAIN_SSH_HOSTS="host1,host3",
                 JAXTRAIN_STAGING_DIR=str(tmp_path / "staging"), JAXTRAIN_SHARED_STORAGE="")

    assert proc.returncode != 0
    assert ("stages its checkpoints in the staging copy" in proc.stderr
            and "or unset both so that each host uploads its checkpoints to the store itself"
            in proc.stderr), proc.stderr[-3000:]
    assert "cannot reach host" not in proc.stderr  # refused before host3 was tried


def test_jaxtrain_run_with_a_hostfile_runs_an_unmodified_script_on_the_hosts(ssh_hosts,
                                                                             shared_dir):
    (shared_dir / "hostfile").write_text("# the test hosts\nhost1 slots=1\nhost2 slots=2\n")
    proc = run_command(
        [sys.executable, "-m", "jaxtrain", "run", "--hostfile", "hostfile", "-n", "3",
         "--no-status-line", "--name", "cli", str(PSUM_SCRIPT)],
        cwd=shared_dir, env=ssh_hosts.env(HOME=str(shared_dir)), capture_output=True, text=True,
        timeout=180)

    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(3):
        assert f"(rank={rank}) psum=3 process_count=3" in proc.stdout, proc.stdout
    state = json.loads((shared_dir / "jaxtrain_results" / "cli" / "run.json").read_text())
    assert state["status"] == "FINISHED"
    logs = shared_dir / "jaxtrain_results" / "cli" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.log", "rank-1.log", "rank-2.log"]


# --- the same command on every host --------------------------------------------------------------

SAME_SCRIPT = """\
import os
import socket
import jax
import jaxtrain

ctx = jaxtrain.get_context()
print(f"rank {ctx.get_world_rank()} on {socket.gethostname()} of {jax.process_count()}")
# What a worker must not hold: the join secret, host 0's relay settings, the agent key's memfd.
held = sorted(k for k in os.environ if k.startswith(("JAXTRAIN_JOIN", "JAXTRAIN_AGENT")))
for fd in os.listdir("/proc/self/fd"):
    try:
        if "jaxtrain-agent-key" in os.readlink(f"/proc/self/fd/{fd}"):
            held.append("agent key descriptor")
    except OSError:
        pass
print(f"rank {ctx.get_world_rank()} holds {held}")
jaxtrain.report({"rank": ctx.get_world_rank()})
"""


def on_host(hosts: SshHosts, host: str, cwd: Path, *args: str, env: str = "") -> subprocess.Popen:
    """`jaxtrain run ARGS` started on `host` over ssh, as pdsh or gcloud --worker=all do."""
    command = (f"cd {cwd} && HOME={cwd} JAXTRAIN_SHARED_STORAGE={hosts.shared} {env} exec "
               f"{sys.executable} -m jaxtrain run --no-status-line " + " ".join(args))
    return start_driver([*hosts.ssh_command.split(), "-o", "BatchMode=yes", host, command],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def secret_file(path: Path, secret: str) -> str:
    path.write_text(secret)
    path.chmod(0o600)
    return str(path)


def test_the_same_command_on_two_hosts_is_one_run_and_a_wrong_secret_is_refused(ssh_hosts,
                                                                                 shared_dir):
    (shared_dir / "same.py").write_text(SAME_SCRIPT)
    good = secret_file(shared_dir / "secret", "0123456789abcdef-the-right-one")
    bad = secret_file(shared_dir / "wrong", "0123456789abcdef-a-wrong-secret")
    common = ["--coordinator", "host1:8490", "--num-hosts", "2", "-n", "4", "--name", "same"]
    # Host 0 has its secret in its environment, which none of its workers may inherit.
    host0 = on_host(ssh_hosts, "host1", shared_dir, *common, "--host-rank", "0", "same.py",
                    env="JAXTRAIN_JOIN_SECRET=0123456789abcdef-the-right-one")
    try:
        # A host that does not hold the join secret is turned away; the run waits on.
        intruder = on_host(ssh_hosts, "host2", shared_dir, *common, "--host-rank", "1",
                           "--join-secret-file", bad, "--join-timeout", "10", "same.py")
        _, refused = intruder.communicate(timeout=120)
        assert intruder.returncode == 1, refused
        assert "host 0 at host1:8490 refused this host (host rank 1): wrong join secret" \
               in refused
        host1 = on_host(ssh_hosts, "host2", shared_dir, *common, "--host-rank", "1",
                        "--join-secret-file", good, "same.py")
        joined_out, joined_err = host1.communicate(timeout=180)
        out, err = host0.communicate(timeout=180)
    finally:
        for p in (host0,):
            if p.poll() is None:
                p.kill()

    assert host0.returncode == 0, err[-3000:]
    assert host1.returncode == 0, joined_err[-3000:]
    assert re.search(r"jaxtrain: refused a host joining from 198\.19\.13\.12:\d+: it does not "
                     r"hold the secret", err), err[-3000:]
    assert "jaxtrain: host 1 (host2, 198.19.13.12) joined" in err
    for rank, host in enumerate(["host1", "host1", "host2", "host2"]):
        assert f"(rank={rank}) rank {rank} on {host} of 4" in out, out
        assert f"(rank={rank}) rank {rank} holds []" in out, out
    assert "rank 0 on" not in joined_out  # the output is gathered on host 0 only
    assert "the run ended on host 0 (host1) with status 0" in joined_err
    rundir = shared_dir / "jaxtrain_results" / "same"
    assert json.loads((rundir / "run.json").read_text())["status"] == "FINISHED"
    assert sorted(p.name for p in (rundir / "logs").iterdir()) == [
        f"rank-{r}.log" for r in range(4)]
    assert workers_left(ssh_hosts, "host2") == []


def test_a_host_without_a_join_secret_is_refused_before_it_joins(tmp_path):
    (tmp_path / "same.py").write_text(SAME_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXTRAIN_")}
    proc = run_command(
        [sys.executable, "-m", "jaxtrain", "run", "--coordinator", "127.0.0.1:9",
         "--host-rank", "1", "--num-hosts", "2", "same.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    assert proc.returncode == 2
    assert "needs a join secret that every host holds: give --join-secret-file FILE" \
           in proc.stderr


def test_joined_tpu_hosts_that_do_not_name_their_slice_are_planned_as_one_slice():
    from jaxtrain import ScalingConfig, _core
    from jaxtrain.hosts.join import host_entry

    has = {"name": "x", "gpus": 0, "tpu_chips": 4, "tpu_slice": "", "tpu_worker_id": 0,
           "tpu_accelerator_type": "v4-16", "tpu_topology": ""}
    described = [host_entry(f"t{k}", f"10.0.0.{k + 1}", has, k, "t0") for k in range(2)]
    config = ScalingConfig(num_workers=2, use_tpu=True, topology="2x2x2",
                           accelerator_type="TPU-V4")
    plan = _core.plan(config._core, json.dumps({"hosts": described}), {}, False).to_dict()

    assert [w["host"] for w in plan["workers"]] == ["t0", "t1"]
    assert [w["env"]["TPU_WORKER_ID"] for w in plan["workers"]] == ["0", "1"]
    assert plan["workers"][1]["env"]["TPU_WORKER_HOSTNAMES"] == "10.0.0.1,10.0.0.2"


LONG_SCRIPT = """\
import time
from pathlib import Path
import jaxtrain

for i in range(600):
    jaxtrain.report({"i": i})
    if i == 3 and jaxtrain.get_context().get_world_rank() == 0:
        Path("ready").write_text("")
    time.sleep(0.1)
"""


def test_host_0_killed_leaves_no_process_on_any_host_within_5_s(ssh_hosts, shared_dir):
    (shared_dir / "long.py").write_text(LONG_SCRIPT)
    good = secret_file(shared_dir / "secret", "0123456789abcdef-the-right-one")
    common = ["--coordinator", "host1:8490", "--num-hosts", "2", "-n", "4",
              "--join-secret-file", good]
    started = [on_host(ssh_hosts, host, shared_dir, *common, "--host-rank", str(rank), "long.py")
               for rank, host in enumerate(["host1", "host2"])]
    try:
        deadline = time.monotonic() + 120
        while not (shared_dir / "ready").exists() and all(p.poll() is None for p in started):
            assert time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.1)
        assert (shared_dir / "ready").exists(), [p.communicate(timeout=30) for p in started]
        host0 = [p.split()[0] for p in ssh_hosts.processes("host1")
                 if "jaxtrain run" in p and "--host-rank 0" in p]
        assert len(host0) == 1, ssh_hosts.processes("host1")
        os.kill(int(host0[0]), signal.SIGKILL)
        killed_at = time.monotonic()
        left: dict[str, list[str]] = {}
        while time.monotonic() - killed_at < 5:
            left = {h: [p for p in ssh_hosts.processes(h) if "python" in p]
                    for h in ("host1", "host2")}
            if not any(left.values()):
                break
            time.sleep(0.1)
        assert not any(left.values()), f"still running 5 s after host 0 was killed: {left}"
        _, joined_err = started[1].communicate(timeout=30)
        assert started[1].returncode == 1
        assert "lost the connection to host 0 (host1:8490)" in joined_err
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


# The training function lives in a module of the working_dir, so the workers unpickle it by
# reference: each must import it from its host's copy, unpacked before the task.
SHIPPED_MODULE = '''
import json, os, socket
import jax


def train(config):
    rank = jax.process_index()
    with open(os.path.join(config["out"], f"where-{rank}.json"), "w") as f:
        json.dump({"host": socket.gethostname(), "file": __file__, "cwd": os.getcwd(),
                   "excluded_there": os.path.exists("data/big.bin"),
                   "kept_there": os.path.exists("data/small.txt")}, f)
'''

SHIPS_ITS_WORKING_DIR = '''
import os, sys
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig
import shipped_module

JaxTrainer(shipped_module.train, train_loop_config={"out": sys.argv[1]},
           scaling_config=ScalingConfig(num_workers=4),
           run_config=RunConfig(name="shipped", storage_path=sys.argv[1], worker_runtime_env={
               "working_dir": ".", "excludes": ["data/*.bin"]})).fit()
print("done")
'''


def test_a_working_dir_outside_the_shared_directory_is_shipped_to_the_hosts(ssh_hosts,
                                                                            shared_dir, tmp_path):
    project = tmp_path / "project"  # the driver's machine only: not in the hosts' shared dir
    (project / "data").mkdir(parents=True)
    (project / "shipped_module.py").write_text(SHIPPED_MODULE)
    (project / "data" / "big.bin").write_bytes(b"\0" * 1000)
    (project / "data" / "small.txt").write_text("kept\n")
    (project / "driver.py").write_text(SHIPS_ITS_WORKING_DIR)

    proc = run_command([sys.executable, "driver.py", str(shared_dir)], cwd=project,
                       env=ssh_hosts.env(JAXTRAIN_SSH_HOSTS="host1,host2"), capture_output=True,
                       text=True, timeout=180)

    assert proc.returncode == 0, proc.stderr[-3000:]
    where = [json.loads((shared_dir / f"where-{r}.json").read_text()) for r in range(4)]
    copies = {Path(w["file"]).parent for w in where}
    try:
        assert [w["host"] for w in where] == ["host1", "host1", "host2", "host2"]
        for w in where:
            copy = Path(w["file"]).parent
            assert re.fullmatch(r".*/jaxtrain-\d+/working_dir/[0-9a-f]{64}", str(copy)), w
            assert not w["file"].startswith(str(project)), w
            assert w["cwd"] == str(copy)
            assert (w["excluded_there"], w["kept_there"]) == (False, True)
        assert len(copies) == 1  # one archive: the same name on every host
    finally:
        for copy in copies:  # where the hosts' /tmp is this machine's
            if re.search(r"/working_dir/[0-9a-f]{64}$", str(copy)):
                shutil.rmtree(copy, ignore_errors=True)


# KILLED_ON_HOST2 with its run on a bucket: storage_path from STORE, the hosts' credentials and
# endpoint in HOST_ENV (as a user's runtime env passes them), two checkpoints kept, and STEPS
# steps (a second fit() of the run goes on further).
ON_A_BUCKET = KILLED_ON_HOST2.replace(
    "from jaxtrain import (Checkpoint, ", "from jaxtrain import (Checkpoint, CheckpointConfig, "
).replace("for s in range(step, 8):", "for s in range(step, STEPS):").replace(
    "\ndef train():", "\nSTEPS = int(os.environ['STEPS'])  # read by the driver\n\n\ndef train():"
).replace(
    'run_config=RunConfig(name="killed", storage_path=os.getcwd(),',
    'run_config=RunConfig(name="killed", storage_path=os.environ["STORE"], '
    'worker_runtime_env={"env_vars": json.loads(os.environ["HOST_ENV"])}, '
    'checkpoint_config=CheckpointConfig(num_to_keep=2),')


def test_a_run_on_a_bucket_across_hosts_shares_no_directory(ssh_hosts, shared_dir, bucket,
                                                             s3_endpoint, tmp_path):
    from s3_server import BRIDGES, endpoint_on

    # Every replacement took: the import, the steps, the storage path and the hosts' variables.
    assert ON_A_BUCKET.count("os.environ") == 3 and "CheckpointConfig(num_to_keep=2)" in ON_A_BUCKET
    assert "import (Checkpoint, CheckpointConfig, " in ON_A_BUCKET
    endpoint = endpoint_on(s3_endpoint, BRIDGES["ssh"])
    host_env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    # The driver's home (its staging copy of the run's records) is its own; nothing is declared
    # shared: the hosts write their checkpoints to the bucket themselves.
    home = tmp_path / "driver-home"
    home.mkdir()
    env = dict(JAXTRAIN_SSH_HOSTS="host1,host2", STORE=f"s3://{bucket}/runs", STEPS="8",
               HOST_ENV=json.dumps(host_env), JAXTRAIN_SHARED_STORAGE="", HOME=str(home),
               **host_env)
    proc = drive(ssh_hosts, shared_dir, ON_A_BUCKET, **env)

    import s3fs

    check_a_run_on_a_bucket(proc, shared_dir, s3fs.S3FileSystem(endpoint_url=endpoint),
                            f"{bucket}/runs/killed", ["host1", "host1", "host2", "host2"])
    # The driver's copy of the run holds records and manifests, never a checkpoint's file.
    staging = home / ".cache" / "jaxtrain" / "staging" / "s3" / bucket / "runs" / "killed"
    assert sorted(p.name for p in staging.rglob("rank-*.json")) == []
    assert (staging / "logs" / "rank-2.log").exists()  # logs came over ssh to the driver

    # A second fit() of the run resumes from the bucket and goes on.
    proc = drive(ssh_hosts, shared_dir, ON_A_BUCKET, **dict(env, STEPS="10"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'final {"step": 9, "value": 550.0}' in proc.stdout
    resumed = [json.loads((shared_dir / f"attempt-2-rank-{r}.json").read_text())
               for r in range(4)]
    assert [a["first_step"] for a in resumed] == [8] * 4
    assert workers_left(ssh_hosts, "host1") == [] and workers_left(ssh_hosts, "host2") == []


STORE_SCRIPT = """\
import socket
import tempfile
import jaxtrain
from jaxtrain import Checkpoint

rank = jaxtrain.get_context().get_world_rank()
for step in range(3):
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/rank-{rank}.txt", "w") as f:
            f.write(f"{step} {socket.gethostname()}")
        jaxtrain.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
"""


def test_tpu_vm_hosts_started_alike_write_their_checkpoints_to_a_bucket(ssh_hosts, shared_dir,
                                                                         bucket, s3_endpoint):
    """The TPU VM way (`jaxtrain run --coordinator` on every host) with a bucket and nothing
    shared: each host's home is its own /tmp; the script is in the shared directory only
    because the test writes it once for both hosts, and the run writes nothing there."""
    import s3fs
    from s3_server import BRIDGES, endpoint_on

    (shared_dir / "store.py").write_text(STORE_SCRIPT)
    endpoint = endpoint_on(s3_endpoint, BRIDGES["ssh"])
    env = (f"AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing "
           f"AWS_DEFAULT_REGION=us-east-1 AWS_ENDPOINT_URL={endpoint} "
           "JAXTRAIN_SHARED_STORAGE= JAXTRAIN_JOIN_SECRET=0123456789abcdef-the-right-one")
    common = ["--coordinator", "host1:8491", "--num-hosts", "2", "-n", "4", "--name", "tpu",
              "--storage-path", f"s3://{bucket}/runs"]
    hosts = [on_host(ssh_hosts, host, shared_dir, *common, "--host-rank", str(i), "store.py",
                     env=f"{env} HOME=/tmp")
             for i, host in enumerate(["host1", "host2"])]
    try:
        results = [p.communicate(timeout=180) for p in hosts]
    finally:
        for p in hosts:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(hosts, results, strict=True):
        assert p.returncode == 0, err[-3000:]

    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    root = f"{bucket}/runs/tpu"
    assert json.loads(fs.cat_file(f"{root}/run.json"))["status"] == "FINISHED"
    for n in (1, 2, 3):
        name = f"checkpoint_{n:06d}"
        manifest = json.loads(fs.cat_file(f"{root}/{name}/.jaxtrain_manifest.json"))
        assert manifest["location"] == "store"
        assert sorted(f["path"] for f in manifest["file_list"]) == [
            f"rank-{r}.txt" for r in range(4)]
        assert [fs.cat_file(f"{root}/{name}/rank-{r}.txt").decode() for r in range(4)] == [
            f"{n - 1} {host}" for host in ["host1", "host1", "host2", "host2"]]
    # Nothing of the run was written to the directory the hosts do share.
    assert sorted(p.name for p in shared_dir.iterdir()) == ["store.py"]
    assert workers_left(ssh_hosts, "host2") == []
