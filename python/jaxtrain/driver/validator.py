"""Where and how the driver runs the validation of committed checkpoints (jaxtrain.validation has
the types, the run directory's records and the rules): ``place()`` a run's validations on the
driver's host or on a host of the run that ``ValidationConfig(host=...)`` or
``ray_remote_kwargs={"label_selector": ...}`` names, reached over ssh as the ssh launcher reaches
it (``Placement``); the ``Validator``, which runs them one checkpoint at a time while training
goes on, each in a process of its own (``main``). The process reads its task on stdin (a JSON
line, then the pickled function) and ends when its stdin ends; it writes its outcome as one line
on stdout after ``RESULT_MARK``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from jaxtrain.checkpoint import Checkpoint
from jaxtrain.validation import (
    POLL_S,
    RECORD_NAME,
    ValidationConfig,
    ValidationTaskConfig,
    read_record,
    request_path,
    write_json,
)

_NEEDS = {"num_cpus": ("cpus", "CPUs"), "num_gpus": ("gpus", "GPUs"), "memory": ("memory",
                                                                                "bytes of memory")}


@dataclass(frozen=True)
class Placement:
    """Where a run's validations run: ``target`` None for the driver's host, else the ssh target
    of one of the run's hosts; ``needs``: ray_remote_kwargs' num_cpus, num_gpus and memory."""

    target: str | None = None
    needs: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.target or "the driver's host"


def place(config: ValidationConfig | None, launcher: str) -> Placement:
    """The placement of `config`'s validations in a run whose workers `launcher` starts. A
    ValueError naming the field when the host it names is not one of the run's, when `launcher`
    has no hosts to name, or when the host lacks what the validation needs (where that is known
    here: the driver's host, and hosts whose JAXTRAIN_HOSTS entry says)."""
    if config is None:
        return Placement()
    kwargs = config.ray_remote_kwargs or {}
    needs = {k: kwargs[k] for k in _NEEDS if k in kwargs}
    selector = kwargs.get("label_selector")
    if config.host is None and not selector:
        check_needs(needs, this_host(), "the driver's host")
        return Placement(None, needs)
    from jaxtrain.hosts import join as hosts
    from jaxtrain.labels import requirement

    field_ = (f"ValidationConfig.host={config.host!r}" if config.host is not None else
              f"ValidationConfig.ray_remote_kwargs['label_selector']={selector!r}")
    if launcher != "ssh":
        raise ValueError(
            f"{field_}: this run starts its workers with the {launcher} launcher, which has no "
            "hosts to name; a validation runs on a named host in runs on ssh hosts or TPU VMs "
            "(JAXTRAIN_HOSTFILE, JAXTRAIN_SSH_HOSTS, JAXTRAIN_HOSTS; jaxtrain run --coordinator). "
            "Leave it out to validate on the driver's host")
    listed, source = hosts.run_hosts()
    if config.host is not None:
        found = [h for h in listed if config.host in (h.target, h.target.rpartition("@")[2])]
        if not found:
            raise ValueError(f"{field_} is not one of the run's hosts ({source}: "
                             f"{', '.join(h.target for h in listed)}); name one of them")
    else:
        node_labels = {k: requirement(v) for k, v in selector.items()}
        found = [h for h in listed if hosts.matches(h.labels, node_labels)]
        if not found:
            described = "; ".join(f"{h.target}: {h.labels or 'no labels'}" for h in listed)
            raise ValueError(f"{field_} matches no host of {source} ({described}); give the "
                             "hosts labels=key=value words in a hostfile (docs/hosts.md), or "
                             "change the selector")
    host = found[0]
    check_needs(needs, host.has, host.target)
    return Placement(host.target, needs)


def this_host() -> dict[str, int]:
    """What this host gives a process of it: the CPUs it may run on, its GPUs (as placement
    sees them), its memory in bytes."""
    from jaxtrain import _core

    return {"cpus": len(os.sched_getaffinity(0)), "gpus": int(_core.describe_this_host()["gpus"]),
            "memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}


def check_needs(needs: dict[str, float], has: dict[str, int], name: str) -> None:
    """ValueError naming the key when `needs` asks for more than `has` holds (keys `has` does not
    know pass)."""
    for key, value in needs.items():
        have, what = _NEEDS[key]
        if have in has and value > has[have]:
            raise ValueError(
                f"ValidationConfig.ray_remote_kwargs[{key!r}]={value!r} is more than "
                f"{name} has ({has[have]} {what}); ask for at most {has[have]}, or run the "
                "validation on a host that has them (ValidationConfig(host=...))")


def _visible_gpus(count: int) -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES names them: its own list when set."""
    own = os.environ.get("CUDA_VISIBLE_DEVICES")
    if own is not None:
        return [g.strip() for g in own.split(",") if g.strip()][:count]
    return [str(g) for g in range(count)]


# --- the driver's side -------------------------------------------------------------------------


class Validator:
    """Runs the validations a run's checkpoints ask for, where `placement` says, while fit() waits.

    One thread looks for committed checkpoints with a request and no outcome (those of an earlier
    driver of the run too), and runs the validation function on each in a process of its own, one
    at a time, oldest first; it records each outcome in validation.json. A validation that raises,
    crashes or passes ``timeout_s`` is said on stderr and recorded as failed; the run goes on."""

    def __init__(self, config: ValidationConfig, run_dir: str,
                 placement: Placement | None = None) -> None:
        from jaxtrain import user_code

        try:
            self._fn = user_code.dumps(config.fn)
        except Exception as e:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
            raise ValueError(f"ValidationConfig.fn={config.fn!r} cannot be sent to the "
                             f"validation process: it cannot be pickled ({type(e).__name__}: "
                             f"{e})") from e
        self._config = config
        self._run_dir = os.path.abspath(run_dir)
        self._placement = placement or Placement()
        if self._placement.target is not None:
            from jaxtrain import _core

            try:
                _core.check_shared_storage(self._run_dir)
            except ValueError as e:
                raise ValueError(
                    f"ValidationConfig: the validation on {self._placement.target} reads the "
                    f"checkpoints in the run directory, which that host cannot see: {e}") from None
        self._outcomes = read_record(run_dir)
        self._stop = threading.Event()
        self._ending = threading.Event()
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="jaxtrain-validator",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        """Returns once every committed checkpoint's requested validation has ended; says in the
        log how many it waits for."""
        waiting = len(self._todo())
        if waiting:
            sys.stderr.write(f"jaxtrain: training has ended; waiting for {waiting} pending "
                             f"validation{'s' if waiting > 1 else ''} of checkpoints\n")
            sys.stderr.flush()
        self._ending.set()
        self._thread.join()

    def stop(self) -> None:
        """Ends the validation running (the driver was interrupted) and the thread."""
        self._stop.set()
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                self._process.kill()
        self._thread.join()

    def _todo(self) -> list[tuple[str, int]]:
        """(dir_name, round) of the committed checkpoints whose requested validation has not
        ended, oldest first."""
        try:
            index_path = os.path.join(self._run_dir, "checkpoints.json")
            with open(index_path, encoding="utf-8") as f:
                records = json.load(f).get("checkpoints", [])
        except (FileNotFoundError, json.JSONDecodeError):
            return []
        todo = []
        for r in records:
            name, round_ = r.get("dir_name"), r.get("round")
            outcome = self._outcomes.get(name)
            if isinstance(outcome, dict) and outcome.get("round") == round_:
                continue
            if os.path.exists(request_path(self._run_dir, round_)):
                todo.append((name, round_))
        return todo

    def _loop(self) -> None:
        while not self._stop.is_set():
            ending = self._ending.is_set()  # read before the scan: nothing commits after it
            todo = self._todo()
            if not todo:
                if ending:
                    return
                time.sleep(POLL_S)
                continue
            name, round_ = todo[0]
            self._validate(name, round_)

    def _validate(self, name: str, round_: int) -> None:
        with open(request_path(self._run_dir, round_), encoding="utf-8") as f:
            request = json.load(f)
        kwargs = dict((self._config.task_config or ValidationTaskConfig()).fn_kwargs or {})
        kwargs.update(request.get("fn_kwargs") or {})
        began = time.monotonic()
        metrics, error = self._run(os.path.join(self._run_dir, name), kwargs)
        if self._stop.is_set():
            return  # interrupted: the next driver of the run validates it again
        outcome: dict[str, Any] = {"round": round_}
        if error is None:
            outcome.update(status="validated", metrics=metrics)
            sys.stderr.write(f"jaxtrain: validated {name} in {time.monotonic() - began:.1f} s: "
                             f"{json.dumps(metrics)}\n")
        else:
            outcome.update(status="failed", error=error)
            sys.stderr.write(f"jaxtrain: the validation of {name} failed (the run goes on; "
                             f"recorded in {RECORD_NAME}): {error.splitlines()[-1]}\n")
        sys.stderr.flush()
        self._outcomes[name] = outcome
        write_json(os.path.join(self._run_dir, RECORD_NAME),
                    {"version": 1, "checkpoints": self._outcomes})

    def _run(self, path: str, kwargs: dict) -> tuple[dict | None, str | None]:
        """Runs the function on the checkpoint at `path` in a process of its own, on the
        placement's host: its metrics, or None and why it failed."""
        target = self._placement.target
        header: dict[str, Any] = {"path": path, "kwargs": kwargs, "needs": self._placement.needs,
                                  "host": self._placement.name, "cwd": os.getcwd(),
                                  "fn_size": len(self._fn), "env": {}}
        python_path = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
        fds: tuple[int, ...] = ()
        if target is None:
            argv = [sys.executable, "-c", _PROGRAM]
        else:
            from jaxtrain import _core
            from jaxtrain.hosts import join as hosts

            named = [n.strip() for n in os.environ.get("JAXTRAIN_SSH_ENV", "").split(",")]
            header["env"] = {k: v for k, v in os.environ.items()
                             if k.startswith(_core.SSH_FORWARDED_ENV_PREFIXES) or k in named}
            argv, fds = hosts.ssh_argv(target, (
                f"exec env PYTHONPATH={shlex.quote(python_path)} {shlex.quote(sys.executable)} "
                f"-c {shlex.quote(_PROGRAM)}"))
        env = dict(os.environ, PYTHONPATH=python_path)
        with self._lock:
            if self._stop.is_set():
                return None, "interrupted"
            self._process = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             pass_fds=fds)
        process = self._process
        outcome: dict[str, Any] = {}
        tail: list[str] = []
        readers = [threading.Thread(target=_read_output, args=(process.stdout, outcome, None),
                                    daemon=True),
                   threading.Thread(target=_read_output, args=(process.stderr, None, tail),
                                    daemon=True)]
        for reader in readers:
            reader.start()
        try:
            # Its stdin stays open while it runs: when it ends (the driver died), so does it.
            process.stdin.write(json.dumps(header).encode() + b"\n" + self._fn)
            process.stdin.flush()
        except OSError:
            pass  # it ended at once (a host that cannot be reached): said below
        try:
            code = process.wait(timeout=self._config.timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            code = None
            process.wait()
        try:
            process.stdin.close()
        except OSError:
            pass
        for reader in readers:
            reader.join(5)  # what it started may hold its output open
        if code is None:
            return None, (f"TimeoutError: it ran longer than ValidationConfig.timeout_s="
                          f"{self._config.timeout_s} s on {self._placement.name} and was "
                          "stopped")
        if "metrics" in outcome or "error" in outcome:
            return outcome.get("metrics"), outcome.get("error")
        said = f": {' / '.join(tail)}" if tail else ""
        if target is not None and code == 255:
            return None, (f"ConnectionError: the validation host {target} cannot be reached "
                          f"over ssh (exit status 255){said}")
        how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
        return None, (f"its process on {self._placement.name} {how} before it returned "
                      f"metrics{said}")


# The validation process's program: this module's main (as `-m`, the module would run twice: as
# __main__ and as imported).
_PROGRAM = "from jaxtrain.driver.validator import main; main()"
# The line of the validation process's stdout that carries its outcome (JSON after it).
RESULT_MARK = "jaxtrain-validation-result: "


def _read_output(stream, outcome: dict | None, tail: list[str] | None) -> None:
    """A validation process's output, line by line, to the driver's stderr; the outcome line (on
    stdout) into `outcome`; the last lines into `tail` (what ssh says of a host it cannot
    reach)."""
    for raw in stream:
        line = raw.decode(errors="replace")
        if outcome is not None and line.startswith(RESULT_MARK):
            try:
                outcome.update(json.loads(line[len(RESULT_MARK):]))
            except json.JSONDecodeError:
                pass
            continue
        if outcome is not None and not line.strip():
            continue  # the blank line the process writes before its outcome
        sys.stderr.write(line)
        sys.stderr.flush()
        if tail is not None and line.strip():
            tail[:] = (tail + [line.strip()])[-3:]
    stream.close()




def _read_exactly(fd: int, size: int, until_newline: bool = False) -> bytes:
    data = bytearray()
    while until_newline or len(data) < size:
        chunk = os.read(fd, 1 if until_newline else size - len(data))
        if not chunk:
            raise EOFError("the driver closed the validation's input before its task was read")
        if until_newline and chunk == b"\n":
            break
        data += chunk
    return bytes(data)


def _end_with_stdin() -> None:
    """Ends this process when its stdin ends: the driver stopped it, died, or lost the host."""
    while os.read(0, 4096):
        pass
    sys.stderr.write("jaxtrain: the driver ended this validation (its input closed)\n")
    sys.stderr.flush()
    os._exit(1)


def main() -> None:
    """The validation process: reads its task on stdin (a JSON line, then the pickled function),
    runs the function on one checkpoint on this host, and writes {"metrics"} or {"error":
    traceback} on stdout after RESULT_MARK. What the function prints goes to stderr."""
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the function's prints: to stderr, which reaches the driver's log
    outcome: dict[str, Any]
    try:
        header = json.loads(_read_exactly(0, 0, until_newline=True))
        fn_bytes = _read_exactly(0, header["fn_size"])
        threading.Thread(target=_end_with_stdin, daemon=True).start()
        import cloudpickle

        from jaxtrain.session import to_json

        os.environ.update(header["env"])
        needs = header["needs"]
        here = this_host()
        check_needs(needs, here, header["host"])
        if "num_gpus" in needs:  # the host's last GPUs: workers take theirs from the first up
            gpus = _visible_gpus(here["gpus"])
            wanted = int(needs["num_gpus"])
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[len(gpus) - wanted:] if wanted
                                                          else [])
        try:
            os.chdir(header["cwd"])
        except OSError as e:
            raise OSError(f"cannot enter the driver's working directory on {header['host']}: "
                          f"{e}") from None
        fn = cloudpickle.loads(fn_bytes)
        metrics = fn(Checkpoint(header["path"]), **header["kwargs"])
        if not isinstance(metrics, dict):
            raise TypeError(f"the validation function returned {type(metrics).__name__}, not a "
                            "dict of metrics")
        outcome = {"metrics": json.loads(json.dumps(metrics, default=to_json))}
    except BaseException as e:
        from jaxtrain.user_code import user_traceback

        outcome = {"error": user_traceback(e)}
        sys.stderr.write(outcome["error"])
    sys.stdout.flush()
    sys.stderr.flush()
    result.write(f"\n{RESULT_MARK}{json.dumps(outcome)}\n")
    result.flush()
