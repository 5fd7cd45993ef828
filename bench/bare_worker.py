"""One bare JAX process: the floor that startup_and_report.py measures jaxtrain against.

    python bench/bare_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID T0 OUT_DIR NUM_REPORTS

It does the least a process must do to join a ``jax.distributed`` run: import jax, call
``jax.distributed.initialize`` with every argument given, and then emit NUM_REPORTS metric lines
the cheapest way a process can: one JSON line per metric, written straight to a file. A process
other than 0 first waits until the coordinator accepts connections, as jaxtrain's workers do:
one that connects earlier is refused and gRPC retries about a second later, which would make the
floor a second slower whenever rank 0 comes last (the best a hand-written script can do).
The launcher sets JAX_PLATFORMS, JAX_NUM_CPU_DEVICES and JAX_CPU_COLLECTIVES_IMPLEMENTATION.

This file is also the one place that defines how a rank times report-like calls and saves what it
measured, so that the jaxtrain workers and the bare processes run the very same loop.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable


def time_calls(emit: Callable[[dict], None], count: int) -> list[int]:
    """Calls ``emit`` ``count`` times with a small metrics dict; returns each call's ns."""
    samples = [0] * count
    for step in range(count):
        metrics = {"step": step, "loss": 1.0 / (step + 1)}  # built outside the timed region
        start = time.perf_counter_ns()
        emit(metrics)
        samples[step] = time.perf_counter_ns() - start
    return samples


def save_rank_result(out_dir: str, rank: int, startup_s: float, samples: list[int]) -> None:
    """Writes one rank's figures to OUT_DIR/rank<N>.json, where the benchmark driver reads them."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"startup_s": startup_s, "report_ns": samples}, f)


def main() -> None:
    coordinator, num_processes, process_id, t0, out_dir, num_reports = sys.argv[1:]
    import jax

    if int(process_id) != 0:
        host, port = coordinator.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                break
            except OSError:
                time.sleep(0.002)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(num_processes),
        process_id=int(process_id),
        cluster_detection_method="deactivate",
    )
    startup_s = time.time() - float(t0)  # the "first line after initialize"

    # One unbuffered write(2) per metric, to a file in the page cache: no other process has to
    # run for it to return (a pipe's reader or jaxtrain's controller does), so it is a lower bound.
    metrics_fd = os.open(
        os.path.join(out_dir, f"metrics-rank{process_id}.jsonl"),
        os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    )

    def emit_line(metrics: dict) -> None:
        os.write(metrics_fd, json.dumps(metrics).encode() + b"\n")

    samples = time_calls(emit_line, int(num_reports))
    os.close(metrics_fd)
    save_rank_result(out_dir, int(process_id), startup_s, samples)


if __name__ == "__main__":
    main()
