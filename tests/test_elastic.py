"""Elastic runs on the ssh test hosts (tests/ssh_fixtures.py; docs/elastic.md): a run of
ScalingConfig(num_workers=(2, 4)) on host1 and host2, 2 workers each, that loses host2's network
mid-run goes on with host1's 2 workers from its latest checkpoint, and grows back to 4 once host2
answers again; real JAX, real sshd, real processes. A simulated multi-slice TPU run resizes by
whole slices; fewer hosts than min fail the run as a fixed-size run fails; the local launcher,
which does not resize, trains on max."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from test_ssh import finish, said_until, start_long_run, workers_left

from conftest import run_driver

if TYPE_CHECKING:
    from ssh_fixtures import SshHosts

pytest_plugins = ["ssh_fixtures"]

# 6 epochs of a 64-row array in global batches of 8 (8 steps an epoch), shuffled per epoch, read
# through jaxtrain.data.DataLoader whatever the world size: each step adds the global sum of its
# batch (a psum over every process) to a value checkpointed with the step, with the loader's
# position. Whatever the resizes, the run ends where an uninterrupted one ends: step 47 and
# 6 x (0 + ... + 63) = 12096, each epoch's rows seen once.
ELASTIC_RUN = '''
import json, os, tempfile, time
from pathlib import Path
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import (Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig, data,
                      get_checkpoint, get_context, report)

EPOCHS = 6


def train():
    ctx = get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    mesh = Mesh(np.array(jax.devices()), ("workers",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    loader = data.DataLoader(np.arange(64, dtype=np.float32), global_batch_size=8, shuffle=True,
                             seed=0)
    step, value = 0, 0.0
    if (checkpoint := get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            state = json.loads(Path(d, "state.json").read_text())
        step, value = state["step"] + 1, state["value"]
    for epoch in range(loader.epoch, EPOCHS):
        for local in loader:
            batch = float(total(jax.make_array_from_process_local_data(
                NamedSharding(mesh, P("workers")), local)))
            value += batch
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    Path(d, "state.json").write_text(json.dumps({"step": step, "value": value}))
                report({"step": step, "epoch": epoch, "batch_sum": batch, "value": value,
                        "world_size": world, "process_count": jax.process_count(),
                        "local_rows": len(local), "attempt": ctx.get_attempt()},
                       checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
            if step == 5 and ctx.get_attempt() == 0 and rank == 0:
                Path("ready").write_text("")
            step += 1
            time.sleep(0.3)


result = JaxTrainer(
    train, scaling_config=ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=2),
    run_config=RunConfig(name="elastic", storage_path=os.getcwd(),
                         failure_config=FailureConfig(max_failures=1,
                                                      unreachable_host_timeout_s=5))).fit()
print("final", json.dumps(result.metrics))
'''


def rounds(run: Path) -> list[dict]:
    path = run / "result.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["metrics"] for line in path.read_text().splitlines() if line]


def check_every_epoch_seen_once(run: Path, worlds: dict[int, set]) -> None:
    """ELASTIC_RUN's rounds in `run`: each attempt saw the world it was given (`worlds`: attempt
    -> {(world_size, process_count, local_rows)}), in jaxtrain and in JAX alike, each process
    reading its share of the same global batches; no step is lost (those after the checkpoint an
    attempt restored from are reported again by the next, with the same rows); and each epoch's
    rows were seen once."""
    seen = rounds(run)
    by_attempt = {}
    for r in seen:
        by_attempt.setdefault(r["attempt"], set()).add(
            (r["world_size"], r["process_count"], r["local_rows"]))
    assert by_attempt == worlds, by_attempt
    assert {r["step"] for r in seen} == set(range(48))
    batches = {}
    for r in seen:
        assert batches.setdefault(r["step"], r["batch_sum"]) == r["batch_sum"], r
    for epoch in range(6):
        assert sum(batches[s] for s in range(8 * epoch, 8 * epoch + 8)) == 2016.0


def cut_and_restore_host2(hosts: SshHosts, cwd: Path, program: str, run: Path, full: int,
                          fewer: int) -> tuple[str, str, int]:
    """`program` driven on host1 and host2; host2's link cut once it has trained a while, and
    restored once the run has shrunk from `full` to `fewer` workers and recorded a round on them.
    Its stdout, stderr and exit status."""
    driver = start_long_run(hosts, cwd, program, stdout=subprocess.PIPE)
    with hosts.cut("host2"):
        said = said_until(driver, f"resizing the run from {full} to {fewer} workers")
        deadline = time.monotonic() + 120
        while not any(r["world_size"] == fewer for r in rounds(run)) and driver.poll() is None:
            assert time.monotonic() < deadline, said[-3000:]
            time.sleep(0.2)
    out, err = finish(driver)
    return out, said + err, driver.returncode


def test_a_host_lost_shrinks_the_run_and_its_return_grows_it_back(ssh_hosts, ssh_shared_dir):
    shared_dir = ssh_shared_dir
    run = shared_dir / "elastic"
    out, err, returncode = cut_and_restore_host2(ssh_hosts, shared_dir, ELASTIC_RUN, run, 4, 2)

    assert returncode == 0, err[-3000:]
    assert "jaxtrain: attempt 0 failed: rank" in err, err[-3000:]
    assert ("jaxtrain: resizing the run from 4 to 2 workers (host host2 cannot be reached; "
            "ScalingConfig.num_workers=(2, 4)): hosts host1") in err, err[-3000:]
    assert "host host2 can be reached again; the run grows at its next committed checkpoint" \
        in err, err[-3000:]
    assert "jaxtrain: resizing the run from 2 to 4 workers (host host2 can be reached again" \
        in err, err[-3000:]
    final = json.loads(out.split("final ", 1)[1])
    assert (final["step"], final["value"], final["world_size"]) == (47, 12096.0, 4)

    state = json.loads((run / "run.json").read_text())
    attempts = state["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "RESIZED", "FINISHED"], attempts
    assert [a["world_size"] for a in attempts] == [4, 2, 4]
    assert attempts[1]["hosts"] == ["host1", "host1"]
    assert attempts[2]["hosts"] == ["host1", "host1", "host2", "host2"]
    assert attempts[1]["resize"]["from"] == 4 and attempts[1]["resize"]["to"] == 2
    assert attempts[2]["resize"]["from"] == 2 and attempts[2]["resize"]["to"] == 4
    assert "failure" not in attempts[1] and state["resizes"] == 2
    check_every_epoch_seen_once(run, {0: {(4, 4, 2)}, 1: {(2, 2, 4)}, 2: {(4, 4, 2)}})
    assert workers_left(ssh_hosts, "host1") == []


# A simulated multi-slice TPU run (JAXTRAIN_SIMULATE=1: planned as for TPUs, JAX on CPU) over
# host1 and host2 described as two single-host v4 slices: it resizes by whole slices, and each
# attempt's MEGASCALE_* variables are computed for the slices it has, never kept stale.
SLICES_RUN = """
import json, os, tempfile, time
from pathlib import Path
os.environ.pop("JAXTRAIN_SSH_HOSTS")
os.environ.update(JAXTRAIN_LAUNCHER="ssh", JAXTRAIN_SIMULATE="1", JAXTRAIN_HOSTS="hosts.json")
Path("hosts.json").write_text(json.dumps({"hosts": [
    {"name": h, "tpu": {"chips": 4, "slice": f"slice-{h}", "accelerator_type": "v4-8",
                        "topology": "2x2x1"}} for h in ("host1", "host2")]}))
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import (Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig,
                      get_checkpoint, get_context, report)

TPU_NAMES = ("MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS",
             "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES")


def train():
    ctx = get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    Path(f"env-{ctx.get_attempt()}-{rank}.json").write_text(
        json.dumps({n: os.environ.get(n) for n in TPU_NAMES}))
    mesh = Mesh(np.array(jax.devices()), ("workers",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    start, value = 0, 0.0
    if (checkpoint := get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            state = json.loads(Path(d, "state.json").read_text())
        start, value = state["step"] + 1, state["value"]
    for step in range(start, 40):
        value += float(total(jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("workers")), np.array([1.0]))))
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                Path(d, "state.json").write_text(json.dumps({"step": step, "value": value}))
            report({"step": step, "world_size": world, "attempt": ctx.get_attempt(),
                    "slices": os.environ.get("MEGASCALE_NUM_SLICES")},
                   checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
        if step == 5 and ctx.get_attempt() == 0 and rank == 0:
            Path("ready").write_text("")
        time.sleep(0.3)


result = JaxTrainer(
    train, scaling_config=ScalingConfig(num_workers=(1, 2), use_tpu=True, topology="2x2x1",
                                        accelerator_type="TPU-V4",
                                        elastic_resize_monitor_interval_s=2),
    run_config=RunConfig(name="slices", storage_path=os.getcwd(),
                         failure_config=FailureConfig(max_failures=1,
                                                      unreachable_host_timeout_s=5))).fit()
print("final", json.dumps(result.metrics))
"""


def test_a_simulated_multislice_tpu_run_resizes_by_whole_slices(ssh_hosts, ssh_shared_dir):
    shared_dir = ssh_shared_dir
    run = shared_dir / "slices"
    out, err, returncode = cut_and_restore_host2(ssh_hosts, shared_dir, SLICES_RUN, run, 2, 1)

    assert returncode == 0, err[-3000:]
    final = json.loads(out.split("final ", 1)[1])
    assert (final["step"], final["world_size"], final["slices"]) == (39, 2, "2")
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert [(a["status"], a["world_size"]) for a in attempts] == [
        ("ERRORED", 2), ("RESIZED", 1), ("FINISHED", 2)], attempts

    def env(attempt: int, rank: int) -> dict:
        return json.loads((shared_dir / f"env-{attempt}-{rank}.json").read_text())

    for attempt in (0, 2):  # two slices: multi-slice variables for both
        assert [env(attempt, r)["MEGASCALE_NUM_SLICES"] for r in (0, 1)] == ["2", "2"]
        assert [env(attempt, r)["MEGASCALE_SLICE_ID"] for r in (0, 1)] == ["0", "1"]
        assert [env(attempt, r)["TPU_WORKER_HOSTNAMES"] for r in (0, 1)] == ["host1", "host2"]
    # One slice left: no multi-slice variables at all, none kept from the attempt before.
    alone = env(1, 0)
    assert alone["MEGASCALE_NUM_SLICES"] is None and alone["MEGASCALE_SLICE_ID"] is None
    assert alone["MEGASCALE_COORDINATOR_ADDRESS"] is None
    assert (alone["TPU_WORKER_ID"], alone["TPU_WORKER_HOSTNAMES"]) == ("0", "host1")
    assert not (shared_dir / "env-1-1.json").exists()
    assert {r["step"] for r in rounds(run)} == set(range(40))


def test_fewer_hosts_than_min_fail_the_run_naming_the_host(ssh_hosts, ssh_shared_dir):
    """(4, 4) on 2 hosts x 2: without host2 the run cannot go on, so it does what a fixed-size run
    does: the restart waits for host2 and fails, naming it."""
    program = ELASTIC_RUN.replace("num_workers=(2, 4)", "num_workers=(4, 4)")
    driver = start_long_run(ssh_hosts, ssh_shared_dir, program, stdout=subprocess.PIPE)
    with ssh_hosts.cut("host2"):
        out, err = finish(driver)

    assert driver.returncode != 0, out[-2000:]
    assert ("host host2 cannot be reached, and the hosts left (host1) hold 2 worker(s), fewer "
            "than the min of ScalingConfig.num_workers (4); starting on every host, as a "
            "fixed-size run does") in err, err[-3000:]
    assert "cannot restart the worker group: cannot reach host host2 over ssh" in err, err[-3000:]
    attempts = json.loads((ssh_shared_dir / "elastic" / "run.json").read_text())["attempts"]
    assert [(a["status"], a["world_size"]) for a in attempts] == [("ERRORED", 4), ("ERRORED", 4)]


def test_a_local_run_of_an_elastic_config_trains_on_max_and_says_so(tmp_path):
    proc = run_driver("""
        import json, os
        import jax
        from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, get_context, report

        def train():
            report({"world_size": get_context().get_world_size(),
                    "process_count": jax.process_count()})

        result = JaxTrainer(train, scaling_config=ScalingConfig(num_workers=(1, 2)),
                            run_config=RunConfig(name="local", storage_path=os.getcwd())).fit()
        print("final", json.dumps(result.metrics))
        """, tmp_path, env={"JAXTRAIN_SIMULATE": "0"})

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("jaxtrain: ScalingConfig.num_workers=(1, 2): the local launcher does not resize this "
            "run (docs/elastic.md); it trains on 2 workers, as a fixed-size run") in proc.stderr
    assert json.loads(proc.stdout.split("final ", 1)[1]) == {"world_size": 2, "process_count": 2}
