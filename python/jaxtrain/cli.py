"""The ``jaxtrain`` command: run an unmodified JAX script SPMD, and inspect runs.

    jaxtrain run -n 4 train.py --lr 3e-4     # like torchrun, on the same engine as JaxTrainer
    jaxtrain ls | show RUN | logs RUN -f | metrics RUN --csv

``run`` is a second front door to ``JaxTrainer``: its training function is ``_run_script``, which
runs the script as ``__main__`` in every worker (jax.distributed already initialised). The other
commands only read run directories (docs/architecture.md); they never import jax or start workers.

Exit codes (docs/cli.md): 0 success; 1 the run failed or could not start; N a rank's script exited
with status N; 2 bad usage (an option, a value, an unknown run or script); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import runpy
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxtrain.result import _flatten

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# How often `logs -f` looks for new output and for the end of the run.
_FOLLOW_POLL_S = 0.25


class _UsageError(Exception):
    """The command line asks for something that cannot be: exit status 2, message on stderr."""


# --- the training function of `jaxtrain run` (runs in the workers) ------------------------------


def _run_script(config: dict) -> None:
    """Runs ``config["script"]`` (a path) or ``config["module"]`` as ``__main__`` with
    ``sys.argv = [script, *config["args"]]``, in a worker where jax.distributed is initialised.

    A script's ``sys.exit(0)`` is a success; ``sys.exit(n)`` ends the worker with status n, which
    ``jaxtrain run`` returns.
    """
    _make_initialize_idempotent()
    args = list(config.get("args") or [])
    try:
        if config.get("module"):
            # As `python -m`: the working directory first on the path; run_module sets argv[0].
            sys.path.insert(0, os.getcwd())
            sys.argv = [config["module"], *args]
            runpy.run_module(config["module"], run_name="__main__", alter_sys=True)
        else:
            # As `python script.py`: the script's directory first on the path.
            script = config["script"]
            sys.path.insert(0, os.path.dirname(script))
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = _python_exit_status(e.code)
        if status:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def _python_exit_status(code: Any) -> int:
    """The status `python script.py` exits with after ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code % 256
    sys.stderr.write(f"{code}\n")
    return 1


def _make_initialize_idempotent() -> None:
    """Scripts written for plain JAX call ``jax.distributed.initialize()`` themselves; in a
    ``jaxtrain run`` worker it is already initialised, so a second call does nothing."""
    import jax
    import jax.distributed

    original = jax.distributed.initialize
    if getattr(original, "_jaxtrain_idempotent", False):
        return

    def initialize(*args: Any, **kwargs: Any) -> None:
        if _distributed_initialized():
            return None
        return original(*args, **kwargs)

    initialize.__doc__ = original.__doc__
    initialize._jaxtrain_idempotent = True  # type: ignore[attr-defined]
    jax.distributed.initialize = initialize


def _distributed_initialized() -> bool:
    import jax.distributed

    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None:
        return bool(is_initialized())
    from jax._src import distributed  # jax < 0.6 has no public is_initialized()

    return distributed.global_state.client is not None


# --- jaxtrain run ---------------------------------------------------------------------------------


def _parse_resources(text: str) -> dict[str, float]:
    """``TPU=4,CPU=1`` or a JSON object; amounts are checked by ScalingConfig."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise _UsageError(f"--resources-per-worker={text!r} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise _UsageError(f"--resources-per-worker={text!r} must be a JSON object")
        return value
    resources: dict[str, float] = {}
    for item in text.split(","):
        key, sep, amount = item.partition("=")
        key = key.strip()
        try:
            number = float(amount)
        except ValueError:
            number = None
        if not sep or not key or number is None:
            raise _UsageError(
                f"--resources-per-worker={text!r}: {item.strip()!r} is not NAME=AMOUNT; write "
                "e.g. TPU=4,CPU=1 or {\"TPU\": 4}"
            )
        resources[key] = int(number) if number.is_integer() else number
    return resources


def _cmd_run(args: argparse.Namespace) -> int:
    from jaxtrain.config import CheckpointConfig, FailureConfig, RunConfig
    from jaxtrain.trainer import JaxTrainer

    if args.target is None:
        raise _UsageError("give the script to run: jaxtrain run [options] script.py [args ...] "
                          "(or -m module)")
    if args.module:
        task: dict[str, Any] = {"module": args.target, "args": args.args}
        _check_module(args.target)
    else:
        script = os.path.abspath(args.target)
        if not os.path.isfile(script):
            raise _UsageError(f"cannot find the script '{args.target}' (looked for {script})")
        task = {"script": script, "args": args.args}
    try:
        trainer = JaxTrainer(
            _run_script,
            train_loop_config=task,
            scaling_config=_scaling_config(args),
            run_config=RunConfig(
                name=args.name,
                storage_path=args.storage_path,
                failure_config=FailureConfig(max_failures=args.max_failures),
                checkpoint_config=CheckpointConfig(
                    num_to_keep=args.num_to_keep,
                    checkpoint_score_attribute=args.checkpoint_score_attribute,
                    checkpoint_score_order=args.checkpoint_score_order,
                ),
            ),
        )
        run_dir = _shown_run_dir(trainer.run_config)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    trainer._status_line = not args.no_status_line
    if args.hosts:
        os.environ["JAXTRAIN_SSH_HOSTS"] = args.hosts
    if args.hostfile:
        os.environ["JAXTRAIN_HOSTFILE"] = os.path.abspath(args.hostfile)
    if args.coordinator is None:
        return _fit(trainer, args, run_dir)
    from jaxtrain.hosts import SameCommand

    try:
        same = SameCommand.from_args(args.coordinator, args.host_rank, args.num_hosts,
                                     args.join_secret_file)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if same.host_rank != 0:
        return same.join()
    status = EXIT_FAILED
    try:
        same.gather()
        status = _fit(trainer, args, run_dir)
    except (TimeoutError, OSError) as e:
        _say(f"run '{trainer.run_config.name}' could not start: {e}")
    finally:
        same.end(status, run_dir)
    return status


def _fit(trainer: Any, args: argparse.Namespace, run_dir: str) -> int:
    from jaxtrain.errors import TrainingFailedError

    name = trainer.run_config.name
    _say(f"run '{name}' on {args.num_workers} worker(s); run directory {run_dir}")
    try:
        result = trainer.fit()
    except KeyboardInterrupt:
        _say(f"run '{name}' interrupted; every worker was stopped ({run_dir})")
        return EXIT_INTERRUPTED
    except TrainingFailedError as e:
        sys.stderr.write(f"{e}\n")
        _say(f"run '{name}' failed; see: jaxtrain show {run_dir}")
        return _failed_run_status(e)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    except (RuntimeError, OSError) as e:
        _say(f"run '{name}' could not start: {e}")
        return EXIT_FAILED
    rounds = len(result._read_rounds())
    _say(f"run '{name}' finished ({rounds} report round(s)); results in {result.path}")
    return EXIT_OK


def _shown_run_dir(run_config: Any) -> str:
    """The run directory as users name it: a path, or a URL on remote storage."""
    from jaxtrain.trainer import _run_dir

    path = run_config.storage_path
    if "://" in path and not path.startswith("file://"):
        return f"{path.rstrip('/')}/{run_config.name}"
    return _run_dir(run_config)


def _scaling_config(args: argparse.Namespace) -> Any:
    """The ScalingConfig of the scaling options; its own validation reports bad values."""
    from jaxtrain.config import ScalingConfig

    resources = (
        _parse_resources(args.resources_per_worker) if args.resources_per_worker else None
    )
    return ScalingConfig(
        num_workers=args.num_workers,
        use_tpu=args.use_tpu,
        use_gpu=args.use_gpu,
        topology=args.topology,
        accelerator_type=args.accelerator_type,
        resources_per_worker=resources,
        placement_strategy=args.placement_strategy,
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from jaxtrain import _core

    if args.kubernetes:
        return _plan_kubernetes(args)
    try:
        config = _scaling_config(args)._core
        ssh = _core.choose_launcher() == "ssh"  # listed hosts (docs/hosts.md)
        plan = (_core.plan_ssh(config) if ssh else _core.plan_local(config)).to_dict()
    except ValueError as e:
        raise _UsageError(str(e)) from None
    except (RuntimeError, OSError) as e:
        _say(f"no plan: {e}")
        return EXIT_FAILED
    if args.json:
        print(json.dumps(plan, indent=2))
        return EXIT_OK
    simulated = " (simulated on local CPU processes)" if plan["simulated"] else ""
    print(f"platform {plan['platform']}{simulated}; hosts from {plan['hosts_source']}; "
          f"{plan['num_slices']} slice(s)")
    rows = [[str(w["rank"]), w["host"], w["slice"] or "-", ",".join(w["devices"]) or "-",
             str(w["local_rank"]), str(w["node_rank"])] for w in plan["workers"]]
    print(_table(["RANK", "HOST", "SLICE", "DEVICES", "LOCAL", "NODE"], rows))
    for w in plan["workers"]:
        env = " ".join(f"{k}={v}" for k, v in sorted(w["env"].items()))
        unset = "".join(f" -{k}" for k in w["unset_env"])
        print(f"rank {w['rank']} env: {env}{unset}")
    return EXIT_OK


def _plan_kubernetes(args: argparse.Namespace) -> int:
    """The JobSet of attempt 1, as the Kubernetes launcher would create it; no cluster asked."""
    from jaxtrain import _core, kubernetes

    try:
        scaling = _scaling_config(args)._core
        plan = _core.plan_kubernetes(scaling)
        options = {
            "namespace": os.environ.get("JAXTRAIN_K8S_NAMESPACE", "default"),
            "name": "jaxtrain-run-xxxxx",
            "image": os.environ.get("JAXTRAIN_K8S_IMAGE", "IMAGE"),
            "image_pull_policy": os.environ.get("JAXTRAIN_K8S_IMAGE_PULL_POLICY", ""),
            "service_account": os.environ.get("JAXTRAIN_K8S_SERVICE_ACCOUNT", ""),
            "request_dir": "/unused",
            "worker_command": [os.environ.get("JAXTRAIN_K8S_PYTHON", "python"), "-m",
                               "jaxtrain.worker"],
            "supervisor_argv": ["unused"],
            "pod_template": kubernetes.load_pod_template(
                os.environ.get("JAXTRAIN_K8S_POD_TEMPLATE")),
        }
        env = dict(plan.to_dict()["workers"][0]["env"])
        env["JAXTRAIN_WORLD_SIZE"] = str(args.num_workers)
        jobset = _core.kubernetes_jobset(scaling, json.dumps(options), options["name"] + "-1", env)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    print(json.dumps(json.loads(jobset), indent=2))
    return EXIT_OK


def _check_module(name: str) -> None:
    import importlib.util

    top = name.split(".")[0]
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path[:] = saved
    if not found:
        raise _UsageError(
            f"cannot find the module '{name}': no '{top}' in the working directory or on "
            "the Python path"
        )


def _failed_run_status(error: Any) -> int:
    """The failing rank's exit status when its process exited with one, else 1."""
    if getattr(error, "cause", "") == "exit":
        first_line = str(error).split("\n", 1)[0]
        match = re.search(r"exited with status (\d+)$", first_line)
        if match and 0 < int(match.group(1)) < 256:
            return int(match.group(1))
    return EXIT_FAILED


# --- reading run directories ------------------------------------------------------------------


def _default_storage_path() -> str:
    from jaxtrain.config import RunConfig

    return RunConfig(name="_").storage_path


def _local_path(path: str) -> str:
    if path.startswith("file://"):
        path = path[len("file://"):]
    return os.path.abspath(os.path.expanduser(path))


# Local copies of remote runs (their records, logs and manifests), by the URL they show.
_REMOTE_VIEWS: dict[str, str] = {}


def _remote(path: str, what: str) -> tuple[Any, str] | None:
    from jaxtrain import storage

    try:
        return storage.remote_filesystem(path, field=what)
    except ValueError as e:
        raise _UsageError(str(e)) from None


def _remote_view(fs: Any, root: str) -> str:
    """A temporary local copy of the remote run `root`, removed when the command exits."""
    import atexit
    import shutil

    from jaxtrain import storage

    try:
        view = storage.local_view(fs, root)
    except FileNotFoundError:
        raise _UsageError(f"no run at {storage.url(fs, root)}: it has no run.json") from None
    atexit.register(shutil.rmtree, view, True)
    _REMOTE_VIEWS[view] = storage.url(fs, root)
    return view


def _resolve_run(run: str, storage_path: str | None) -> str:
    """A bare name is looked up under the storage path first, then as a path; anything with a
    '/' (or '.', '..') is a path. A URL, or a name under a URL storage path, is read from the
    remote storage into a temporary local copy."""
    if "://" in run and not run.startswith("file://"):
        return _remote_view(*_remote(run, "RUN"))
    if storage_path and "://" in storage_path and not storage_path.startswith("file://"):
        fs, base = _remote(storage_path, "--storage-path")
        return _remote_view(fs, f"{base}/{run}")
    storage = _local_path(storage_path or _default_storage_path())
    candidates = []
    if os.sep not in run and run not in (".", ".."):
        candidates.append(os.path.join(storage, run))
    candidates.append(_local_path(run))
    for candidate in candidates:
        if os.path.isfile(os.path.join(candidate, "run.json")):
            return candidate
    for candidate in candidates:
        if os.path.isdir(candidate) and any(
            os.path.isfile(os.path.join(e.path, "run.json")) for e in os.scandir(candidate)
        ):
            raise _UsageError(f"{candidate} is a storage path, not a run; list its runs with: "
                              f"jaxtrain ls {candidate}")
    looked = " nor ".join(f"{c}/run.json" for c in dict.fromkeys(candidates))
    raise _UsageError(
        f"no run '{run}': there is neither {looked}. List the runs with: jaxtrain ls {storage}"
    )


def _read_state(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _UsageError(f"cannot read {run_dir}/run.json: {e}") from None


def _status(run_dir: str, state: dict, lock_known: bool = True) -> tuple[str, str | None]:
    """run.json's status and, for a RUNNING one, its driver ("host H, pid P, since T"). A RUNNING
    run whose lock no live driver holds is CRASHED: its driver was killed, or its machine went
    down, before it could record how the run ended. A copy of a remote run has no lock to ask
    (`lock_known` False): its status is run.json's."""
    status = str(state.get("status", "?"))
    if status != "RUNNING" or not lock_known:
        return status, None
    from jaxtrain import _core

    try:
        holder = _core.run_lock_holder(run_dir)
    except OSError:
        return status, None
    return ("RUNNING", holder) if holder is not None else ("CRASHED", None)


def _round_count(run_dir: str, state: dict) -> int:
    """run.json counts rounds when an attempt ends; while it runs, result.jsonl has them."""
    if state.get("status") != "RUNNING":
        return int(state.get("rounds", 0))
    try:
        with open(os.path.join(run_dir, "result.jsonl"), "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def _when(t: float | None) -> str:
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _duration(start: float | None, end: float | None) -> str:
    if not start:
        return "-"
    s = (end or time.time()) - start
    if s < 60:
        text = f"{s:.1f}s"
    elif s < 3600:
        text = f"{int(s // 60)}m{int(s % 60):02d}s"
    else:
        text = f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return text if end else f"{text}+"


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )


def _value(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


# --- jaxtrain ls ----------------------------------------------------------------------------------


def _cmd_ls(args: argparse.Namespace) -> int:
    remote = _remote(args.storage_path, "STORAGE_PATH") if args.storage_path else None
    if remote is not None:
        return _ls_remote(*remote)
    storage = _local_path(args.storage_path or _default_storage_path())
    if not os.path.isdir(storage):
        raise _UsageError(f"the storage path {storage} does not exist (no run has used it)")
    rows = []
    for entry in os.scandir(storage):
        if not os.path.isfile(os.path.join(entry.path, "run.json")):
            continue
        try:
            state = _read_state(entry.path)
        except _UsageError:
            rows.append((0.0, [entry.name, "UNREADABLE", "-", "-", "-", "-", "-"]))
            continue
        start = state.get("start_time")
        rows.append((start or 0.0, [
            entry.name,
            _status(entry.path, state, not getattr(args, "remote_copy", False))[0],
            str(len(state.get("attempts", []))),
            str(state.get("world_size", "?")),
            str(_round_count(entry.path, state)),
            _when(start),
            _duration(start, state.get("end_time")),
        ]))
    if not rows:
        _say(f"no runs under {storage}")
        return EXIT_OK
    rows.sort(key=lambda r: (r[0], r[1][0]))
    header = ["NAME", "STATUS", "ATTEMPTS", "WORKERS", "ROUNDS", "START", "DURATION"]
    print(_table(header, [r for _, r in rows]))
    return EXIT_OK


def _ls_remote(fs: Any, base: str) -> int:
    """Lists the runs under a remote storage path from a local copy of their records."""
    import atexit
    import shutil
    import tempfile

    view = tempfile.mkdtemp(prefix="jaxtrain-ls-")
    atexit.register(shutil.rmtree, view, True)
    try:
        entries = fs.ls(base, detail=True)
    except FileNotFoundError:
        entries = []
    for entry in entries:
        run = entry["name"].rstrip("/")
        if entry["type"] != "directory" or not fs.exists(f"{run}/run.json"):
            continue
        local = os.path.join(view, run.rsplit("/", 1)[-1])
        os.makedirs(local)
        for name in ("run.json", "result.jsonl"):
            if fs.exists(f"{run}/{name}"):
                fs.get_file(f"{run}/{name}", os.path.join(local, name))
    return _cmd_ls(argparse.Namespace(storage_path=view, remote_copy=True))


# --- jaxtrain show --------------------------------------------------------------------------------


def _cmd_show(args: argparse.Namespace) -> int:
    from jaxtrain.result import Result

    run_dir = _resolve_run(args.run, args.storage_path)
    state = _read_state(run_dir)
    result = Result.from_path(run_dir)
    config = state.get("config", {})
    out: list[str] = []

    def field(key: str, value: Any) -> None:
        out.append(f"{key:<11}{value}")

    field("run", state.get("name", os.path.basename(run_dir)))
    field("path", _REMOTE_VIEWS.get(run_dir, run_dir))
    status, holder = _status(run_dir, state, run_dir not in _REMOTE_VIEWS)
    if holder:
        status += f" (driver: {holder})"
    elif status == "CRASHED":
        status += (" (its driver ended without recording how the run ended: it was killed, or "
                   "its machine went down; run it again to resume it)")
    field("status", status)
    field("started", _when(state.get("start_time")))
    field("duration", _duration(state.get("start_time"), state.get("end_time")))
    workers = f"{state.get('world_size', '?')} ({state.get('platform', '?')}"
    field("workers", workers + (", simulated)" if state.get("simulated") else ")"))
    field("rounds", _round_count(run_dir, state))

    out.append("config")
    for key in ("scaling_config", "run_config", "failure_config", "checkpoint_config"):
        section = config.get(key) or {}
        values = " ".join(f"{k}={_value(v)}" for k, v in section.items() if v is not None)
        out.append(f"  {key:<19}{values}")
    if config.get("train_loop_config") is not None:
        out.append(f"  {'train_loop_config':<19}{json.dumps(config['train_loop_config'])}")

    attempts = state.get("attempts", [])
    out.append(f"attempts ({len(attempts)})")
    for a in attempts:
        start, end = a.get("start_time"), a.get("end_time")
        line = (f"  {a.get('attempt', '?')}  {a.get('status', '?'):<9} {_when(start)}  "
                f"{_duration(start, end)}")
        if a.get("restored_from"):
            restored = a["restored_from"]
            if os.path.dirname(restored) == run_dir:
                restored = os.path.basename(restored)
            line += f"  restored from {restored}"
        failure = a.get("failure")
        if failure:
            line += f"  rank {failure.get('rank')} {failure.get('cause')}: {failure.get('message')}"
        out.append(line)

    rounds = result._read_rounds()
    if result.metrics is None:
        out.append("last metrics  none reported")
    else:
        out.append(f"last metrics (round {rounds[-1].get('round', '?')})")
        flat = _flatten(result.metrics)
        width = max(len(k) for k in flat) if flat else 0
        out += [f"  {k:<{width}}  {_value(v)}" for k, v in flat.items()]

    out += _checkpoint_lines(run_dir, result, config.get("checkpoint_config") or {})

    if result.error is not None:
        out.append(f"error      {str(result.error).splitlines()[0]}")
        try:
            with open(os.path.join(run_dir, "error.txt"), encoding="utf-8",
                      errors="replace") as f:
                out += [f"  {line}".rstrip() for line in f.read().rstrip().splitlines()]
        except FileNotFoundError:
            pass
        out.append(f"  logs: jaxtrain logs {run_dir} --rank {result.error.rank}")
    if args.plot is not None:
        out.append(f"plot       {_plot(run_dir, result, args.plot)}")
    print("\n".join(out))
    return EXIT_OK


def _plot(run_dir: str, result: Any, path: str) -> str:
    from jaxtrain.plot import plot_metrics

    if not path:  # beside the run's files; a remote run's view is temporary, so here instead
        name = os.path.basename(run_dir.rstrip("/"))
        path = (f"{name}-metrics.png" if run_dir in _REMOTE_VIEWS
                else os.path.join(run_dir, "metrics.png"))
    try:
        return plot_metrics(result.metrics_dataframe, path, title=os.path.basename(run_dir))
    except (ImportError, ValueError) as e:
        raise _UsageError(f"--plot: {e}") from None


def _checkpoint_lines(run_dir: str, result: Any, checkpoint_config: dict) -> list[str]:
    if not result.best_checkpoints:
        return ["checkpoints  none"]
    rounds: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "checkpoints.json"), encoding="utf-8") as f:
            rounds = {c["dir_name"]: c.get("round") for c in json.load(f).get("checkpoints", [])}
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pass
    attribute = checkpoint_config.get("checkpoint_score_attribute")
    order = checkpoint_config.get("checkpoint_score_order", "max")
    by = f"best first by {attribute} ({order})" if attribute else "newest first"
    lines = [f"checkpoints ({len(result.best_checkpoints)}, {by})"]
    latest = result.checkpoint.path if result.checkpoint else None
    rows = []
    for checkpoint, metrics in reversed(result.best_checkpoints):  # Ray's order: best last
        name = os.path.basename(checkpoint.path)
        row = [name, f"round {rounds.get(name, '?')}"]
        if attribute:
            row.append(f"{attribute}={_value(_flatten(metrics).get(attribute, '-'))}")
        row.append("latest" if checkpoint.path == latest else "")
        rows.append(row)
    lines += ["  " + line for line in _table([""] * len(rows[0]), rows).splitlines()[1:]]
    return lines


# --- jaxtrain logs --------------------------------------------------------------------------------


def _log_files(run_dir: str, state: dict, rank: int | None) -> list[tuple[bytes, str]]:
    logs = os.path.join(run_dir, "logs")
    world_size = state.get("world_size")
    if not isinstance(world_size, int) or world_size < 1:
        found = [re.fullmatch(r"rank-(\d+)\.log", n) for n in os.listdir(logs)] \
            if os.path.isdir(logs) else []
        world_size = max((int(m.group(1)) + 1 for m in found if m), default=0)
    if rank is None:
        return [(f"(rank={r}) ".encode(), os.path.join(logs, f"rank-{r}.log"))
                for r in range(world_size)]
    if not 0 <= rank < world_size:
        ranks = f"ranks 0-{world_size - 1}" if world_size > 1 else "rank 0"
        raise _UsageError(f"--rank {rank}: run '{state.get('name')}' has {ranks}")
    return [(b"", os.path.join(logs, f"rank-{rank}.log"))]


def _cmd_logs(args: argparse.Namespace) -> int:
    if args.kubernetes:
        from jaxtrain import kubernetes

        try:
            return kubernetes.logs(args.namespace, args.run, args.follow, _say)
        except LookupError as e:
            raise _UsageError(str(e)) from None
        except (ValueError, PermissionError, ConnectionError, ImportError) as e:
            _say(f"cannot read the logs: {e}")
            return EXIT_FAILED
    run_dir = _resolve_run(args.run, args.storage_path)
    files = _log_files(run_dir, _read_state(run_dir), args.rank)
    offsets = {path: 0 for _, path in files}
    partial = {path: b"" for _, path in files}
    out = sys.stdout.buffer
    while True:
        # The status is read before the logs: output written before the run ended is then
        # always printed by the last pass.
        state = _read_state(run_dir)
        running = args.follow and _status(run_dir, state, run_dir not in _REMOTE_VIEWS)[0] == (
            "RUNNING")
        for prefix, path in files:
            try:
                with open(path, "rb") as f:
                    f.seek(offsets[path])
                    data = f.read()
            except FileNotFoundError:
                continue
            offsets[path] += len(data)
            lines = (partial[path] + data).split(b"\n")
            partial[path] = lines.pop()
            if not running and partial[path]:
                lines.append(partial[path])
                partial[path] = b""
            out.write(b"".join(prefix + line + b"\n" for line in lines))
        out.flush()
        if not running:
            return EXIT_OK
        time.sleep(_FOLLOW_POLL_S)


# --- jaxtrain metrics -----------------------------------------------------------------------------


def _cmd_metrics(args: argparse.Namespace) -> int:
    from jaxtrain.result import Result

    run_dir = _resolve_run(args.run, args.storage_path)
    result = Result.from_path(run_dir)
    rounds = result._read_rounds()
    if args.json:
        for row in rounds:
            print(json.dumps(row))
        return EXIT_OK
    if not rounds:
        _say(f"run '{os.path.basename(run_dir)}' has not reported any metrics")
        return EXIT_OK
    frame = result.metrics_dataframe
    if args.csv:
        frame.to_csv(sys.stdout, index=False)
        return EXIT_OK
    frame["time"] = [time.strftime("%H:%M:%S", time.localtime(t)) for t in frame["time"]]
    print(frame.to_string(index=False))
    return EXIT_OK


# --- the parser -----------------------------------------------------------------------------------


_EXIT_CODES = """\
exit status:
  0    success
  1    the run failed (a rank raised, was killed or could not start)
  N    a rank's script exited with status N (sys.exit(N))
  2    bad usage: an unknown option or value, an unknown run, a missing script
  130  interrupted (Ctrl-C); every worker was stopped
"""


def _add_scaling_options(parser: argparse.ArgumentParser) -> None:
    scaling = parser.add_argument_group("scaling (ScalingConfig)")
    scaling.add_argument("-n", "--num-workers", type=int, default=1, metavar="N",
                         help="worker processes (default 1)")
    scaling.add_argument("--use-tpu", action="store_true", help="run on TPUs")
    scaling.add_argument("--use-gpu", action="store_true", help="run on GPUs")
    scaling.add_argument("--topology", help="TPU slice topology, e.g. 4x4")
    scaling.add_argument("--accelerator-type", help="e.g. TPU-V6E")
    scaling.add_argument("--resources-per-worker", metavar="SPEC",
                         help="e.g. TPU=4,CPU=1 or '{\"TPU\": 4}'")
    scaling.add_argument("--placement-strategy", default="PACK",
                         help="PACK (default), SPREAD, STRICT_PACK or STRICT_SPREAD")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("run directory (RunConfig)")
    where.add_argument("--name", help="the run's name (default jaxtrain_run-<UTC time>); "
                       "an existing run of this name is resumed from its latest checkpoint")
    where.add_argument("--storage-path", metavar="PATH",
                       help="where runs live (default ~/jaxtrain_results)")
    policy = parser.add_argument_group("failures and checkpoints")
    policy.add_argument("--max-failures", type=int, default=0, metavar="N",
                        help="restart the worker group up to N times (-1: no limit; default 0)")
    policy.add_argument("--num-to-keep", type=int, metavar="N",
                        help="checkpoints to keep (default all)")
    policy.add_argument("--checkpoint-score-attribute", metavar="METRIC",
                        help="keep the best checkpoints by this reported metric")
    policy.add_argument("--checkpoint-score-order", default="max", metavar="ORDER",
                        help="max (default) or min")


def _add_kubernetes_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", metavar="NS",
                        help="the namespace (default: JAXTRAIN_K8S_NAMESPACE, the kubeconfig "
                        "context's, or default)")


# `jaxtrain run` options a submitted run passes on to the driver pod's `jaxtrain run`.
_RUN_VALUE_OPTIONS = ("num_workers", "topology", "accelerator_type", "resources_per_worker",
                      "placement_strategy", "name", "storage_path", "max_failures",
                      "num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order")


def _run_argv(args: argparse.Namespace) -> list[str]:
    argv = [f"--{flag}" for flag in ("use_tpu", "use_gpu") if getattr(args, flag)]
    for dest in _RUN_VALUE_OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            argv += [f"--{dest}", str(value)]
    return [a.replace("_", "-") if a.startswith("--") else a for a in argv]


def _cmd_submit(args: argparse.Namespace) -> int:
    from jaxtrain import kubernetes

    if args.target is None:
        raise _UsageError("give the script to run: jaxtrain submit --kubernetes --image IMAGE "
                          "[options] script.py [args ...]")
    if not os.path.isfile(args.target):
        raise _UsageError(f"cannot find the script '{args.target}'")
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise _UsageError(f"--env '{item}' is not allowed; it must be NAME=VALUE")
        env[name] = value
    try:
        _scaling_config(args)  # bad options are refused here, not in the pod
        return kubernetes.submit(args.target, args.args, _run_argv(args), args.image,
                                 args.namespace, args.service_account, args.name,
                                 args.pod_template, env, not args.detach, _say)
    except (ValueError, LookupError) as e:
        raise _UsageError(str(e)) from None
    except (PermissionError, ConnectionError, ImportError) as e:
        _say(f"cannot submit: {e}")
        return EXIT_FAILED


def _cmd_status(args: argparse.Namespace) -> int:
    from jaxtrain import kubernetes

    try:
        rows = kubernetes.status(args.namespace, args.name)
    except LookupError as e:
        raise _UsageError(str(e)) from None
    except (ValueError, PermissionError, ConnectionError, ImportError) as e:
        _say(f"cannot list the submitted runs: {e}")
        return EXIT_FAILED
    print(_table(["NAME", "PHASE", "EXIT", "SCRIPT", "CREATED"],
                 [[r["name"], r["phase"] + (f" ({r['detail']})" if r["detail"] else ""),
                   "-" if r["exit_code"] is None else str(r["exit_code"]), r["script"],
                   r["created"]] for r in rows]))
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    from jaxtrain import __version__

    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="jaxtrain",
        description="Run a JAX script SPMD on N worker processes with jax.distributed "
        "initialised, and inspect runs.",
        epilog="examples:\n  jaxtrain run -n 4 train.py --lr 3e-4\n  jaxtrain ls\n"
        "  jaxtrain show my_run\n\n" + _EXIT_CODES + "\nSee 'jaxtrain COMMAND --help'.",
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"jaxtrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run a script (or -m module) on every worker",
        usage="jaxtrain run [options] script.py [args ...]\n"
        "       jaxtrain run [options] -m module [args ...]",
        description="Starts the script on every worker with jax.distributed initialised before "
        "its first line (a script's own jax.distributed.initialize() does nothing); "
        "jaxtrain.report() and get_checkpoint() work inside it. Worker output is printed "
        "prefixed '(rank=N) '; on a terminal a live status line stays below it. Everything "
        "after the script (or module) goes to it.",
        epilog="example:\n  jaxtrain run -n 4 --name my_run train.py --epochs 10\n"
        "  JAXTRAIN_SIMULATE=1 jaxtrain run --use-tpu --topology 4x4 -n 4 train.py\n\n"
        + _EXIT_CODES,
        formatter_class=formatter,
    )
    _add_scaling_options(run)
    hosts = run.add_argument_group("hosts (ssh; docs/hosts.md)")
    listed = hosts.add_mutually_exclusive_group()
    listed.add_argument("--hosts", metavar="H1,H2",
                        help="start the workers over ssh on these hosts (h1:4 gives h1 4 workers; "
                        "without counts they share -n equally); sets JAXTRAIN_SSH_HOSTS")
    listed.add_argument("--hostfile", metavar="FILE",
                        help="the hosts as MPI and DeepSpeed list them, 'host slots=N' per line; "
                        "sets JAXTRAIN_HOSTFILE")
    listed.add_argument("--coordinator", metavar="HOST:PORT",
                        help="the same command runs on every host: host 0 (at HOST:PORT) drives "
                        "the run, the others join it; 'tpu': host 0 of this TPU VM slice, port "
                        "8490, and --host-rank/--num-hosts from the slice")
    hosts.add_argument("--host-rank", type=int, metavar="K", help="with --coordinator: this "
                       "host's index, 0 for the host that drives the run")
    hosts.add_argument("--num-hosts", type=int, metavar="M",
                       help="with --coordinator: how many hosts run this command")
    hosts.add_argument("--join-secret-file", metavar="FILE", help="with --coordinator: the secret "
                       "every host holds (mode 600), else JAXTRAIN_JOIN_SECRET")
    _add_run_options(run)
    run.add_argument("--no-status-line", action="store_true",
                     help="on a terminal, do not keep the live status line (attempt, ranks up, "
                     "last round, rank 0's metrics, rounds/s) below the output")
    run.add_argument("-m", "--module", action="store_true",
                     help="run the target as a module, as python -m does")
    run.add_argument("target", nargs="?", metavar="script.py | module")
    run.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    run.set_defaults(handler=_cmd_run)

    submit = commands.add_parser(
        "submit",
        help="run a script on a Kubernetes cluster, its driver in a pod",
        usage="jaxtrain submit --kubernetes --image IMAGE [options] script.py [args ...]",
        description="Creates a driver pod that runs 'jaxtrain run [options] script.py [args]' "
        "in the cluster of the current kubeconfig; its workers are one JobSet (see "
        "docs/kubernetes.md). The script travels in a ConfigMap, mounted in the driver's and "
        "the workers' pods. The console is streamed until the run ends (Ctrl-C only stops the "
        "streaming; --detach returns at once); 'jaxtrain status --kubernetes' and 'jaxtrain "
        "logs --kubernetes NAME' find the run again.",
        epilog="example:\n  jaxtrain submit --kubernetes --image us-docker.pkg.dev/p/r/train:1 "
        "\\\n      --use-tpu --topology 4x4 --accelerator-type TPU-V6E -n 4 \\\n"
        "      --storage-path gs://bucket/runs train.py --epochs 10\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    submit.add_argument("--kubernetes", action="store_true",
                        help="submit to Kubernetes (the only target today; the default)")
    _add_kubernetes_options(submit)
    submit.add_argument("--image", required=True,
                        help="the driver's image, also the workers' unless JAXTRAIN_K8S_IMAGE "
                        "is given with --env; it must have jaxtrain[kubernetes] and jax")
    submit.add_argument("--service-account", metavar="NAME",
                        help="the driver pod's service account (see the Role in "
                        "docs/kubernetes.md)")
    submit.add_argument("--pod-template", metavar="FILE",
                        help="a Pod (YAML or JSON) merged into the driver's and the workers' "
                        "pods: volumes for the storage, tolerations, ...")
    submit.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the driver (repeatable)")
    submit.add_argument("--detach", action="store_true",
                        help="return once the driver pod is created")
    _add_scaling_options(submit)
    _add_run_options(submit)
    submit.add_argument("target", nargs="?", metavar="script.py")
    submit.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    submit.set_defaults(handler=_cmd_submit)

    status = commands.add_parser(
        "status", help="the runs submitted to Kubernetes (jaxtrain submit)",
        description="Lists the driver pods that 'jaxtrain submit' created in the namespace, "
        "oldest first: name, phase, exit status, script and creation time; or one of them.",
        epilog="example:\n  jaxtrain status --kubernetes\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    status.add_argument("--kubernetes", action="store_true",
                        help="look on Kubernetes (the only place today; the default)")
    _add_kubernetes_options(status)
    status.add_argument("name", nargs="?", metavar="NAME", help="one submitted run")
    status.set_defaults(handler=_cmd_status)

    plan = commands.add_parser(
        "plan", help="print where each rank would run, its devices and environment",
        description="Prints the placement that 'run' (and JaxTrainer.fit) would use for these "
        "scaling options, without starting anything: rank -> host, slice, devices, and the "
        "environment each worker starts with. Honours JAXTRAIN_HOSTS (a host description) and "
        "JAXTRAIN_SIMULATE=1, as runs do.",
        epilog="example:\n  JAXTRAIN_SIMULATE=1 jaxtrain plan -n 4 --use-tpu --topology 2x2x2 "
        "--accelerator-type TPU-V4\n  JAXTRAIN_HOSTS=hosts.json jaxtrain plan -n 2 --use-gpu "
        "--json\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    _add_scaling_options(plan)
    plan.add_argument("--json", action="store_true", help="the whole plan as JSON")
    plan.add_argument("--kubernetes", action="store_true",
                      help="print the JobSet the Kubernetes launcher would create (JSON; "
                      "honours JAXTRAIN_K8S_IMAGE, _NAMESPACE, _POD_TEMPLATE; asks no cluster)")
    plan.set_defaults(handler=_cmd_plan)

    ls = commands.add_parser(
        "ls", help="list the runs under a storage path",
        description="Lists the runs under STORAGE_PATH (default ~/jaxtrain_results), oldest "
        "first: status, attempts, workers, report rounds, start and duration ('+': running).",
        epilog="example:\n  jaxtrain ls /mnt/nfs/runs\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    ls.add_argument("storage_path", nargs="?", metavar="STORAGE_PATH")
    ls.set_defaults(handler=_cmd_ls)

    run_help = ("a run's name (under --storage-path, default ~/jaxtrain_results) or its "
                "directory")

    show = commands.add_parser(
        "show", help="a run's config, status, attempts, last metrics, checkpoints and error",
        description="Shows a run, running or finished: config, status, attempts, rank 0's last "
        "metrics, the kept checkpoints (best first, with their scores) and the error, if any.",
        epilog="example:\n  jaxtrain show my_run\n  jaxtrain show /mnt/nfs/runs/my_run\n\n"
        + _EXIT_CODES,
        formatter_class=formatter,
    )
    show.add_argument("run", metavar="RUN", help=run_help)
    show.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    show.add_argument("--plot", nargs="?", const="", metavar="FILE",
                      help="also draw the metrics per round as a PNG (default RUN/metrics.png; "
                      "needs matplotlib)")
    show.set_defaults(handler=_cmd_show)

    logs = commands.add_parser(
        "logs", help="print (or follow) the workers' output",
        description="Prints the output of every rank, each line prefixed '(rank=N) ', or of one "
        "rank as it is. Each attempt begins with a '===== jaxtrain: attempt N =====' line.",
        epilog="example:\n  jaxtrain logs my_run --rank 1\n  jaxtrain logs my_run -f\n\n"
        + _EXIT_CODES,
        formatter_class=formatter,
    )
    logs.add_argument("run", metavar="RUN", help=run_help)
    logs.add_argument("--rank", type=int, metavar="R", help="only this rank, without prefix")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing new output until the run is no longer RUNNING")
    logs.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    logs.add_argument("--kubernetes", action="store_true",
                      help="RUN is a run submitted to Kubernetes: its driver pod's output")
    _add_kubernetes_options(logs)
    logs.set_defaults(handler=_cmd_logs)

    metrics = commands.add_parser(
        "metrics", help="rank 0's reported metrics, one row per report round",
        description="Prints rank 0's metrics per report round: a table (nested keys joined "
        "with '/'), CSV with --csv (unix times), or JSON Lines with --json (one "
        '{"round", "time", "metrics"} object per round, as in result.jsonl).',
        epilog="example:\n  jaxtrain metrics my_run --csv > my_run.csv\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    metrics.add_argument("run", metavar="RUN", help=run_help)
    form = metrics.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="CSV")
    form.add_argument("--json", action="store_true", help="JSON Lines")
    metrics.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    metrics.set_defaults(handler=_cmd_metrics)
    return parser


def _say(message: str) -> None:
    sys.stderr.write(f"jaxtrain: {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``jaxtrain`` command; returns its exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage errors (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return args.handler(args)
    except _UsageError as e:
        sys.stderr.write(f"jaxtrain {args.command}: error: {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`jaxtrain logs RUN | head`): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
