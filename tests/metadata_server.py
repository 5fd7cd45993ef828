"""A fake GCE metadata server for the tests: a real HTTP server in a thread that serves
``/computeMetadata/v1/instance/preempted`` and ``/computeMetadata/v1/instance/maintenance-event``
as Google documents them: the header ``Metadata-Flavor: Google`` is required (403 without it) and
sent back; each value has an ETag; ``?wait_for_change=true`` holds the request until the value
differs from the one ``last_etag`` names (without it, until the next change), or for
``timeout_sec``.

Each value is kept per client address, as each VM has its own metadata: an ssh test host (a
network namespace with its own address) sees its own, and every other client the default. A
test sets values with ``set()``; a training function with ``PUT /control/instance/<key>`` (its
body the value; ``?for=self`` sets it for the requesting address only), so that it flips
``preempted`` at a chosen step.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "/computeMetadata/v1/instance/"
CONTROL = "/control/instance/"
QUIET = {"preempted": "FALSE", "maintenance-event": "NONE"}


class MetadataServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._changed = threading.Condition()
        # (client address or None for every client) -> key -> (value, version)
        self._values: dict[str | None, dict[str, tuple[str, int]]] = {
            None: {k: (v, 0) for k, v in QUIET.items()}}
        self._version = 0
        self.requests: list[tuple[str, str, bool]] = []  # (client, path, had the flavor header)
        self._closed = False
        self._httpd = ThreadingHTTPServer((host, 0), self._handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="fake-metadata-server")

    @property
    def host(self) -> str:
        """For GCE_METADATA_HOST on this machine."""
        return f"127.0.0.1:{self.port}"

    def set(self, key: str, value: str, client: str | None = None) -> None:
        """`key`'s value for `client`'s address (None: every client without its own)."""
        if key not in QUIET:
            raise KeyError(f"the fake metadata server serves {sorted(QUIET)}, not {key!r}")
        with self._changed:
            self._version += 1
            self._values.setdefault(client, {})[key] = (value, self._version)
            self._changed.notify_all()

    def value(self, key: str, client: str | None = None) -> tuple[str, str]:
        """`key`'s value as `client` sees it, and its ETag."""
        with self._changed:
            value, version = self._values.get(client, {}).get(key) or self._values[None][key]
        return value, hashlib.sha1(f"{key}/{version}/{value}".encode()).hexdigest()[:16]

    def _wait(self, key: str, client: str, last_etag: str | None, timeout_s: float):
        first = self.value(key, client)
        with self._changed:
            self._changed.wait_for(
                lambda: self._closed or self.value(key, client)[1] != (last_etag or first[1]),
                timeout=timeout_s)
        return self.value(key, client)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, body: str, etag: str | None = None) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(data)))
                if etag:
                    self.send_header("ETag", etag)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 (http.server's name)
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                flavored = self.headers.get("Metadata-Flavor") == "Google"
                client = self.client_address[0]
                server.requests.append((client, url.path, flavored))
                if not flavored:
                    return self._answer(403, "Missing Metadata-Flavor:Google header.")
                key = url.path.removeprefix(PREFIX)
                if not url.path.startswith(PREFIX) or key not in QUIET:
                    return self._answer(404, "Not found")
                if query.get("wait_for_change", [""])[0] == "true":
                    timeout = float(query.get("timeout_sec", ["3600"])[0])
                    value, etag = server._wait(key, client, query.get("last_etag", [None])[0],
                                               timeout)
                else:
                    value, etag = server.value(key, client)
                self._answer(200, value, etag)

            def do_PUT(self):  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
                key = url.path.removeprefix(CONTROL)
                if not url.path.startswith(CONTROL) or key not in QUIET:
                    return self._answer(404, "Not found")
                mine = urllib.parse.parse_qs(url.query).get("for", [""])[0] == "self"
                server.set(key, body, self.client_address[0] if mine else None)
                self._answer(200, "ok")

        return Handler

    def start(self) -> MetadataServer:
        self._thread.start()
        return self

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()


@contextlib.contextmanager
def serving(host: str = "127.0.0.1") -> Iterator[MetadataServer]:
    server = MetadataServer(host).start()
    try:
        yield server
    finally:
        server.close()


def put(address: str, key: str, value: str, *, only_me: bool = False) -> None:
    """Sets `key` on the fake server at `address` (host:port) from any process: what a training
    function calls to flip `preempted` at a chosen step. Never through a proxy."""
    conn = http.client.HTTPConnection(address, timeout=10)
    try:
        conn.request("PUT", CONTROL + key + ("?for=self" if only_me else ""), body=value.encode())
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"the fake metadata server answered {response.status}")
    finally:
        conn.close()
