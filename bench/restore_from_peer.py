"""Benchmark: a rank whose host lost its memory restores its part from its peer's host, against
reading it from storage.

    .venv/bin/python bench/restore_from_peer.py [--shard-mib 256] [--repeats 5]

Two processes stand for two hosts, each with a memory directory of its own under /dev/shm and a
peer server (jaxtrain/worker/checkpoint_peers.py) on loopback; a directory of files stands for
the JAX coordination service's key-value store. Rank 1's host keeps a copy of rank 0's part,
sent by rank 0 as its stager does (``replicate``). Then, per repeat, in turn (ABAB..., so machine
noise hits both):

* peer: rank 0's host has lost its memory; the rank fetches its part from rank 1's host (its
  size and CRC-32C checked on the way in, as a restart does) and then reads it from its own
  memory, as the training function reads the restored file;
* storage: the same part as a committed file on this machine's disk, fsynced and dropped from the
  page cache (``posix_fadvise(DONTNEED)``), read by the rank: the floor, what a restart reads
  without the copies.

Figures: each configuration's time to the part read in full, the ratio peer/storage, and the
issue's target (>= 10 x faster than from storage, ratio <= 0.1). The storage here is a local
disk; a shared filesystem or an object store, what runs across hosts use, reads slower.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import startup_and_report

from jaxtrain import _core
from jaxtrain.worker.checkpoint_memory import HostMemory
from jaxtrain.worker.checkpoint_peers import Peers

TARGET_RATIO = 0.1
BLOCK = 4 << 20


class DirectoryKeyValue:
    """The key-value store's two calls, on files: shared by processes as the service is."""

    def __init__(self, path: str) -> None:
        self.path = path

    def key_value_set(self, key: str, value: str) -> None:
        tmp = os.path.join(self.path, f".{secrets.token_hex(4)}")
        Path(tmp).write_text(value)
        os.rename(tmp, os.path.join(self.path, key.replace("/", "_")))

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            try:
                return Path(self.path, key.replace("/", "_")).read_text()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(key) from None
                time.sleep(0.01)


def peer_host(memory_dir: str, run_dir: str, kv_dir: str, secret: bytes, stop) -> None:
    """Rank 1 on its own host: serves until ``stop`` is set."""
    # Another host: its own memory, and a name of its own (a peer is never on the same host).
    with mock.patch.dict(os.environ, {"JAXTRAIN_MEMORY_DIR": memory_dir}), \
            mock.patch("socket.gethostname", return_value="peer-host"):
        Peers(HostMemory(run_dir, 1), secret, 1, 2, 1, "127.0.0.1", DirectoryKeyValue(kv_dir))
    stop.wait()


def read_all(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(BLOCK):
            n += len(chunk)
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shard-mib", type=int, default=256, help="the part's size (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="measured pairs (default 5)")
    args = parser.parse_args()
    size = args.shard_mib << 20
    block = os.urandom(BLOCK)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, \
            tempfile.TemporaryDirectory(dir=os.getcwd()) as disk:
        run_dir, kv_dir = os.path.join(disk, "run"), os.path.join(disk, "kv")
        os.makedirs(kv_dir)
        here, there = os.path.join(shm, "host0"), os.path.join(shm, "host1")
        os.makedirs(here)
        os.makedirs(there)
        secret = secrets.token_bytes(32)
        stop = multiprocessing.Event()
        server = multiprocessing.Process(target=peer_host,
                                         args=(there, run_dir, kv_dir, secret, stop))
        server.start()
        try:
            with mock.patch.dict(os.environ, {"JAXTRAIN_MEMORY_DIR": here}):
                rank0 = Peers(HostMemory(run_dir, 0), secret, 0, 2, 1, "127.0.0.1",
                              DirectoryKeyValue(kv_dir))
            # The committed part in storage, and rank 0's copy, sent to rank 1's host.
            stored = os.path.join(disk, "shard-0.bin")
            crc = 0
            with open(stored, "wb") as f:
                for _ in range(size // BLOCK):
                    f.write(block)
                    crc = _core.crc32c(block, crc)
                os.fsync(f.fileno())
            written = rank0.memory.prepare(0, 1)
            os.makedirs(written)
            shutil.copyfile(stored, os.path.join(written, "shard-0.bin"))
            entry = {"path": "shard-0.bin", "size": size, "crc32c": crc, "mode": 0o644}
            copy_id = secrets.token_hex(16)
            rank0.memory.keep(written, 0, 1, [entry], copy_id)
            rank0.replicate(copy_id)
            expected = {"shard-0.bin": (size, crc)}

            def from_peer() -> float:
                shutil.rmtree(rank0.memory.root)  # this host's memory lost
                began = time.perf_counter()
                rank0.fetch(copy_id, expected)
                read_all(os.path.join(rank0.memory.dir, "a0-r1", "shard-0.bin"))
                return time.perf_counter() - began

            def from_storage() -> float:
                fd = os.open(stored, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                began = time.perf_counter()
                assert read_all(stored) == size
                return time.perf_counter() - began

            from_peer(), from_storage()  # warm-up
            peer, storage = [], []
            for _ in range(args.repeats):
                peer.append(from_peer())
                storage.append(from_storage())
        finally:
            stop.set()
            server.join()
    ratios = [p / s for p, s in zip(peer, storage, strict=True)]
    spread = functools.partial(startup_and_report.spread, digits=3)

    print(f"restore of one rank's part ({args.shard_mib} MiB) after its host lost its memory, "
          f"{args.repeats} repeats, median [min-max]:")
    print(f"  from the peer's host memory (fetch + read): {spread(peer, 's')}")
    print(f"  from storage (local disk, page cache dropped): {spread(storage, 's')}")
    print(f"  ratio peer/storage: {spread(ratios, 'x')}")
    met = statistics.median(ratios) <= TARGET_RATIO
    print(json.dumps({"peer_s": statistics.median(peer), "storage_s": statistics.median(storage),
                      "ratio": statistics.median(ratios)}))
    print(f"target: restore from peers >= 10 x faster than from storage (ratio <= "
          f"{TARGET_RATIO}): {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
