"""JaxTrainer: the driver side of a run.

``fit()`` plans the worker group, hands the training function (pickled by value) to the C++
controller, and waits for the outcome with the GIL released. The controller runs in its own
threads: it spawns the workers, authenticates them, streams their output and metrics into the
run directory, and stops them all when one fails or the driver is interrupted.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import inspect
import json
import os
import posixpath
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

from jaxtrain import (
    _core,
    callbacks,
    goodput,
    launch,
    records,
    storage,
    user_code,
    validation,
)
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.config import RunConfig, ScalingConfig
from jaxtrain.driver import local_mode, metrics, ray_args, runtime_env, validator
from jaxtrain.driver.options import (
    COMPILATION_CACHE_ENV,
    SNAPSHOT_BUDGET_ENV,
    VERBOSE_ENV,
    EngineOptions,
)
from jaxtrain.driver.run_dir import make_private, private_files, warn_if_locks_stay_local
from jaxtrain.errors import TrainingFailedError
from jaxtrain.result import Result, load
from jaxtrain.worker import checkpoint_memory, gce_metadata
from jaxtrain.worker.checkpoint_store import STORE_ENV

# Seconds a worker gets between SIGTERM and SIGKILL when the group is stopped.
_TERMINATE_GRACE_S = 5.0
# Seconds from spawning the group until every worker must have connected.
_START_TIMEOUT_S = 300.0
_PROXY_EXEMPT = "127.0.0.1,localhost,::1"
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy",
                    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def _takes_config(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        raise ValueError(
            f"train_loop_per_worker={getattr(fn, '__name__', fn)!r} takes {len(required)} "
            "required arguments; it must take none, or one dict (train_loop_config)"
        )
    return len(positional) >= 1 or any(p.kind == p.VAR_POSITIONAL for p in params)


class JaxTrainer:
    """Runs ``train_loop_per_worker`` SPMD on ``scaling_config.num_workers`` processes, each with
    ``jax.distributed`` initialised before the function starts; with ``num_workers=0`` (local
    mode) in the driver's own process instead, without ``jax.distributed``
    (jaxtrain/driver/local_mode.py).

    The function takes no argument, or one dict (``train_loop_config``).
    ``resume_from_checkpoint``: the checkpoint that ``get_checkpoint()`` returns in the first
    attempt when the run has no committed checkpoint of its own yet (a run's own checkpoints
    win: a restart, or a run resumed by name, starts from its latest). ``validation_config``:
    the function that ``report(..., validation=...)`` runs on committed checkpoints, on the
    driver's host while training goes on (docs/checkpoints.md).
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        validation_config: validation.ValidationConfig | None = None,
        jax_config: Any = None,
        datasets: Any = None,
        dataset_config: Any = None,
    ) -> None:
        ray_args.check(resume_from_checkpoint, jax_config, datasets, dataset_config)
        if not callable(train_loop_per_worker):
            raise ValueError(
                f"train_loop_per_worker={train_loop_per_worker!r} is not callable; pass the "
                "training function"
            )
        self._takes_config = _takes_config(train_loop_per_worker)
        if train_loop_config is not None:
            if not isinstance(train_loop_config, dict):
                raise ValueError(
                    f"train_loop_config={train_loop_config!r} is not allowed; it must be a dict"
                )
            if not self._takes_config:
                raise ValueError(
                    "train_loop_config was given, but train_loop_per_worker takes no argument; "
                    "add one parameter (config) to the function or drop train_loop_config"
                )
        if scaling_config is None:
            scaling_config = ScalingConfig()
        if not isinstance(scaling_config, ScalingConfig):
            raise ValueError(
                f"scaling_config={scaling_config!r} is not allowed; pass a "
                "jaxtrain.ScalingConfig"
            )
        if run_config is None:
            run_config = RunConfig()
        if not isinstance(run_config, RunConfig):
            raise ValueError(
                f"run_config={run_config!r} is not allowed; pass a jaxtrain.RunConfig"
            )
        if validation_config is not None and not isinstance(validation_config,
                                                            validation.ValidationConfig):
            raise ValueError(
                f"validation_config={validation_config!r} is not allowed; pass a "
                "jaxtrain.ValidationConfig(fn=...) or None"
            )
        self.validation_config = validation_config
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.resume_from_checkpoint = resume_from_checkpoint
        # A live status line under the rank output when the console is a terminal (jaxtrain
        # only; `jaxtrain run` turns it on).
        self.status_line = False
        # A fit() that succeeds ends saying where the run directory is (`jaxtrain run` turns it
        # off: its own last line says it).
        self.say_run_dir = True

    def fit(self) -> Result:
        """Runs the training function on every worker and returns the Result.

        Raises TrainingFailedError when a worker fails, and KeyboardInterrupt after stopping every
        worker when the driver is interrupted. On SIGTERM (when no other handler is installed) the
        run is stopped the same way, and the driver then ends as SIGTERM ends it. Raises
        RuntimeError when another driver has this run open. With JAXTRAIN_PRIVATE=1 the run is
        private: its directory is 0700 and what the run writes is 0700/0600 (the umask gains 077
        meanwhile).
        """
        options = EngineOptions.read(os.environ, self.run_config.metrics_port)  # before anything
        # Chosen once (local mode runs on this host whatever JAXTRAIN_LAUNCHER says).
        launcher = launch.by_name("local") if self.scaling_config.num_workers == 0 else \
            launch.choose()
        # Chosen among every host listed, before label_selector narrows them to the workers'.
        placement = validator.Placement() if self.validation_config is None else \
            validator.place(self.validation_config, launcher.name)
        _idle_standbys.fit_started()
        try:
            with private_files(options.private), _select_nodes_by_labels(self.scaling_config,
                                                                         launcher):
                return self._fit(options, launcher, placement)
        finally:
            _idle_standbys.fit_ended(options.warm_workers_idle_s)

    def _fit(self, options: EngineOptions, launcher: launch.Launcher,
             placement: validator.Placement) -> Result:
        fn = self.train_loop_per_worker
        if self.resume_from_checkpoint is not None:
            fn = ray_args.StartFrom(fn, self.resume_from_checkpoint)
        # Local mode: the function runs in this process, the controller's one process is a relay.
        local = local_mode.Driver() if self.scaling_config.num_workers == 0 else None
        try:
            return self._fit_with(options, launcher, fn, local, placement)
        finally:
            if local is not None:
                local.close()

    def _fit_with(self, options: EngineOptions, launcher: launch.Launcher,
                  fn: Callable[..., Any], local: local_mode.Driver | None,
                  placement: validator.Placement) -> Result:
        in_memory = options.checkpoint_in_memory
        mirror = _mirror(self.run_config)  # remote storage: a local staging copy, mirrored
        run_dir = mirror.local if mirror is not None else local_run_dir(self.run_config)
        make_storage_path(self.run_config)
        warn_if_locks_stay_local(run_dir)
        launcher_options = ""
        if self.scaling_config.elastic and not launcher.resizes:
            sys.stderr.write(
                f"jaxtrain: ScalingConfig.num_workers={self.scaling_config.num_workers!r}: the "
                f"{launcher.name} launcher does not resize this run (docs/elastic.md); it trains "
                f"on {self.scaling_config.max_workers} workers, as a fixed-size run\n")
        store = None  # the hosts upload their checkpoints to object storage themselves
        if local is not None:
            in_memory = None  # the driver's process keeps no copies in host memory
            plan = local_mode.relay_plan()
            spans_hosts = False
        else:
            plan = launcher.plan(self.scaling_config)
            spans_hosts = launcher.spans_hosts(plan)
            store = _store_direct(self.run_config, mirror, spans_hosts, options)
            if spans_hosts and store is None and launcher.needs_shared_run_dir:
                # Refused before any host is contacted: other hosts could not see it.
                _check_shared(run_dir, mirror)
            launcher_options = launcher.options_json(
                self.run_config.name, run_dir, self.scaling_config,
                self.run_config.failure_config, store)
        if self.validation_config is not None and mirror is not None:
            raise ValueError(
                f"JaxTrainer(validation_config=...) with RunConfig.storage_path="
                f"{self.run_config.storage_path!r}: validation runs on a local or shared run "
                "directory only (docs/checkpoints.md)")
        # Local mode pickles nothing: the function runs here.
        payload = b"" if local is not None else _pickle_task(
            fn, self.train_loop_config, self._takes_config, store,
            self.validation_config is not None)
        shipped = _ship_working_dir(self.run_config, spans_hosts, options)  # before any start
        if mirror is not None:
            # pull() rebuilds the staging copy, which a live driver of this run is writing; the
            # controller takes the run's lock only later (RunStore::Open).
            _refuse_live_run(run_dir)
            mirror.pull(store_direct=store is not None)
        if options.private:
            make_private(run_dir)
        resumed = _say_resuming(run_dir, self.run_config.name)
        worker_env = _worker_env(self.run_config, plan)
        # Every launcher passes it on.
        worker_env[COMPILATION_CACHE_ENV] = options.compilation_cache
        if store is not None:
            worker_env[STORE_ENV] = "1"
        if options.snapshot_budget_mib is not None:
            worker_env[SNAPSHOT_BUDGET_ENV] = options.snapshot_budget_mib
        if options.gce_metadata:
            worker_env[gce_metadata.ENV] = options.gce_metadata
        if options.verbose:
            worker_env[VERBOSE_ENV] = "1"
        if in_memory is not None:
            worker_env[checkpoint_memory.IN_MEMORY_ENV] = in_memory
            # Absolute: workers may run in another working directory.
            worker_env[checkpoint_memory.MEMORY_DIR_ENV] = options.memory_dir
            if options.memory_budget_mib:
                worker_env[checkpoint_memory.BUDGET_ENV] = options.memory_budget_mib
        launcher.adjust_worker_env(worker_env)
        if local is not None:
            worker_env.update(local.env)
        preload_file = None
        if options.preload_task and launcher.preloads_task and local is None and shipped is None:
            # Standbys unpickle the task ahead of a restart (docs/warm-workers.md).
            preload_file = _write_preload(payload)
            worker_env[PRELOAD_FILE_ENV] = preload_file
        sys.stdout.flush()
        sys.stderr.flush()
        # Bound before anything starts: a port in use is refused with nothing to stop.
        metrics_server = None if options.metrics_endpoint is None else \
            metrics.MetricsServer(*options.metrics_endpoint, self.run_config.name,
                                  metrics.read_token())
        console_fd = _console_fd()
        controller = _core.Controller(
            run_dir=run_dir,
            experiment_name=self.run_config.name,
            plan=plan,
            worker_argv=[sys.executable, "-m", "jaxtrain.worker"],
            # A shipped working_dir: the worker enters its copy; "/" is on every host.
            worker_cwd="/" if shipped else _working_dir(self.run_config) or os.getcwd(),
            worker_env=worker_env,
            payload=runtime_env.wrap(payload, shipped),
            run_config_json=json.dumps(
                {
                    "scaling_config": self.scaling_config._as_dict(),
                    "run_config": {
                        "name": self.run_config.name,
                        "storage_path": self.run_config.storage_path,
                    },
                    "failure_config": self.run_config.failure_config._as_dict(),
                    "checkpoint_config": self.run_config.checkpoint_config._as_dict(),
                    "train_loop_config": _describe(self.train_loop_config),
                }
            ),
            terminate_grace_s=_TERMINATE_GRACE_S,
            start_timeout_s=_START_TIMEOUT_S,
            progress_timeout_floor_s=options.progress_timeout_floor_s,
            failure_config=local_mode.failure_config() if local is not None
            else self.run_config.failure_config._core,
            checkpoint_config=self.run_config.checkpoint_config._core,
            verify_checksums=options.verify_checksums,
            verbose=options.verbose,
            console_fd=console_fd,
            launcher=launcher.name,
            scaling_config=self.scaling_config._core,
            status_line=self.status_line and console_fd >= 0 and os.isatty(console_fd),
            launcher_options_json=launcher_options,
            # A local run's restarts restore from this host's memory: a checkpoint held there
            # whole is checked by sizes only (docs/checkpoint-memory.md).
            memory_store=checkpoint_memory.store_path(run_dir)
            if in_memory == "1" and launcher.restores_from_this_host else "",
        )
        validator = _validator(self.validation_config, run_dir, placement)
        events = callbacks.Dispatcher.start(self, run_dir) if self.run_config.callbacks else None
        sigterm = _SigtermAsException()
        live_server = None
        try:
            if validator is not None:
                validator.start()
            if metrics_server is not None:
                metrics_server.serve(controller.metrics_json, run_dir)
            controller.start()  # on Slurm, SIGTERM while waiting for the allocation withdraws it
            live_server = _live_server(run_dir, controller)
            if mirror is not None:
                mirror.start(controller.wait_for_commits)
            try:
                if local is not None:  # the function, in this thread
                    local.run(controller, events, fn, self.train_loop_config, self._takes_config)
                # Short waits let Python deliver signals and the callbacks run; the wait returns
                # at once when the run ends.
                while not controller.wait(0.2):
                    if events is not None and events.poll():
                        controller.abort(events.fatal_reason())
            except BaseException as e:  # Ctrl-C, SIGTERM, or a handler of the user's that raised
                controller.abort(_interruption(e))
                if validator is not None:
                    validator.stop()
                while not controller.wait(1.0):
                    pass
                raise
            finally:
                if mirror is not None:
                    mirror.close()  # what was committed reaches the storage, even after Ctrl-C
            outcome = controller.outcome()
        except _Terminated:
            if metrics_server is not None:
                metrics_server.close()  # before the controller it reads is gone
            if live_server is not None:
                live_server.close()
                live_server = None
            controller.close()
            sigterm.restore()
            sigterm.redeliver()  # ends the driver as SIGTERM would have, now that all is stopped
            raise
        finally:
            if metrics_server is not None:
                metrics_server.close()
            if live_server is not None:
                live_server.close()  # before the controller it asks is gone
            controller.close()  # releases a Slurm allocation jaxtrain requested, now
            sigterm.restore()
            if preload_file is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(preload_file)
            if in_memory == "1":
                checkpoint_memory.remove_store(run_dir)  # this host's copies; others: sweep()
        if validator is not None:
            validator.finish()
            _retain(run_dir, self.run_config.checkpoint_config)
        remote = (mirror.fs, mirror.root) if mirror is not None else None
        # run.json as the run left it: the outcome carries it, so it is not read back.
        state = json.loads(outcome["run_state"]) if outcome["run_state"] is not None else None
        result = _result(outcome, state, run_dir, self.run_config.checkpoint_config, remote)
        if result.goodput is not None:
            sys.stderr.write(_end_lines(result, state, resumed))
        if result.error is None and self.say_run_dir:
            where = mirror.url if mirror is not None else run_dir
            sys.stderr.write(f"jaxtrain: run '{self.run_config.name}' finished; its metrics, "
                             f"checkpoints and logs are in {where}\n")
        if events is not None:
            # Raises ControllerError if a raise_on_error callback failed.
            events.finish(result, state)
        if result.error is not None and local is not None and local.exception is not None:
            # Local mode: the function's own exception, for a debugger's post-mortem.
            raise result.error from local.exception
        if result.error is not None:
            raise result.error
        return result



def _say_resuming(run_dir: str, name: str) -> int | None:
    """Says in one line that this fit() resumes the run `name` already in `run_dir` (a used
    RunConfig.name: Ray's way to resume after a driver ended), how the run last ended and from
    which checkpoint its first attempt starts; the report rounds it had, or None for a new run.
    A run that another driver holds is refused later, when the controller opens it."""
    state = records.read_state_or_none(run_dir)
    if state is None or not records.attempts(state):
        return None
    status, holder = records.run_status(run_dir, state)
    if holder is not None:
        return None
    rounds = records.count_rounds(run_dir, state)
    latest = (records.read_index(run_dir) or {}).get("latest")
    start = f"from its latest checkpoint, {latest}" if latest else \
        "from the start: it has no committed checkpoint"
    sys.stderr.write(
        f"jaxtrain: run '{name}' exists ({status} after {rounds} report round(s) in "
        f"{len(records.attempts(state))} attempt(s)): this fit() resumes it {start}; choose "
        "another RunConfig.name to start a new run\n")
    return rounds


def _end_lines(result: Result, state: dict | None, resumed: int | None) -> str:
    """What fit() says at the end: the run's goodput; for a resumed run, this fit()'s own
    (its rounds, attempts and time) and then the whole run's."""
    assert result.goodput is not None
    if resumed is None or state is None:
        return f"jaxtrain: {result.goodput.line()}\n"
    rounds = result.report_rounds()
    own = goodput.compute(state, rounds, now=time.time(), this_driver=True)
    return (f"jaxtrain: this fit(): {len(rounds) - resumed} report round(s) in "
            f"{len(own.attempts)} attempt(s), {own.line()}\n"
            f"jaxtrain: the whole run, with the fit()s before it resumed: {len(rounds)} report "
            f"round(s), {result.goodput.line()}\n")


class _IdleStandbys:
    """Ends the standby workers that fit()s left for a next one (the local launcher's pool, kept
    in this process) once no fit() has run for JAXTRAIN_WARM_WORKERS_IDLE_S seconds: each holds
    ~160 MB, which a notebook would otherwise keep until its kernel exits (docs/warm-workers.md).
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0  # fit()s in progress in this process
        self._generation = 0  # counts fit() starts and ends: a timer acts only on its own

    def fit_started(self) -> None:
        with self._lock:
            self._running += 1
            self._generation += 1

    def fit_ended(self, idle_s: float) -> None:
        with self._lock:
            self._running -= 1
            self._generation += 1
            if self._running > 0:
                return  # the last fit() to end counts the idle time
            if idle_s == 0:
                _core.end_idle_standbys()
                return
            timer = threading.Timer(idle_s, self._end, args=(self._generation,))
        timer.daemon = True
        timer.start()

    def _end(self, generation: int) -> None:
        with self._lock:  # held: a fit() that starts now finds none rather than a dying set
            # An exiting driver ends them itself (their pipes close).
            if generation == self._generation and not sys.is_finalizing():
                _core.end_idle_standbys()


_idle_standbys = _IdleStandbys()


def _validator(config: validation.ValidationConfig | None, run_dir: str,
               placement: validator.Placement) -> validator.Validator | None:
    """The driver's Validator of a run with a validation_config; a function that cannot be
    pickled, or a host that cannot see the run directory, is refused before anything starts."""
    return None if config is None else validator.Validator(config, run_dir, placement)


def _retain(run_dir: str, checkpoint_config) -> None:
    """CheckpointConfig's retention once more after the last validations, which may have changed
    the scores since the last commit applied it."""
    if checkpoint_config.num_to_keep is None:
        return
    for warning in _core.apply_retention(
            run_dir, checkpoint_config.num_to_keep, checkpoint_config.checkpoint_score_attribute,
            checkpoint_config.checkpoint_score_order == "max"):
        sys.stderr.write(f"jaxtrain: {warning}\n")


class _Terminated(BaseException):
    """Raised in the driver's main thread on SIGTERM, to stop the run as Ctrl-C does."""


class _SigtermAsException:
    """While a run is in progress, SIGTERM raises _Terminated in the main thread, so the run is
    stopped cleanly (workers terminated, run.json final, a requested Slurm allocation released)
    instead of the driver dying with its workers orphaned until they notice. Installed only where
    SIGTERM has its default action: a handler of the user's is left alone."""

    def __init__(self) -> None:
        self._installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, self._raise)
        self._installed = True

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise _Terminated()

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed = False

    @staticmethod
    def redeliver() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)


def _interruption(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "the driver was interrupted (KeyboardInterrupt)"
    if isinstance(e, _Terminated):
        return "the driver got SIGTERM"
    return f"the driver stopped waiting for the run: {type(e).__name__}: {e}"


def _refuse_live_run(run_dir: str) -> None:
    holder = _core.run_lock_holder(run_dir)
    if holder is not None:
        raise RuntimeError(
            f"the run directory '{run_dir}' is in use by another driver ({holder}): a run has "
            "one driver at a time. Wait for that run to end or stop it, or choose another "
            "RunConfig.name"
        )


def _pickle_task(fn: Callable, config: dict | None, takes_config: bool,
                 store: dict | None = None, validation: bool = False) -> bytes:
    """The payload every worker runs; with `store`, the filesystem and run directory on object
    storage that the workers upload their checkpoints to; `validation`: the trainer has a
    validation_config. Raises ValueError naming the training function and, where it can be
    found, the captured variable that cannot be pickled."""
    task = {"fn": fn, "config": config, "takes_config": takes_config, "validation": validation}
    if store is not None:
        task["store"] = store
    try:
        return user_code.dumps(task)
    except Exception as e:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
        raise ValueError(_why_unpicklable(fn, config, e)) from e


def _store_direct(run_config: RunConfig, mirror: storage.Mirror | None,
                  spans_hosts: bool, options: EngineOptions) -> dict | None:
    """Whether the workers of a run on object storage upload their checkpoints to it themselves
    (checkpoint_store.py), as {"url" or "fs", "root"} for the payload, or None: the URL, which
    each host opens itself, unless the user passed a filesystem object, which is pickled.
    Decided by what is shared: yes when the workers are on other hosts, unless
    JAXTRAIN_STAGING_DIR names a staging directory (which must then be shared with them); no
    when they are all on this host. JAXTRAIN_STORE_DIRECT=1 or 0 overrides."""
    if mirror is None:
        return None
    value = options.store_direct
    direct = value == "1" if value else spans_hosts and not options.staging_dir
    if not direct:
        return None
    if run_config.storage_filesystem is None:
        # The hosts open the URL with their own credentials: none travel in the payload.
        return {"url": run_config.storage_path, "root": mirror.root}
    return {"fs": mirror.fs, "root": mirror.root}


def _unpicklable(value: Any) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:
        return True
    return False


def _captured(fn: Any) -> list[tuple[str, Any]]:
    """What pickling `fn` by value pickles with it: its closure, defaults, the globals it names
    and, for a bound method, its object."""
    if inspect.ismethod(fn):
        return [("self", fn.__self__), *_captured(fn.__func__)]
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out = list(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()),
                   strict=False))
    out += [(f"default of {fn.__name__}", d) for d in fn.__defaults__ or ()]
    out += [(f"default {k!r} of {fn.__name__}", d) for k, d in (fn.__kwdefaults__ or {}).items()]
    fn_globals = getattr(fn, "__globals__", {})
    out += [(name, fn_globals[name]) for name in code.co_names if name in fn_globals]
    return out


def _culprit(fn: Any, depth: int = 0) -> str | None:
    """'lock (a _thread.lock)' or 'helper -> lock (...)': the first captured value of `fn`
    that cannot be pickled, followed into captured functions."""
    for name, value in _captured(fn):
        if not _unpicklable(value):
            continue
        if depth < 3 and (inspect.isfunction(value) or inspect.ismethod(value)):
            inner = _culprit(value, depth + 1)
            if inner:
                return f"{name} -> {inner}"
        kind = type(value)
        return f"{name!r} (a {kind.__module__}.{kind.__qualname__})"
    return None


def _why_unpicklable(fn: Callable, config: dict | None, error: Exception) -> str:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    reason = f"{type(error).__name__}: {error}"
    if config is not None and _unpicklable(config):
        bad = [k for k, v in config.items() if _unpicklable(v)]
        where = f" (key {bad[0]!r})" if bad else ""
        return (f"train_loop_config cannot be sent to the workers{where}: it cannot be pickled "
                f"({reason}); pass values that pickle, such as numbers, strings and arrays")
    culprit = _culprit(fn)
    what = f"it captures {culprit}, which" if culprit else "it"
    return (f"train_loop_per_worker={name!r} cannot be sent to the workers: {what} cannot be "
            f"pickled ({reason}). Create such objects inside the training function, or pass "
            "picklable values through train_loop_config")


@contextlib.contextmanager
def _select_nodes_by_labels(scaling_config: ScalingConfig,
                            launcher: launch.Launcher) -> Iterator[None]:
    """Applies ScalingConfig.label_selector for the launcher that will start the workers, for
    the length of a fit() (launch.Launcher.select_nodes): on Kubernetes the pod template gets
    it; on Slurm it becomes the allocation's and steps' --constraint; on ssh hosts of a
    hostfile, only the hosts whose labels match are used. Refused with a ValueError naming the
    field where no launcher can select: the local launcher, hosts listed without labels. An
    empty selector is no selector."""
    if not scaling_config.node_labels():
        yield
        return
    with launcher.select_nodes(scaling_config) as overrides:
        saved = {k: os.environ.get(k) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def local_run_dir(run_config: RunConfig) -> str:
    """The run directory of `run_config` on the local filesystem (a path or ``file://`` URL)."""
    path = run_config.storage_path.removeprefix("file://")
    return os.path.abspath(os.path.join(path, run_config.name))


def make_storage_path(run_config: RunConfig) -> None:
    """Creates the local storage path of `run_config` if it does not exist (as the run directory
    is, 0755 before the umask), and checks that a new run directory can be made in it; nothing
    for remote storage. Raises ValueError naming RunConfig.storage_path and the OS's reason, so
    that it is said before anything starts."""
    if storage.remote_filesystem(run_config.storage_path, run_config.storage_filesystem):
        return
    path = os.path.dirname(local_run_dir(run_config))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"RunConfig.storage_path={run_config.storage_path!r} cannot be used: "
                         f"'{path}' is a file, not a directory; give a directory that this user "
                         "can create and write to")
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
        if not os.path.isdir(local_run_dir(run_config)) and \
                not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    except OSError as e:
        raise ValueError(
            f"RunConfig.storage_path={run_config.storage_path!r} cannot be used: "
            f"{e.strerror or e} ('{e.filename or path}'); give a directory that this user can "
            "create and write to") from None


def _mirror(run_config: RunConfig) -> storage.Mirror | None:
    """For remote storage, the Mirror of the run (its staging copy is rebuilt by ``pull()``)."""
    remote = storage.remote_filesystem(run_config.storage_path, run_config.storage_filesystem)
    if remote is None:
        return None
    fs, base = remote
    root = posixpath.join(base, run_config.name)
    return storage.Mirror(fs, root, storage.staging_dir(fs, root))


def _check_shared(run_dir: str, mirror: storage.Mirror | None) -> None:
    try:
        _core.check_shared_storage(os.path.dirname(run_dir))
    except ValueError as e:
        if mirror is None:
            raise
        raise ValueError(
            f"RunConfig.storage_path: this run on {mirror.url} stages its checkpoints in the "
            f"staging copy '{os.path.dirname(run_dir)}' (JAXTRAIN_STAGING_DIR, or "
            "JAXTRAIN_STORE_DIRECT=0), which every host must see, and it is not shared: set "
            "JAXTRAIN_STAGING_DIR to a directory shared with every host, or unset both so that "
            f"each host uploads its checkpoints to the store itself ({str(e).split(': ', 1)[-1]})"
        ) from None


def _working_dir(run_config: RunConfig) -> str | None:
    return (run_config.worker_runtime_env or {}).get("working_dir")


def _ship_working_dir(run_config: RunConfig, spans_hosts: bool,
                      options: EngineOptions) -> runtime_env.Packed | None:
    """The working_dir, packed, for workers on other hosts (docs/hosts.md); None where every
    worker is on this host and works in the directory itself."""
    working_dir = _working_dir(run_config)
    if working_dir is None or not spans_hosts:
        return None
    return runtime_env.pack(working_dir, run_config.worker_runtime_env.get("excludes", ()),
                            cap=options.working_dir_max_bytes,
                            gitignore=options.working_dir_gitignore)



# Names the file _write_preload writes (worker.PRELOAD_FILE_ENV; jaxtrain.worker is not imported
# here, since `python -m jaxtrain.worker` would then find it imported already).
PRELOAD_FILE_ENV = "JAXTRAIN_PRELOAD_FILE"
_preload_dir: str | None = None


def _write_preload(payload: bytes) -> str:
    """Writes `payload` (the pickled task) where this driver's standby workers read it ahead of
    their activation: one private file per driver process, in a 0700 directory of its own (so
    that every fit() names the same path and a pooled standby keeps its key), replaced by each
    fit(), removed when the fit() ends and the directory when the driver exits."""
    global _preload_dir
    if _preload_dir is None:
        _preload_dir = tempfile.mkdtemp(prefix="jaxtrain-preload-")
        atexit.register(shutil.rmtree, _preload_dir, True)
    path = os.path.join(_preload_dir, "task.pkl")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)
    return path


def _worker_env(run_config: RunConfig, plan: Any) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    runtime_env = run_config.worker_runtime_env or {}
    # The user's variables, but not over what placement set for the hardware (e.g. the
    # JAX_PLATFORMS of a simulated TPU slice): placement knows what this run can see.
    placed = {k for w in plan.to_dict()["workers"] for k in w["env"]}
    env.update({k: v for k, v in runtime_env.get("env_vars", {}).items() if k not in placed})
    # Workers import what the driver can import (the driver's script directory included), and
    # first what the runtime env's working_dir holds, as in Ray.
    entries = [p or os.getcwd() for p in sys.path]
    if "working_dir" in runtime_env:
        entries.insert(0, runtime_env["working_dir"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
    # A proxy must never see the loopback traffic of the control channel or of jax.distributed.
    if any(os.environ.get(p) for p in _PROXY_VARIABLES):
        for name in ("no_proxy", "NO_PROXY"):
            current = os.environ.get(name, "")
            env[name] = f"{current},{_PROXY_EXEMPT}" if current else _PROXY_EXEMPT
    return env


def _console_fd() -> int:
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return -1  # e.g. a notebook: worker output is in the run's logs/


def _describe(config: dict | None) -> Any:
    if config is None:
        return None
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError):
        return repr(config)


def _live_server(run_dir: str, controller):
    """The driver's end of ``jaxtrain stack`` (jaxtrain.driver.live); none when its address is
    taken, which only costs the command."""
    from jaxtrain.driver import live

    try:
        return live.LiveServer(run_dir, controller)
    except OSError as e:
        sys.stderr.write(f"jaxtrain: warning: 'jaxtrain stack' cannot reach this run: {e}\n")
        return None


def _result(outcome: dict, state: dict | None, run_dir: str, checkpoint_config,
            remote: tuple[Any, str] | None) -> Result:
    """The Result of the run that ended with `outcome`, whose run.json is `state`: the failure,
    run.json and the return value as the outcome carries them; the rounds and checkpoints read
    from `run_dir`."""
    error: BaseException | None = None
    if outcome["state"] == "ERRORED":
        error = TrainingFailedError.from_failure(outcome["failure"], outcome["failures"])
    elif outcome["state"] == "ABORTED":
        error = TrainingFailedError(f"The run was stopped: {outcome['abort_reason']}")
    return load(run_dir, state, checkpoint_config._as_dict(), error, outcome["return_value"],
                remote, finished=outcome["state"] == "FINISHED")
