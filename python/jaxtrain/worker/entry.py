"""The worker entry point: ``python -m jaxtrain.worker``, started by the controller.

One worker, in order: authenticate to the controller; rank 0 reserves the JAX coordinator port;
register; import jax (overlapping with the other ranks' start-up); receive the coordinator and the
training function; point JAX's persistent compilation cache at the run directory; the ranks
other than 0 wait for rank 0's coordinator to listen; ``jax.distributed.initialize`` with every
argument given and cluster detection off; run the function; report done;
``jax.distributed.shutdown`` (bounded); exit.

Exit codes: 0 done; 1 the training function raised; 3 start-up failed; 4 the controller went away.

Rank 0 sends what the training function returned with its done message (``Result.return_value``).
In local mode (``ScalingConfig(num_workers=0)``) the process the controller starts is only a relay:
it hands the run's secret to the driver, whose own process is the rank
(jaxtrain/driver/local_mode.py), and exits with the code the driver gives it.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

EXIT_RAISED = 1
EXIT_START_UP = 3
EXIT_CONTROLLER_LOST = 4

# The largest pickled return value rank 0 may send (kMaxReturnValueSize, src/wire/messages.h).
RETURN_VALUE_LIMIT = 4 << 20
# Local mode: the driver's socket that the relay hands the run's secret to
# (jaxtrain/driver/local_mode.py).
LOCAL_MODE_SOCKET_ENV = "JAXTRAIN_LOCAL_MODE_SOCKET"

# The signal on which faulthandler dumps every thread's stack for the controller's ping "stacks"
# (docs/failure-detection.md): a real-time one, which neither Slurm (SIGUSR1), the Kubernetes
# supervisor (SIGUSR2) nor a training script's own faulthandler.register(SIGUSR2) takes.
STACKS_SIGNAL = signal.SIGRTMIN + 4

# jax.distributed timeouts, in seconds.
_INIT_TIMEOUT_S = 300
_HEARTBEAT_TIMEOUT_S = 100
_SHUTDOWN_TIMEOUT_S = 30


def _env_int(name: str) -> int:
    return int(os.environ[name])


def _reserve_coordinator(host: str) -> tuple[socket.socket, str]:
    """A port for the JAX coordinator on `host`, and a socket that holds it until the coordinator
    has bound it: bound with SO_REUSEPORT and never listening, so that gRPC (which binds its
    servers with SO_REUSEPORT) can take the port while no other program can in between."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, 0))
    except OSError:
        s.close()
        raise
    port = s.getsockname()[1]
    return s, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# How often a rank other than 0 tries the coordinator's port while rank 0 starts it.
_COORDINATOR_POLL_S = 0.002


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once the JAX coordinator at ``address`` (host:port) accepts connections, or after
    ``timeout_s`` (jax.distributed.initialize then reports what it finds).

    Every rank gets its start at the same moment, while rank 0 is still starting the coordinator:
    a client that jax.distributed.initialize connects before the coordinator listens is refused,
    and gRPC waits about a second before its next try, so the whole group starts a second later
    than it could (measured here: initialize took 1.0 s on 4 CPU ranks started together, 0.02 s
    when ranks 1..3 waited for the port first). Until rank 0's coordinator binds it, the port is
    held by a socket that never listens (_reserve_coordinator), so a refusal means "not yet"."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(_COORDINATOR_POLL_S)


def _address_towards(address: str) -> str:
    """This host's address on its route to ``address`` (host:port, the controller's): the other
    ranks reach the controller, and so this host, the same way. 127.0.0.1 for a local run."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))  # picks the route and the source address; sends nothing
        return s.getsockname()[0]


def _take_rank_env() -> None:
    """Sets this rank's own entry of JAXTRAIN_RANK_ENV: what the placement gives each rank (a
    simulated TPU worker's TPU_WORKER_ID, ...) where one command starts every rank (Slurm,
    Kubernetes; src/launch/launcher.h, MergeUniform)."""
    table = os.environ.pop("JAXTRAIN_RANK_ENV", "")
    if table:
        os.environ.update(json.loads(table).get(os.environ["JAXTRAIN_RANK"], {}))


def _local_device_ids(platform: str) -> list[int] | None:
    """The ``local_device_ids`` for ``jax.distributed.initialize`` (placement set the variables).

    cpu: the JAX_NUM_CPU_DEVICES devices. cuda: 0..k-1 for the k GPUs of CUDA_VISIBLE_DEVICES,
    which CUDA renumbers from 0 in the order given. tpu: None; libtpu already sees only this
    worker's chips, and a chip holds two JAX devices on v2, v3 and v7x, so chip counts are not ids.
    """
    if platform == "cpu":
        return list(range(int(os.environ.get("JAX_NUM_CPU_DEVICES", "1"))))
    if platform == "cuda":
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return list(range(len(visible)))
    return None


def done_message(value) -> str:
    """Rank 0's done message: what its training function returned, pickled (cloudpickle) and in
    hex. Raises TypeError naming the value's type when it cannot be pickled, and ValueError naming
    the limit when its pickle is larger than RETURN_VALUE_LIMIT."""
    import cloudpickle

    if value is None:  # nothing returned: nothing to record (Result.return_value is None)
        return "{}"
    try:
        data = cloudpickle.dumps(value)
    except Exception as e:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
        kind = type(value)
        raise TypeError(
            f"the training function returned a value of type {kind.__module__}.{kind.__qualname__}"
            f", which cannot be pickled ({type(e).__name__}: {e}); Result.return_value needs a "
            "picklable value: return plain data (numbers, strings, dicts, numpy arrays)") from e
    if len(data) > RETURN_VALUE_LIMIT:
        raise ValueError(
            f"the training function returned a value of {len(data)} bytes pickled, more than the "
            f"limit of {RETURN_VALUE_LIMIT} bytes ({RETURN_VALUE_LIMIT >> 20} MiB) for "
            "Result.return_value; save large results in a checkpoint (report(checkpoint=...)) or "
            "a file, and return their path")
    return json.dumps({"return_value": data.hex()})


def _relay_to_driver(secret: str) -> None:
    """Local mode: hands the run's secret, the controller's address and the attempt to the driver
    at LOCAL_MODE_SOCKET_ENV, then exits with the code the driver sends when its training function
    has ended (EXIT_CONTROLLER_LOST when the driver goes away without one)."""
    message = {"secret": secret, "controller": os.environ["JAXTRAIN_CONTROLLER_ADDR"],
               "attempt": _env_int("JAXTRAIN_ATTEMPT")}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(os.environ[LOCAL_MODE_SOCKET_ENV])
            s.sendall(json.dumps(message).encode() + b"\n")
            code = s.recv(1)
    except OSError as e:
        sys.stderr.write(f"jaxtrain worker: local mode: the driver cannot be reached: {e}\n")
        os._exit(EXIT_START_UP)
    os._exit(code[0] if code else EXIT_CONTROLLER_LOST)


def _fail(client, phase: str, exit_code: int, message: str | None = None,
          status_code: str | None = None) -> None:
    """Reports the exception being handled to the controller (as `message` when given, with the
    traceback either way; in phase "training" without the worker's own frames) and ends the
    worker with `exit_code`. Phase "storage" (an upload to object storage failed) carries the
    `status_code` the failure policy decides by."""
    exc_type, exc, _ = sys.exc_info()
    if phase == "training" and exc is not None:
        from jaxtrain.user_code import user_traceback

        tb = user_traceback(exc)
    else:
        tb = traceback.format_exc()
    sys.stderr.write(tb if message is None else f"{tb}jaxtrain worker: {message}\n")
    sys.stderr.flush()
    if message is None:
        message = f"{exc_type.__name__}: {exc}" if exc_type else "unknown error"
        if phase == "start-up":
            message = f"start-up failed: {message}"
    try:
        error = {"message": message, "traceback": tb, "phase": phase}
        if status_code is not None:
            error["status_code"] = status_code
        client.send_error(json.dumps(error))
    except Exception:  # the controller may already be gone; the exit code still tells
        pass
    sys.stdout.flush()
    os._exit(exit_code)


def _enable_stacks(client) -> None:
    """Lets the controller take this process's Python stacks (WorkerClient::EnableStacks).

    faulthandler's handler dumps every thread's stack on the thread that gets the signal, the
    client's own, without the GIL: so it works while the training thread is blocked inside XLA.
    The dump goes to a memfd that the client reads back and sends, so it reaches the driver from
    every launcher's hosts alike.
    """
    import faulthandler

    try:
        fd = os.memfd_create("jaxtrain-stacks")
        faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError) as e:  # stacks are a help, not a need
        sys.stderr.write(f"jaxtrain worker: stacks cannot be taken on a hang: {e}\n")
        return
    client.enable_stacks(fd, STACKS_SIGNAL, threading.get_ident())


def _take_secret() -> str | None:
    """The run's secret, from where the launcher put it: an inherited pipe (JAXTRAIN_RUN_SECRET_FD,
    the local launcher), a file this worker may delete after reading
    (JAXTRAIN_RUN_SECRET_FILE), or the environment (JAXTRAIN_RUN_SECRET, Slurm). Neither the pipe
    nor the file leaves it in /proc/PID/environ for the worker's life."""
    fd = os.environ.pop("JAXTRAIN_RUN_SECRET_FD", None)
    path = os.environ.pop("JAXTRAIN_RUN_SECRET_FILE", None)
    secret = os.environ.pop("JAXTRAIN_RUN_SECRET", None)
    if fd:
        chunks = []
        with os.fdopen(int(fd), "rb", closefd=True) as f:
            while chunk := f.read():
                chunks.append(chunk)
        if int(fd) == 0:  # srun's stdin (the Slurm launcher): user code gets /dev/null
            null = os.open(os.devnull, os.O_RDONLY)  # fd 0 itself, the lowest free one
            if null != 0:
                os.dup2(null, 0)
                os.close(null)
        return b"".join(chunks).decode().strip()
    if path:
        try:
            with open(path, encoding="ascii") as f:
                secret = f.read().strip()
        except PermissionError:
            raise PermissionError(
                f"cannot read the run's key at {path} as uid {os.getuid()}: on Kubernetes, a "
                "worker that is not root reads it through spec.securityContext.fsGroup, which "
                "JAXTRAIN_K8S_POD_TEMPLATE must then set (docs/kubernetes.md)") from None
        try:
            os.unlink(path)
        except OSError:  # a read-only mount (e.g. a Kubernetes Secret): its owner removes it
            pass
    return secret


# The standby's import thread runs at this nice value (Linux: per thread), so that standbys
# started while a group trains take little CPU from it; the main thread, which goes on to run the
# worker, keeps the priority it was started with.
STANDBY_IMPORT_NICE = 10

# Linux weighs the CPU between sessions first (autogroups, when the kernel has them on and the
# process is in the root cgroup), and only then by nice within each: a standby in a session of its
# own (an ssh agent's, a pod holder's) competes with each worker's session as an equal, whatever
# its threads' nice. So such a standby also lowers its session's priority while it imports, and
# puts it back once the import is done or it is activated (sched(7), "The autogroup feature").
_AUTOGROUP = "/proc/self/autogroup"

# "step": the standby's session holds only its standby step (a Slurm step's daemon and its
# tasks, each task a standby), so it may lower it although it does not lead it. Set by the Slurm
# launcher for its standby steps.
STANDBY_SESSION_ENV = "JAXTRAIN_STANDBY_SESSION"


def _in_standby_step() -> bool:
    return os.environ.get(STANDBY_SESSION_ENV) == "step"


def _own_session() -> bool:
    """Whether this standby's session holds no worker but itself: it leads it (an ssh agent's
    or pod holder's new session), or it is a standby step's (STANDBY_SESSION_ENV). A standby that
    shares its driver's session must not lower the running workers' priority with its own."""
    return os.getsid(0) == os.getpid() or _in_standby_step()


def _autogroup_nice() -> int | None:
    """This session's autogroup nice value; None where there is none to change: no autogroup
    file (another kernel, autogroups off) or a session shared with workers (_own_session)."""
    try:
        if not _own_session():
            return None
        with open(_AUTOGROUP, encoding="ascii") as f:
            return int(f.read().split()[-1])  # "/autogroup-25 nice 0"
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup_nice(nice: int, patience_s: float) -> bool:
    """Sets this session's autogroup nice. The kernel takes one such change at a time from an
    unprivileged process, about every 100 ms (EAGAIN meanwhile): tried again for `patience_s`."""
    import errno

    deadline = time.monotonic() + patience_s
    while True:
        try:
            with open(_AUTOGROUP, "w", encoding="ascii") as f:
                f.write(str(nice))
            return True
        except OSError as e:
            if e.errno != errno.EAGAIN or time.monotonic() > deadline:
                return False
        time.sleep(0.01)


# The file of the pickled task a standby unpickles ahead of its activation (set by fit() for local
# workers; docs/warm-workers.md).
PRELOAD_FILE_ENV = "JAXTRAIN_PRELOAD_FILE"
# "1": the worker also says how it went about its start (set by fit() from the driver's
# JAXTRAIN_VERBOSE; jaxtrain/driver/options.py).
VERBOSE_ENV = "JAXTRAIN_VERBOSE"
# A standby started again without the preload, because the preload touched a device.
NO_PRELOAD_ENV = "JAXTRAIN_STANDBY_NO_PRELOAD"
# "1": the pickled task comes first on the activation's pipe, as 8 bytes of length (big-endian)
# and the bytes, before the activation (a Slurm standby step's stdin, which srun hands to every
# task; src/launch/slurm_launcher.h).
PRELOAD_ON_PIPE_ENV = "JAXTRAIN_PRELOAD_ON_PIPE"


class _Standby:
    """What a standby's import thread leaves for its main thread."""

    def __init__(self) -> None:
        self.task: tuple[bytes, dict] | None = None  # the preloaded payload and its task
        self.spoiled = ""  # why the preload left this process unusable, or ""
        self.wake_r, self.wake_w = os.pipe()  # written when spoiled
        self.import_tid = 0  # the import thread's native id
        self.preload: bytes | None = None  # the pickled task, when it came on the pipe
        # The session's autogroup nice before the import lowered it; None while not lowered.
        self.autogroup_nice: int | None = None
        self.autogroup_lock = threading.Lock()

    def lower_session(self) -> None:
        """Lowers the session's priority for the import (_AUTOGROUP), where it may be put back
        without privileges (a nice of 0 or more)."""
        own = _autogroup_nice()
        if own is None or own < 0 or own >= STANDBY_IMPORT_NICE:
            return
        with self.autogroup_lock:
            if _set_autogroup_nice(STANDBY_IMPORT_NICE, patience_s=1.0):
                self.autogroup_nice = own

    def restore_session(self, patience_s: float, activated: bool = False) -> None:
        """Puts the session's priority back, once: the import is done, or the worker starts.
        `activated`: the worker starts, so the session holds workers from now on. In a standby
        step's session another task may have lowered it (and may have died since): it is put
        back to the nice every new session has."""
        with self.autogroup_lock:
            lowered_by_another = activated and _in_standby_step() and \
                _autogroup_nice() == STANDBY_IMPORT_NICE
            if self.autogroup_nice is None and lowered_by_another:
                self.autogroup_nice = 0
            if self.autogroup_nice is None:
                return
            if _set_autogroup_nice(self.autogroup_nice, patience_s):
                self.autogroup_nice = None
            else:
                _say(f"could not put the session's CPU priority back to nice "
                     f"{self.autogroup_nice} ({_AUTOGROUP}): the worker runs at nice "
                     f"{STANDBY_IMPORT_NICE} against other sessions")


_standby: _Standby | None = None


def _import_ahead(state: _Standby | None = None) -> None:
    """What every worker imports, done by a standby before its activation; then, with `state`,
    the training function (_preload_task). An import that fails here fails again, and is
    reported, where the worker imports it itself."""
    if state is not None:
        state.import_tid = threading.get_native_id()
        state.lower_session()
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STANDBY_IMPORT_NICE)
    except OSError:  # not Linux, or not allowed: the import runs at normal priority
        pass
    try:
        _import_and_preload(state)
    finally:
        if state is not None:
            state.restore_session(patience_s=10.0)


def _import_and_preload(state: _Standby | None) -> None:
    try:
        import cloudpickle  # noqa: F401
        import jax  # noqa: F401

        from jaxtrain import _core, checkpoint, session  # noqa: F401
    except BaseException:
        return
    if state is not None:
        try:
            _preload_task(state)
        except BaseException as e:  # never fatal: the worker unpickles at activation
            _say(f"the training function was not preloaded ({type(e).__name__}: {e}); it is "
                 "unpickled at activation")


def _say(message: str) -> None:
    sys.stderr.write(f"jaxtrain worker: standby: {message}\n")
    sys.stderr.flush()


class _DeviceTouched(RuntimeError):
    pass


def _imported_modules(fn, limit: int = 200) -> list[str]:
    """The absolute module names that `fn`'s code imports (``import a.b``, ``from a import b``),
    in its nested functions and in the functions and classes pickled with it (those of its
    globals that share its module), in the order first met."""
    import dis
    import types

    names: dict[str, None] = {}
    seen: set[int] = set()
    todo: list = [fn]
    while todo and len(seen) < limit:
        obj = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            todo += [v for v in vars(obj).values() if isinstance(v, types.FunctionType)]
            continue
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        if not isinstance(obj, types.FunctionType):
            continue
        module_globals = obj.__globals__
        codes = [obj.__code__]
        while codes:
            code = codes.pop(0)
            level = 0
            for ins in dis.get_instructions(code):
                # An import's level (0: absolute) is the constant pushed just before it
                # (LOAD_SMALL_INT from Python 3.14).
                if ins.opname in ("LOAD_CONST", "LOAD_SMALL_INT") and isinstance(ins.argval, int):
                    level = ins.argval
                elif ins.opname == "IMPORT_NAME":
                    if level == 0 and ins.argval:
                        names.setdefault(ins.argval, None)
                elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                    value = module_globals.get(ins.argval)
                    if isinstance(value, (types.FunctionType, type)) and getattr(
                            value, "__module__", None) == obj.__module__:
                        todo.append(value)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return list(names)


def _preload_task(state: _Standby) -> None:
    """Unpickles the task in the file PRELOAD_FILE_ENV names and imports the modules its
    function's code imports, before the activation, so that a restart does not wait for them.

    The rule (docs/warm-workers.md): nothing before the activation touches a device, because
    ``jax.distributed.initialize`` has to come first (and on an accelerator the running group
    holds it). JAX's backend initialisation is refused meanwhile; an unpickling or an import that
    asks for it leaves the process unusable (a module may have kept the refusal), and the standby
    starts again without the preload (_restart_standby). Anything else that fails only costs the
    preload: the worker unpickles the task at activation, and the function imports what it
    imports; the log says so. The task is used at activation only if its bytes are the ones the
    controller sends."""
    path = os.environ.get(PRELOAD_FILE_ENV)
    if os.environ.get(NO_PRELOAD_ENV) == "1":
        return
    if state.preload is not None:
        data = state.preload
    elif not path:
        return
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            _say(f"the training function was not preloaded (cannot read {path}: {e.strerror}); "
                 "it is unpickled at activation")
            return
    import cloudpickle
    from jax._src import xla_bridge

    init_backend = getattr(xla_bridge, "_init_backend", None)
    if init_backend is None:  # another jax: no way to keep devices untouched
        _say("the training function was not preloaded (this jax has no "
             "xla_bridge._init_backend to guard); it is unpickled at activation")
        return
    touched: list[str] = []

    def refuse(platform: str, *args, **kwargs):
        touched.append(platform)
        raise _DeviceTouched(f"a standby worker may not initialise JAX's '{platform}' backend "
                             "before its activation")

    began = time.monotonic()
    imported, missing = [], []
    task = None
    xla_bridge._init_backend = refuse
    try:
        try:
            task = cloudpickle.loads(data)
        except Exception as e:
            if not touched:
                _say(f"the training function could not be unpickled before activation "
                     f"({type(e).__name__}: {e}); it is unpickled at activation")
        if task is not None and not touched:
            import importlib

            for name in _imported_modules(task["fn"]):
                if name in sys.modules:
                    continue
                try:
                    importlib.import_module(name)
                    imported.append(name)
                except Exception:
                    missing.append(name)
                if touched:
                    break
    finally:
        xla_bridge._init_backend = init_backend
    if touched:
        state.spoiled = (f"preloading the training function asked for JAX's "
                         f"'{touched[0]}' backend (a device) before the activation")
        os.write(state.wake_w, b"x")
        return
    if task is None:
        return
    state.task = (data, task)
    if os.environ.get(VERBOSE_ENV) != "1":
        return
    _say(f"preloaded the training function in {time.monotonic() - began:.2f} s; imported "
         f"{', '.join(imported) or 'nothing new'}"
         + (f"; not importable before activation: {', '.join(missing)}" if missing else ""))


def preloaded_task(task_bytes: bytes):
    """The task a standby unpickled ahead, when `task_bytes` is the payload it unpickled; else
    None (the caller unpickles)."""
    state, task = _standby, None
    if state is not None and state.task is not None and state.task[0] == task_bytes:
        task = state.task[1]
    if state is not None:
        state.task = None
    return task


def _restart_standby(activation: bytes | None, fd: int, reason: str) -> None:
    """Replaces this process (same pid, so the pool and the controller keep it) with a standby
    that does not preload: given `activation`, on a new pipe that holds it, else on `fd`, the
    pool's pipe, still unread."""
    _say(f"{reason}; starting again without the preload (set JAXTRAIN_PRELOAD_TASK=0 to skip it)")
    if _standby is not None:
        _standby.restore_session(patience_s=2.0)  # the new process reads it as its own
    if activation is not None:
        r, w = os.pipe()
        os.write(w, activation)  # far less than a pipe holds
        os.close(w)
        os.close(fd)
        fd = r
    os.set_inheritable(fd, True)
    env = dict(os.environ)
    env.update({"JAXTRAIN_STANDBY": "1", "JAXTRAIN_RUN_SECRET_FD": str(fd), NO_PRELOAD_ENV: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


def _read_preload(fd: int) -> bytes | None:
    """The pickled task that comes first on the activation's pipe (PRELOAD_ON_PIPE_ENV); None at
    EOF (the standby was ended before it came)."""
    def exactly(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = os.read(fd, min(n - len(data), 1 << 20))
            if not chunk:
                return None
            data += chunk
        return data

    size = exactly(8)
    if size is None:
        os._exit(0)  # ended before its activation, as at an EOF below
    return exactly(int.from_bytes(size, "big")) or None


def _await_activation(import_ahead: bool = True) -> str:
    """A standby worker (JAXTRAIN_STANDBY=1, src/launch/standby_pool.h): imports jax, and the
    training function (_preload_task), while it waits for its activation on the pipe
    JAXTRAIN_RUN_SECRET_FD names, a JSON object with the run's secret and the variables that
    differ per attempt and per fit(); sets them and returns the secret. EOF instead of an
    activation: the pool ended this standby or the driver is gone; it exits 0 at once, even in the
    middle of the import. No fork happens after the import, so it does not matter which threads
    the import started (docs/warm-workers.md)."""
    global _standby
    import select

    os.environ.pop("JAXTRAIN_STANDBY")
    fd = int(os.environ.pop("JAXTRAIN_RUN_SECRET_FD"))
    state = _standby = _Standby()
    if os.environ.pop(PRELOAD_ON_PIPE_ENV, "") == "1" and os.environ.get(NO_PRELOAD_ENV) != "1":
        state.preload = _read_preload(fd)
    own_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    # A local mode relay imports nothing.
    importer = threading.Thread(target=_import_ahead if import_ahead else lambda: None,
                                args=(state,) if import_ahead else (),
                                name="jaxtrain-standby-import", daemon=True)
    importer.start()
    # Woken by the import thread when the preload spoiled this process: it starts again at once,
    # the pool's pipe unread, so that the restart finds a usable standby.
    while True:
        readable, _, _ = select.select([fd, state.wake_r], [], [])
        if fd in readable:
            break
        _restart_standby(None, fd, state.spoiled)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    if not chunks:
        os._exit(0)
    activation = b"".join(chunks)
    if importer.is_alive():
        # The rest of the import (or preload) is this attempt's start-up now: at the worker's
        # own priority, where the user may raise it again (root, or RLIMIT_NICE).
        try:
            os.setpriority(os.PRIO_PROCESS, state.import_tid, own_nice)
        except OSError:
            pass
    state.restore_session(patience_s=2.0, activated=True)
    os.environ.pop(STANDBY_SESSION_ENV, None)
    importer.join()
    if state.spoiled:
        _restart_standby(activation, fd, state.spoiled)
    os.close(fd)
    os.close(state.wake_r)
    os.close(state.wake_w)
    parsed = json.loads(activation)
    os.environ.update(parsed["env"])
    return parsed["secret"]


def _start_peers(memory, secret: str, rank: int, world_size: int):
    """This rank's peer copies (checkpoint_peers.py) in a run across hosts, or None: on one host,
    or where this jax has no coordination service to publish the peer server's address in. The
    server listens on this host's address towards the controller, which the other hosts reach."""
    from jaxtrain.worker import checkpoint_peers

    local_world_size = _env_int("JAXTRAIN_LOCAL_WORLD_SIZE")
    if checkpoint_peers.peer_of(rank, world_size, local_world_size) is None:
        return None
    try:
        from jax._src.distributed import global_state

        host = _address_towards(os.environ["JAXTRAIN_CONTROLLER_ADDR"])
        return checkpoint_peers.Peers(memory, bytes.fromhex(secret), rank, world_size,
                                      local_world_size, host, global_state.client)
    except Exception as e:  # no key-value store in this jax, no address to listen on
        sys.stderr.write(f"jaxtrain worker: rank {rank}: no peer copies of checkpoints "
                         f"({type(e).__name__}: {e}); each is kept in this host's memory only\n")
        return None


def _fetch_own_part(path: str, peers, rank: int) -> None:
    """Fetches this rank's part of the checkpoint at ``path`` from its peer's host when this
    host's memory holds no copy of it (the host was replaced or its memory freed); said in the
    log. Anything short of the whole part leaves the restore to read storage."""
    missing = peers.memory.missing_part(path)
    if missing is None:
        return  # this host kept it, unchanged (or there is no copy to fetch)
    began = time.monotonic()
    try:
        fetched = peers.fetch(*missing)
    except Exception as e:  # a peer gone, refusing, or sending what does not check out
        sys.stderr.write(f"jaxtrain worker: rank {rank}: this host's memory holds no copy of its "
                         f"part of '{os.path.basename(path)}', nor could its peer's host send "
                         f"it ({e})\n")
        return
    sys.stderr.write(f"jaxtrain worker: rank {rank}: fetched its part of "
                     f"'{os.path.basename(path)}' from the memory of its peer's host (rank "
                     f"{peers.peer}): {fetched / 2**20:.1f} MiB in "
                     f"{time.monotonic() - began:.3f} s\n")


def _open_store(client, task: dict, start: dict, rank: int, attempt: int):
    """The run directory on object storage when this run's hosts write their checkpoints there
    themselves (checkpoint_store.py), else None. Rank 0 first deletes what an earlier attempt
    uploaded and no committed checkpoint names, while the other ranks wait at a barrier of the
    JAX coordination service, so that no upload of this attempt races the sweep."""
    spec = task.get("store")
    if spec is None:
        return None
    from jaxtrain.worker import checkpoint_store

    try:
        fs = spec["fs"] if "fs" in spec else checkpoint_store.open_url(spec["url"])
    except Exception as e:
        _fail(client, "storage", EXIT_START_UP, f"start-up failed: {e}",
              checkpoint_store.status_code(e.__cause__ or e))
    store = checkpoint_store.Store(fs, spec["root"], rank, attempt, start["first_round"],
                                   start.get("committed") or [], start["experiment_name"])
    if rank == 0:
        try:
            gone = store.sweep()
        except Exception as e:
            _fail(client, "storage", EXIT_START_UP,
                  f"start-up failed: the run directory {store.url} on object storage: {e}",
                  checkpoint_store.status_code(e.__cause__ or e))
        if gone:
            sys.stderr.write(f"jaxtrain worker: removed from {store.url} what an earlier attempt "
                             f"left: {', '.join(sorted(gone))}\n")
    from jax._src.distributed import global_state

    global_state.client.wait_at_barrier(f"jaxtrain-store-sweep-a{attempt}", 300_000)
    return store


def _restore_point(path: str | None, memory, rank: int, attempt: int,
                   checksums_skipped: bool = False, peers=None):
    """The Checkpoint that get_checkpoint() returns: the committed checkpoint at ``path`` (None:
    none), or with JAXTRAIN_CHECKPOINT_IN_MEMORY=1 this rank's view of it in host memory when this
    host holds copies of its files (jaxtrain/worker/checkpoint_memory.py); said in the rank's log.

    ``checksums_skipped``: the controller checked the checkpoint by sizes only, because every part
    of it has its copy here. A rank that reads any of it from storage after all (a view that
    could not be built whole) checks every file's CRC-32C first; a mismatch raises."""
    from jaxtrain import _core
    from jaxtrain.checkpoint import Checkpoint

    if not path:
        return None
    began = time.monotonic()
    if peers is not None:
        _fetch_own_part(path, peers, rank)
    try:
        view = memory.view(path, attempt) if memory is not None else None
    except Exception as e:  # the store in a state of its own making: the storage still serves
        sys.stderr.write(f"jaxtrain worker: rank {rank}: restoring from host memory failed "
                         f"({type(e).__name__}: {e}); restoring from storage\n")
        view = None
    if checksums_skipped and (view is None or view.in_memory < view.files):
        _core.verify_checkpoint(path, True)
    if view is None:
        if memory is not None:
            sys.stderr.write(f"jaxtrain worker: rank {rank}: this host's memory holds no copy of "
                             f"'{os.path.basename(path)}'; restoring it from storage\n")
        return Checkpoint(path)
    checkpoint = Checkpoint(view.path)
    if view.in_memory < view.files:
        checkpoint._source = path  # the view links to storage: to_directory() copies from there
    sys.stderr.write(f"jaxtrain worker: rank {rank}: restoring '{os.path.basename(path)}' from "
                     f"host memory: {view.in_memory} of {view.files} files "
                     f"({view.bytes / 2**20:.1f} MiB)"
                     + (", the others from storage" if view.in_memory < view.files else "")
                     + f"; linked in {time.monotonic() - began:.3f} s\n")
    return checkpoint


def main() -> None:
    # Under the Slurm launcher SIGUSR1 is a notice: Slurm's --signal=USR1@<s> before the time
    # limit (JAXTRAIN_SLURM_SIGNAL_S, which the launcher sets for its steps). It may come while
    # the worker starts (Slurm sends it up to 60 s early): held until watch_preemption() takes
    # it, then raised again.
    usr1_notice_s = os.environ.get("JAXTRAIN_SLURM_SIGNAL_S", "")
    early_usr1: list[int] = []
    if usr1_notice_s.isdigit():
        signal.signal(signal.SIGUSR1, lambda signum, frame: early_usr1.append(signum))
    standby = os.environ.get("JAXTRAIN_STANDBY") == "1"
    relay = LOCAL_MODE_SOCKET_ENV in os.environ
    secret = _await_activation(import_ahead=not relay) if standby else _take_secret()
    if not secret:
        sys.stderr.write(
            "jaxtrain.worker is started by jaxtrain (JaxTrainer.fit); it is not run by hand\n"
        )
        sys.exit(2)
    if relay:
        _relay_to_driver(secret)
    from jaxtrain import _core, session
    from jaxtrain.launch import kubernetes, slurm
    from jaxtrain.worker import checkpoint_memory

    slurm.place_worker()
    kubernetes.place_worker()
    _take_rank_env()
    rank = _env_int("JAXTRAIN_RANK")
    attempt = _env_int("JAXTRAIN_ATTEMPT")
    world_size = _env_int("JAXTRAIN_WORLD_SIZE")
    platform = os.environ.get("JAXTRAIN_PLATFORM", "cpu")

    def join(registration: str):
        try:
            return _core.WorkerClient.connect(
                os.environ["JAXTRAIN_CONTROLLER_ADDR"], secret, rank, attempt, 60.0, registration
            )
        except OSError as e:  # refused, unreachable, or no handshake within the timeout
            sys.stderr.write(f"jaxtrain worker: rank {rank} could not join the run: {e}\n")
            sys.exit(EXIT_START_UP)

    # The registration goes with the handshake's last frame (one segment fewer per rank), so it
    # is made first; a worker that cannot make it joins only to say why.
    try:
        coordinator_host = os.environ.get("JAXTRAIN_COORDINATOR_HOST") or _address_towards(
            os.environ["JAXTRAIN_CONTROLLER_ADDR"]
        )
        reserved, coordinator = (
            _reserve_coordinator(coordinator_host) if rank == 0 else (None, "")
        )
        registration = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "coordinator": coordinator}
        )
    except Exception:
        _fail(join(""), "start-up", EXIT_START_UP)
    client = join(registration)
    try:
        import jax  # the slow part of start-up, overlapped with the other ranks'
    except Exception:
        _fail(client, "start-up", EXIT_START_UP)

    try:
        start_json, payload = client.wait_start()
    except ConnectionError:
        sys.stderr.write("jaxtrain worker: the controller ended the run before it started\n")
        os._exit(EXIT_CONTROLLER_LOST)
    except PermissionError as e:  # a frame that did not open: nothing of it was used
        sys.stderr.write(f"jaxtrain worker: ending the connection to the controller: {e}\n")
        os._exit(EXIT_CONTROLLER_LOST)
    _enable_stacks(client)
    client.watch_controller(EXIT_CONTROLLER_LOST)
    start = json.loads(start_json)
    metadata_watcher = None

    try:
        from jaxtrain.worker import compilation_cache

        compilation_cache.set_up(
            jax, start["run_dir"], platform=platform, rank=rank, world_size=world_size,
            local_rank=_env_int("JAXTRAIN_LOCAL_RANK"),
            local_world_size=_env_int("JAXTRAIN_LOCAL_WORLD_SIZE"), secret=bytes.fromhex(secret))
        bind_host = start["coordinator"].rsplit(":", 1)[0]
        # jax 0.7 added heartbeat_timeout_seconds and a later jax shutdown_timeout_seconds; the
        # newest jax for Python 3.10 (0.6.2) has neither and keeps its own defaults.
        accepted = inspect.signature(jax.distributed.initialize).parameters
        if rank != 0:
            _wait_for_coordinator(start["coordinator"], _INIT_TIMEOUT_S)
        timeouts = {"heartbeat_timeout_seconds": _HEARTBEAT_TIMEOUT_S,
                    "shutdown_timeout_seconds": _SHUTDOWN_TIMEOUT_S}
        jax.distributed.initialize(
            coordinator_address=start["coordinator"],
            num_processes=world_size,
            process_id=rank,
            local_device_ids=_local_device_ids(platform),
            cluster_detection_method="deactivate",
            initialization_timeout=_INIT_TIMEOUT_S,
            coordinator_bind_address=f"{bind_host}:{start['coordinator'].rsplit(':', 1)[1]}"
            if rank == 0
            else None,
            **{name: value for name, value in timeouts.items() if name in accepted},
        )
        if reserved is not None:
            reserved.close()  # the coordinator has bound the port
        # jax.distributed installs a SIGTERM handler for its preemption service; jaxtrain's own
        # takes its place: a SIGTERM the run did not send is a preemption notice (agreed by every
        # rank through the controller, get_preemption_info()); the group's own stop still ends
        # the process at once (docs/preemption.md).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        client.watch_preemption(int(usr1_notice_s) if usr1_notice_s.isdigit() else -1)
        if early_usr1:
            os.kill(os.getpid(), signal.SIGUSR1)
        # On GCE and TPU VMs, one rank per host also watches the metadata server's notices.
        if _env_int("JAXTRAIN_LOCAL_RANK") == 0:
            from jaxtrain.worker import gce_metadata

            metadata_watcher = gce_metadata.start(rank, client.send_preemption_notice)
        import cloudpickle

        from jaxtrain.worker import runtime_env

        task_bytes, shipped = runtime_env.unwrap(payload)
        if shipped is not None:  # before the task: its function may live in the working_dir
            runtime_env.enter(shipped)
        task = preloaded_task(task_bytes) or cloudpickle.loads(task_bytes)
    except Exception:
        _fail(client, "start-up", EXIT_START_UP)

    store = _open_store(client, task, start, rank, attempt)
    memory = peers = None
    if checkpoint_memory.enabled() and store is not None:
        if rank == 0:
            sys.stderr.write("jaxtrain worker: checkpoints are not kept in host memory in a run "
                             "whose hosts write them to object storage themselves\n")
    elif checkpoint_memory.enabled():
        memory = checkpoint_memory.HostMemory(start["run_dir"], rank)
        if _env_int("JAXTRAIN_LOCAL_RANK") == 0:
            checkpoint_memory.sweep(start["run_dir"])
        peers = _start_peers(memory, secret, rank, world_size)
    try:
        if store is not None and start.get("checkpoint"):
            checkpoint = store.checkpoint(start["checkpoint"])  # read from the store itself
        else:
            checkpoint = _restore_point(start.get("checkpoint"), memory, rank, attempt,
                                        start.get("checkpoint_checksums_skipped", False), peers)
    except Exception as e:
        _fail(client, "start-up", EXIT_START_UP,
              f"start-up failed: the checkpoint '{start.get('checkpoint')}' failed its check "
              f"before rank {rank} read it from storage: {e}; a new fit() of the run checks "
              "every checkpoint and restores the newest whole one")
    session.install(
        session.Session(
            client,
            session.TrainContext(
                world_rank=rank,
                world_size=world_size,
                local_rank=_env_int("JAXTRAIN_LOCAL_RANK"),
                local_world_size=_env_int("JAXTRAIN_LOCAL_WORLD_SIZE"),
                node_rank=_env_int("JAXTRAIN_NODE_RANK"),
                experiment_name=start["experiment_name"],
                attempt=attempt,
                run_dir=start["run_dir"],
            ),
            checkpoint,
            fail=lambda message: _fail(client, "training", EXIT_RAISED, message),
            memory=memory,
            peers=peers,
            store=store,
            fail_storage=lambda message, code: _fail(client, "storage", EXIT_RAISED, message,
                                                     code),
            validation=task.get("validation", False),
            first_round=start["first_round"],
        )
    )
    try:
        fn = task["fn"]
        value = fn(dict(task["config"] or {})) if task["takes_config"] else fn()
        done = done_message(value) if rank == 0 else "{}"  # Result.return_value
    except BaseException:
        # What report() accepted before the function raised still reaches the controller (a
        # checkpoint whose round every rank reported is committed before the restart).
        session.require("report").flush()
        _fail(client, "training", EXIT_RAISED)

    session.require("report").flush()  # queued reports go before done
    session.stop_profile(session.require("report"))  # a trace of fewer steps than asked
    if metadata_watcher is not None:
        metadata_watcher.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        client.send_done(done)  # returns once the controller's host has it
    except OSError as e:  # not taken within its timeout: the controller is stuck or gone
        sys.stderr.write(f"jaxtrain worker: the controller did not take the done message: {e}\n")
    try:
        jax.distributed.shutdown()
    except Exception as e:  # a peer already gone; nothing left to coordinate
        sys.stderr.write(f"jaxtrain worker: jax.distributed.shutdown() failed: {e}\n")
    else:
        if memory is not None:  # every rank passed its shutdown barrier after its done was taken
            checkpoint_memory.end_of_run(start["run_dir"], _env_int("JAXTRAIN_LOCAL_RANK"))
    client.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: leftover non-daemon threads or atexit hooks must not keep a
    # finished worker alive.
    os._exit(0)

