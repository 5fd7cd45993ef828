"""A worker pod's first process when its group restarts in place (docs/kubernetes.md, "Restarts
in place"): ``python -m jaxtrain.kubernetes hold [--no-standby] -- COMMAND...``; and the
supervisor's way in, ``python -m jaxtrain.kubernetes activate MESSAGE``, run in the pod through the
API server's exec.

The holder runs the worker COMMAND as its child, in a session of its own, and outlives it when it
fails, so that the next attempt starts in the same pod: no pod, container or image to make again.
Once the attempt trains (the supervisor's ``{"prepare": {}}``, from the launcher's PrepareNext) it
starts a standby worker beside the running one (``JAXTRAIN_STANDBY``, as a local standby: jax
imported, no device touched; docs/warm-workers.md), which the next attempt's activation starts
(none with ``--no-standby``: the driver's ``JAXTRAIN_WARM_WORKERS=0``). For the
supervisor, which reads the pod's log, it says when an attempt's worker starts and how it ended,
each on a line of its own:

    jaxtrain pod: attempt 2: worker started (warm)
    jaxtrain pod: attempt 2: worker exited with status 3

A worker that exits 0 ends the holder with 0: the run is over for this pod. A SIGTERM (the pod
deleted, drained or evicted: the workers' preemption notice) is passed to the worker, and the
holder then ends with the worker's status, as the worker would have as the pod's first process. A
pod whose worker failed waits for the next attempt's activation for up to ``HOLD_S``; without one
the holder ends with the worker's status (128 + n for signal n). As PID 1 it reaps every orphan.

The activation socket is a Unix socket in a 0700 directory under the container's ``$TMPDIR``:
only the container's own processes (the exec'd ``activate``) reach it. One JSON line in, one out:
``{"start": {"attempt": "2", "env": {...}}}`` starts the attempt's worker (its variables set over
the pod's: kActivationEnv of src/launch/standby_pool.h), ``{"signal": "TERM"}`` (or ``"KILL"``)
signals the running worker's process group, ``{"prepare": {}}`` starts the standby.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time

from jaxtrain import private_dirs

# How long a pod whose worker failed waits for the next attempt before its holder ends.
HOLD_S = 300.0
PREFIX = "jaxtrain pod: "
_SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


def holds(command: list[str]) -> bool:
    """Whether a worker container's `command` starts the holder."""
    return command[1:4] == ["-m", "jaxtrain.kubernetes", "hold"]


def activation_names() -> tuple[str, ...]:
    """The variables an activation sets, which a standby's environment lacks (the engine's
    kActivationEnv, src/launch/standby_pool.h). Imported when needed: ``activate`` runs without
    the engine."""
    from jaxtrain import _core

    return _core.ACTIVATION_ENV


def socket_path() -> str:
    return os.path.join(private_dirs.tmp_base(), "jaxtrain-holder", "socket")


def how(status: int) -> str:
    """A wait status, said as the supervisor says a rank's end (and read back by exit_code)."""
    code = os.waitstatus_to_exitcode(status)
    return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"


def exit_code(said: str) -> int:
    """What how() says, as a shell reports the status: 128 + n for signal n; 1 for anything
    else."""
    words, _, number = said.rpartition(" ")
    if not number.isdigit() or words not in ("exited with status", "killed by signal"):
        return 1
    return int(number) + (128 if words == "killed by signal" else 0)


def _say(line: str) -> None:
    os.write(1, f"{PREFIX}{line}\n".encode())


class Holder:
    def __init__(self, command: list[str], standby: bool = True) -> None:
        self.command = command
        self.worker = 0  # the running worker's pid, 0 when none
        self.attempt = os.environ.get("JAXTRAIN_ATTEMPT", "0")
        self.last_status: int | None = None
        self.standby = 0  # pid of the standby, 0 when none
        self.standby_fd = -1  # the write end of its activation pipe
        self.terminating = False
        self.warm = standby
        self.activation_names = activation_names()

    # -- processes --

    def _spawn(self, env: dict[str, str], fds: tuple[int, ...] = ()) -> int:
        """Starts the command in a session of its own with SIGTERM ignored until the worker
        takes it with its own handler (docs/preemption.md), as it was when the worker was the
        pod's first process: a notice that comes while it starts waits for the next one, or for
        the kubelet's SIGKILL. The holder has no thread, so it forks; SIGTERM is blocked across
        the fork, so that the holder's own handler takes any that comes meanwhile.
        Errors: OSError when the command cannot be run (the child's reason)."""
        err_r, err_w = os.pipe()  # close-on-exec: empty at EOF when the exec succeeded
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(err_r)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    for signum in (signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE,
                                   signal.SIGXFSZ):
                        signal.signal(signum, signal.SIG_DFL)
                    signal.pthread_sigmask(signal.SIG_SETMASK, set())
                    os.setsid()
                    for fd in fds:
                        os.set_inheritable(fd, True)
                    os.execvpe(self.command[0], self.command, env)
                except BaseException as e:
                    os.write(err_w, f"{type(e).__name__}: {e}".encode()[:1000])
                os._exit(127)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(err_w)
            for fd in fds:
                os.close(fd)
        with os.fdopen(err_r, "rb") as f:
            error = f.read()
        if error:
            os.waitpid(pid, 0)
            raise OSError(f"cannot run {self.command[0]}: {error.decode(errors='replace')}")
        return pid

    def _start_standby(self) -> None:
        if not self.warm or self.standby or self.terminating:
            return
        env = {k: v for k, v in os.environ.items()
               if k not in self.activation_names and k != "JAXTRAIN_RUN_SECRET_FILE"}
        r, w = os.pipe()
        env.update(JAXTRAIN_STANDBY="1", JAXTRAIN_RUN_SECRET_FD=str(r))
        try:
            self.standby = self._spawn(env, (r,))
            self.standby_fd = w
        except OSError as e:
            os.close(w)
            _say(f"no standby worker: {e}")

    def _end_standby(self) -> None:
        if self.standby_fd >= 0:
            os.close(self.standby_fd)  # it reads EOF and exits 0
            self.standby_fd = -1
        self.standby = 0

    def start(self, attempt: str, env: dict[str, str]) -> dict:
        if self.worker:
            return {"error": f"attempt {self.attempt}'s worker (pid {self.worker}) is running"}
        if self.terminating:
            return {"error": "the pod is terminating"}
        for name, value in env.items():
            if name not in self.activation_names:
                return {"error": f"{name} is not set by an activation"}
            os.environ[name] = value
        self.attempt = attempt
        warm, why = False, "no standby" if self.warm else "standbys are off"
        if self.standby:
            try:
                with open(os.environ["JAXTRAIN_RUN_SECRET_FILE"], encoding="ascii") as f:
                    secret = f.read().strip()
                message = json.dumps({"secret": secret, "env": dict(env)}).encode()
                if os.write(self.standby_fd, message) == len(message):
                    self.worker, warm = self.standby, True
            except (OSError, KeyError) as e:
                why = f"the standby could not be activated ({e})"
            os.close(self.standby_fd)  # an unactivated standby reads EOF and exits
            self.standby_fd, self.standby = -1, 0
        if not warm:
            try:
                self.worker = self._spawn(dict(os.environ))
            except OSError as e:
                return {"error": str(e)}
        _say(f"attempt {attempt}: worker started ({'warm' if warm else 'cold: ' + why})")
        return {"ok": True, "pid": self.worker, "warm": warm, **({} if warm else {"why": why})}

    def signal(self, name: str) -> dict:
        if name not in _SIGNALS:
            return {"error": f"signal '{name}' is not one of {sorted(_SIGNALS)}"}
        if not self.worker:
            ended = "" if self.last_status is None else how(self.last_status)
            return {"ok": True, "running": False, "attempt": self.attempt, "ended": ended}
        try:
            os.killpg(self.worker, _SIGNALS[name])
        except ProcessLookupError:
            pass
        return {"ok": True, "running": True}

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.worker:
                self.worker = 0
                self.last_status = status
                try:
                    os.killpg(pid, signal.SIGKILL)  # what it left in its session
                except OSError:
                    pass
                _say(f"attempt {self.attempt}: worker {how(status)}")
            elif pid == self.standby:
                self._end_standby()

    # -- the loop --

    def _answer(self, conn: socket.socket) -> None:
        """Reads one request (at most 64 KiB, within 5 s in all) and answers it. Nothing a
        client sends ends the holder: a request it cannot read is answered with an error."""
        deadline = time.monotonic() + 5.0
        try:
            data = b""
            while not data.endswith(b"\n") and len(data) < 1 << 16:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no whole request within 5 s")
                conn.settimeout(left)
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            try:
                request = json.loads(data)
                if "start" in request:
                    reply = self.start(str(request["start"]["attempt"]),
                                       dict(request["start"].get("env") or {}))
                elif "signal" in request:
                    reply = self.signal(str(request["signal"]))
                elif "prepare" in request:
                    self._start_standby()
                    reply = {"ok": True, "standby": bool(self.standby)}
                else:
                    reply = {"error": "neither start, signal nor prepare"}
            except Exception as e:  # a malformed request, however deep
                reply = {"error": f"not an activation: {type(e).__name__}: {e}"[:500]}
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass
        finally:
            conn.close()

    def _listen(self) -> socket.socket:
        path = socket_path()
        directory = os.path.dirname(path)
        private_dirs.private_dir(os.path.dirname(directory), os.path.basename(directory))
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(8)
        server.setblocking(False)
        return server

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)

        def on_term(signum, frame):
            self.terminating = True
            self._end_standby()
            if self.worker:
                try:
                    os.killpg(self.worker, signum)
                except ProcessLookupError:
                    pass

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_term)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        try:
            server, no_server = self._listen(), ""
        except OSError as e:
            server, no_server = None, str(e)
        if self.terminating:
            return 128 + signal.SIGTERM
        try:
            self.worker = self._spawn(dict(os.environ))
        except OSError as e:
            _say(f"attempt {self.attempt}: {e}")
            return 127
        _say(f"attempt {self.attempt}: worker started (first)")
        if no_server:
            _say(f"no activation socket ({no_server}): this pod's worker cannot be restarted "
                 "in place")
        selector = selectors.DefaultSelector()
        selector.register(wake_r, selectors.EVENT_READ)
        if server is not None:
            selector.register(server, selectors.EVENT_READ)
        idle_since: float | None = None
        while True:
            self._reap()
            if not self.worker and self.last_status is not None:
                code = exit_code(how(self.last_status))
                if code == 0 or self.terminating or server is None:
                    self._end_standby()
                    return code
                if idle_since is None:
                    idle_since = time.monotonic()
                if time.monotonic() - idle_since > HOLD_S:
                    _say(f"no next attempt came within {HOLD_S:.0f} s: the pod ends")
                    self._end_standby()
                    return code
            else:
                idle_since = None
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj == wake_r:
                    os.read(wake_r, 512)
                else:
                    try:
                        conn, _ = server.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(True)
                    self._answer(conn)


def hold(argv: list[str]) -> int:
    standby = argv[:1] != ["--no-standby"]
    if not standby:
        argv = argv[1:]
    if argv[:1] != ["--"] or len(argv) < 2:
        sys.stderr.write("usage: python -m jaxtrain.kubernetes hold [--no-standby] -- "
                         "COMMAND...\n")
        return 2
    return Holder(argv[1:], standby).run()


def activate(argv: list[str]) -> int:
    """Sends one message to the holder and prints its answer; 0 when it was taken."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m jaxtrain.kubernetes activate MESSAGE\n")
        return 2
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10.0)
            s.connect(socket_path())
            s.sendall(argv[0].encode() + b"\n")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
    except OSError as e:
        answer = json.dumps({"error": f"no holder answers at {socket_path()}: {e}"}).encode()
    sys.stdout.write(answer.decode().strip() + "\n")
    try:
        return 0 if json.loads(answer).get("ok") else 1
    except (ValueError, AttributeError):
        return 1
