"""The one reader of a run directory's records, as the controller writes them (docs/architecture.md,
"The run directory"; src/controller/run_record.h, src/storage/run_store.h):

* ``run.json`` — the run's state: ``status``, ``config``, ``rounds`` and one entry per attempt in
  ``attempts`` (with its ``failure``, when it failed);
* ``result.jsonl`` — one line per report round (``round``, ``time``, ``metrics``, ``checkpoint``),
  rank 0's metrics as reported, under ``metrics``; its flat views (``progress.csv``,
  ``Result.metrics_dataframe``, ``jaxtrain metrics``) name jaxtrain's columns ``jaxtrain/round``
  and ``jaxtrain/time`` (ROUND_COLUMN, TIME_COLUMN), a namespace that report() keeps users' metrics
  out of (check_metric_names), so a metric named ``time`` or ``round`` is a column of its own;
* ``checkpoints.json`` — the index of committed checkpoints (``checkpoints``, ``latest``);
* ``error.txt`` — the first failure, as a person reads it;
* ``return_value.pkl`` — rank 0's return value, pickled.

Everything that reads these (Result, the callbacks during fit(), goodput, ``jaxtrain ls/show``, the
dashboard, the sweep of copies in host memory) reads them here, so each file is parsed one way.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

RUN_FILE = "run.json"
ROUNDS_FILE = "result.jsonl"
INDEX_FILE = "checkpoints.json"
ERROR_FILE = "error.txt"
RETURN_VALUE_FILE = "return_value.pkl"
# The records a copy of a remote run directory needs besides its logs and checkpoints.
RECORD_FILES = (RUN_FILE, ROUNDS_FILE, RETURN_VALUE_FILE)
# jaxtrain's own columns where a round's metrics are flat (progress.csv, as the controller writes
# it: src/storage/run_store.h), nested keys joined with '/'. progress.csv of a run recorded
# before they were namespaced begins "round,time" instead.
RESERVED_METRIC = "jaxtrain"
ROUND_COLUMN = f"{RESERVED_METRIC}/round"
TIME_COLUMN = f"{RESERVED_METRIC}/time"


def check_metric_names(metrics: dict) -> None:
    """Raises ValueError when a key of `metrics` would take jaxtrain's columns' names once
    flattened: ``jaxtrain`` itself or one that starts with ``jaxtrain/``."""
    for key in metrics:
        if key == RESERVED_METRIC or (isinstance(key, str)
                                      and key.startswith(f"{RESERVED_METRIC}/")):
            raise ValueError(
                f"report(metrics): the metric {key!r} is not allowed: names under "
                f"'{RESERVED_METRIC}/' are jaxtrain's own columns ({ROUND_COLUMN}, {TIME_COLUMN}) "
                "in progress.csv and Result.metrics_dataframe; rename the metric")


def flat_rounds(rounds: list[dict]) -> list[dict]:
    """`rounds` (read_rounds) as flat rows: ROUND_COLUMN, TIME_COLUMN, then the round's metrics
    with nested keys joined with '/'."""
    from jaxtrain.result import flatten

    return [{ROUND_COLUMN: r.get("round"), TIME_COLUMN: r.get("time"),
             **flatten(r.get("metrics") or {})} for r in rounds]


def is_run_dir(path: str) -> bool:
    """Whether `path` is a run directory: one with a run.json."""
    return os.path.isfile(os.path.join(path, RUN_FILE))


def read_state(run_dir: str) -> Any:
    """run.json of `run_dir`, as JSON. Raises FileNotFoundError without one, OSError when it
    cannot be read and json.JSONDecodeError (a ValueError) when it is not JSON."""
    with open(os.path.join(run_dir, RUN_FILE), encoding="utf-8") as f:
        return json.load(f)


def read_state_or_none(run_dir: str) -> dict | None:
    """run.json of `run_dir`; None when there is none or it is not (yet) a JSON object."""
    try:
        state = read_state(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) else None


def attempts(state: dict) -> list[dict]:
    """run.json's attempts, oldest first (entries that are not objects left out)."""
    return [a for a in state.get("attempts") or [] if isinstance(a, dict)]


def failed_attempts(state: dict) -> list[dict]:
    """The attempts that failed in a driver that recorded how: CRASHED ones (an attempt of an
    earlier driver of this run, which ended without a record) are left out."""
    return [a for a in attempts(state) if a.get("failure") and a.get("status") != "CRASHED"]


def run_status(run_dir: str, state: dict, lock_known: bool = True) -> tuple[str, str | None]:
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


def parse_rounds(text: bytes | str) -> list[dict]:
    """result.jsonl's rounds; a line torn by a crash ends them."""
    rows = []
    for line in (text.decode("utf-8", "replace") if isinstance(text, bytes) else text).splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def read_rounds(run_dir: str) -> list[dict]:
    """result.jsonl's rounds (parse_rounds); none without the file."""
    try:
        with open(os.path.join(run_dir, ROUNDS_FILE), "rb") as f:
            return parse_rounds(f.read())
    except FileNotFoundError:
        return []


def round_marks(run_dir: str) -> tuple[list[dict], dict | None]:
    """What goodput needs of result.jsonl's rounds, ``{"time", "checkpoint"?}`` each, and the
    last round whole; read line by line, so that the metrics of the other rounds are never held
    (a Result reads them when asked, Result.report_rounds). As parse_rounds, a torn line ends
    them."""
    marks: list[dict] = []
    last = None
    try:
        with open(os.path.join(run_dir, ROUNDS_FILE), "rb") as f:
            for line in f:
                try:
                    row = json.loads(line.decode("utf-8", "replace"))
                except json.JSONDecodeError:
                    break
                if isinstance(row, dict):
                    mark = {"time": row.get("time")}
                    if "checkpoint" in row:
                        mark["checkpoint"] = row["checkpoint"]
                    marks.append(mark)
                last = row
    except FileNotFoundError:
        pass
    return marks, last


def count_rounds(run_dir: str, state: dict) -> int:
    """How many rounds the run recorded: run.json counts them when an attempt ends; while it runs,
    result.jsonl has them."""
    if state.get("status") != "RUNNING":
        return int(state.get("rounds", 0))
    try:
        with open(os.path.join(run_dir, ROUNDS_FILE), "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


class RoundTail:
    """result.jsonl of one run directory read as it grows: each ``new()`` returns the rounds
    appended since the last call. Only whole lines are read (a line still being written is read
    next time); a line that is not a JSON object is skipped; a file replaced by another (a remote
    copy refreshed) is read again from its start. ``open_file``: how the file is opened (a binary
    file object, FileNotFoundError without one); default ``open(path, "rb")``. Thread-safe."""

    def __init__(self, run_dir: str, from_end: bool = False,
                 open_file: Callable[[], BinaryIO] | None = None) -> None:
        self.path = os.path.join(run_dir, ROUNDS_FILE)
        self._open = open_file or (lambda: open(self.path, "rb"))
        self._lock = threading.Lock()
        self.inode: int | None = None  # of the file read so far; None: none yet
        self._offset = 0
        if from_end:
            self.new()

    def new(self) -> list[dict]:
        with self._lock:
            try:
                with self._open() as f:
                    inode = os.fstat(f.fileno()).st_ino
                    if inode != self.inode:
                        self.inode, self._offset = inode, 0
                    f.seek(self._offset)
                    data = f.read()
            except FileNotFoundError:
                self.inode, self._offset = None, 0
                return []
            end = data.rfind(b"\n") + 1
            self._offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows


def read_index(run_dir: str) -> dict | None:
    """checkpoints.json of `run_dir`; None when there is none, or it cannot be read or is not a
    JSON object."""
    try:
        with open(os.path.join(run_dir, INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return index if isinstance(index, dict) else None


def read_error(run_dir: str) -> str | None:
    """error.txt of `run_dir` (undecodable bytes replaced); None without one."""
    try:
        with open(os.path.join(run_dir, ERROR_FILE), encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None
