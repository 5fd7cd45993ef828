"""A slow, lossy link for a test host (a network namespace, tests/netns_hosts.py), made with the
kernel's netfilter where there is no netem qdisc (kernels built without CONFIG_NET_SCH_NETEM).

``impaired(namespace, interface, delay_ms, loss)`` is, for the block:
* loss: iptables' ``statistic`` match drops each packet the host sends or receives on
  `interface` with probability `loss` (so each way: a round trip loses about twice that);
* delay: iptables' NFQUEUE target hands every packet the host sends on `interface` to a queue,
  and a delayer process (this file run as a program) gives the kernel the verdict NF_ACCEPT for
  each `delay_ms` after it was queued, in order: as netem's delay on the host's interface, every
  round trip through the host takes `delay_ms` longer. The delayer opens its queue's socket in
  the host's namespace and then returns to the one it was started in: it is none of the host's
  processes, so freezing or killing every process of the host (namespace_frozen, `ip netns pids`)
  leaves the link as it was.

The delayer speaks nfnetlink_queue over a raw NETLINK_NETFILTER socket (the message layouts of
the kernel's uapi, linux/netfilter/nfnetlink.h and nfnetlink_queue.h); it needs nothing but
Python. The rules carry --queue-bypass: should the delayer be gone, packets pass undelayed instead
of being dropped. Leaving the block removes the rules, then stops the delayer, which lets the
packets it still holds go first. Needs root and iptables (Debian's iptables package:
scripts/setup.sh installs it).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

# linux/netlink.h, linux/netfilter/nfnetlink.h, linux/netfilter/nfnetlink_queue.h
NETLINK_NETFILTER = 12
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED, NLA_F_NET_BYTEORDER
NF_ACCEPT = 1

# The queue the delayer serves: one impaired link at a time per namespace.
QUEUE = 7


def iptables() -> str | None:
    """iptables with the legacy (x_tables) backend where it is there: the NFQUEUE target then
    needs no nf_tables queue support (CONFIG_NFT_QUEUE) in the kernel."""
    return shutil.which("iptables-legacy") or shutil.which("iptables")


def why_not() -> str | None:
    """Why no link can be impaired here, or None."""
    if os.geteuid() != 0:
        return "a slow link needs root (iptables, nfnetlink_queue)"
    if iptables() is None:
        return ("a slow link needs iptables: apt-get install -y --no-install-recommends "
                "iptables (scripts/setup.sh installs it)")
    return None


class _Queue:
    """One nfnetlink_queue queue bound on a NETLINK_NETFILTER socket of this namespace."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        # Room for bursts: a packet whose message the socket cannot take stays queued in the
        # kernel with no verdict to come.
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
        self.sock.bind((0, 0))
        self._config(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, socket.AF_INET))
        self._config(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
        self._config(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16))

    def _message(self, msg: int, flags: int, attrs: list[tuple[int, bytes]]) -> bytes:
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, self.number)  # nfgenmsg, res_id BE
        for kind, payload in attrs:
            attr = struct.pack("=HH", 4 + len(payload), kind) + payload
            body += attr + b"\0" * (-len(attr) % 4)
        self.seq += 1
        return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg,
                           NLM_F_REQUEST | flags, self.seq, 0) + body

    def _config(self, kind: int, payload: bytes) -> None:
        self.sock.send(self._message(NFQNL_MSG_CONFIG, NLM_F_ACK, [(kind, payload)]))
        reply = self.sock.recv(65536)
        length, msg_type = struct.unpack_from("=IH", reply)
        error = struct.unpack_from("=i", reply, 16)[0] if msg_type == NLMSG_ERROR else 0
        if error:
            raise OSError(-error, f"nfnetlink_queue config {kind} of queue {self.number}: "
                          f"{os.strerror(-error)}")

    def packets(self) -> list[int]:
        """The ids of the packets in the messages now waiting on the socket."""
        data = self.sock.recv(1 << 20)
        ids = []
        offset = 0
        while offset + 16 <= len(data):
            length, msg_type = struct.unpack_from("=IH", data, offset)
            if length < 16:
                break
            if msg_type == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                at = offset + 20  # nlmsghdr, nfgenmsg
                while at + 4 <= offset + length:
                    attr_len, kind = struct.unpack_from("=HH", data, at)
                    if attr_len < 4:
                        break
                    if kind & NLA_TYPE_MASK == NFQA_PACKET_HDR:
                        ids.append(struct.unpack_from("!I", data, at + 4)[0])
                        break
                    at += (attr_len + 3) & ~3
            offset += (length + 3) & ~3
        return ids

    def accept(self, packet_id: int) -> None:
        self.sock.send(self._message(NFQNL_MSG_VERDICT, 0, [
            (NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))]))


CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def _queue_in(namespace: str, number: int) -> _Queue:
    """Queue `number` of network namespace `namespace` (ip netns), this thread back in its own
    namespace after: a socket belongs to the namespace it was made in."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            return _Queue(number)
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def serve(namespace: str, number: int, delay_s: float) -> None:
    """Delays every packet of `namespace`'s queue `number` by `delay_s`, in order, until SIGTERM;
    then accepts what it holds at once and returns."""
    queue = _queue_in(namespace, number)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    held: collections.deque[tuple[float, int]] = collections.deque()  # (due, id), due rising
    print("bound", flush=True)
    while not stop:
        now = time.monotonic()
        while held and held[0][0] <= now:
            queue.accept(held.popleft()[1])
        timeout = max(0.0, held[0][0] - now) if held else 0.5
        try:
            ready, _, _ = select.select([queue.sock], [], [], timeout)
        except InterruptedError:
            continue
        if ready:
            due = time.monotonic() + delay_s
            held.extend((due, packet_id) for packet_id in queue.packets())
    while held:
        queue.accept(held.popleft()[1])


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


@contextlib.contextmanager
def impaired(namespace: str, interface: str, delay_ms: float, loss: float) -> Iterator[None]:
    """`namespace`'s link on `interface` (its side of the veth, inside it) slow and lossy for the
    block: `delay_ms` on every packet it sends, `loss` (a probability) on every packet it sends
    and every packet it receives. Rules and delayer are gone after the block, however it ends."""
    if not 0 <= loss < 1:
        raise ValueError(f"loss must be a probability in [0, 1), got {loss!r}")
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms!r}")
    if (why := why_not()) is not None:
        raise RuntimeError(why)
    tables = [iptables(), "-w"]
    rules = []
    if loss:
        drop = ["-m", "statistic", "--mode", "random", "--probability", str(loss), "-j", "DROP"]
        rules += [["INPUT", "-i", interface, *drop], ["OUTPUT", "-o", interface, *drop]]
    if delay_ms:
        rules.append(["OUTPUT", "-o", interface, "-j", "NFQUEUE", "--queue-num", str(QUEUE),
                      "--queue-bypass"])
    delayer = None
    added: list[list[str]] = []
    try:
        if delay_ms:
            delayer = subprocess.Popen(
                [sys.executable, __file__, namespace, str(QUEUE), str(delay_ms / 1000)],
                stdout=subprocess.PIPE, text=True)
            if delayer.stdout.readline().strip() != "bound":
                raise RuntimeError(f"the delayer of {namespace} did not bind queue {QUEUE} "
                                   f"(exit status {delayer.wait()})")
        for rule in rules:
            _run("ip", "netns", "exec", namespace, *tables, "-A", *rule)
            added.append(rule)
        yield
    finally:
        try:
            for rule in reversed(added):
                _run("ip", "netns", "exec", namespace, *tables, "-D", *rule)
        finally:
            if delayer is not None:  # after the rules: no packet is queued for it any more
                delayer.terminate()
                try:
                    delayer.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    delayer.kill()
                    delayer.wait()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
