"""The dashboard's web server: a page (static HTML, JavaScript and CSS, no build step) and a JSON
API over a source of runs (``jaxtrain.dashboard.runs``), on jaxtrain.http_server (connections
capped, each with a timeout). It only reads the run directories.

API (every answer JSON; docs/dashboard.md):

    GET /api/runs                        the runs, each with status, progress and ETA
    GET /api/runs/NAME?since=R           one run: attempts, ranks, checkpoints, goodput, and the
                                         metrics of its rounds after round R (default all)
    GET /api/runs/NAME/logs/RANK         the tail of rank RANK's log

Access: every request must carry the token, on every address, loopback included (every local
user of a shared host can connect to 127.0.0.1): ``?token=T`` (which also sets a cookie for the
page's own requests), the cookie, or ``Authorization: Bearer T``; else 401. Bound to a loopback
address, only requests naming a loopback host are served besides (a web page elsewhere cannot
reach the runs through DNS rebinding).
"""

from __future__ import annotations

import hmac
import http.server
import ipaddress
import json
import math
import os
import re
import secrets
import socket
import time
import urllib.parse
from typing import Any

from jaxtrain import http_server
from jaxtrain.dashboard import runs as runs_lib

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
_RUN = re.compile(r"/api/runs/([^/]+)")
_LOG = re.compile(r"/api/runs/([^/]+)/logs/(\d+)")
_COOKIE = "jaxtrain_dashboard_token"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _request_host(header: str) -> str:
    """The host of a Host header: 'h', 'h:port', '[v6]' or '[v6]:port'."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as None: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def new_token() -> str:
    return secrets.token_urlsafe(18)


class Dashboard(http_server.BoundedHTTPServer):
    """Serves `source` on (host, port) to requests that carry `token` (new_token)."""

    max_connections = 32  # a page polls once a second: a few viewers, each a few connections

    def __init__(self, source: Any, host: str, port: int, token: str):
        if not token:
            raise ValueError("a dashboard needs a token, on every address (new_token() makes one)")
        super().__init__((host, port), _Handler, ipv6=":" in host)
        self.source = source
        self.token = token
        self.loopback = is_loopback(host)
        self.rounds = runs_lib.RoundReader()

    @property
    def url(self) -> str:
        """The page's URL, with the token; bound to every address, named by this host's name."""
        host, port = self.server_address[:2]
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/?token={self.token}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Dashboard
    server_version = "jaxtrain-dashboard"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a request per second per viewer: not worth a line each

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        refused = self._refusal(query)
        if refused:
            return self._send(*refused)
        set_cookie = bool(query.get("token"))
        try:
            if url.path in _STATIC:
                return self._file(*_STATIC[url.path], set_cookie)
            self._api(url.path, query)
        except runs_lib.SourceError as e:
            self._send(503, {"error": str(e)})
        except OSError as e:  # the storage went away, or an object store did not answer
            self._send(503, {"error": f"cannot read the runs of {self.server.source.where}: {e}"})

    def _refusal(self, query: dict) -> tuple[int, dict] | None:
        """(status, answer) of a request that is refused, None for one that is served."""
        if self.server.loopback:
            host = _request_host(self.headers.get("Host") or "")
            if host and not is_loopback(host):
                return 403, {"error": "this dashboard serves only localhost; the request named "
                             f"host {host!r}"}
        token = self.server.token
        given = (query.get("token") or [None])[0]
        if given is None:
            auth = self.headers.get("Authorization") or ""
            if auth.startswith("Bearer "):
                given = auth[len("Bearer "):]
        if given is None:
            for part in (self.headers.get("Cookie") or "").split(";"):
                key, _, value = part.strip().partition("=")
                if key == _COOKIE:
                    given = value
        if given is None:
            return 401, {"error": "this dashboard needs its token: open the URL that `jaxtrain "
                         "dashboard` printed (it ends in ?token=...), or send 'Authorization: "
                         "Bearer TOKEN'"}
        if not hmac.compare_digest(given.encode(), token.encode()):
            return 401, {"error": "the token is wrong: use the one that `jaxtrain dashboard` "
                         "printed"}
        return None

    def _api(self, path: str, query: dict) -> None:
        source, now = self.server.source, time.time()
        if path in ("/api/runs", "/api/runs/"):
            runs = []
            for name in source.names():
                run_dir = source.run_dir(name)
                if run_dir is not None:
                    rounds = self.server.rounds.rounds(run_dir)
                    runs.append(runs_lib.summary(name, run_dir, rounds, source.remote, now))
            runs.sort(key=lambda r: (r.get("start_time") or 0.0, r["name"]))
            return self._send(200, {"source": source.where, "now": now, "runs": runs})
        if m := _LOG.fullmatch(path):
            run_dir = self._run_dir(m.group(1))
            if run_dir is None:
                return
            rank, world_size = int(m.group(2)), runs_lib.read_state(run_dir).get("world_size")
            if isinstance(world_size, int) and rank >= world_size:
                return self._send(404, {"error": f"run {urllib.parse.unquote(m.group(1))!r} has "
                                        f"ranks 0 to {world_size - 1}, not {rank}"})
            # text None: the rank has printed nothing yet.
            return self._send(200, {"rank": rank, "text": runs_lib.log_tail(run_dir, rank)})
        if m := _RUN.fullmatch(path):
            run_dir = self._run_dir(m.group(1))
            if run_dir is None:
                return
            since = (query.get("since") or ["0"])[0]
            if not since.isdigit():
                return self._send(400, {"error": f"since={since!r} is not allowed: give a "
                                        "round number (0 or more)"})
            rounds = self.server.rounds.rounds(run_dir)
            return self._send(200, runs_lib.detail(urllib.parse.unquote(m.group(1)), run_dir,
                                                   rounds, source.remote, now, int(since)))
        self._send(404, {"error": f"no such page: {path}; the API is /api/runs, "
                         "/api/runs/NAME and /api/runs/NAME/logs/RANK"})

    def _run_dir(self, quoted: str) -> str | None:
        name = urllib.parse.unquote(quoted)
        run_dir = self.server.source.run_dir(name)
        if run_dir is None:
            self._send(404, {"error": f"no run {name!r} under {self.server.source.where}"})
        return run_dir

    def _file(self, name: str, kind: str, set_cookie: bool) -> None:
        with open(os.path.join(STATIC_DIR, name), "rb") as f:
            body = f.read()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        if set_cookie:
            self.send_header("Set-Cookie", f"{_COOKIE}={self.server.token}; HttpOnly; "
                             "SameSite=Strict; Path=/")
        self.end_headers()
        self.wfile.write(body)

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(_finite(payload), allow_nan=False, default=str).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)
