"""The driver's end of the commands that act on a live run (``jaxtrain stack``, ``jaxtrain
profile``): a Unix socket in the abstract namespace, named after the run directory, served by a
thread of the driver while the run is under way.

Only processes of the driver's own user are answered (the peer's credentials, SO_PEERCRED), and
the commands trust only a driver of their own user, and only a folder inside the run directory
(another user may bind the address first: the driver then says the commands cannot reach it).
The address is on the driver's host only, so these commands run there. A request is one line of
JSON, ``{"op": "stacks"}`` or ``{"op": "profile", "steps": N}``; the answer one line:
``{"dir": ...}`` (the folder every rank's stacks were written to, or the one their traces go to,
under the run directory) or ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Any

# How long a request may take: the ranks' answers (2 s at most) and the files.
_STACKS_TIMEOUT_S = 10.0
_MAX_REQUEST = 4096


def address(run_dir: str) -> bytes:
    """The abstract socket address of the live run in `run_dir`: its directory's device and
    inode, the same by whatever path this host reaches it (and no hash module for the driver to
    load)."""
    st = os.stat(run_dir)
    return f"\0jaxtrain-run-{st.st_dev:x}-{st.st_ino:x}".encode()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class LiveServer:
    """Answers the live-run commands for one run while its controller runs."""

    def __init__(self, run_dir: str, controller: Any) -> None:
        self._controller = controller
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(address(run_dir))
        except OSError:  # another driver of this run directory on this host holds it
            self._sock.close()
            raise
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="jaxtrain-live", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops answering; an answer under way is finished first."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._thread.join()
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    self._answer(conn)
                except OSError:  # the asker went away
                    pass

    def _answer(self, conn: socket.socket) -> None:
        if _peer_uid(conn) != os.getuid():
            return
        conn.settimeout(5.0)
        data = b""
        while b"\n" not in data and len(data) < _MAX_REQUEST:
            chunk = conn.recv(_MAX_REQUEST)
            if not chunk:
                break
            data += chunk
        try:
            request = json.loads(data.split(b"\n", 1)[0])
            op = request["op"]
        except (ValueError, KeyError, TypeError):
            return self._reply(conn, {"error": "a request is one line of JSON {\"op\": ...}"})
        try:
            if op == "stacks":
                reply = {"dir": self._controller.take_stacks(_STACKS_TIMEOUT_S)}
            elif op == "profile" and isinstance(request.get("steps"), int):
                reply = {"dir": self._controller.start_profile(request["steps"],
                                                               _STACKS_TIMEOUT_S)}
            else:
                reply = {"error": f"unknown request {request!r}; known: {{\"op\": \"stacks\"}}, "
                         "{\"op\": \"profile\", \"steps\": N}"}
        except (RuntimeError, TimeoutError, OSError, ValueError) as e:
            reply = {"error": str(e)}
        self._reply(conn, reply)

    @staticmethod
    def _reply(conn: socket.socket, reply: dict) -> None:
        conn.sendall(json.dumps(reply).encode() + b"\n")


def request(run_dir: str, op: str, timeout_s: float = _STACKS_TIMEOUT_S + 5, **fields) -> dict:
    """Asks the driver of the live run in `run_dir` on this host; its answer.

    Raises ConnectionError when no driver of that run listens on this host."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(address(run_dir))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise ConnectionError(str(e)) from None
        if _peer_uid(s) != os.getuid():
            raise ConnectionError(f"the process at the run's address is user {_peer_uid(s)}'s, "
                                  "not this user's driver")
        s.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    if not data:
        raise ConnectionError("the driver closed the connection without an answer")
    answer = json.loads(data)
    inside = os.path.join(os.path.realpath(run_dir), "")
    if "dir" in answer and not os.path.realpath(answer["dir"]).startswith(inside):
        raise ConnectionError(f"the driver answered a folder outside the run: {answer['dir']!r}")
    return answer
