"""Local mode (``ScalingConfig(num_workers=0)``, as Ray Train V2's): the training function runs in
the driver's own process and main thread, so that a debugger's breakpoints work, while the run is
recorded as every run is.

The controller runs the run as a one-rank run whose rank is the driver itself: the one process it
starts is a relay (``python -m jaxtrain.worker`` with LOCAL_MODE_SOCKET_ENV set), which hands the
run's secret to the driver through a Unix socket in a private directory and then waits. The
driver joins the run over the control connection as rank 0 would (report, checkpoints committed
into the run directory, retention, result.jsonl, the return value), runs the function, and tells
the relay which exit code to end with. No ``jax.distributed`` is initialised, nothing is pickled
but the return value, and the driver's JAX settings are left as they are. The rank's output is the
driver's own (it is not in ``logs/rank-0.log``). As in Ray, FailureConfig does not apply: a
failure is not retried, and no progress watchdog runs (a breakpoint may hold the function for
hours).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

from jaxtrain import _core
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.user_code import user_traceback

# jaxtrain.worker's (imported when used: the relay runs it as __main__).
_EXIT_RAISED = 1
_POLL_S = 0.2
_CONNECT_TIMEOUT_S = 60.0


def relay_plan() -> Any:
    """The relay's plan: one CPU process on this host (it only waits)."""
    return _core.plan_local(_core.ScalingConfig(
        num_workers=1, use_tpu=False, use_gpu=False, topology=None, accelerator_type=None,
        resources_per_worker=None, placement_strategy="PACK"))


def failure_config() -> Any:
    """No restart and no progress watchdog: Ray's local mode has no fault tolerance."""
    return _core.FailureConfig(max_failures=0, controller_failure_limit=0,
                               progress_timeout_s=None)


class Driver:
    """The driver's side of a local mode run: the socket the relay connects to, then the rank."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="jaxtrain-local-")  # 0700: this user's only
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(os.path.join(self._dir, "driver.sock"))
        self._listener.listen(1)
        self._listener.settimeout(_POLL_S)
        self._relay: socket.socket | None = None
        # The training function's exception, for TrainingFailedError's __cause__.
        self.exception: BaseException | None = None

    @property
    def env(self) -> dict[str, str]:
        """What the relay's environment needs."""
        from jaxtrain.worker.entry import LOCAL_MODE_SOCKET_ENV

        return {LOCAL_MODE_SOCKET_ENV: self._listener.getsockname()}

    def close(self) -> None:
        self._end_relay(_EXIT_RAISED)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def run(self, controller: Any, events: Any, fn: Callable[..., Any], config: dict | None,
            takes_config: bool) -> None:
        """Joins the started run as its rank and runs `fn` in this thread; returns when the
        function has ended (its end sent to the controller) or the run has ended without it.
        Meanwhile a thread follows the run for the callbacks (`events`) and interrupts the
        function when the run ends under it (stopped by a callback, a commit that failed). An
        exception of the caller's own (Ctrl-C, SIGTERM) propagates."""
        hello = self._accept(controller)
        if hello is None:
            return  # the run ended before the relay connected (it could not start)
        client = _core.WorkerClient.connect(
            hello["controller"], hello["secret"], 0, int(hello["attempt"]), _CONNECT_TIMEOUT_S,
            json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                        "coordinator": "none (local mode)"}))
        try:
            start = json.loads(client.wait_start()[0])
            client.watch_controller(-1)  # reads the commits' notices; never ends this process
            self._train(controller, events, client, start, fn, config, takes_config)
        finally:
            client.stop()

    def _accept(self, controller: Any) -> dict | None:
        while True:
            try:
                relay, _ = self._listener.accept()
                break
            except TimeoutError:
                if controller.wait(0):
                    return None
        relay.settimeout(_CONNECT_TIMEOUT_S)
        self._relay = relay
        line = b""
        while not line.endswith(b"\n"):
            chunk = relay.recv(4096)
            if not chunk:
                raise ConnectionError("local mode: the relay process closed its socket before "
                                      "it sent the run's secret")
            line += chunk
        return json.loads(line)

    def _end_relay(self, code: int) -> None:
        if self._relay is not None:
            try:
                self._relay.sendall(bytes([code]))
            except OSError:
                pass  # gone already: the controller has seen it end
            self._relay.close()
            self._relay = None

    def _train(self, controller: Any, events: Any, client: Any, start: dict,
               fn: Callable[..., Any], config: dict | None, takes_config: bool) -> None:
        from jaxtrain import session  # here: a fit() with workers does not load the worker's API
        from jaxtrain.worker.entry import done_message

        def fail(message: str) -> None:
            """The stager thread's failure (a checkpoint that cannot be staged): the rank's error
            ends the run, which interrupts the function; the stager thread ends here."""
            self._send_error(client, message)
            raise SystemExit(_EXIT_RAISED)

        rank = session.Session(
            client,
            session.TrainContext(world_rank=0, world_size=1, local_rank=0, local_world_size=1,
                                 node_rank=0, experiment_name=start["experiment_name"],
                                 attempt=int(start["attempt"]), run_dir=start["run_dir"]),
            Checkpoint(start["checkpoint"]) if start.get("checkpoint") else None,
            fail=fail,
        )
        session.install(rank)
        follower = _Follower(controller, events)
        try:
            with follower:
                value = fn(dict(config or {})) if takes_config else fn()
                session.require("report").flush()
                done = done_message(value)
        except BaseException as e:
            if follower.interrupted:
                return  # the run ended under the function; its outcome says how
            if not isinstance(e, Exception):
                raise  # Ctrl-C, SIGTERM, sys.exit(): the caller stops the run
            session.require("report").flush()
            self.exception = e
            self._send_error(client, None)
            return
        finally:
            session.install(None)
            rank.stager.close()
        try:
            client.send_done(done)
        except OSError as e:  # not taken within its timeout: the controller is stuck or gone
            sys.stderr.write(f"jaxtrain: local mode: the controller did not take the done "
                             f"message: {e}\n")
        self._end_relay(0)

    def _send_error(self, client: Any, message: str | None) -> None:
        exc_type, exc, _ = sys.exc_info()
        if message is None:
            message = f"{exc_type.__name__}: {exc}" if exc_type else "unknown error"
        try:
            tb = user_traceback(exc) if exc is not None else traceback.format_exc()
            client.send_error(json.dumps({"message": message, "traceback": tb,
                                          "phase": "training"}))
        except OSError:
            pass  # the controller may be gone; the relay's exit code still tells
        self._end_relay(_EXIT_RAISED)


class _Follower:
    """While the training function runs in the main thread: a thread that polls the callbacks
    (which stop the run when one raises with raise_on_error) and, when the run ends under the
    function, interrupts it (KeyboardInterrupt, with ``interrupted`` set) where it runs in the main
    thread; elsewhere the function runs on to its end, its reports failing."""

    def __init__(self, controller: Any, events: Any) -> None:
        self._controller = controller
        self._events = events
        self._lock = threading.Lock()
        self._running = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="jaxtrain-local-mode",
                                        daemon=True)
        self._caller = threading.get_ident()  # the thread that runs the function
        self.interrupted = False

    def __enter__(self) -> _Follower:
        self._running = True
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._running = False
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        while not self._stop.is_set():
            if self._controller.wait(_POLL_S):
                with self._lock:
                    if self._running and self._caller == threading.main_thread().ident:
                        # A real SIGINT, so that a blocking call (a sleep) is interrupted too.
                        self.interrupted = True
                        signal.pthread_kill(self._caller, signal.SIGINT)
                return
            if self._events is not None and self._events.poll():
                self._controller.abort(self._events.fatal_reason())
