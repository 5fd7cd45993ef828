"""The driver's Prometheus endpoint: the run's metrics in Prometheus' text exposition format
(version 0.0.4), served at ``http://HOST:PORT/metrics`` while ``fit()`` runs.

Opt-in: ``RunConfig(metrics_port=...)`` or ``JAXTRAIN_METRICS_PORT`` (0: any free port, said on
stderr). It binds to 127.0.0.1 unless ``JAXTRAIN_METRICS_HOST`` names another address. Scrapes
need no token unless ``JAXTRAIN_METRICS_TOKEN_FILE`` names a file holding one (docs/observability.md
says why: aggregate numbers, and a scraper configured in advance). The
values come from the controller (``Controller.metrics_json()``, controller/run_metrics.h), read
at each scrape, and the goodput parts from the run directory (jaxtrain.goodput), read at most
every GOODPUT_EVERY_S seconds; the families are listed in docs/observability.md.

Served on jaxtrain.http_server: a thread per connection (daemons), at most
``MetricsServer.max_connections`` at once, each closed after ``timeout_s`` without a read or
write, so an idle or slow client delays neither a scrape nor the end of ``fit()``. ``close()``
returns without waiting for any client, once no scrape is reading the controller, and the
controller is never read after it returns.
"""

from __future__ import annotations

import hmac
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxtrain import goodput
from jaxtrain.driver.options import METRICS_PORT_ENV

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The controller's states (RunMetrics::state), each a series of jaxtrain_run_state.
STATES = ("QUEUED", "STARTING", "RUNNING", "STOPPING", "RESTARTING", "FINISHED", "ERRORED",
          "ABORTED")

# A file holding the bearer token every scrape must then carry (Prometheus: credentials_file).
TOKEN_FILE_ENV = "JAXTRAIN_METRICS_TOKEN_FILE"

# The goodput gauges are computed from run.json and result.jsonl at most this often (seconds).
GOODPUT_EVERY_S = 5.0

def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _number(value: float | int) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


class _Writer:
    def __init__(self, run: str) -> None:
        self.run = _label(run)
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float | int, **labels: Any) -> None:
        text = "".join(f',{k}="{_label(v)}"' for k, v in labels.items())
        self.lines.append(f'{name}{{run="{self.run}"{text}}} {_number(value)}')

    def summary(self, name: str, help_text: str, d: dict) -> None:
        self.family(name, "summary", help_text)
        self.sample(f"{name}_sum", float(d.get("sum_s", 0.0)))
        self.sample(f"{name}_count", int(d.get("count", 0)))


def exposition(m: dict, run: str, run_goodput: goodput.Goodput | None = None) -> str:
    """The text exposition of the controller's metrics ``m`` (RunMetricsJson) and of the run's
    goodput (no samples without one), every series labelled with the run's name."""
    w = _Writer(run)
    state = m.get("state", "STARTING")
    w.family("jaxtrain_run_state", "gauge",
             "1 for the run's current state, 0 for the others.")
    for s in STATES:
        w.sample("jaxtrain_run_state", int(s == state), state=s)
    w.family("jaxtrain_attempt", "gauge", "The number of the attempt running or last run.")
    w.sample("jaxtrain_attempt", m.get("attempt", 0))
    w.family("jaxtrain_attempts_total", "counter",
             "Attempts started by this driver, by what started them: start for the first, resize "
             "after an elastic run's planned stop to grow, else the cause of the previous "
             "attempt's failure.")
    for cause, n in sorted(m.get("attempts_by_cause", {}).items()):
        w.sample("jaxtrain_attempts_total", n, cause=cause)
    w.family("jaxtrain_world_size", "gauge", "Ranks in the worker group.")
    w.sample("jaxtrain_world_size", m.get("world_size", 0))
    w.family("jaxtrain_ranks_up", "gauge", "Ranks registered with the controller in this attempt.")
    w.sample("jaxtrain_ranks_up", m.get("ranks_up", 0))
    w.family("jaxtrain_reports_total", "counter",
             "report() calls received from every rank, as of the last round recorded.")
    w.sample("jaxtrain_reports_total", m.get("reports", 0))
    w.family("jaxtrain_rounds_total", "counter", "Report rounds recorded by this driver.")
    w.sample("jaxtrain_rounds_total", m.get("rounds", 0))
    w.family("jaxtrain_last_round", "gauge",
             "The run's number of the last report round recorded (0: none yet).")
    w.sample("jaxtrain_last_round", m.get("last_round", 0))
    w.summary("jaxtrain_worker_group_start_seconds",
              "From spawning an attempt's worker group until every rank registered.",
              m.get("group_start", {}))
    w.summary("jaxtrain_worker_group_restart_seconds",
              "From noticing an attempt's failure until the next group's every rank registered.",
              m.get("restart", {}))
    w.summary("jaxtrain_checkpoint_commit_seconds",
              "From a round's checkpoint handed to the committer until it was committed.",
              m.get("checkpoint_commit", {}))
    w.family("jaxtrain_checkpoint_committed_bytes_total", "counter",
             "Bytes of the checkpoints committed by this driver.")
    w.sample("jaxtrain_checkpoint_committed_bytes_total", m.get("checkpoint_bytes", 0))
    w.family("jaxtrain_checkpoint_last_size_bytes", "gauge",
             "Bytes of the last checkpoint committed.")
    w.sample("jaxtrain_checkpoint_last_size_bytes", m.get("last_checkpoint_bytes", 0))
    steps = m.get("rank_step_s", [])
    w.family("jaxtrain_rank_step_time_seconds", "gauge",
             "Each rank's step time: the median of its last intervals between reports.")
    for rank, s in enumerate(steps):
        if s is not None:
            w.sample("jaxtrain_rank_step_time_seconds", float(s), rank=rank)
    stragglers = set(m.get("stragglers", []))
    w.family("jaxtrain_rank_straggler", "gauge",
             "1 while the rank is a straggler (docs/observability.md), else 0.")
    for rank in range(len(steps)):
        w.sample("jaxtrain_rank_straggler", int(rank in stragglers), rank=rank)
    w.family("jaxtrain_goodput_seconds", "gauge",
             "Seconds of the run's wall time in each part (docs/observability.md, Goodput); "
             "they add up to the wall time.")
    if run_goodput is not None:
        for part, seconds in run_goodput.parts().items():
            w.sample("jaxtrain_goodput_seconds", seconds, part=part)
    w.family("jaxtrain_goodput_ratio", "gauge",
             "The run's goodput: productive training time over wall time, 0 to 1.")
    if run_goodput is not None:
        w.sample("jaxtrain_goodput_ratio", run_goodput.fraction)
    return "\n".join(w.lines) + "\n"


def read_token(environ: Any = os.environ) -> str | None:
    """The token of JAXTRAIN_METRICS_TOKEN_FILE, None without the variable. Raises ValueError
    naming the variable when the file cannot be read, others may read it, or it is empty."""
    path = environ.get(TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read(4096).strip()
    except OSError as e:
        raise ValueError(f"{TOKEN_FILE_ENV}={path!r} cannot be read: {e.strerror or e}") from None
    if mode & 0o077:
        raise ValueError(f"{TOKEN_FILE_ENV}={path!r}: other users may read it (mode "
                         f"{stat.filemode(mode)}); chmod 600 it")
    if not token:
        raise ValueError(f"{TOKEN_FILE_ENV}={path!r} is empty; write the token in it")
    return token


class MetricsServer:
    """Binds at once (so a taken port fails before the run starts); ``serve`` starts answering
    scrapes from ``source``, which returns RunMetricsJson ("" while there is none). With a
    ``token`` (read_token), a scrape without ``Authorization: Bearer <token>`` gets 401."""

    def __init__(self, host: str, port: int, run: str, token: str | None = None) -> None:
        self.run = run
        self._source: Callable[[], str] = lambda: ""
        self._run_dir: str | None = None
        self._goodput: goodput.Goodput | None = None
        self._goodput_at = float("-inf")  # time.monotonic() of the last computation
        self._goodput_lock = threading.Lock()
        self.token = token
        # Held while the controller is read; close() takes it to set _closed.
        self._reading = threading.Lock()
        self._closed = False
        server = self
        # Here: a run that serves no metrics does not load http.server and what it imports.
        import http.server

        from jaxtrain import http_server


        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 -- http.server's name
                if server.token is not None and not hmac.compare_digest(
                        (self.headers.get("Authorization") or "").encode(),
                        f"Bearer {server.token}".encode()):
                    self.send_error(401, f"a scrape needs the token of {TOKEN_FILE_ENV} as "
                                    "'Authorization: Bearer TOKEN'")
                    return
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "the metrics are at /metrics")
                    return
                body = server.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass  # a scrape a second is not news

        class Server(http_server.BoundedHTTPServer):
            max_connections = 8  # Prometheus scrapes one at a time; a few people's curl besides
            timeout_s = 5.0

        try:
            self._http = Server((host, port), Handler, ipv6=":" in host)
        except OSError as e:
            raise ValueError(
                f"cannot serve the run's metrics at {host}:{port}: {e.strerror or e}; choose "
                f"another {METRICS_PORT_ENV} (or RunConfig.metrics_port), or 0 for any free "
                "port") from e
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._http.server_address[:2]
        return str(host), int(port)

    def render(self) -> str:
        with self._reading:
            text = "" if self._closed else self._source()
        return exposition(json.loads(text) if text else {}, self.run, self._run_goodput())

    def _run_goodput(self) -> goodput.Goodput | None:
        """The run directory's goodput, computed again once GOODPUT_EVERY_S have passed; the last
        one while run.json cannot be read (not yet written)."""
        with self._goodput_lock:
            if self._run_dir is None or time.monotonic() - self._goodput_at < GOODPUT_EVERY_S:
                return self._goodput
            self._goodput_at = time.monotonic()
            try:
                self._goodput = goodput.from_run_dir(self._run_dir)
            except (OSError, ValueError):
                pass
            return self._goodput

    def serve(self, source: Callable[[], str], run_dir: str | None = None) -> None:
        """Answers scrapes from now on; ``run_dir``: the local run directory whose goodput the
        gauges show (none without it)."""
        self._source = source
        self._run_dir = run_dir
        self._thread = threading.Thread(target=self._http.serve_forever, name="jaxtrain-metrics",
                                        daemon=True)
        self._thread.start()
        host, port = self.address
        print(f"jaxtrain: metrics at http://{host}:{port}/metrics", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stops serving without waiting for any client (open connections are shut down); once
        it returns, ``source`` is not called again. Idempotent."""
        with self._reading:  # a scrape reading the controller now finishes first
            self._closed = True
        self._http.stop()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
