"""``jaxtrain ls``, ``show``, ``logs`` and ``metrics``: they only read run directories (local, or
a temporary copy of a remote one); they never import jax or start workers."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Any

from jaxtrain import records
from jaxtrain.cli.common import EXIT_FAILED, EXIT_OK, UsageError, say, table
from jaxtrain.result import flatten

# How often `logs -f` looks for new output and for the end of the run.
_FOLLOW_POLL_S = 0.25


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
        raise UsageError(str(e)) from None


def _remote_view(fs: Any, root: str) -> str:
    """A temporary local copy of the remote run `root`, removed when the command exits."""
    import atexit
    import shutil

    from jaxtrain import storage

    try:
        view = storage.local_view(fs, root)
    except FileNotFoundError:
        raise UsageError(f"no run at {storage.url(fs, root)}: it has no run.json") from None
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
        if records.is_run_dir(candidate):
            return candidate
    for candidate in candidates:
        if os.path.isdir(candidate) and any(
            records.is_run_dir(e.path) for e in os.scandir(candidate)
        ):
            raise UsageError(f"{candidate} is a storage path, not a run; list its runs with: "
                              f"jaxtrain ls {candidate}")
    looked = " nor ".join(f"{c}/run.json" for c in dict.fromkeys(candidates))
    raise UsageError(
        f"no run '{run}': there is neither {looked}. List the runs with: jaxtrain ls {storage}"
    )


def _read_state(run_dir: str) -> dict:
    try:
        return records.read_state(run_dir)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {run_dir}/run.json: {e}") from None




def _when(t: float | None) -> str:
    """A time as `ls` and `show` print it: in UTC, as the default run names are."""
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


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



def _value(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


# --- jaxtrain ls ----------------------------------------------------------------------------------


_LS_HEADER = ["NAME", "STATUS", "ATTEMPTS", "WORKERS", "ROUNDS", "START", "DURATION"]


def cmd_ls(args: argparse.Namespace) -> int:
    given = getattr(args, "storage_path_option", None)
    if given is not None and args.storage_path is not None and given != args.storage_path:
        raise UsageError(f"STORAGE_PATH '{args.storage_path}' and --storage-path '{given}' "
                         "differ; give one of them")
    path = args.storage_path if args.storage_path is not None else given
    remote = _remote(path, "STORAGE_PATH") if path else None
    if remote is not None:
        return _ls_remote(*remote, shown=path)
    storage = _local_path(path or _default_storage_path())
    shown = getattr(args, "shown", None) or storage
    if not os.path.isdir(storage):
        # The default storage path before the first run has no runs yet; a path given that does
        # not exist is more likely mistyped.
        if path or os.path.exists(storage):
            raise UsageError(f"the storage path {storage} does not exist (no run has used it)"
                             if not os.path.exists(storage) else
                             f"the storage path {storage} is not a directory")
        print(table(_LS_HEADER, []))
        say(f"no runs under {shown}: it does not exist yet (the first run creates it)")
        return EXIT_OK
    rows = []
    for entry in os.scandir(storage):
        if not records.is_run_dir(entry.path):
            continue
        try:
            state = _read_state(entry.path)
        except UsageError:
            rows.append((0.0, [entry.name, "UNREADABLE", "-", "-", "-", "-", "-"]))
            continue
        start = state.get("start_time")
        rows.append((start or 0.0, [
            entry.name,
            records.run_status(entry.path, state, not getattr(args, "remote_copy", False))[0],
            str(len(records.attempts(state))),
            str(state.get("world_size", "?")),
            str(records.count_rounds(entry.path, state)),
            _when(start),
            _duration(start, state.get("end_time")),
        ]))
    rows.sort(key=lambda r: (r[0], r[1][0]))
    print(table(_LS_HEADER, [r for _, r in rows]))
    if not rows:
        say(f"no runs under {shown}")
    return EXIT_OK


def _ls_remote(fs: Any, base: str, shown: str) -> int:
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
        if entry["type"] != "directory" or not fs.exists(f"{run}/{records.RUN_FILE}"):
            continue
        local = os.path.join(view, run.rsplit("/", 1)[-1])
        os.makedirs(local)
        for name in (records.RUN_FILE, records.ROUNDS_FILE):
            if fs.exists(f"{run}/{name}"):
                fs.get_file(f"{run}/{name}", os.path.join(local, name))
    return cmd_ls(argparse.Namespace(storage_path=view, remote_copy=True, shown=shown))


# --- jaxtrain show --------------------------------------------------------------------------------


def cmd_show(args: argparse.Namespace) -> int:
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
    status, holder = records.run_status(run_dir, state, run_dir not in _REMOTE_VIEWS)
    if holder:
        status += f" (driver: {holder})"
    elif status == "CRASHED":
        status += (" (its driver ended without recording how the run ended: it was killed, or "
                   "its machine went down; run it again to resume it)")
    attempts = records.attempts(state)
    if status.startswith("RUNNING") and attempts and attempts[-1].get("phase") == "queued":
        # Its launch waits in a queue (Kueue's admission): the driver's loop waits with it.
        status += f"; queued: attempt {attempts[-1].get('attempt', '?')} waits to be admitted"
    field("status", status)
    field("started", _when(state.get("start_time")))
    field("duration", _duration(state.get("start_time"), state.get("end_time")))
    workers = f"{state.get('world_size', '?')} ({state.get('platform', '?')}"
    field("workers", workers + (", simulated)" if state.get("simulated") else ")"))
    field("rounds", records.count_rounds(run_dir, state))

    out.append("config")
    for key in ("scaling_config", "run_config", "failure_config", "checkpoint_config"):
        section = config.get(key) or {}
        values = " ".join(f"{k}={_value(v)}" for k, v in section.items() if v is not None)
        out.append(f"  {key:<19}{values}")
    if config.get("train_loop_config") is not None:
        out.append(f"  {'train_loop_config':<19}{json.dumps(config['train_loop_config'])}")

    out.append(f"attempts ({len(attempts)})")
    for a in attempts:
        start, end = a.get("start_time"), a.get("end_time")
        shown = "queued" if a.get("phase") == "queued" else a.get("status", "?")
        line = f"  {a.get('attempt', '?')}  {shown:<9} {_when(start)}  {_duration(start, end)}"
        if isinstance(a.get("queue_wait_s"), int | float) and a["queue_wait_s"] > 0:
            line += f"  queued {a['queue_wait_s']:.1f} s"
        if a.get("restored_from"):
            restored = a["restored_from"]
            if os.path.dirname(restored) == run_dir:
                restored = os.path.basename(restored)
            line += f"  restored from {restored}"
        failure = a.get("failure")
        if failure:
            line += f"  rank {failure.get('rank')} {failure.get('cause')}: {failure.get('message')}"
        out.append(line)
        if failure and isinstance(failure.get("stacks"), str):
            out.append(f"     stacks: {_stacks_files(run_dir, failure['stacks'])}")

    rounds = result.report_rounds()
    out += _goodput_lines(state, rounds, status)
    if result.metrics is None:
        out.append("last metrics  none reported")
    else:
        out.append(f"last metrics (round {rounds[-1].get('round', '?')})")
        flat = flatten(result.metrics)
        width = max(len(k) for k in flat) if flat else 0
        out += [f"  {k:<{width}}  {_value(v)}" for k, v in flat.items()]

    out += _checkpoint_lines(run_dir, result, config.get("checkpoint_config") or {})

    if result.error is not None:
        out.append(f"error      {str(result.error).splitlines()[0]}")
        text = records.read_error(run_dir)
        if text is not None:
            out += [f"  {line}".rstrip() for line in text.rstrip().splitlines()]
        out.append(f"  logs: jaxtrain logs {run_dir} --rank {result.error.rank}")
    if args.plot is not None:
        out.append(f"plot       {_plot(run_dir, result, args.plot)}")
    print("\n".join(out))
    return EXIT_OK


def _ask_live_run(run_dir: str, op: str, **fields) -> dict:
    """The live driver's answer (jaxtrain.driver.live); a UsageError naming the run's status
    and its driver's host when no driver of the run answers here."""
    from jaxtrain.driver import live

    try:
        return live.request(run_dir, op, **fields)
    except ConnectionError:
        state = _read_state(run_dir)
        status, holder = records.run_status(run_dir, state, run_dir not in _REMOTE_VIEWS)
        where = f" (driver: {holder}; run this command on its host)" if holder else ""
        raise UsageError(f"no driver of the run in {run_dir} answers on this host: the run is "
                         f"{status}{where}") from None


def cmd_stack(args: argparse.Namespace) -> int:
    run_dir = _resolve_run(args.run, args.storage_path)
    answer = _ask_live_run(run_dir, "stacks")
    if "error" in answer:
        say(f"the run could not give its stacks: {answer['error']}")
        return EXIT_FAILED
    folder = answer["dir"]
    names = sorted((n for n in os.listdir(folder) if n.startswith("rank-")),
                   key=lambda n: int(n[5:-4]) if n[5:-4].isdigit() else -1)
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            print(f.read().rstrip("\n") + "\n")
    say(f"every rank's stacks are kept in {folder}")
    return EXIT_OK


def cmd_profile(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} is not allowed; trace 1 step or more")
    run_dir = _resolve_run(args.run, args.storage_path)
    answer = _ask_live_run(run_dir, "profile", steps=args.steps)
    if "error" in answer:
        say(f"the run could not start the profile: {answer['error']}")
        return EXIT_FAILED
    folder = answer["dir"]
    print(folder)
    say(f"every rank traces its next {args.steps} step(s), from its next report(), into "
        f"{folder}/rank-R; view them with: tensorboard --logdir {folder} (the profile plugin: "
        "pip install tensorboard tensorboard-plugin-profile), or open a rank's "
        "perfetto_trace.json.gz at https://ui.perfetto.dev")
    return EXIT_OK


def _stacks_files(run_dir: str, stacks: str) -> str:
    """Every rank's stacks of a hung attempt (docs/failure-detection.md): the folder and its
    files, rank by rank."""
    folder = os.path.join(run_dir, stacks)
    try:
        names = [n for n in os.listdir(folder) if n.startswith("rank-") and n.endswith(".txt")]
    except OSError:
        return folder
    names.sort(key=lambda n: int(n[5:-4]) if n[5:-4].isdigit() else -1)
    return f"{folder}/ " + " ".join(names)


def _goodput_lines(state: dict, rounds: list[dict], status: str) -> list[str]:
    """Where the run's time went (jaxtrain.goodput, docs/observability.md): the run and each
    attempt. A crashed run's ends at its last record, a running one's now."""
    from jaxtrain import goodput

    g = goodput.compute(state, rounds, now=time.time() if status == "RUNNING" else None)
    head = (f"goodput    {100 * g.fraction:.1f} % (seconds"
            + (", so far)" if status == "RUNNING" else ")"))
    return [head] + [f"  {row}" for row in g.table()]


def _plot(run_dir: str, result: Any, path: str) -> str:
    from jaxtrain.driver.plot import plot_metrics

    if not path:  # beside the run's files; a remote run's view is temporary, so here instead
        name = os.path.basename(run_dir.rstrip("/"))
        path = (f"{name}-metrics.png" if run_dir in _REMOTE_VIEWS
                else os.path.join(run_dir, "metrics.png"))
    try:
        return plot_metrics(result.metrics_dataframe, path, title=os.path.basename(run_dir))
    except (ImportError, ValueError) as e:
        raise UsageError(f"--plot: {e}") from None


def _checkpoint_lines(run_dir: str, result: Any, checkpoint_config: dict) -> list[str]:
    if not result.best_checkpoints:
        return ["checkpoints  none"]
    rounds: dict[str, Any] = {}
    try:
        rounds = {c["dir_name"]: c.get("round")
                  for c in (records.read_index(run_dir) or {}).get("checkpoints", [])}
    except (KeyError, TypeError):
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
            row.append(f"{attribute}={_value(flatten(metrics).get(attribute, '-'))}")
        row.append("latest" if checkpoint.path == latest else "")
        rows.append(row)
    lines += ["  " + line for line in table([""] * len(rows[0]), rows).splitlines()[1:]]
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
        raise UsageError(f"--rank {rank}: run '{state.get('name')}' has {ranks}")
    return [(b"", os.path.join(logs, f"rank-{rank}.log"))]


def cmd_logs(args: argparse.Namespace) -> int:
    if args.kubernetes:
        from jaxtrain.kubernetes import submit as kubernetes

        try:
            return kubernetes.logs(args.namespace, args.run, args.follow, say)
        except LookupError as e:
            raise UsageError(str(e)) from None
        except (ValueError, PermissionError, ConnectionError, ImportError) as e:
            say(f"cannot read the logs: {e}")
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
        lock_known = run_dir not in _REMOTE_VIEWS
        running = args.follow and records.run_status(run_dir, state, lock_known)[0] == "RUNNING"
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


def cmd_metrics(args: argparse.Namespace) -> int:
    from jaxtrain.result import Result

    run_dir = _resolve_run(args.run, args.storage_path)
    result = Result.from_path(run_dir)
    rounds = result.report_rounds()
    if args.json:
        for row in rounds:
            print(json.dumps(row))
        return EXIT_OK
    if not rounds:
        say(f"run '{os.path.basename(run_dir)}' has not reported any metrics")
        return EXIT_OK
    frame = result.metrics_dataframe
    if args.csv:
        frame.to_csv(sys.stdout, index=False)
        return EXIT_OK
    frame[records.TIME_COLUMN] = [time.strftime("%H:%M:%S", time.localtime(t))
                                  for t in frame[records.TIME_COLUMN]]
    print(frame.to_string(index=False))
    return EXIT_OK


