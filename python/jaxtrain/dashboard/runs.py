"""What the dashboard shows of run directories, as JSON-ready dicts. Read only: nothing here
writes to a run directory (the records are the controller's; docs/architecture.md).

A *source* is where the runs are: a local (or shared) storage path, one run directory, or a
storage path on an object store, read through temporary local copies of each run's records
(``jaxtrain.storage.local_view``) refreshed at most every ``REMOTE_REFRESH_S`` seconds.

Whoever can write to a shared storage path can plant a run directory there, or links in one, to
make the dashboard serve files its user can read. So a run directory is read through a descriptor
of the directory itself (``RunFiles``, opened without following a link) and every file in it
relative to that, without following links, and only when the directory's owner owns it: a run
directory that is a link, or a file that is a link or another user's, is not read.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import threading
import time
from typing import Any

from jaxtrain import private_dirs, records
from jaxtrain.result import flatten

# The metric names of progress: rank 0 reports its position as `step` (from 0) and the run's
# length as `total_steps` (docs/dashboard.md); the ETA needs both.
STEP_METRIC = "step"
TOTAL_METRIC = "total_steps"
# Rounds of the current attempt the ETA's pace is measured over (the latest ones).
ETA_WINDOW_ROUNDS = 50
# The most rounds one answer sends: a long run's curve is drawn from every n-th round.
MAX_ROUNDS_SENT = 5000
# How old a remote run's local copy may get before it is read again.
REMOTE_REFRESH_S = 5.0
# What a log tail holds at most.
LOG_TAIL_BYTES = 16 * 1024


class SourceError(Exception):
    """The storage path or run cannot be read: the message says which and why."""


# --- sources ----------------------------------------------------------------------------------


class LocalSource:
    """The runs under a local storage path, or the one run `only`."""

    remote = False

    def __init__(self, base: str, only: str | None = None):
        self.base = base
        self.only = only
        self.where = os.path.join(base, only) if only else base

    def names(self) -> list[str]:
        if self.only:
            return [self.only]
        try:
            entries = list(os.scandir(self.base))
        except FileNotFoundError:
            return []  # no run yet (the storage path is made by the first): the table waits
        except OSError as e:
            raise SourceError(f"cannot list the storage path {self.base}: {e.strerror}") from None
        return sorted(e.name for e in entries
                      if e.is_dir(follow_symlinks=False) and is_run_dir(e.path))

    def run_dir(self, name: str) -> str | None:
        """The directory of the run `name`, None when there is no such run here."""
        if name not in self.names():
            return None
        return os.path.join(self.base, name)


class RemoteSource:
    """The runs under a storage path on an object store (an fsspec filesystem `fs`)."""

    remote = True

    def __init__(self, fs: Any, base: str, only: str | None = None):
        self.fs = fs
        self.base = base.rstrip("/")
        self.only = only
        from jaxtrain import storage

        self.where = storage.url(fs, f"{self.base}/{only}" if only else self.base)
        self._lock = threading.Lock()
        self._views: dict[str, tuple[float, str]] = {}  # name -> (when copied, local copy)
        self._names: tuple[float, list[str]] = (-REMOTE_REFRESH_S, [])  # (when listed, names)
        atexit.register(self.close)

    def names(self) -> list[str]:
        if self.only:
            return [self.only]
        with self._lock:
            when, names = self._names
        if time.monotonic() - when < REMOTE_REFRESH_S:
            return names
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.base, detail=True)
        except FileNotFoundError:
            entries = []
        names = sorted(
            entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries
            if entry["type"] == "directory"
            and self.fs.exists(f"{entry['name'].rstrip('/')}/{records.RUN_FILE}"))
        with self._lock:
            self._names = (time.monotonic(), names)
        return names

    def run_dir(self, name: str) -> str | None:
        from jaxtrain import storage

        if name not in self.names():
            return None
        with self._lock:
            when, view = self._views.get(name, (0.0, ""))
            if time.monotonic() - when < REMOTE_REFRESH_S:
                return view
            try:
                fresh = storage.local_view(self.fs, f"{self.base}/{name}")
            except FileNotFoundError:
                return None
            self._views[name] = (time.monotonic(), fresh)
        if view:
            shutil.rmtree(view, ignore_errors=True)
        return fresh

    def close(self) -> None:
        with self._lock:
            views, self._views = self._views, {}
        for _, view in views.values():
            shutil.rmtree(view, ignore_errors=True)


def open_source(target: str | None) -> LocalSource | RemoteSource:
    """The source of `target`: a run directory, a storage path (local or a URL), or a run's name
    under the default storage path; None: the default storage path. Raises SourceError."""
    from jaxtrain import storage
    from jaxtrain.config import RunConfig

    default = RunConfig(name="_").storage_path
    if target and "://" in target and not target.startswith("file://"):
        try:
            fs, base = storage.remote_filesystem(target, field="STORAGE_PATH")
        except ValueError as e:
            raise SourceError(str(e)) from None
        base = base.rstrip("/")
        if fs.exists(f"{base}/{records.RUN_FILE}"):
            parent, _, name = base.rpartition("/")
            return RemoteSource(fs, parent, name)
        return RemoteSource(fs, base)
    path = os.path.abspath(os.path.expanduser((target or default).removeprefix("file://")))
    if records.is_run_dir(path):
        path = os.path.realpath(path)  # the user named it: a link to it is theirs to follow
        return LocalSource(os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path) or (target is None and not os.path.lexists(path)):
        return LocalSource(path)  # the default storage path before the first run: no runs yet
    if target and os.sep not in target:
        named = os.path.join(os.path.expanduser(default), target)
        if records.is_run_dir(named):
            return LocalSource(os.path.dirname(named), target)
    if os.path.exists(path):
        raise SourceError(f"{path} is neither a storage path (a directory of runs) nor a run "
                          "directory (one with a run.json)")
    raise SourceError(f"{path} does not exist: give a storage path (a directory of runs, default "
                      f"{default}) or a run directory")


# --- one run ----------------------------------------------------------------------------------


class RunFiles:
    """A run directory opened for reading: the directory (not a link to one) by a descriptor, and
    its files relative to it (private_dirs.open_beneath: no part a link, each owned by the
    directory's owner). Raises OSError when the directory cannot be opened so (ELOOP: a link)."""

    def __init__(self, run_dir: str) -> None:
        self.fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.owner = os.fstat(self.fd).st_uid

    def __enter__(self) -> RunFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def open(self, rel: str) -> Any:
        """The file ``rel`` ('/'-separated), open for reading in binary; OSError (PermissionError
        for a link or another user's file, FileNotFoundError) otherwise."""
        return os.fdopen(private_dirs.open_beneath(self.fd, rel, owner=self.owner), "rb")

    def read(self, rel: str) -> bytes:
        with self.open(rel) as f:
            return f.read()

    def mtime(self, rel: str) -> float | None:
        try:
            with self.open(rel) as f:
                return os.fstat(f.fileno()).st_mtime
        except OSError:
            return None


def is_run_dir(path: str) -> bool:
    """Whether `path` is a run directory the dashboard reads: a directory, not a link to one,
    with a run.json (RunFiles)."""
    try:
        with RunFiles(path) as files:
            files.open(records.RUN_FILE).close()
        return True
    except OSError:
        return False


def read_state(run_dir: str) -> dict:
    """run.json; a run whose run.json cannot be read is shown as UNREADABLE."""
    try:
        with RunFiles(run_dir) as files:
            state = json.loads(files.read(records.RUN_FILE))
    except (OSError, ValueError) as e:
        return {"status": "UNREADABLE", "error": f"cannot read run.json: {e}"}
    return state if isinstance(state, dict) else {"status": "UNREADABLE",
                                                   "error": "run.json is not an object"}


def status(run_dir: str, state: dict, remote: bool) -> tuple[str, str | None]:
    """As `jaxtrain ls`: run.json's status, CRASHED for a RUNNING run no live driver holds (a
    remote copy has no lock to ask), and the driver of a RUNNING one."""
    return records.run_status(run_dir, state, lock_known=not remote)


class RoundReader:
    """result.jsonl read incrementally: each call reads only what was appended since the last
    one. One per run directory; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # run directory -> (its result.jsonl read so far, the rounds read)
        self._files: dict[str, tuple[records.RoundTail, list[dict]]] = {}

    def rounds(self, run_dir: str) -> list[dict]:
        with self._lock:
            tail, rows = self._files.get(run_dir) or (records.RoundTail(
                run_dir, open_file=lambda: _open_rounds(run_dir)), [])
            inode = tail.inode
            new = tail.new()
            if tail.inode is None:  # no file (yet)
                self._files.pop(run_dir, None)
                return []
            if tail.inode != inode:  # rewritten (a remote copy refreshed): read whole
                rows = []
            rows = rows + new
            self._files[run_dir] = (tail, rows)
            return rows


def progress(rounds: list[dict], attempts: list[dict], now: float) -> dict:
    """Rank 0's position (`step`, counted from 0, so `done` = step + 1 steps are done; without
    it, the round), the run's length when it reports `total_steps`, and the ETA: the steps left
    at the pace of the current attempt's latest rounds."""
    out = {"round": rounds[-1].get("round") if rounds else 0, "step": None, "done": None,
           "total": None, "fraction": None, "eta_s": None}
    if not rounds:
        return out
    last = flatten(rounds[-1].get("metrics"))
    step = _number(last.get(STEP_METRIC))
    total = _number(last.get(TOTAL_METRIC))
    out.update(step=step, done=step + 1 if step is not None else None, total=total)
    if step is None or total is None or total <= 0:
        return out
    out["fraction"] = min(1.0, max(0.0, (step + 1) / total))
    began = max((a.get("start_time") or 0.0 for a in attempts), default=0.0)
    recent = [r for r in rounds[-ETA_WINDOW_ROUNDS:] if (r.get("time") or 0.0) >= began]
    if len(recent) >= 2:
        first_step = _number(flatten(recent[0].get("metrics")).get(STEP_METRIC))
        steps = step - first_step if first_step is not None else 0
        seconds = recent[-1]["time"] - recent[0]["time"]
        if steps > 0 and seconds > 0:
            out["eta_s"] = max(0.0, (total - step - 1) * seconds / steps)
    return out


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return v


def summary(name: str, run_dir: str, rounds: list[dict], remote: bool, now: float,
            state: dict | None = None) -> dict:
    """What the list of runs shows of one run (`state`: its run.json, if already read)."""
    state = read_state(run_dir) if state is None else state
    shown, driver = status(run_dir, state, remote)
    attempts = records.attempts(state)
    position = progress(rounds, attempts, now)
    if shown != "RUNNING":
        position["eta_s"] = None  # nothing is left to wait for
    return {
        "name": name,
        "status": shown,
        "driver": driver,
        "error": state.get("error"),
        "world_size": state.get("world_size"),
        "platform": state.get("platform"),
        "attempts": len(attempts),
        "rounds": len(rounds),
        "start_time": state.get("start_time"),
        "end_time": state.get("end_time"),
        "progress": position,
        "last_metrics": rounds[-1].get("metrics") if rounds else None,
    }


def detail(name: str, run_dir: str, rounds: list[dict], remote: bool, now: float,
           since: int = 0) -> dict:
    """Everything the run's page shows. `since`: the rounds already shown (those with a number
    above it are sent)."""
    state = read_state(run_dir)
    out = summary(name, run_dir, rounds, remote, now, state)
    attempts = records.attempts(state)
    out.update({
        "now": now,
        "config": state.get("config", {}),
        "attempt_list": [_attempt(a) for a in attempts],
        "ranks": ranks(run_dir, state, out["status"], rounds, now),
        "metrics": [{"round": r.get("round"), "time": r.get("time"),
                     "metrics": {k: v for k, v in flatten(r.get("metrics")).items()
                                 if _number(v) is not None}}
                    for r in thinned([r for r in rounds if (r.get("round") or 0) > since])],
        "checkpoints": checkpoints(run_dir, state),
        "goodput": goodput(state, rounds, now),
    })
    return out


def thinned(rounds: list[dict], most: int = MAX_ROUNDS_SENT) -> list[dict]:
    """At most about `most` of `rounds`, evenly spaced, the last always among them."""
    if len(rounds) <= most:
        return rounds
    stride = -(-len(rounds) // most)
    return rounds[:-1:stride] + rounds[-1:]


def _attempt(a: dict) -> dict:
    failure = a.get("failure") if isinstance(a.get("failure"), dict) else None
    return {
        "attempt": a.get("attempt"),
        "status": a.get("status"),
        "start_time": a.get("start_time"),
        "end_time": a.get("end_time"),
        "queued": a.get("phase") == "queued",  # its launch waits in a queue (Kueue) now
        "queue_wait_s": _number(a.get("queue_wait_s")) or 0.0,
        "restored_from": os.path.basename(a["restored_from"]) if a.get("restored_from") else None,
        "failure": failure and {k: failure.get(k) for k in (
            "rank", "host", "cause", "message", "exit_code", "signal", "decision", "stacks")},
        "stragglers": straggler_periods(a),
    }


def straggler_periods(a: dict) -> list[dict]:
    """An attempt's stragglers (docs/observability.md), from run.json's record of each change:
    one period per time a rank became a straggler, oldest first, with its step time and the
    other ranks' median then; ``end_time`` is when it stopped being one, None if it still was
    when the attempt ended (or is now, while it runs)."""
    events = a.get("stragglers") if isinstance(a.get("stragglers"), list) else []
    periods: list[dict] = []
    open_by_rank: dict[int, dict] = {}
    for e in events:
        if not isinstance(e, dict) or not isinstance(e.get("rank"), int) \
                or _number(e.get("time")) is None:
            continue
        rank = e["rank"]
        if e.get("slow") and rank not in open_by_rank:
            open_by_rank[rank] = {"rank": rank, "start_time": e["time"], "end_time": None,
                                  "step_time_s": _number(e.get("step_time_s")),
                                  "median_step_time_s": _number(e.get("median_step_time_s"))}
            periods.append(open_by_rank[rank])
        elif not e.get("slow") and rank in open_by_rank:
            open_by_rank.pop(rank)["end_time"] = e["time"]
    return periods


def ranks(run_dir: str, state: dict, shown: str, rounds: list[dict], now: float) -> list[dict]:
    """Each rank of the latest attempt: its host, its state, how long ago the last report round
    completed (every rank had reported by then) and how long ago it last printed."""
    attempts = records.attempts(state)
    world_size = state.get("world_size")
    if not isinstance(world_size, int) or world_size < 1:
        return []
    latest = attempts[-1] if attempts else {}
    hosts = latest.get("hosts") if isinstance(latest.get("hosts"), list) else []
    failure = latest.get("failure") if isinstance(latest.get("failure"), dict) else {}
    attempt_status = latest.get("status", "?")
    last_round = rounds[-1].get("time") if rounds else None
    straggling = {p["rank"]: p for p in straggler_periods(latest) if p["end_time"] is None}
    out = []
    for r in range(world_size):
        if attempt_status == "RUNNING":
            rank_state = "CRASHED" if shown == "CRASHED" else "RUNNING"
        elif failure.get("rank") == r:
            rank_state = f"FAILED ({failure.get('cause')})"
        elif attempt_status in ("ERRORED", "ABORTED", "CRASHED"):
            rank_state = "STOPPED"
        else:
            rank_state = attempt_status
        printed = _mtime_in(run_dir, f"logs/rank-{r}.log")
        host = hosts[r] if r < len(hosts) and hosts[r] else failure.get("host") \
            if failure.get("rank") == r else None
        out.append({
            "rank": r,
            "host": host or None,
            "state": rank_state,
            "last_report_age_s": now - last_round if last_round else None,
            "last_output_age_s": now - printed if printed else None,
            "step_time_s": _number_at(latest.get("step_time_s"), r),
            # Its straggler period in the latest attempt, while it lasts (or lasted to the end).
            "straggler": straggling.get(r),
        })
    return out


def checkpoints(run_dir: str, state: dict) -> list[dict]:
    """The committed checkpoints, oldest first, with the best (by the run's CheckpointConfig
    score, when it has one) and the latest marked."""
    try:
        with RunFiles(run_dir) as files:
            index = json.loads(files.read(records.INDEX_FILE))
    except (OSError, ValueError):
        return []
    if not isinstance(index, dict):
        return []
    cc = (state.get("config") or {}).get("checkpoint_config") or {}
    attribute = cc.get("checkpoint_score_attribute")
    higher = cc.get("checkpoint_score_order", "max") == "max"
    listed = [c for c in index.get("checkpoints", []) if isinstance(c, dict)]
    scores = {c.get("dir_name"): _number(flatten(c.get("metrics")).get(attribute))
              for c in listed} if attribute else {}
    scored = [(s, n) for n, s in scores.items() if s is not None]
    best = (max if higher else min)(scored, key=lambda p: p[0])[1] if scored else None
    return [{
        "dir_name": c.get("dir_name"),
        "round": c.get("round"),
        "time": c.get("time"),
        "bytes": c.get("bytes"),
        "score_attribute": attribute,
        "score": scores.get(c.get("dir_name")),
        "best": c.get("dir_name") == best,
        "latest": c.get("dir_name") == index.get("latest"),
    } for c in listed]


def log_tail(run_dir: str, rank: int, limit: int = LOG_TAIL_BYTES) -> str | None:
    """The last `limit` bytes of rank `rank`'s log (from a line's start); None without a log."""
    try:
        with RunFiles(run_dir) as files, files.open(f"logs/rank-{rank}.log") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return None
    if size > limit:
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", errors="replace")


def _open_rounds(run_dir: str) -> Any:
    """result.jsonl by RunFiles' rules; one that is a link or another user's reads as none."""
    try:
        with RunFiles(run_dir) as files:
            return files.open(records.ROUNDS_FILE)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise FileNotFoundError(f"{records.ROUNDS_FILE} of {run_dir} is not read: {e}") from None


def _mtime_in(run_dir: str, rel: str) -> float | None:
    try:
        with RunFiles(run_dir) as files:
            return files.mtime(rel)
    except OSError:
        return None


# --- goodput ------------------------------------------------------------------------------------
# GOODPUT: the one place the dashboard takes goodput accounting from (jaxtrain.goodput, the
# definitions of docs/observability.md), computed from the records the page already read.


def goodput(state: dict, rounds: list[dict], now: float) -> dict | None:
    """The run's goodput as JSON: seconds per part, the wall time and the goodput fraction."""
    from jaxtrain import goodput as accounting

    try:
        g = accounting.compute(state, rounds, now)
    except (KeyError, TypeError, ValueError) as e:
        return {"error": f"cannot account this run's time: {e}"}
    return {"parts": g.parts(), "wall": g.wall, "fraction": g.fraction}


def _number_at(values: Any, i: int) -> float | None:
    """values[i] when values is a list holding a number there (run.json's per-rank fields)."""
    if isinstance(values, list) and i < len(values):
        return _number(values[i])
    return None
