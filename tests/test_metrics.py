"""The driver's Prometheus endpoint: its exposition parsed by prometheus_client's parser, the
settings refused with a clear error, and a real Prometheus scraping a live two-worker run and
answering queries about it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import run_driver, wait_for
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, UserCallback, goodput
from jaxtrain.driver.metrics import MetricsServer, exposition, read_token
from jaxtrain.driver.options import metrics_endpoint as endpoint

SNAPSHOT = {
    "state": "RUNNING", "attempt": 1, "world_size": 2, "ranks_up": 2, "reports": 40,
    "rounds": 20, "last_round": 20, "attempts_by_cause": {"start": 1, "exit": 1},
    "group_start": {"count": 2, "sum_s": 3.5, "last_s": 1.5},
    "restart": {"count": 1, "sum_s": 2.25, "last_s": 2.25},
    "checkpoint_commit": {"count": 4, "sum_s": 0.5, "last_s": 0.125},
    "checkpoint_bytes": 4096, "last_checkpoint_bytes": 1024,
    "rank_step_s": [0.1, None], "stragglers": [1],
}


def _finished_run(path: Path) -> Path:
    """A run directory by hand: the driver 100-130 s, one attempt 101-129 s, ready at 102 s,
    reports at 105 and 125 s: start-up 2 s, compile 3 s, training 20 s, shutdown 5 s."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "run.json").write_text(json.dumps({
        "status": "FINISHED", "start_time": 100.0, "end_time": 130.0,
        "attempts": [{"attempt": 0, "status": "FINISHED", "start_time": 101.0,
                      "ready_time": 102.0, "end_time": 129.0}]}))
    (path / "result.jsonl").write_text(
        "".join(json.dumps({"round": i + 1, "time": t}) + "\n" for i, t in enumerate((105, 125))))
    return path


def test_the_exposition_parses_with_help_and_type_for_every_family(tmp_path):
    from prometheus_client import parser
    run_goodput = goodput.from_run_dir(_finished_run(tmp_path / "run"))
    text = exposition(SNAPSHOT, 'run "a"\\b', run_goodput)
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["jaxtrain_reports"].type == "counter"
    assert families["jaxtrain_attempts"].type == "counter"
    assert families["jaxtrain_worker_group_start_seconds"].type == "summary"
    for f in families.values():
        assert f.documentation, f.name
        for s in f.samples:
            assert s.labels["run"] == 'run "a"\\b'
    values = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))): s.value
              for f in families.values() for s in f.samples}
    assert values[("jaxtrain_reports_total", ())] == 40
    assert values[("jaxtrain_attempts_total", (("cause", "exit"),))] == 1
    assert values[("jaxtrain_run_state", (("state", "RUNNING"),))] == 1
    assert values[("jaxtrain_run_state", (("state", "STARTING"),))] == 0
    assert values[("jaxtrain_worker_group_restart_seconds_sum", ())] == 2.25
    assert values[("jaxtrain_checkpoint_committed_bytes_total", ())] == 4096
    assert values[("jaxtrain_rank_step_time_seconds", (("rank", "0"),))] == 0.1
    assert ("jaxtrain_rank_step_time_seconds", (("rank", "1"),)) not in values  # not known yet
    assert values[("jaxtrain_rank_straggler", (("rank", "1"),))] == 1
    assert families["jaxtrain_goodput_seconds"].type == "gauge"
    parts = {part: values[("jaxtrain_goodput_seconds", (("part", part),))]
             for part in goodput.PARTS}
    assert parts == {"queue": 0, "startup": 2, "compile": 3, "training": 20,
                     "checkpoint_blocked": 0, "restart": 0, "lost": 0, "shutdown": 5}
    assert values[("jaxtrain_goodput_ratio", ())] == pytest.approx(20 / 30)
    # Before the controller has published anything, the families are there with zeros; the
    # goodput's, without samples until run.json can be read.
    families = {f.name: f for f in parser.text_string_to_metric_families(exposition({}, "r"))}
    assert families["jaxtrain_goodput_ratio"].samples == []


def test_the_port_and_host_settings():
    assert endpoint(None, {}) is None
    assert endpoint(None, {"JAXTRAIN_METRICS_PORT": "9100"}) == ("127.0.0.1", 9100)
    assert endpoint(None, {"JAXTRAIN_METRICS_PORT": "0", "JAXTRAIN_METRICS_HOST": "0.0.0.0"}) \
        == ("0.0.0.0", 0)
    assert endpoint(9200, {"JAXTRAIN_METRICS_PORT": "9100"}) == ("127.0.0.1", 9200)
    for bad in ("http", "-1", "70000"):
        with pytest.raises(ValueError, match=f"JAXTRAIN_METRICS_PORT='{bad}' is not allowed; it "
                           "must be a port number, 0 to 65535"):
            endpoint(None, {"JAXTRAIN_METRICS_PORT": bad})
    for bad in (-1, 65536, "9100", True):
        with pytest.raises(ValueError, match="RunConfig.metrics_port=.* is not allowed"):
            RunConfig(metrics_port=bad)
    assert RunConfig(metrics_port=0).metrics_port == 0


def test_a_taken_port_is_refused_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot serve the run's metrics at 127.0.0.1:{port}"):
            MetricsServer("127.0.0.1", port, "r")


def test_the_server_answers_at_metrics_only(tmp_path):
    server = MetricsServer("127.0.0.1", 0, "r")
    server.serve(lambda: json.dumps(SNAPSHOT), str(_finished_run(tmp_path / "run")))
    try:
        host, port = server.address
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
            assert 'jaxtrain_reports_total{run="r"} 40' in text
            assert 'jaxtrain_goodput_seconds{run="r",part="training"} 20.0' in text
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://{host}:{port}/", timeout=10)
    finally:
        server.close()
        server.close()


# --- a client that holds a connection (the review's N5) ----------------------------------------


def _scrape(server: MetricsServer) -> int:
    host, port = server.address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as r:
        return r.status


def _closed_by_server(conn: socket.socket) -> bool:
    """Whether the server ended `conn`: a read gets end of file (or a reset)."""
    conn.settimeout(60)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_an_idle_connection_delays_neither_a_scrape_nor_close():
    server = MetricsServer("127.0.0.1", 0, "r")
    server.serve(lambda: json.dumps(SNAPSHOT))
    idle = socket.create_connection(server.address)  # connects, sends nothing
    try:
        assert _scrape(server) == 200
        closing = _in_thread(server.close)
        closing.join(60)  # a hang detector, not a timing: close() waits for no client
        assert not closing.is_alive(), "close() waits for an idle client"
        assert _closed_by_server(idle)
    finally:
        idle.close()


def test_connections_past_the_cap_are_closed_at_once(monkeypatch):
    server = MetricsServer("127.0.0.1", 0, "r")
    monkeypatch.setattr(server._http, "timeout_s", 600.0)  # the held ones stay for the test
    server.serve(lambda: json.dumps(SNAPSHOT))
    held = [socket.create_connection(server.address)
            for _ in range(server._http.max_connections)]
    try:
        wait_for("the server to take every held connection",
                 lambda: server._http.open_connections() == len(held), 60)
        with socket.create_connection(server.address) as extra:
            assert _closed_by_server(extra)
        held.pop().close()
        wait_for("a slot to be free", lambda: server._http.open_connections() < len(held) + 1,
                 60)
        assert _scrape(server) == 200
    finally:
        for conn in held:
            conn.close()
        server.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_timeout(monkeypatch):
    server = MetricsServer("127.0.0.1", 0, "r")
    monkeypatch.setattr(server._http, "timeout_s", 1.0)
    server.serve(lambda: json.dumps(SNAPSHOT))
    try:
        with socket.create_connection(server.address) as idle:
            assert _closed_by_server(idle)
        wait_for("its slot to be free", lambda: server._http.open_connections() == 0, 60)
    finally:
        server.close()


def test_with_a_token_file_every_scrape_needs_the_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("sc4pe\n")
    token_file.chmod(0o644)
    with pytest.raises(ValueError, match="JAXTRAIN_METRICS_TOKEN_FILE=.*other users may read it"):
        read_token({"JAXTRAIN_METRICS_TOKEN_FILE": str(token_file)})
    token_file.chmod(0o600)
    token = read_token({"JAXTRAIN_METRICS_TOKEN_FILE": str(token_file)})
    assert token == "sc4pe" and read_token({}) is None
    server = MetricsServer("127.0.0.1", 0, "r", token)
    server.serve(lambda: json.dumps(SNAPSHOT))
    try:
        host, port = server.address
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30)
        assert refused.value.code == 401
        request = urllib.request.Request(f"http://{host}:{port}/metrics",
                                         headers={"Authorization": "Bearer sc4pe"})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 200
    finally:
        server.close()


_IDLE_CLIENT_DRIVER = """
    import os, socket, sys, time, urllib.request

    from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, UserCallback, report

    PORT, STORAGE = int(sys.argv[1]), sys.argv[2]
    RELEASE = os.path.join(STORAGE, "release")


    def train(config):
        step = 0
        while not os.path.exists(config["release"]) and step < 2000:
            time.sleep(0.05)
            report({"step": step})
            step += 1


    class HoldAConnection(UserCallback):
        held = None

        def after_report(self, run_context, metrics, checkpoint):
            if self.held is None:
                # Another local user's idle connection: it connects and never sends a byte.
                self.held = socket.create_connection(("127.0.0.1", PORT))
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics",
                                            timeout=60) as r:
                    print("scraped", r.status, flush=True)
                open(RELEASE, "w").close()  # the workers end, the connection still held


    hold = HoldAConnection()
    result = JaxTrainer(train, train_loop_config={"release": RELEASE},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name="held", storage_path=STORAGE,
                                             metrics_port=PORT, callbacks=[hold])).fit()
    print("fit returned", result.error, hold.held is not None, flush=True)
"""


def test_an_idle_connection_to_the_metrics_port_does_not_hang_fit(storage, tmp_path):
    """The review's N5: one connection that sends nothing held the single-threaded server, so
    every scrape timed out and close() on fit()'s way out waited for it for ever."""
    driver = _IDLE_CLIENT_DRIVER.replace("int(sys.argv[1]), sys.argv[2]",
                                         f"{_free_port()}, {str(storage)!r}")
    done = run_driver(driver, tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "scraped 200" in done.stdout
    assert "fit returned None True" in done.stdout


# --- a real Prometheus --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        why = ("Prometheus is not installed: apt-get install -y --no-install-recommends "
               "prometheus (scripts/setup.sh installs it)")
        if os.environ.get("JAXTRAIN_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return path


class Prometheus:
    def __init__(self, binary: str, tmp: Path, target: str) -> None:
        self.port = _free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: jaxtrain\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for("Prometheus to be ready", self._ready, 30)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "Prometheus exited; see prometheus.log"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": promql}))
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


class ReleaseWhenScraped(UserCallback):
    """Once the run has reported a few rounds, waits (in the driver) until Prometheus holds the
    run's reports and both ranks' step times, then lets the workers end."""

    def __init__(self, prometheus: Prometheus, run: str, release: Path) -> None:
        self.prometheus, self.run, self.release = prometheus, run, release

    def after_report(self, run_context, metrics, checkpoint):
        if run_context.round < 3 or self.release.exists():
            return

        def scraped():
            reports = self.prometheus.query(f'jaxtrain_reports_total{{run="{self.run}"}}')
            steps = self.prometheus.query(
                f'jaxtrain_rank_step_time_seconds{{run="{self.run}"}}')
            return reports and float(reports[0]["value"][1]) > 0 and len(steps) == 2

        wait_for("Prometheus to scrape the live run", scraped, 20)
        self.release.write_text("scraped")


def _train(config):
    import time
    from pathlib import Path

    import jax.numpy as jnp

    from jaxtrain import report

    x = jnp.ones((4, 4))
    for step in range(config["max_steps"]):
        if Path(config["release"]).exists():
            break
        x = x @ x / 4.0
        time.sleep(0.05)  # the step's work
        report({"step": step, "x": float(x[0, 0])})


def test_a_real_prometheus_scrapes_a_live_run(storage, tmp_path, prometheus_binary, monkeypatch):
    port = _free_port()
    monkeypatch.setenv("JAXTRAIN_METRICS_PORT", str(port))
    prometheus = Prometheus(prometheus_binary, tmp_path, f"127.0.0.1:{port}")
    release = tmp_path / "release"
    try:
        result = JaxTrainer(
            _train, train_loop_config={"max_steps": 400, "release": str(release)},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="scraped", storage_path=storage,
                                 callbacks=[ReleaseWhenScraped(prometheus, "scraped", release)]),
        ).fit()
        assert result.error is None
        assert release.exists()
        # The target is gone now (its series are stale): the run's last values over a range.
        [reports] = prometheus.query('last_over_time(jaxtrain_reports_total{run="scraped"}[5m])')
        assert float(reports["value"][1]) > 0
        steps = prometheus.query(
            'last_over_time(jaxtrain_rank_step_time_seconds{run="scraped"}[5m])')
        assert sorted(s["metric"]["rank"] for s in steps) == ["0", "1"]
        assert all(float(s["value"][1]) > 0 for s in steps)
        [running] = prometheus.query(
            'max_over_time(jaxtrain_run_state{run="scraped",state="RUNNING"}[5m])')
        assert float(running["value"][1]) == 1
        [started] = prometheus.query(
            'last_over_time(jaxtrain_attempts_total{run="scraped",cause="start"}[5m])')
        assert float(started["value"][1]) == 1
    finally:
        prometheus.stop()
