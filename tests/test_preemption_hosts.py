"""Preemption notices from the hosts themselves, with real JAX workers: the GCE metadata server's
``instance/preempted`` and ``instance/maintenance-event`` (a fake server,
tests/metadata_server.py) in a local run and on an ssh test host, and a SIGTERM to every worker
process of one ssh host (as a spot VM's shutdown sends it). In each, every rank sees the notice at
the same step, the just-in-time checkpoint is committed, the group restarts from it, and the run
finishes with max_failures=0 as an undisturbed one does.

The ssh tests use the hosts' fixed network namespaces: run them only under
``flock /tmp/jaxtrain-clusters.lock`` (-k ssh)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from metadata_server import QUIET, put, serving

from jaxtrain import Checkpoint, FailureConfig, JaxTrainer, RunConfig, ScalingConfig
from jaxtrain.worker import gce_metadata

if TYPE_CHECKING:
    from ssh_fixtures import SshHosts

pytest_plugins = ["ssh_fixtures"]  # ssh_hosts, ssh_shared_dir (only the ssh tests start them)

TESTS = Path(__file__).resolve().parent
STEPS = 24
PREEMPT_AT = 8  # the step of attempt 0 at which the preemption happens
# The last step at which a notice is waited for (see _train); the restart has steps left after it.
LAST_WAIT = STEPS - 3
WATCHER_THREAD = "jaxtrain-gce-metadata"


def _undisturbed_state() -> float:
    """What _train computes without a preemption: the same arithmetic, in the same order."""
    state = 1.0
    for step in range(STEPS):
        state = state * 0.9 + 10.0 / (step + 1)  # 10 = the sum of rank + 1 over 4 ranks
    return state


def _preempt(config) -> None:
    """What config["preempt"] says happens at step PREEMPT_AT of attempt 0, done by rank
    config["by"]: the metadata server's value flipped (for this host's address only with
    "only_me"), or a SIGTERM to every worker process of this host (their pids are in this host's
    own /tmp)."""
    how = config["preempt"]
    if how["kind"] == "metadata":
        put(how["server"], how["key"], how["value"], only_me=how["only_me"])
    else:
        pids = Path(tempfile.gettempdir(), how["tag"])
        for each in sorted(pids.iterdir()):
            os.kill(int(each.read_text()), signal.SIGTERM)


def _train(config):
    """Ray Train V2's pattern: a periodic checkpoint every 8 steps, and on a preemption notice
    one just-in-time checkpoint. A run that expects a notice (config["preempt"]) and has not seen
    it by step LAST_WAIT waits for it there, so that the test does not depend on how many steps
    pass while the notice travels (every rank asks the same number of times, as always)."""
    import socket
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxtrain as train

    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    out = Path(config["out"])
    how = config["preempt"]
    Path(out, f"threads-{attempt}-{rank}").write_text(json.dumps(
        {"host": socket.gethostname(), "local_rank": ctx.get_local_rank(),
         "watchers": sorted(t.name for t in threading.enumerate()
                            if t.name.startswith(WATCHER_THREAD))}))
    if how is not None and how["kind"] == "sigterm-host" and attempt == 0:
        pids = Path(tempfile.gettempdir(), how["tag"])  # this host's own /tmp
        pids.mkdir(exist_ok=True)
        Path(pids, str(rank)).write_text(str(os.getpid()))
    state, start = 1.0, 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = json.loads(Path(d, "state.json").read_text())
            state, start = saved["state"], saved["step"] + 1
    saved_on_preemption = False
    for step in range(start, STEPS):
        share = multihost_utils.process_allgather(jnp.asarray([rank + 1.0]))
        state = state * 0.9 + float(np.sum(np.asarray(share))) / (step + 1)
        expecting = how is not None and attempt == 0
        if expecting and step == PREEMPT_AT and rank == config["by"]:
            _preempt(config)
        info = train.get_preemption_info()
        while expecting and info is None and step == LAST_WAIT:
            info = train.get_preemption_info()
        due = (step + 1) % 8 == 0
        if info is not None and not saved_on_preemption:
            Path(out, f"seen-{attempt}-{rank}").write_text(json.dumps(
                {"step": step, "ranks": info.preempted_ranks, "nodes": info.preempted_node_ids,
                 "deadline_ms": info.deadline_ms}))
            if how["kind"] == "metadata" and rank == config["by"]:
                # The VM that comes back is a new one: its metadata says nothing.
                put(how["server"], how["key"], QUIET[how["key"]], only_me=how["only_me"])
            saved_on_preemption = due = True
        metrics = {"step": step, "state": state, "attempt": attempt}
        if due:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    Path(d, "state.json").write_text(json.dumps({"state": state, "step": step}))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
    jax.block_until_ready(jnp.zeros(()))


def _fit(out: Path, storage: Path, name: str, *, preempt: dict | None = None, by: int = 2,
         env_vars: dict[str, str] | None = None):
    return JaxTrainer(
        _train,
        train_loop_config={"out": str(out), "preempt": preempt, "by": by},
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             worker_runtime_env={"env_vars": env_vars or {}},
                             failure_config=FailureConfig(max_failures=0)),
    ).fit()


def _check_preempted_and_finished(run_path: Path, out: Path, *, source: str,
                                  node_to_ranks: dict[str, list[int]] | None = None) -> None:
    """The run's record and what the ranks saw: one preemption by `source` (of `node_to_ranks`,
    or of every rank on the first failure's host), every rank saw it at the same step, the
    restart resumed from the just-in-time checkpoint with no step redone, and the run ended as
    an undisturbed one."""
    run = json.loads(Path(run_path, "run.json").read_text())
    attempts = run["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"], attempts
    failure = attempts[0]["failure"]
    assert failure["cause"] == "preemption", failure
    assert f"by {source}" in failure["message"] and "was committed" in failure["message"], failure
    if node_to_ranks is None:
        node_to_ranks = {failure["host"]: [0, 1, 2, 3]}
    assert failure["preemption"]["preempted_node_to_ranks"] == node_to_ranks, failure
    assert failure["preemption"]["drain_timed_out"] is False
    assert failure["decision"]["action"] == "retry"

    seen = [json.loads((out / f"seen-0-{rank}").read_text()) for rank in range(4)]
    assert all(s == seen[0] for s in seen), seen
    assert seen[0]["nodes"] == sorted(node_to_ranks)
    assert seen[0]["ranks"] == sorted(r for rs in node_to_ranks.values() for r in rs)
    assert seen[0]["deadline_ms"] > 0
    jit_step = seen[0]["step"]
    assert PREEMPT_AT <= jit_step <= LAST_WAIT, jit_step
    assert not list(out.glob("seen-1-*"))  # the restarted group got no notice

    rows = [json.loads(line)["metrics"]
            for line in Path(run_path, "result.jsonl").read_text().splitlines()]
    first = [r["step"] for r in rows if r["attempt"] == 0]
    second = [r["step"] for r in rows if r["attempt"] == 1]
    assert first[-1] == jit_step and second[0] == jit_step + 1, (first, second)
    assert second[-1] == STEPS - 1
    assert attempts[1]["restored_from"].endswith(f"checkpoint_{jit_step + 1:06d}"), attempts[1]
    assert rows[-1]["state"] == pytest.approx(_undisturbed_state(), rel=1e-12)


def _watchers(out: Path, attempt: int) -> dict[int, dict]:
    return {rank: json.loads((out / f"threads-{attempt}-{rank}").read_text())
            for rank in range(4)}


# --- the watcher's policy and its server, without a run ---------------------------------------

def test_the_watcher_runs_where_a_metadata_server_is_and_is_forced_by_the_variable(tmp_path):
    google, other = tmp_path / "google", tmp_path / "other"
    google.write_text("Google Compute Engine\n")
    other.write_text("Standard PC (Q35 + ICH9, 2009)\n")
    absent = str(tmp_path / "absent")
    assert gce_metadata.metadata_host({}, absent) is None
    assert gce_metadata.metadata_host({}, str(other)) is None
    assert gce_metadata.metadata_host({}, str(google)) == "metadata.google.internal"
    assert gce_metadata.metadata_host({"GCE_METADATA_HOST": "10.0.0.9:8080"},
                                      absent) == "10.0.0.9:8080"
    assert gce_metadata.metadata_host({"GCE_METADATA_ROOT": "old:80"}, absent) == "old:80"
    assert gce_metadata.metadata_host({"JAXTRAIN_GCE_METADATA": "1"},
                                      absent) == "metadata.google.internal"
    assert gce_metadata.metadata_host({"JAXTRAIN_GCE_METADATA": "0"}, str(google)) is None
    assert gce_metadata.metadata_host(
        {"JAXTRAIN_GCE_METADATA": "0", "GCE_METADATA_HOST": "10.0.0.9"}, absent) is None
    with pytest.raises(ValueError, match=r"JAXTRAIN_GCE_METADATA='yes' is not allowed; use 1"):
        gce_metadata.metadata_host({"JAXTRAIN_GCE_METADATA": "yes"}, absent)


def test_only_preemption_and_a_maintenance_that_stops_the_vm_are_notices():
    assert gce_metadata.notice_source("preempted", "TRUE") == "GCE metadata: preempted"
    assert gce_metadata.notice_source("preempted", "FALSE") is None
    assert gce_metadata.notice_source("maintenance-event", "NONE") is None
    assert gce_metadata.notice_source("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE") is None
    assert gce_metadata.notice_source(
        "maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE") == (
        "GCE metadata: maintenance-event TERMINATE_ON_HOST_MAINTENANCE")
    assert [gce_metadata.retry_delay(t) for t in (1, 2, 3)] == [0.5, 1.0, 2.0]


def test_the_watcher_long_polls_with_the_flavor_header_and_notices_once_per_key():
    notices, lines = [], []
    with serving() as server:
        watcher = gce_metadata.Watcher(server.host, lambda *n: notices.append(n), lines.append)
        watcher.start()
        put(server.host, "maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")  # not a notice
        put(server.host, "preempted", "TRUE")
        put(server.host, "maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        for thread in watcher.threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in watcher.threads)
        assert all(flavored for _, _, flavored in server.requests)
    assert sorted(source for source, _ in notices) == [
        "GCE metadata: maintenance-event TERMINATE_ON_HOST_MAINTENANCE",
        "GCE metadata: preempted"]
    assert all(deadline > 0 for _, deadline in notices)
    assert lines[0].startswith("watching the GCE metadata server at 127.0.0.1:")


def test_a_watcher_that_cannot_reach_the_server_says_so_once_and_stops():
    lines = []
    with serving() as server:
        port = server.port
    watcher = gce_metadata.Watcher(f"127.0.0.1:{port}", lambda *n: None, lines.append).start()
    for thread in watcher.threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in watcher.threads)
    assert len(lines) == 2, lines
    assert "cannot be asked (ConnectionRefusedError" in lines[1], lines


def test_a_bad_switch_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_GCE_METADATA", "true")
    with pytest.raises(ValueError, match="JAXTRAIN_GCE_METADATA='true' is not allowed"):
        _fit(tmp_path, tmp_path / "results", "refused")
    assert not (tmp_path / "results").exists()


# --- local runs -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """A run here, where no metadata server is (the default): no watcher starts, and its final
    state is what every preempted run must end with."""
    mp = pytest.MonkeyPatch()
    for name in ("GCE_METADATA_HOST", "GCE_METADATA_ROOT", "JAXTRAIN_GCE_METADATA"):
        mp.delenv(name, raising=False)
    try:
        assert gce_metadata.metadata_host() is None, "this machine looks like a GCE VM"
        out = tmp_path_factory.mktemp("undisturbed")
        result = _fit(out, out / "results", "undisturbed")
    finally:
        mp.undo()
    return out, result


def test_without_a_metadata_server_no_watcher_starts(undisturbed):
    out, result = undisturbed
    assert all(w["watchers"] == [] for w in _watchers(out, 0).values())
    for rank in range(4):
        log = Path(result.path, "logs", f"rank-{rank}.log").read_text()
        assert "GCE metadata" not in log, log
    assert result.metrics["state"] == pytest.approx(_undisturbed_state(), rel=1e-12)


@pytest.mark.parametrize("key,value,source", [
    ("preempted", "TRUE", "GCE metadata: preempted"),
    ("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE",
     "GCE metadata: maintenance-event TERMINATE_ON_HOST_MAINTENANCE"),
])
def test_a_metadata_notice_saves_just_in_time_and_the_run_finishes(tmp_path, undisturbed, key,
                                                                    value, source):
    with serving() as server:
        result = _fit(tmp_path, tmp_path / "results", "metadata",
                      preempt={"kind": "metadata", "server": server.host, "key": key,
                               "value": value, "only_me": False},
                      env_vars={"GCE_METADATA_HOST": server.host})
        assert all(flavored for _, _, flavored in server.requests)
    _check_preempted_and_finished(Path(result.path), tmp_path, source=source)
    assert result.metrics["state"] == pytest.approx(undisturbed[1].metrics["state"], rel=1e-12)
    # One watcher per host: in the worker of local rank 0, one thread per key; in each attempt.
    for attempt in (0, 1):
        watchers = _watchers(tmp_path, attempt)
        assert watchers[0]["watchers"] == [f"{WATCHER_THREAD}-maintenance-event",
                                           f"{WATCHER_THREAD}-preempted"], watchers
        assert all(watchers[r]["watchers"] == [] for r in (1, 2, 3)), watchers
    log = Path(result.path, "logs", "rank-0.log").read_text()
    assert f"the GCE metadata server says {key} = {value}" in log, log


# --- ssh hosts (run under flock /tmp/jaxtrain-clusters.lock) ----------------------------------

DRIVER = textwrap.dedent("""\
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_preemption_hosts import _fit
    result = _fit(Path.cwd(), Path.cwd(), "preempted", **json.loads(os.environ["FIT"]))
    print("result", result.path)
""")


def _drive(hosts: SshHosts, cwd: Path, **fit) -> Path:
    from test_ssh import drive

    proc = drive(hosts, cwd, DRIVER.format(tests=str(TESTS)), JAXTRAIN_SSH_HOSTS="host1,host2",
                 FIT=json.dumps(fit), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.split("result ", 1)[1].split()[0])


def test_ssh_sigterm_to_every_worker_of_one_host_is_a_notice_for_it(ssh_hosts, ssh_shared_dir):
    tag = f"jaxtrain-pids-{os.getpid()}-{ssh_shared_dir.name}"
    run_path = _drive(ssh_hosts, ssh_shared_dir, preempt={"kind": "sigterm-host", "tag": tag})

    _check_preempted_and_finished(run_path, ssh_shared_dir, source="SIGTERM",
                                  node_to_ranks={"host2": [2, 3]})
    assert [w["host"] for w in _watchers(ssh_shared_dir, 1).values()] == [
        "host1", "host1", "host2", "host2"]
    assert all(w["watchers"] == [] for w in _watchers(ssh_shared_dir, 0).values())
    ssh_hosts.run_on("host2", f"rm -rf /tmp/{tag}")


def test_ssh_a_metadata_notice_on_one_host_preempts_that_host(ssh_hosts, ssh_shared_dir):
    from s3_server import BRIDGES, LISTEN

    with serving(LISTEN) as server:
        on_hosts = f"{BRIDGES['ssh']}:{server.port}"
        run_path = _drive(ssh_hosts, ssh_shared_dir,
                          preempt={"kind": "metadata", "server": on_hosts, "key": "preempted",
                                   "value": "TRUE", "only_me": True},
                          env_vars={"GCE_METADATA_HOST": on_hosts})
        clients = {client for client, _, _ in server.requests}
    assert len(clients) == 2, clients  # each host's watcher asked for its own VM's metadata
    _check_preempted_and_finished(run_path, ssh_shared_dir, source="GCE metadata: preempted",
                                  node_to_ranks={"host2": [2, 3]})
    watchers = _watchers(ssh_shared_dir, 0)
    assert [bool(w["watchers"]) for w in watchers.values()] == [True, False, True, False]
    log = (run_path / "logs" / "rank-2.log").read_text()
    assert "the GCE metadata server says preempted = TRUE" in log, log
