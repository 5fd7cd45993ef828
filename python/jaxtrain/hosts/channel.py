"""Connections over the secure channel (src/wire/channel.h): the hosts' joins and relay sessions
(hosts.py) and the peer copies of checkpoints (checkpoint_peers.py). Both ends prove they hold the
same secret, bound to the connection's purpose and both ends' names; every byte after that is
encrypted and authenticated, in order. docs/security.md says what each use protects."""

from __future__ import annotations

import json
import socket

from jaxtrain import _core

# Channel errors: PermissionError (refused, or no shared secret), TimeoutError, ConnectionError.
Errors = (OSError, ValueError)
# The reason a refusal carries when the two ends do not hold the same secret.
NOT_THE_SAME_SECRET = "do not hold the same secret"
# The largest record's bytes (kMaxRecordPlaintext).
RECORD_SIZE = 1 << 20


class Connection:
    """A socket and its secure channel; closed with the socket."""

    def __init__(self, sock: socket.socket, channel) -> None:
        self.sock = sock
        self._channel = channel

    @property
    def peer(self) -> str:
        """The other end's proven name."""
        return self._channel.peer

    @classmethod
    def connect(cls, address: tuple[str, int], secret: bytes, purpose: str, me: str,
                responder: str, timeout_s: float, source: str | None = None) -> Connection:
        """Connects to `address` and proves `me` to `responder` for `purpose`."""
        sock = socket.create_connection(address, timeout=timeout_s,
                                        source_address=(source, 0) if source else None)
        return cls._handshake(sock, _core.channel_connect, secret, purpose, me, responder,
                              timeout_s)

    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, purpose: str, me: str,
               initiators: list[str], timeout_s: float) -> Connection:
        """The accepting end's handshake on `sock` (closed when it fails), all within
        `timeout_s`; `initiators`: the names accepted (any when empty)."""
        return cls._handshake(sock, _core.channel_accept, secret, purpose, me, initiators,
                              timeout_s)

    @classmethod
    def _handshake(cls, sock: socket.socket, handshake, *args) -> Connection:
        """`handshake` (one end's) on `sock` in blocking mode; `sock` closed when it fails."""
        try:
            sock.settimeout(None)
            return cls(sock, handshake(sock.fileno(), *args))
        except BaseException:
            sock.close()
            raise

    def send(self, data: bytes, timeout_s: float | None = None) -> None:
        self._channel.send(data, timeout_s)

    def send_file(self, file_fd: int, size: int, timeout_s: float | None = None) -> None:
        self._channel.send_file(file_fd, size, timeout_s)

    def receive(self, timeout_s: float | None = None) -> bytes:
        return self._channel.receive(timeout_s)

    def receive_into(self, buffer, timeout_s: float | None = None) -> int:
        """The next record into `buffer` (RECORD_SIZE bytes hold any); returns its length."""
        return self._channel.receive_into(buffer, timeout_s)

    def send_json(self, message: dict, timeout_s: float | None = None) -> None:
        self.send(json.dumps(message).encode(), timeout_s)

    def receive_json(self, timeout_s: float | None = None) -> dict:
        """The next record as a JSON object; ValueError when it is not one."""
        message = json.loads(self.receive(timeout_s))
        if not isinstance(message, dict):
            raise ValueError("a message that is not a JSON object")
        return message

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def end_number(name: str, kind: str) -> int | None:
    """N of an end named `kind`-N (host-3, rank-12), else None."""
    prefix, _, number = name.partition("-")
    return int(number) if prefix == kind and number.isdigit() else None


def family_of(host: str) -> socket.AddressFamily:
    """The address family of a numeric address."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def shut(sock: socket.socket) -> None:
    """Ends a connection that another thread may wait on, without closing its descriptor under
    that thread (a number closed there could be reused by the next connection)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
