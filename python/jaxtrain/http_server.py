"""The HTTP server under jaxtrain's own endpoints (the dashboard, the driver's metrics): the
standard library's ThreadingHTTPServer, bounded so that no client, however slow or idle, holds
it or the process that owns it.

* at most ``max_connections`` connections are served at once; one more is closed at once
  (every other local user can connect to a loopback port, and threads count against the
  owner's process limit);
* every connection has a socket timeout (``timeout_s``) for each read and write: one that sends
  nothing is closed when it passes;
* ``stop()`` returns at once: the accept loop ends, the listening socket closes and every open
  connection is shut down, so no handler thread waits on its client any more.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
from typing import Any


class BoundedHTTPServer(http.server.ThreadingHTTPServer):
    """A ThreadingHTTPServer with a connection cap, per-connection timeouts and a bounded
    ``stop()``. Handler threads are daemons."""

    daemon_threads = True
    max_connections = 16
    timeout_s = 10.0

    def __init__(self, address: tuple[str, int], handler: type, ipv6: bool = False) -> None:
        self.address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._open_lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._state = threading.Lock()
        self._serving = False  # serve_forever has begun (stop then ends it)
        self._stopped = False
        super().__init__(address, handler)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        with self._state:
            if self._stopped:
                return
            self._serving = True
        super().serve_forever(poll_interval)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: this one is closed, the others go on
            return
        request.settimeout(self.timeout_s)
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._open_lock:
            if request not in self._open:
                return
            self._open.discard(request)
        self._slots.release()

    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)

    def stop(self) -> None:
        """Stops serving and returns without waiting for any client: the accept loop ends, the
        listening socket closes, and each open connection is shut down (its handler's next read
        or write fails, and its thread ends). Idempotent."""
        with self._state:
            serving, self._serving, self._stopped = self._serving, False, True
        if serving:
            self.shutdown()  # waits for the accept loop only: requests run on their threads
        self.server_close()
        with self._open_lock:
            still = list(self._open)
        for request in still:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
