"""JaxTrainer on a real Slurm cluster: several nodes on this machine, each slurmd in its own network
namespace with its own address and hostname (tests/slurm_fixtures.py, scripts/slurm_cluster.sh).

Every driver runs in the root namespace, as on a login node: inside an allocation (salloc ...
python driver.py, where the Slurm launcher is chosen automatically) or outside one (then
JAXTRAIN_LAUNCHER=slurm asks Slurm for the allocation and waits for it). The workers run on the
nodes and reach the driver's controller over the bridge.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import peer_copies
from conftest import run_command, start_driver
from seed_program import with_psum_first

if TYPE_CHECKING:
    from slurm_fixtures import SlurmCluster

# slurm_cluster and slurm_shared_dir; s3_endpoint and bucket
pytest_plugins = ["slurm_fixtures", "s3_server"]

REPO = Path(__file__).resolve().parent.parent



@pytest.fixture
def shared_dir(slurm_shared_dir: Path) -> Path:
    """The test's directory in the nodes' shared directory: its working directory and storage."""
    return slurm_shared_dir


def seed_program(num_workers: int | None) -> str:
    """The seed's program with the psum first; with `num_workers`, num_workers CPU workers
    spread over the nodes."""
    return with_psum_first(num_workers, 'placement_strategy="SPREAD"')


def drive(cluster: SlurmCluster, cwd: Path, program: str, *, allocation: list[str] | None = None,
        timeout: float = 150, **env: str | None) -> subprocess.CompletedProcess:
    """Runs `program` as a driver in `cwd`: under `salloc <allocation>` when given. HOME is `cwd`
    unless `env` names another; a variable given as None is left out of the environment."""
    (cwd / "driver.py").write_text(program)
    argv = [sys.executable, str(cwd / "driver.py")]
    if allocation is not None:
        argv = ["salloc", *allocation, *argv]
    environ = {k: v for k, v in cluster.env(**{"HOME": str(cwd), **env}).items()
               if env.get(k, "") is not None}
    return run_command(argv, cwd=cwd, env=environ, capture_output=True, text=True,
                       timeout=timeout)


def seen(cwd: Path, world_size: int) -> list[dict]:
    return [json.loads((cwd / f"seen-rank-{r}.json").read_text()) for r in range(world_size)]


def jobs(cluster: SlurmCluster) -> list[str]:
    return cluster.run("squeue", "--noheader", "--format=%i %j %T").splitlines()


def run_dir(cwd: Path) -> Path:
    runs = list((cwd / "jaxtrain_results").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def test_two_workers_inside_an_allocation_are_one_jax_job_across_the_nodes(slurm_cluster,
                                                                           shared_dir):
    proc = drive(slurm_cluster, shared_dir, seed_program(2), allocation=["-N2", "-n2"])

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Training finished\. Final loss: \d+\.\d{4}", proc.stdout), proc.stdout
    ranks = seen(shared_dir, 2)
    assert [r["psum"] for r in ranks] == [1.0, 1.0]
    assert [r["process_count"] for r in ranks] == [2, 2]
    assert {r["host"] for r in ranks} == {"node1", "node2"}
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"]) for r in ranks] == [
        (0, 0, 1), (1, 0, 1)]
    assert len({r["job"] for r in ranks}) == 1  # the driver's own allocation
    # The console carries each rank's lines with its prefix; the run directory its own log.
    assert "(rank=0) [Gloo] Rank 0 is connected" in proc.stdout
    assert "(rank=1) [Gloo] Rank 1 is connected" in proc.stdout
    rundir = run_dir(shared_dir)
    for rank in range(2):
        log = (rundir / "logs" / f"rank-{rank}.log").read_text()
        assert f"[Gloo] Rank {rank} is connected" in log
        assert f"Rank {1 - rank} is connected" not in log
    assert len((rundir / "result.jsonl").read_text().splitlines()) == 100


def test_four_workers_outside_an_allocation_wait_for_their_own(slurm_cluster, shared_dir):
    # Every CPU of the cluster is taken for a few seconds: the request must wait, and say so.
    blocker = slurm_cluster.run("sbatch", "--parsable", "--ntasks=4", "--nodes=2",
                                "--job-name=blocker", "--output=/dev/null",
                                "--wrap=sleep 4").strip()
    proc = drive(slurm_cluster, shared_dir, seed_program(None), JAXTRAIN_LAUNCHER="slurm",
               JAXTRAIN_SIMULATE="1")

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jaxtrain: asking Slurm for an allocation: 4 tasks, 1 CPU each" in proc.stderr
    waiting = re.search(r"jaxtrain: waiting for Slurm job (\d+) \(4 tasks.*\): state PENDING, "
                        r"reason (\w+)", proc.stderr)
    assert waiting, proc.stderr[-3000:]
    assert waiting.group(1) != blocker
    assert f"jaxtrain: Slurm granted job {waiting.group(1)}" in proc.stderr
    assert re.search(r"Training finished\. Final loss: \d+\.\d{4}", proc.stdout)
    ranks = seen(shared_dir, 4)
    assert [r["psum"] for r in ranks] == [6.0] * 4
    assert {r["host"] for r in ranks} == {"node1", "node2"}
    assert {r["job"] for r in ranks} == {waiting.group(1)}
    # The allocation jaxtrain asked for is released when the run ends.
    assert not [j for j in jobs(slurm_cluster) if j.startswith(waiting.group(1) + " ")]


def test_ctrl_c_while_waiting_for_an_allocation_withdraws_the_request(slurm_cluster, shared_dir):
    blocker = slurm_cluster.run("sbatch", "--parsable", "--ntasks=4", "--nodes=2",
                                "--job-name=blocker", "--output=/dev/null",
                                "--wrap=sleep 60").strip()
    try:
        (shared_dir / "driver.py").write_text(textwrap.dedent('''
            import os
            from jaxtrain import JaxTrainer, RunConfig, ScalingConfig
            JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2),
                       run_config=RunConfig(name="never", storage_path=os.getcwd())).fit()
        '''))
        driver = start_driver([sys.executable, "driver.py"], cwd=shared_dir,
                              env=slurm_cluster.env(JAXTRAIN_LAUNCHER="slurm"),
                              stderr=subprocess.PIPE, text=True)
        said = []
        for line in driver.stderr:
            said.append(line)
            if "jaxtrain: waiting for Slurm job" in line:
                driver.send_signal(signal.SIGINT)
                break
        said.append(driver.stderr.read())
        assert driver.wait(timeout=30) != 0
        said = "".join(said)
        job = re.search(r"waiting for Slurm job (\d+)", said).group(1)
        assert said.rstrip().endswith("KeyboardInterrupt"), said
        assert not [j for j in jobs(slurm_cluster) if j.startswith(job + " ")]
    finally:
        slurm_cluster.run("scancel", blocker)


def test_sigterm_of_the_driver_stops_the_run_and_releases_the_allocation_it_requested(
        slurm_cluster, shared_dir):
    (shared_dir / "driver.py").write_text(textwrap.dedent('''
        import os, threading
        from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, report

        def train():
            report({"step": 1})
            with open("/proc/self/environ", "rb") as f:  # the secret came on stdin, not here
                leaked = b"JAXTRAIN_RUN_SECRET=" in f.read()
            print("training", "LEAKED" if leaked else "clean", flush=True)
            threading.Event().wait()  # until the run is stopped

        JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="terminated", storage_path=os.getcwd())).fit()
    '''))
    driver = start_driver([sys.executable, "driver.py"], cwd=shared_dir,
                          env=slurm_cluster.env(JAXTRAIN_LAUNCHER="slurm"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = []
        for line in driver.stdout:
            if " training " in line:
                started.append(line.split(" training ")[1].strip())
            if len(started) == 2:
                break
        assert started == ["clean", "clean"]
        job = [j.split()[0] for j in jobs(slurm_cluster) if "jaxtrain-terminated" in j]
        assert len(job) == 1, jobs(slurm_cluster)
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
        assert driver.returncode == -signal.SIGTERM, err[-3000:]
        # The allocation jaxtrain asked for is cancelled with the run (at most COMPLETING while
        # Slurm winds it down), not left running to its time limit.
        left = [j for j in jobs(slurm_cluster) if j.startswith(job[0] + " ")]
        assert all(j.endswith(" COMPLETING") for j in left), left
        state = json.loads((shared_dir / "terminated" / "run.json").read_text())
        assert state["status"] == "ABORTED"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()


KILLED_ON_NODE2 = '''
import json, os, signal, socket, time
from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, get_context, report


def train():
    ctx = get_context()
    with open(f"attempt-{ctx.get_attempt()}-rank-{ctx.get_world_rank()}.json", "w") as f:
        json.dump({"host": socket.gethostname(), "job": os.environ["SLURM_JOB_ID"],
                   "step": os.environ["SLURM_STEP_ID"]}, f)
    report({"step": 0})
    if ctx.get_attempt() == 0 and socket.gethostname() == "node2":
        print("killing myself on node2", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    report({"step": 1, "attempt": ctx.get_attempt()})


result = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
                    run_config=RunConfig(name="killed", storage_path=os.getcwd(),
                                         failure_config=FailureConfig(max_failures=1))).fit()
print("final", json.dumps(result.metrics))
'''


def test_a_worker_killed_on_one_node_restarts_the_group_in_the_same_allocation(slurm_cluster,
                                                                                shared_dir):
    # Verbose: the console says how the restart was made, the rank logs what was preloaded.
    proc = drive(slurm_cluster, shared_dir, KILLED_ON_NODE2, allocation=["-N2", "-n2"],
                 JAXTRAIN_VERBOSE="1")

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'final {"step": 1, "attempt": 1}' in proc.stdout
    assert ("jaxtrain: attempt 0 failed: rank 1 (host node2): its process was killed by signal 9 "
            "(SIGKILL) on node2") in proc.stderr
    assert "srun: error: node2: task 1: Killed" in proc.stdout
    assert "(rank=1) killing myself on node2" in proc.stdout
    first = [json.loads((shared_dir / f"attempt-0-rank-{r}.json").read_text()) for r in range(2)]
    second = [json.loads((shared_dir / f"attempt-1-rank-{r}.json").read_text()) for r in range(2)]
    assert [a["host"] for a in first] == ["node1", "node2"]
    assert len({a["job"] for a in first + second}) == 1  # one allocation ...
    assert {a["step"] for a in first} != {a["step"] for a in second}  # ... a new step per attempt
    # ... started ahead as standbys once attempt 0 trained, and activated by the restart.
    assert re.search(r"jaxtrain: ranks 0,1 started from a standby step \(jaxtrain-killed-2",
                     proc.stderr), proc.stderr[-3000:]
    # The standbys got the training function down srun's stdin and imported what it imports.
    for rank in (0, 1):
        log = (shared_dir / "killed" / "logs" / f"rank-{rank}.log").read_text()
        assert "standby: preloaded the training function" in log, log[-2000:]
    run_state = json.loads((shared_dir / "killed" / "run.json").read_text())
    assert [a["status"] for a in run_state["attempts"]] == ["ERRORED", "FINISHED"]
    assert run_state["attempts"][0]["failure"]["host"] == "node2"
    rank1 = (shared_dir / "killed" / "logs" / "rank-1.log").read_text()
    assert "killing myself on node2" in rank1
    assert "srun: error: node2: task 1: Killed" in rank1
    assert "killing myself" not in (shared_dir / "killed" / "logs" / "rank-0.log").read_text()


def test_a_node_that_lost_its_memory_restores_from_its_peers_then_from_storage(slurm_cluster,
                                                                             shared_dir):
    # Two nodes of two tasks each (Slurm's block distribution: ranks 0 and 1 on node1).
    proc = drive(slurm_cluster, shared_dir, peer_copies.PROGRAM, allocation=["-N2", "-n4"],
                 timeout=240, JAXTRAIN_CHECKPOINT_IN_MEMORY="1")
    peer_copies.check(proc, shared_dir, ["node1", "node1", "node2", "node2"])


def nodes_env(s3_endpoint: str, **changed: str) -> dict[str, str]:
    """What the nodes need for the S3 server: credentials and the endpoint as they reach it (the
    bridge; the driver's 127.0.0.1 is its own), with `changed` instead where given."""
    from s3_server import BRIDGES, endpoint_on

    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint_on(s3_endpoint, BRIDGES["slurm"]), **changed}


def reaches(cluster: SlurmCluster, node: str, url: str) -> str:
    """What a process on `node` gets from `url`: 'reached' when anything answers."""
    probe = ("import urllib.error, urllib.request\ntry:\n"
             f"    urllib.request.urlopen({url!r}, timeout=10)\n"
             "except urllib.error.HTTPError:\n    pass\nprint('reached')")
    proc = subprocess.run(["ip", "netns", "exec", cluster.namespace(node), sys.executable, "-c",
                           probe], capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() or proc.stderr[-500:]


def check_a_run_on_a_bucket(proc: subprocess.CompletedProcess, cwd: Path, fs, root: str,
                            hosts: list[str]) -> None:
    """What a run of tests/test_ssh.py's ON_A_BUCKET program (8 steps, in `cwd`, its run at `root`
    on `fs`, its 4 ranks on `hosts`) must have done: ended as an uninterrupted run ends, after
    attempt 1 restarted every rank from a checkpoint on the bucket, which holds the last two
    checkpoints (retention deleted the others there), each committed by its manifest."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'final {"step": 7, "value": 360.0}' in proc.stdout  # as an uninterrupted run ends
    restored = re.search(r"jaxtrain: restarting the worker group: attempt 1, from checkpoint "
                         r".*/killed/checkpoint_(\d+)", proc.stderr)
    assert restored, proc.stderr[-3000:]
    second = [json.loads((cwd / f"attempt-1-rank-{r}.json").read_text()) for r in range(4)]
    assert [a["host"] for a in second] == hosts
    assert [a["first_step"] for a in second] == [int(restored.group(1))] * 4
    index = json.loads(fs.cat_file(f"{root}/checkpoints.json"))
    kept = [c["dir_name"] for c in index["checkpoints"]]
    assert kept == ["checkpoint_000007", "checkpoint_000008"]
    listed = sorted(p.removeprefix(root + "/") for p in fs.find(root) if "/checkpoint_" in p)
    assert listed == [f"{name}/{f}" for name in kept
                      for f in [".jaxtrain_manifest.json", *(f"rank-{r}.json" for r in range(4))]]
    manifest = json.loads(fs.cat_file(f"{root}/checkpoint_000008/.jaxtrain_manifest.json"))
    assert manifest["location"] == "store"
    assert sorted((f["path"], f["rank"]) for f in manifest["file_list"]) == [
        (f"rank-{r}.json", r) for r in range(4)]


def connect_seconds(address: str, port: int) -> float:
    """How long a TCP connect to `address`:`port` takes: one round trip (SYN, SYN-ACK), more
    where one is lost."""
    began = time.monotonic()
    with socket.create_connection((address, port), timeout=30):
        return time.monotonic() - began


def check_a_run_on_a_slow_link(proc: subprocess.CompletedProcess, cwd: Path) -> None:
    """What a run of tests/test_ssh.py's SLOW_LINK_RUN program (40 steps of 4 ranks, in `cwd`)
    must have done: finished in its one attempt, nothing failed, every step reported and every
    rank's checkpoint committed. Prints its steps' durations."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed" not in proc.stderr, proc.stderr[-3000:]
    final = json.loads(proc.stdout.split("final ", 1)[1])
    assert (final["step"], final["value"]) == (39, 400.0)
    state = json.loads((cwd / "slow" / "run.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["FINISHED"], state["attempts"]
    assert state["attempts"][0].get("failure") is None
    rounds = [json.loads(line)["metrics"] for line in (cwd / "slow" / "result.jsonl").open()]
    assert [r["step"] for r in rounds] == list(range(40))
    print("steps' seconds on the slow link:", [round(r["seconds"], 3) for r in rounds])
    last = sorted((cwd / "slow").glob("checkpoint_*"))[-1]
    assert sorted(p.name for p in last.glob("rank-*.json")) == [f"rank-{r}.json" for r in range(4)]


def test_a_slow_lossy_link_to_node2_slows_the_run_but_fails_nothing(slurm_cluster, shared_dir):
    """tests/test_ssh.py's test of a slow link on a Slurm node: node2's link 200 ms slower on
    every round trip and losing 2 % of the packets each way for the whole run, Slurm's own traffic
    (slurmctld's pings, the step's launch) included: one attempt, nothing failed."""
    from test_ssh import SLOW_LINK_RUN  # test_ssh imports from this module: taken once both are

    with slurm_cluster.slow("node2", delay_ms=200, loss=0.02):
        assert min(connect_seconds("198.18.0.12", 6818) for _ in range(3)) >= 0.2  # slurmd
        proc = drive(slurm_cluster, shared_dir, SLOW_LINK_RUN, allocation=["-N2", "-n4"],
                     timeout=400)

    check_a_run_on_a_slow_link(proc, shared_dir)


def test_a_run_on_a_bucket_across_the_nodes_shares_no_directory(slurm_cluster, shared_dir, bucket,
                                                                s3_endpoint, tmp_path):
    from test_ssh import ON_A_BUCKET  # test_ssh imports from this module: taken once both are

    host_env = nodes_env(s3_endpoint)
    assert reaches(slurm_cluster, "node2", host_env["AWS_ENDPOINT_URL"]) == "reached"
    # Nothing is declared shared and no staging directory is named: the driver's home (its copy
    # of the run's records) is its own, and the nodes upload their ranks' checkpoint files to the
    # bucket themselves. The driver reaches the server at 127.0.0.1, which on a node is the
    # node's own: the endpoint the workers use can only have come with their runtime env.
    home = tmp_path / "driver-home"
    home.mkdir()
    env = dict(STORE=f"s3://{bucket}/runs", STEPS="8", HOST_ENV=json.dumps(host_env),
               HOME=str(home), JAXTRAIN_SHARED_STORAGE=None, AWS_ENDPOINT_URL=s3_endpoint)
    proc = drive(slurm_cluster, shared_dir, ON_A_BUCKET, allocation=["-N2", "-n4"], timeout=240,
                 **env)

    import s3fs

    check_a_run_on_a_bucket(proc, shared_dir, s3fs.S3FileSystem(endpoint_url=s3_endpoint),
                            f"{bucket}/runs/killed", ["node1", "node1", "node2", "node2"])
    assert "(rank=2) killing myself on node2" in proc.stdout
    # No checkpoint file was written anywhere but on the bucket: not in the driver's copy of the
    # run, not in the directory the nodes happen to share with the driver.
    staging = home / ".cache" / "jaxtrain" / "staging" / "s3" / bucket / "runs" / "killed"
    assert sorted(p.name for p in staging.rglob("rank-*.json")) == []
    assert sorted(p.name for p in shared_dir.rglob("rank-*.json")) == []
    rank2 = (staging / "logs" / "rank-2.log").read_text()  # srun brought it to the driver
    assert "killing myself on node2" in rank2

    # A second fit() of the run resumes from the bucket and goes on.
    proc = drive(slurm_cluster, shared_dir, ON_A_BUCKET, allocation=["-N2", "-n4"], timeout=240,
                 **dict(env, STEPS="10"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'final {"step": 9, "value": 550.0}' in proc.stdout
    resumed = [json.loads((shared_dir / f"attempt-2-rank-{r}.json").read_text())
               for r in range(4)]
    assert [a["first_step"] for a in resumed] == [8] * 4


WITHOUT_CREDENTIALS = '''
import json, os, tempfile
from jaxtrain import (Checkpoint, JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError,
                      report)


def train():
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "state.json"), "w") as f:
            f.write("{}")
        report({"step": 0}, checkpoint=Checkpoint.from_directory(d))


try:
    JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
               run_config=RunConfig(name="nocred", storage_path=os.environ["STORE"],
                                    worker_runtime_env={"env_vars": json.loads(
                                        os.environ["HOST_ENV"])})).fit()
except TrainingFailedError as e:
    print("failed", json.dumps({"cause": e.cause, "host": e.host, "status_code": e.status_code,
                                "message": str(e)}))
'''


def test_nodes_without_credentials_fail_the_run_naming_the_node_and_the_bucket(
        slurm_cluster, shared_dir, bucket, s3_endpoint, tmp_path):
    # The driver has credentials; the nodes have none: srun hands them the driver's environment,
    # so the runtime env blanks the keys there (and their home, the driver's, has no ~/.aws).
    host_env = nodes_env(s3_endpoint, AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    home = tmp_path / "driver-home"
    home.mkdir()
    proc = drive(slurm_cluster, shared_dir, WITHOUT_CREDENTIALS, allocation=["-N2", "-n2"],
                 STORE=f"s3://{bucket}/runs", HOST_ENV=json.dumps(host_env), HOME=str(home),
                 JAXTRAIN_SHARED_STORAGE=None, AWS_ENDPOINT_URL=s3_endpoint)

    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.split("failed ", 1)[1].splitlines()[0])
    assert (failed["cause"], failed["host"], failed["status_code"]) == (
        "storage", "node1", "UNAUTHENTICATED")
    assert (f"listing s3://{bucket}/runs/nocred from host node1 failed: NoCredentialsError: "
            "Unable to locate credentials (this host has no credentials for the store: ") \
        in failed["message"], failed["message"]
    # A host does not gain credentials by being asked again.
    assert "jaxtrain: not restarting: retrying cannot help (the credentials were refused)" \
        in proc.stderr
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    root = f"{bucket}/runs/nocred"
    assert [p for p in fs.find(root) if "/checkpoint_" in p] == []  # nothing half-visible
    if fs.exists(f"{root}/checkpoints.json"):
        assert json.loads(fs.cat_file(f"{root}/checkpoints.json"))["checkpoints"] == []


def test_a_node_local_storage_path_is_refused_before_slurm_is_asked(slurm_cluster, shared_dir,
                                                                    tmp_path):
    # tmp_path is under /tmp, on this machine's local disk: node-local as far as a cluster goes.
    program = textwrap.dedent(f'''
        from jaxtrain import JaxTrainer, RunConfig, ScalingConfig
        JaxTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="refused", storage_path={str(tmp_path)!r})).fit()
    ''')
    before = jobs(slurm_cluster)
    proc = drive(slurm_cluster, shared_dir, program, JAXTRAIN_LAUNCHER="slurm")

    assert proc.returncode != 0
    assert "ValueError: RunConfig.storage_path" in proc.stderr
    assert f"'{tmp_path}' is on a local filesystem" in proc.stderr
    assert "use shared storage (an NFS or other network filesystem mounted on every node, " \
           "s3://, gs://)" in proc.stderr
    assert "asking Slurm" not in proc.stderr
    assert jobs(slurm_cluster) == before
    assert not (tmp_path / "refused").exists()


WAITS_FOR_PROBE = '''
import os, time
from pathlib import Path
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, get_context


def train():
    if get_context().get_world_rank() == 0:
        Path("controller.txt").write_text(os.environ["JAXTRAIN_CONTROLLER_ADDR"])
    deadline = time.time() + 60
    while not Path("probed").exists() and time.time() < deadline:
        time.sleep(0.1)


JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="probe-run", storage_path=os.getcwd())).fit()
print("run finished")
'''

# A peer on node2 that knows the protocol but not the secret: a well-formed hello with a made-up
# MAC. Prints what the controller did with it.
PROBE = '''
import os, socket, struct, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=10)
hello = b"JXTR" + struct.pack(">HIII", 3, 0, 0, os.getpid()) + os.urandom(64)
s.sendall(struct.pack(">IB", len(hello) + 1, 1) + hello)
answer = s.recv(100)
print("closed" if answer[4:5] == b"\\x0b" and s.recv(100) == b"" else "answered")
'''


def test_a_connection_from_a_node_without_the_secret_is_refused(slurm_cluster, shared_dir):
    (shared_dir / "driver.py").write_text(WAITS_FOR_PROBE)
    driver = start_driver(["salloc", "-N2", "-n2", sys.executable, "driver.py"],
                          cwd=shared_dir, env=slurm_cluster.env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        address = shared_dir / "controller.txt"
        deadline = time.monotonic() + 120
        while not address.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert address.exists(), driver.communicate(timeout=30)
        controller = address.read_text()
        assert controller.startswith("198.18.0.1:")  # the bridge: where the nodes reach the driver
        probe = subprocess.run(
            ["ip", "netns", "exec", slurm_cluster.namespace("node2"), sys.executable, "-c",
             PROBE, controller], capture_output=True, text=True, timeout=30)
        assert probe.stdout.strip() == "closed", probe.stderr
    finally:
        (shared_dir / "probed").write_text("")
        out, err = driver.communicate(timeout=120)
    assert driver.returncode == 0, err[-3000:]
    assert "run finished" in out
    assert re.search(r"jaxtrain: refused a control connection from 198\.18\.0\.12:\d+: the "
                     r"hello's MAC was not made with this run's secret", err), err[-3000:]


# Reports every 0.1 s; rank 0 marks each attempt's progress in ready-<attempt> after 3 rounds.
LONG_RUN = '''
import os, time
from pathlib import Path
from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig, get_context, report


def train():
    ctx = get_context()
    for i in range(30):
        report({"i": i, "attempt": ctx.get_attempt()})
        if i == 3 and ctx.get_world_rank() == 0:
            Path(f"ready-{ctx.get_attempt()}").write_text("")
        time.sleep(0.1)


result = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(name="long", storage_path=os.getcwd(),
                                         failure_config=FailureConfig(max_failures=2))).fit()
print("final", result.metrics)
'''


def start_long_run(cluster: SlurmCluster, cwd: Path) -> subprocess.Popen:
    (cwd / "driver.py").write_text(LONG_RUN)
    driver = start_driver(["salloc", "-N2", "-n2", sys.executable, "driver.py"], cwd=cwd,
                          env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    deadline = time.monotonic() + 120
    while not (cwd / "ready-0").exists() and driver.poll() is None:
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.1)
    assert (cwd / "ready-0").exists(), driver.communicate(timeout=30)
    return driver


def test_a_step_cancelled_by_slurm_fails_the_attempt_and_a_new_step_finishes(slurm_cluster,
                                                                             shared_dir):
    driver = start_long_run(slurm_cluster, shared_dir)
    steps = [line.split() for line in slurm_cluster.run(
        "squeue", "--noheader", "--steps", "--format=%i %j").splitlines()]
    # The attempt's step, and the standby step started for the next attempt once it trained
    # (docs/warm-workers.md): the attempt's is the first.
    ours = sorted((step for step, name in steps if name.startswith("jaxtrain-long-")),
                  key=lambda step: int(step.split(".")[1]))
    assert len(ours) in (1, 2), steps
    slurm_cluster.run("scancel", ours[0])  # as an administrator or a time limit would
    out, err = driver.communicate(timeout=120)

    assert driver.returncode == 0, err[-3000:]
    assert "final {'i': 29, 'attempt': 1}" in out
    assert re.search(r"jaxtrain: attempt 0 failed: rank \d \(host node\d\)", err), err[-3000:]
    assert "jaxtrain: restarting the worker group: attempt 1" in err
    state = json.loads((shared_dir / "long" / "run.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["ERRORED", "FINISHED"]


def test_a_lost_node_fails_the_attempt_and_the_run_says_that_slurm_ended_the_job(slurm_cluster,
                                                                                  shared_dir):
    driver = start_long_run(slurm_cluster, shared_dir)
    try:
        # A power cut on node2: its slurmd, the step's slurmstepd and the worker, all at once.
        pids = subprocess.run(["ip", "netns", "pids", slurm_cluster.namespace("node2")],
                              capture_output=True, text=True, check=True).stdout.split()
        subprocess.run(["kill", "-9", *pids], check=True)
        out, err = driver.communicate(timeout=120)
        state = json.loads((shared_dir / "long" / "run.json").read_text())
    finally:
        slurm_cluster.restore()  # a new cluster: the shared directory too

    assert driver.returncode != 0
    assert "jaxtrain: attempt 0 failed: rank 1 (host node2): its control connection closed" in err
    # fit() raised the run's failure: a TrainingFailedError, now one of its Ray-named subclasses.
    failure = r"\b(TrainingFailedError|WorkerGroupError|ControllerError)\b"
    assert re.search(failure, err), err[-3000:]
    assert state["status"] == "ERRORED"
    assert state["attempts"][0]["failure"]["host"] == "node2"
    # Once Slurm has ended the allocation (node failure), no retry is made in it: at most one
    # attempt started while Slurm was still ending the job fails before the run gives up.
    assert "this run's allocation, is no longer running" in err, err[-3000:]
    assert len(state["attempts"]) in (2, 3)


class ElasticDriver:
    """An elastic run's driver in `cwd`, in an allocation of jaxtrain's own of 2 tasks per node,
    once it has written `ready`. close() resumes node2 whatever happened, so that the node serves
    the next test."""

    def __init__(self, cluster: SlurmCluster, cwd: Path, program: str) -> None:
        self.cluster, self.said = cluster, []
        (cwd / "driver.py").write_text(program)
        self.driver = start_driver([sys.executable, "driver.py"], cwd=cwd,
                                   env=cluster.env(HOME=str(cwd), JAXTRAIN_LAUNCHER="slurm",
                                                   JAXTRAIN_SLURM_TASKS_PER_NODE="2"),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (cwd / "ready").exists() and self.driver.poll() is None:
            assert time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.1)

    def said_until(self, words: str) -> None:
        for line in self.driver.stderr:
            self.said.append(line)
            if words in line:
                return
        raise AssertionError("".join(self.said)[-3000:])

    def node2(self, state: str, *reason: str) -> None:
        self.cluster.run("scontrol", "update", "nodename=node2", f"state={state}", *reason)

    def finish(self) -> tuple[str, str]:
        """stdout, and all of stderr, once the driver ends."""
        out, err = self.driver.communicate(timeout=180)
        return out, "".join(self.said) + err

    def close(self) -> None:
        if self.driver.poll() is None:
            self.driver.kill()
            self.driver.communicate()
        # Resuming a node that is not drained is an error of scontrol's: not checked.
        subprocess.run(["scontrol", "update", "nodename=node2", "state=resume"],
                       env=self.cluster.env(), capture_output=True, check=False)


def test_a_drained_node_shrinks_the_run_and_its_resume_grows_it_back(slurm_cluster, shared_dir):
    """ScalingConfig(num_workers=(2, 4)) in an allocation of jaxtrain's own (a node range of
    2 tasks per node): node2 drained while the run trains on it is left at the next committed
    checkpoint, the run going on with node1's 2 workers; resumed, it is taken back at the next
    one, and the run finishes on 4 (docs/elastic.md). Each epoch's rows are seen once."""
    from test_elastic import ELASTIC_RUN, check_every_epoch_seen_once, rounds

    run = shared_dir / "elastic"
    with contextlib.closing(ElasticDriver(slurm_cluster, shared_dir, ELASTIC_RUN)) as elastic:
        elastic.node2("drain", "reason=jaxtrain-test")
        elastic.said_until("resizing the run from 4 to 2 workers")
        deadline = time.monotonic() + 120
        while not any(r["world_size"] == 2 for r in rounds(run)) and \
                elastic.driver.poll() is None:
            assert time.monotonic() < deadline, "".join(elastic.said)[-3000:]
            time.sleep(0.2)
        elastic.node2("resume")
        out, err = elastic.finish()
    driver = elastic.driver

    assert driver.returncode == 0, err[-3000:]
    assert "asking Slurm for an allocation: 2 to 4 tasks on 1 to 2 nodes, 2 per node" in err, err
    assert re.search(r"jaxtrain: Slurm node node2 is \S*DRAIN\S* \(reason: jaxtrain-test\)", err), \
        err[-3000:]
    assert ("jaxtrain: host node2 is being taken from the run; the run shrinks at its next "
            "committed checkpoint") in err, err[-3000:]
    assert ("jaxtrain: resizing the run from 4 to 2 workers (host node2 is being taken from the "
            "run; ScalingConfig.num_workers=(2, 4)): hosts node1") in err, err[-3000:]
    assert "jaxtrain: Slurm node node2 is usable again" in err, err[-3000:]
    assert "jaxtrain: resizing the run from 2 to 4 workers (host node2 can be reached again" \
        in err, err[-3000:]
    final = json.loads(out.split("final ", 1)[1])
    assert (final["step"], final["value"], final["world_size"]) == (47, 12096.0, 4)

    state = json.loads((run / "run.json").read_text())
    attempts = state["attempts"]
    # Planned restarts both: no failure is counted.
    assert [a["status"] for a in attempts] == ["RESIZED", "RESIZED", "FINISHED"], attempts
    assert not any("failure" in a for a in attempts) and state["resizes"] == 2
    assert [a["world_size"] for a in attempts] == [4, 2, 4]
    assert attempts[0]["hosts"] == attempts[2]["hosts"] == ["node1", "node1", "node2", "node2"]
    assert attempts[1]["hosts"] == ["node1", "node1"]
    assert attempts[1]["resize"] == {"from": 4, "to": 2,
                                     "reason": "host node2 is being taken from the run",
                                     "hosts_left_out": ["node2"]}
    assert (attempts[2]["resize"]["from"], attempts[2]["resize"]["to"]) == (2, 4)
    check_every_epoch_seen_once(run, {0: {(4, 4, 2)}, 1: {(2, 2, 4)}, 2: {(4, 4, 2)}})

# ELASTIC_RUN whose ranks on node2 (2 and 3) kill themselves in attempt 0 once `drained` exists,
# with a monitor interval of a minute: no planned resize comes first.
KILLED_WHEN_DRAINED = '''
            if ctx.get_attempt() == 0 and rank >= 2 and Path("drained").exists():
                os.kill(os.getpid(), 9)
'''


def test_a_node_drained_and_lost_fails_the_attempt_and_the_run_goes_on_without_it(
        slurm_cluster, shared_dir):
    """node2 drained, then its tasks killed before the monitor sees it: the attempt fails, the
    restart waits min(unreachable_host_timeout_s, interval) = 5 s for node2 to be usable, and goes
    on from the latest checkpoint with node1's 2 workers, to the end."""
    from test_elastic import ELASTIC_RUN, check_every_epoch_seen_once

    ready = 'Path("ready").write_text("")\n'
    assert ready in ELASTIC_RUN
    program = ELASTIC_RUN.replace(
        "elastic_resize_monitor_interval_s=2", "elastic_resize_monitor_interval_s=60").replace(
        ready, ready + KILLED_WHEN_DRAINED.lstrip("\n"))
    with contextlib.closing(ElasticDriver(slurm_cluster, shared_dir, program)) as elastic:
        elastic.node2("drain", "reason=jaxtrain-test")
        (shared_dir / "drained").write_text("")
        out, err = elastic.finish()

    assert elastic.driver.returncode == 0, err[-3000:]
    assert "jaxtrain: attempt 0 failed: rank" in err, err[-3000:]
    assert ("jaxtrain: host node2 cannot be reached after waiting up to 5 s for it (elastic: "
            "min(FailureConfig.unreachable_host_timeout_s, "
            "ScalingConfig.elastic_resize_monitor_interval_s))") in err, err[-3000:]
    assert ("jaxtrain: resizing the run from 4 to 2 workers (host node2 cannot be reached; "
            "ScalingConfig.num_workers=(2, 4)): hosts node1") in err, err[-3000:]
    final = json.loads(out.split("final ", 1)[1])
    assert (final["step"], final["value"], final["world_size"]) == (47, 12096.0, 2)
    state = json.loads((shared_dir / "elastic" / "run.json").read_text())
    attempts = state["attempts"]
    assert [(a["status"], a["world_size"]) for a in attempts] == [("ERRORED", 4), ("FINISHED", 2)]
    assert attempts[1]["hosts"] == ["node1", "node1"] and state["resizes"] == 1
    check_every_epoch_seen_once(shared_dir / "elastic", {0: {(4, 4, 2)}, 1: {(2, 2, 4)}})
