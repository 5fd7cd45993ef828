"""`jaxtrain dashboard` end to end: its JSON API over real run directories (local and on the S3
server), its access rules, and its page in a real headless Chromium during a live 4-worker run
with a rank killed and the run restarted."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import end_session, finish_driver, run_command, start_driver, wait_for
from jaxtrain import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
)
from jaxtrain.cli import main as cli_main
from jaxtrain.dashboard import Dashboard, open_source
from jaxtrain.dashboard.runs import progress, thinned

pytest_plugins = ["s3_server"]


# --- a run to look at -----------------------------------------------------------------------


def _train(config):
    """Reports `step`, `loss` and `total_steps`, a step every `step_s` seconds; rank 0
    checkpoints every `every` steps. In attempt 0, rank `fail_rank` fails at step `fail_at`
    (raises, or with `kill` is SIGKILLed), after every rank has sent its earlier reports."""
    from jaxtrain import get_checkpoint, get_context, report

    ctx = get_context()
    start = 0
    if get_checkpoint() is not None:
        with get_checkpoint().as_directory() as d:
            start = int(Path(d, "step").read_text()) + 1
    for step in range(start, config["steps"]):
        if step == config["fail_at"] and ctx.get_attempt() == 0:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("before the failure")
            if ctx.get_world_rank() == config["fail_rank"]:
                if config.get("kill"):
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("died on purpose")
        print(f"step {step} on rank {ctx.get_world_rank()}", flush=True)
        time.sleep(config.get("step_s", 0))
        metrics = {"step": step, "loss": 1.0 / (step + 1), "total_steps": config["steps"]}
        if step % config["every"] == 0 and ctx.get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as d:
                Path(d, "step").write_text(str(step))
                report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            report(metrics)


def fit(storage_path: str, name: str, workers: int = 2, **config) -> None:
    """A run of _train that fails once and restarts from its latest checkpoint."""
    JaxTrainer(
        _train,
        train_loop_config={"steps": 6, "fail_at": 3, "fail_rank": 1, "every": 2, **config},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=name, storage_path=storage_path,
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                                               checkpoint_score_order="min")),
    ).fit()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """The storage path of one finished run, 'done': rank 1 failed in attempt 0, attempt 1
    restored from step 2's checkpoint and finished."""
    storage = tmp_path_factory.mktemp("dashboard") / "runs"
    storage.mkdir()
    fit(str(storage), "done")
    return storage


# The token of the dashboards these tests start in this process (serving).
TOKEN = "t0ken-of-the-tests"


@contextlib.contextmanager
def serving(target: str, token: str = TOKEN, host: str = "127.0.0.1"):
    """A Dashboard over `target` in this process, on a free port; yields its base URL."""
    server = Dashboard(open_source(target), host, 0, token)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.stop()
        thread.join()


def get(url: str, headers: dict | None = None, token: str | None = TOKEN
        ) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET, with `token` as a bearer token unless `headers`
    carry one, or a cookie, or `token` is None."""
    headers = dict(headers or {})
    if token is not None and not {"Authorization", "Cookie"} & set(headers):
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def tree_digest(path: Path) -> dict[str, tuple[int, str]]:
    """Every file under `path` with its mtime and content hash."""
    out = {}
    for f in sorted(path.rglob("*")):
        if f.is_file():
            out[str(f)] = (f.stat().st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest())
    return out


# --- the API ------------------------------------------------------------------------------------


def test_the_api_shows_a_finished_run_and_never_writes_to_it(finished_run):
    before = tree_digest(finished_run)
    with serving(str(finished_run)) as url:
        status, listing, _ = get(f"{url}/api/runs")
        assert status == 200
        assert listing["source"] == str(finished_run)
        [run] = listing["runs"]
        assert (run["name"], run["status"], run["attempts"], run["world_size"]) == (
            "done", "FINISHED", 2, 2)
        assert (run["progress"]["done"], run["progress"]["total"]) == (6, 6)
        assert run["progress"]["fraction"] == 1.0
        assert run["progress"]["eta_s"] is None  # finished: nothing left to wait for

        status, detail, _ = get(f"{url}/api/runs/done")
        assert status == 200
        first, second = detail["attempt_list"]
        assert first["status"] == "ERRORED" and second["status"] == "FINISHED"
        assert first["failure"]["rank"] == 1 and first["failure"]["cause"] == "exception"
        assert "died on purpose" in first["failure"]["message"]
        assert second["restored_from"] == "checkpoint_000003"
        assert [r["state"] for r in detail["ranks"]] == ["FINISHED", "FINISHED"]
        assert all(r["host"] for r in detail["ranks"])
        # Rounds 1-3 (steps 0-2), then steps 3-5 again as rounds 4-6 after the restart.
        assert [m["round"] for m in detail["metrics"]] == [1, 2, 3, 4, 5, 6]
        assert detail["metrics"][-1]["metrics"]["loss"] == pytest.approx(1 / 6)
        kept = {c["dir_name"]: c for c in detail["checkpoints"]}
        # Steps 2 and 4 (rounds 3 and 5) are kept; step 4's loss, the lowest, is the best.
        assert set(kept) == {"checkpoint_000003", "checkpoint_000005"}
        assert kept["checkpoint_000005"]["best"] and kept["checkpoint_000005"]["latest"]
        assert not kept["checkpoint_000003"]["best"]
        assert kept["checkpoint_000005"]["score"] == pytest.approx(1 / 5)

        _, newer, _ = get(f"{url}/api/runs/done?since=4")
        assert [m["round"] for m in newer["metrics"]] == [5, 6]

        status, log, _ = get(f"{url}/api/runs/done/logs/1")
        assert status == 200
        assert "===== jaxtrain: attempt 0 =====" in log["text"]
        assert "died on purpose" in log["text"]

        assert get(f"{url}/api/runs/nope")[0:2] == (
            404, {"error": f"no run 'nope' under {finished_run}"})
        assert get(f"{url}/api/runs/done/logs/7")[0:2] == (
            404, {"error": "run 'done' has ranks 0 to 1, not 7"})
        status, body, _ = get(f"{url}/api/runs/done?since=x")
        assert status == 400 and "since='x'" in body["error"]
    assert tree_digest(finished_run) == before


def test_the_api_shows_each_attempts_stragglers(tmp_path):
    """run.json's straggler changes (docs/observability.md), written by hand: rank 1 was one for
    a while in attempt 0, rank 2 became one in attempt 1 and still was at its end."""
    run = tmp_path / "slow"
    run.mkdir()

    def change(rank, slow, t, step_s=0.4):
        return {"rank": rank, "slow": slow, "time": t, "step_time_s": step_s,
                "median_step_time_s": 0.1}

    (run / "run.json").write_text(json.dumps({
        "status": "FINISHED", "world_size": 3, "start_time": 100.0, "end_time": 200.0,
        "attempts": [
            {"attempt": 0, "status": "ERRORED", "start_time": 100.0, "end_time": 140.0,
             "hosts": ["a", "a", "b"],
             "failure": {"rank": 0, "host": "a", "cause": "exit", "message": "exit code 1",
                         "time": 139.0, "decision": {"action": "retry", "reason": "restart 1"}},
             "stragglers": [change(1, True, 110.0), change(1, False, 120.0, 0.1)]},
            {"attempt": 1, "status": "FINISHED", "start_time": 141.0, "end_time": 199.0,
             "hosts": ["a", "a", "b"], "stragglers": [change(2, True, 150.0, 0.31)]},
        ]}))
    with serving(str(tmp_path)) as url:
        status, detail, _ = get(f"{url}/api/runs/slow")
    assert status == 200
    first, second = detail["attempt_list"]
    assert first["stragglers"] == [{"rank": 1, "start_time": 110.0, "end_time": 120.0,
                                    "step_time_s": 0.4, "median_step_time_s": 0.1}]
    assert second["stragglers"] == [{"rank": 2, "start_time": 150.0, "end_time": None,
                                     "step_time_s": 0.31, "median_step_time_s": 0.1}]
    # The ranks table is the latest attempt's: rank 2 was a straggler when it ended.
    assert [r["straggler"] for r in detail["ranks"]] == [None, None, second["stragglers"][0]]


def test_the_api_shows_each_attempts_queue_wait(tmp_path):
    """An attempt whose launch waited for Kueue (queue_wait_s), and one still queued, written by
    hand: the attempt list and the goodput's queue part show them."""
    run = tmp_path / "queued"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({
        "status": "FINISHED", "world_size": 1, "start_time": 100.0, "end_time": 200.0,
        "attempts": [
            {"attempt": 0, "status": "FINISHED", "start_time": 100.0, "ready_time": 130.0,
             "end_time": 199.0, "queue_wait_s": 25.0},
        ]}))
    with serving(str(tmp_path)) as url:
        status, detail, _ = get(f"{url}/api/runs/queued")
    assert status == 200
    [attempt] = detail["attempt_list"]
    assert attempt["queue_wait_s"] == 25.0 and attempt["queued"] is False
    assert detail["goodput"]["parts"]["queue"] == 25.0
    assert detail["goodput"]["parts"]["startup"] == 5.0


def test_one_run_directory_is_served_alone(finished_run):
    with serving(str(finished_run / "done")) as url:
        assert [r["name"] for r in get(f"{url}/api/runs")[1]["runs"]] == ["done"]
        assert get(f"{url}/api/runs/done")[0] == 200


def test_progress_and_eta_come_from_step_and_total_steps():
    attempts = [{"start_time": 100.0}]
    rounds = [{"round": i + 1, "time": 100.0 + 2 * i,
               "metrics": {"step": i, "total_steps": 50}} for i in range(10)]
    p = progress(rounds, attempts, now=120.0)
    # Steps 0-9 are done: 10 of 50.
    assert (p["step"], p["done"], p["total"]) == (9, 10, 50)
    assert p["fraction"] == pytest.approx(0.2)
    assert p["eta_s"] == pytest.approx(40 * 2.0)  # 40 steps left at 2 s a step
    # The pace is the current attempt's: rounds before a restart do not count.
    slower = rounds[:5] + [{**r, "time": r["time"] + 10 * i} for i, r in enumerate(rounds[5:])]
    p = progress(slower, [{"start_time": 100.0}, {"start_time": slower[5]["time"]}], now=200.0)
    assert p["eta_s"] == pytest.approx(40 * 12.0)
    no_total = [{"round": 1, "time": 1.0, "metrics": {"step": 3}}]
    assert progress(no_total, attempts, 2.0)["eta_s"] is None
    assert progress([], attempts, 2.0)["round"] == 0


def test_a_long_run_sends_every_nth_round_and_always_the_last():
    rounds = [{"round": i} for i in range(1, 10_001)]
    sent = [r["round"] for r in thinned(rounds, most=1000)]
    assert sent[:3] == [1, 11, 21] and sent[-1] == 10_000 and len(sent) == 1001
    assert thinned(rounds[:5], most=1000) == rounds[:5]


def test_a_token_is_checked_on_every_request(finished_run):
    """The review's N2: on its default loopback address too (every local user can connect
    there), nothing is served without the token."""
    with serving(str(finished_run), token="s3cret") as url:
        for path in ("/", "/static/dashboard.js", "/api/runs", "/api/runs/done/logs/0"):
            status, body, _ = get(url + path, token=None)
            assert status == 401, path
            assert "needs its token" in body["error"]
        status, body, _ = get(f"{url}/api/runs?token=wrong", token=None)
        assert status == 401 and "the token is wrong" in body["error"]
        assert get(f"{url}/api/runs", {"Authorization": "Bearer s3cret"})[0] == 200
        request = urllib.request.Request(f"{url}/?token=s3cret")
        with urllib.request.urlopen(request, timeout=30) as response:
            cookie = response.headers["Set-Cookie"].split(";")[0]
        assert get(f"{url}/api/runs", {"Cookie": cookie})[0] == 200


def test_on_loopback_only_localhost_names_are_served(finished_run):
    with serving(str(finished_run)) as url:
        assert get(f"{url}/api/runs", {"Host": "localhost:1234"})[0] == 200
        status, body, _ = get(f"{url}/api/runs", {"Host": "attacker.example:1234"})
        assert status == 403 and "'attacker.example'" in body["error"]
    for host in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ValueError, match="needs a token"):
            Dashboard(open_source(str(finished_run)), host, 0, None)


def _start_cli(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = start_driver([sys.executable, "-m", "jaxtrain", "dashboard", *args],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env={**os.environ, **(env or {})})
    line = proc.stdout.readline()
    assert line.startswith("jaxtrain dashboard: http://"), (line, proc.stderr.read())
    return proc, line.split(": ", 1)[1].strip()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_command_makes_a_token_and_prints_it(finished_run, host):
    """On loopback too (the review's N2): a new token each start, in the URL printed."""
    proc, url = _start_cli(str(finished_run), "--host", host, "--port", "0")
    try:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname == (socket.gethostname() if host == "0.0.0.0" else host)
        token = urllib.parse.parse_qs(parts.query)["token"][0]
        base = f"http://127.0.0.1:{parts.port}"
        assert get(f"{base}/api/runs", token=None)[0] == 401
        assert get(f"{base}/api/runs?token={token}", token=None)[0] == 200
    finally:
        end_session(proc)


def test_the_token_comes_from_a_private_file_or_the_environment_never_argv(
        finished_run, tmp_path, capsys):
    """The review's N7: a token in argv is readable by every local user (ps)."""
    refused = run_command([sys.executable, "-m", "jaxtrain", "dashboard", str(finished_run),
                           "--token", "s3cret", "--port", "0"],
                          timeout=120, capture_output=True, text=True)
    assert refused.returncode == 2
    assert "--token is not accepted" in refused.stderr and "--token-file" in refused.stderr
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    token_file.chmod(0o644)
    assert cli_main(["dashboard", str(finished_run), "--token-file", str(token_file)]) == 2
    assert "other users may read it" in capsys.readouterr().err
    token_file.chmod(0o600)
    for args, env in ((["--token-file", str(token_file)], {}),
                      ([], {"JAXTRAIN_DASHBOARD_TOKEN": "from-a-file"})):
        proc, url = _start_cli(str(finished_run), "--port", "0", *args, env=env)
        try:
            assert url.endswith("?token=from-a-file")
            base = url.split("?")[0].rstrip("/")
            assert get(f"{base}/api/runs", token="from-a-file")[0] == 200
            assert get(f"{base}/api/runs", token="another")[0] == 401
        finally:
            end_session(proc)


def test_before_the_first_run_the_dashboard_waits_for_runs(finished_run, tmp_path):
    """The default storage path does not exist before the first run: the page shows an empty
    table, which fills when a run appears (it was refused)."""
    proc, url = _start_cli("--port", "0", env={"HOME": str(tmp_path)})
    try:
        base = url.split("?")[0].rstrip("/")
        token = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["token"][0]
        assert get(f"{base}/api/runs", token=token)[1]["runs"] == []
        shutil.copytree(finished_run / "done", tmp_path / "jaxtrain_results" / "done")
        assert [r["name"] for r in get(f"{base}/api/runs", token=token)[1]["runs"]] == ["done"]
    finally:
        end_session(proc)


def test_a_planted_run_directory_serves_no_file_it_does_not_own(finished_run, tmp_path):
    """The review's N3: whoever can write to a shared storage path plants run directories whose
    files link to the dashboard user's own (an ssh key), a run directory that links to another,
    or one of their own holding a file of the victim's. None of those files is served."""
    storage = tmp_path / "runs"
    storage.mkdir()
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    state = json.dumps({"status": "FINISHED", "world_size": 1, "config": {}})
    # A run whose log and index link to the secret.
    (storage / "linked-log" / "logs").mkdir(parents=True)
    (storage / "linked-log" / "run.json").write_text(state)
    (storage / "linked-log" / "logs" / "rank-0.log").symlink_to(secret)
    (storage / "linked-log" / "checkpoints.json").symlink_to(secret)
    # A run whose logs directory links to the secret's directory.
    (storage / "linked-logs-dir").mkdir()
    (storage / "linked-logs-dir" / "run.json").write_text(state)
    (tmp_path / "id_dir").mkdir()
    (tmp_path / "id_dir" / "rank-0.log").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (storage / "linked-logs-dir" / "logs").symlink_to(tmp_path / "id_dir")
    # A run directory that is a link (to a real run elsewhere).
    (storage / "linked-run").symlink_to(finished_run / "done")
    # Another user's run directory, with a log of this user's in it.
    foreign = storage / "foreign"
    (foreign / "logs").mkdir(parents=True)
    (foreign / "run.json").write_text(state)
    (foreign / "logs" / "rank-0.log").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    for p in (foreign, foreign / "logs", foreign / "run.json"):
        os.chown(p, 65534, 65534)
    with serving(str(storage)) as url:
        status, listing, _ = get(f"{url}/api/runs")
        assert status == 200
        assert sorted(r["name"] for r in listing["runs"]) == [
            "foreign", "linked-log", "linked-logs-dir"]
        answers = [json.dumps(listing)]
        for name in ("linked-log", "linked-logs-dir", "foreign"):
            status, detail, _ = get(f"{url}/api/runs/{name}")
            assert status == 200 and detail["checkpoints"] == []
            status, log, _ = get(f"{url}/api/runs/{name}/logs/0")
            assert status == 200 and log["text"] is None, name
            answers += [json.dumps(detail), json.dumps(log)]
        assert get(f"{url}/api/runs/linked-run")[0] == 404
        assert not any("PRIVATE KEY" in a for a in answers)


def test_idle_connections_neither_hold_the_dashboard_nor_its_stop(finished_run, monkeypatch):
    """The review's N8: connections are capped, each has a timeout, and stop() waits for no
    client."""
    monkeypatch.setattr(Dashboard, "timeout_s", 600.0)  # the held ones stay for the test
    server = Dashboard(open_source(str(finished_run)), "127.0.0.1", 0, TOKEN)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    address = server.server_address[:2]
    held = [socket.create_connection(address) for _ in range(server.max_connections)]
    try:
        wait_for("the dashboard to take every held connection",
                 lambda: server.open_connections() == len(held), 60)
        with socket.create_connection(address) as extra:
            extra.settimeout(60)
            assert extra.recv(1) == b""  # past the cap: closed at once
        stopping = threading.Thread(target=server.stop, daemon=True)
        stopping.start()
        stopping.join(60)  # a hang detector, not a timing
        assert not stopping.is_alive(), "stop() waits for idle clients"
        for conn in held:
            conn.settimeout(60)
            assert conn.recv(1) == b""
    finally:
        for conn in held:
            conn.close()
        server.stop()
        thread.join()


def test_bad_paths_are_clear_usage_errors(tmp_path, capsys):
    assert cli_main(["dashboard", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'missing'} does not exist" in err and "Traceback" not in err
    (tmp_path / "file").write_text("x")
    assert cli_main(["dashboard", str(tmp_path / "file")]) == 2
    assert "neither a storage path" in capsys.readouterr().err
    assert cli_main(["dashboard", str(tmp_path), "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err


def test_a_run_on_the_s3_server(bucket, tmp_path):
    fit(f"s3://{bucket}/runs", "remote")
    with serving(f"s3://{bucket}/runs") as url:
        [run] = get(f"{url}/api/runs")[1]["runs"]
        assert (run["name"], run["status"]) == ("remote", "FINISHED")
        _, detail, _ = get(f"{url}/api/runs/remote")
        assert [a["status"] for a in detail["attempt_list"]] == ["ERRORED", "FINISHED"]
        assert len(detail["metrics"]) == 6
        assert any(c["best"] for c in detail["checkpoints"])
        assert "died on purpose" in get(f"{url}/api/runs/remote/logs/1")[1]["text"]
    with serving(f"s3://{bucket}/runs/remote") as url:
        assert [r["name"] for r in get(f"{url}/api/runs")[1]["runs"]] == ["remote"]


# --- in a real browser --------------------------------------------------------------------------


# The live run: 4 workers, a step every 0.25 s, rank 2 SIGKILLed at step 6 of attempt 0.
_LIVE_DRIVER = """
    import sys

    sys.path.insert(0, sys.argv[2])
    from test_dashboard import fit

    fit(sys.argv[1], "live", workers=4, steps=40, fail_at=6, fail_rank=2, kill=True, every=4,
        step_s=0.25)
"""

_CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                   "--no-first-run", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--window-size=1400,1800"]


def _browser_or_skip():
    """Headless Chromium driven by selenium; skipped without them unless
    JAXTRAIN_REQUIRE_BROWSER=1, which fails instead."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if not (chromium and chromedriver and webdriver):
        missing = ("chromium and chromium-driver (apt-get install -y --no-install-recommends "
                   "chromium chromium-driver)" if not (chromium and chromedriver)
                   else "selenium (pip install -r requirements-dev.txt)")
        message = f"the browser test needs {missing}"
        if os.environ.get("JAXTRAIN_REQUIRE_BROWSER") == "1":
            pytest.fail(message + " (JAXTRAIN_REQUIRE_BROWSER=1)")
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in _CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument("--user-data-dir=" + tempfile.mkdtemp(prefix="jaxtrain-chromium-"))
    return webdriver.Chrome(service=Service(chromedriver), options=options)


@pytest.fixture
def browser():
    driver = _browser_or_skip()
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_follows_a_live_run_through_a_killed_rank_and_its_restart(
        browser, storage, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    dashboard, url = _start_cli(storage, "--port", "0")
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(_LIVE_DRIVER))
    run = start_driver([sys.executable, str(script), storage, os.path.dirname(__file__)],
                       cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)

    def points() -> int:
        charts = browser.find_elements(By.CSS_SELECTOR, '.chart[data-metric="loss"]')
        return int(charts[0].get_attribute("data-points")) if charts else 0

    try:
        browser.get(url)
        link = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, 'tr[data-run="live"] a'))
        link[0].click()
        # The killed rank's attempt, with its cause, and the restart.
        failed = wait.until(lambda b: b.find_elements(
            By.CSS_SELECTOR, '#attempts li[data-attempt="0"][data-status="ERRORED"]'))
        cause = failed[0].find_element(By.CSS_SELECTOR, ".cause")
        assert cause.get_attribute("data-cause") == "signal"
        assert "rank 2" in cause.text
        assert "SIGKILL" in failed[0].text
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, '#attempts li[data-attempt="1"]'))
        assert browser.find_elements(
            By.CSS_SELECTOR, '#timeline g.attempt[data-attempt="1"]')
        # The loss curve gains points between two looks, without a reload.
        first = wait.until(lambda b: points())
        wait.until(lambda b: points() > first)
        shot = tmp_path / "artefacts" / "dashboard-live-run.png"
        shot.parent.mkdir()
        assert browser.save_screenshot(str(shot))
        print(f"dashboard screenshot: {shot}")
        assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        end_session(dashboard)
    done = finish_driver(run, timeout=120)
    assert done.returncode == 0, done.stdout


def test_the_api_names_the_stacks_of_a_hung_attempt(tmp_path):
    """A hang the watchdog stopped (written by hand): its failure names the folder of every
    rank's stacks, which the attempt list shows (docs/failure-detection.md)."""
    run = tmp_path / "hung"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({
        "status": "ERRORED", "world_size": 2, "start_time": 100.0, "end_time": 200.0,
        "attempts": [
            {"attempt": 0, "status": "ERRORED", "start_time": 100.0, "end_time": 199.0,
             "failure": {"rank": 1, "host": "a", "cause": "watchdog", "message": "stuck",
                         "stacks": "stacks/attempt-0"}},
        ]}))
    with serving(str(tmp_path)) as url:
        status, detail, _ = get(f"{url}/api/runs/hung")
    assert status == 200
    assert detail["attempt_list"][0]["failure"]["stacks"] == "stacks/attempt-0"
