"""Goodput accounting: where a run's wall time went, from its run directory's records.

The one definition of the parts (docs/observability.md); the end-of-``fit()`` line,
``Result.goodput``, ``jaxtrain show`` and any dashboard or metrics endpoint read them from here.
Every time comes from the driver's clock, as the controller records it: ``run.json``'s run and
attempt times (``start_time``, ``ready_time``, ``returned_time``, ``end_time``, ``failure.time``,
``queue_wait_s``)
and ``result.jsonl``'s round times (a round is recorded once every rank reported it and, for a
round with a checkpoint, once the checkpoint is committed).

An attempt's time, from its ``start_time`` to the next attempt's ``start_time`` when it failed and
was restarted, else to its ``end_time``, is split at these moments::

    start_time -start-up-> ready_time -compile-> first report -training-> ...
      failed:    ... the restored checkpoint's report -lost-> failure -restart-> next start
      otherwise: ... every function returned -shutdown-> end_time
      no report: start_time -start-up-> ready_time -compile-> every function returned
                 -shutdown-> end_time (training cannot be told from compilation: none)

An attempt's own ``queue_wait_s`` (its launch waited for Kueue to admit its JobSet, or for a new
Slurm allocation) is taken out of its start-up into ``queue``; an attempt whose ``phase`` is
``queued`` (its launch waits now) has all its time so far in ``queue``.

The run adds the driver's own time: the queue wait before it (``queue_wait_s``), its start-up
before the first attempt, and its shutdown after the last. Attempts of an earlier driver of the
same run directory (a resumed run) count from their start to their end; the time between drivers
belongs to no run and is not counted.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from dataclasses import dataclass
from typing import Any

from jaxtrain import records

# The parts, in the order a run goes through them, with the names the line and the table use.
PARTS: dict[str, str] = {
    "queue": "queue",
    "startup": "start-up",
    "compile": "compile",
    "training": "training",
    "checkpoint_blocked": "checkpoints",
    "restart": "restarts",
    "lost": "lost",
    "shutdown": "shutdown",
}


@dataclass(frozen=True)
class Goodput:
    """Seconds of a run's (or one attempt's) wall time in each part; they add up to ``wall``.

    ``queue``: waiting for capacity (a Slurm allocation the driver asked for). ``startup``: the
    driver's start-up, then each attempt's launch until every rank had started and registered
    (processes, Python, jaxtrain). ``compile``: from then to the attempt's first report: ``import
    jax``, ``jax.distributed.initialize``, the checkpoint's restore and the first step's
    compilation. ``training``: productive time, from an attempt's first report to its last (to
    the return of its last rank's function when it finished), less what a restart redid.
    ``checkpoint_blocked``: training blocked by checkpoints (not recorded by this version: always
    0, inside ``training``). ``restart``: from noticing a failure through
    stopping the group and choosing the checkpoint to the next attempt's launch (or the end of
    the run). ``lost``: progress a restart redid, from the report of the checkpoint it restored
    (or the attempt's first report) to the failure. ``shutdown``: from the return of an attempt's
    last function (an older run.json: its last report) to its end (``jax.distributed.shutdown``,
    the processes' exit), and the driver's end. ``fraction``: ``training / wall``.

    For the run, ``attempts`` holds each attempt's own Goodput (``attempt``, ``status`` and
    ``cause`` set); an attempt's own ``attempts`` is empty. ``live``: the run was still running,
    counted up to the time asked for. ``reported``: a round was reported (in the attempt; for
    the run, in any attempt). Without one, training cannot be told from import and compilation:
    the function's time is ``compile``, and ``line()`` says that goodput was not measured.
    """

    queue: float = 0.0
    startup: float = 0.0
    compile: float = 0.0
    training: float = 0.0
    checkpoint_blocked: float = 0.0
    restart: float = 0.0
    lost: float = 0.0
    shutdown: float = 0.0
    attempt: int | None = None  # None for the run
    status: str = ""
    cause: str | None = None  # the attempt's failure cause
    attempts: tuple[Goodput, ...] = ()
    live: bool = False
    reported: bool = True

    @property
    def wall(self) -> float:
        """Seconds in all: the sum of the parts."""
        return sum(getattr(self, name) for name in PARTS)

    @property
    def fraction(self) -> float:
        """The goodput: productive training over wall time, 0 for no time."""
        wall = self.wall
        return self.training / wall if wall > 0 else 0.0

    def parts(self) -> dict[str, float]:
        """The seconds of each part, by field name, in PARTS' order."""
        return {name: getattr(self, name) for name in PARTS}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the parts, ``wall``, ``fraction`` and, for the run, ``attempts``."""
        d: dict[str, Any] = self.parts()
        d.update(wall=self.wall, fraction=self.fraction)
        if self.attempt is None:
            d.update(live=self.live, attempts=[a.to_dict() for a in self.attempts])
        else:
            d.update(attempt=self.attempt, status=self.status, cause=self.cause)
        return d

    def line(self) -> str:
        """One line: the fraction, training of the wall time, and every other non-zero part; for
        a run without a report, that goodput was not measured and where the time went."""
        others = ", ".join(f"{PARTS[name]} {seconds:.1f} s"
                           for name, seconds in self.parts().items()
                           if name != "training" and round(seconds, 1) > 0)
        if not self.reported:
            return ("goodput not measured: the training function never called report(), so "
                    "training cannot be told from import and compilation "
                    f"({self.wall:.1f} s in all" + (f": {others})" if others else ")"))
        text = (f"goodput {100 * self.fraction:.1f} % (training {self.training:.1f} s of "
                f"{self.wall:.1f} s")
        return text + (f"; {others})" if others else ")")

    def table(self) -> list[str]:
        """The run and each attempt, one row each: seconds per part, wall and goodput."""
        names = list(PARTS)
        head = ["", "status"] + [PARTS[n] for n in names] + ["wall", "goodput"]
        rows = [head]
        for g in (self, *self.attempts):
            label = "run" if g.attempt is None else f"attempt {g.attempt}"
            status = g.status + (f" ({g.cause})" if g.cause else "")
            rows.append([label, status] + [f"{getattr(g, n):.1f}" for n in names]
                        + [f"{g.wall:.1f}", f"{100 * g.fraction:.1f} %"])
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                          for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                for r in rows]


def compute(state: dict, rounds: list[dict], now: float | None = None,
            this_driver: bool = False) -> Goodput:
    """The Goodput of a run from its records: ``state`` is run.json, ``rounds`` result.jsonl's
    lines (``{"round", "time", "checkpoint"?, ...}``). ``now``: where a RUNNING run's time ends;
    None ends it at its last recorded time. ``this_driver``: only the last driver's part of a
    resumed run (its own attempts, start-up and shutdown), as the end of its ``fit()`` says it.
    Pure: reads nothing else."""
    status = str(state.get("status", ""))
    live = status == "RUNNING"
    attempts = records.attempts(state)
    reported = sorted((float(r["time"]), r.get("checkpoint")) for r in rounds
                      if isinstance(r, dict) and _number(r.get("time")) is not None)
    driver_start = _number(state.get("start_time"))
    end = _number(state.get("end_time")) if not live else now
    if end is None:  # a live run without `now`: its last recorded time
        known = [t for a in attempts for t in _times(a)] + [t for t, _ in reported]
        end = max(known + ([driver_start] if driver_start is not None else []), default=0.0)

    per_attempt = []
    for i, a in enumerate(attempts):
        following = attempts[i + 1] if i + 1 < len(attempts) else None
        per_attempt.append(_attempt(a, following, reported, end if live else None))
    if this_driver and driver_start is not None:
        kept = [(a, g) for a, g in zip(attempts, per_attempt, strict=True)
                if (_number(a.get("start_time")) or 0.0) >= driver_start]
        attempts, per_attempt = [a for a, _ in kept], [g for _, g in kept]

    run = dict.fromkeys(PARTS, 0.0)
    for g in per_attempt:
        for name, seconds in g.parts().items():
            run[name] += seconds
    if driver_start is not None:
        run["queue"] += max(0.0, _number(state.get("queue_wait_s")) or 0.0)
        # This driver's attempts: those it started; the rest were an earlier driver's.
        own = [(a, g) for a, g in zip(attempts, per_attempt, strict=True)
               if (_number(a.get("start_time")) or 0.0) >= driver_start]
        if own:
            first_start = _number(own[0][0].get("start_time")) or driver_start
            run["startup"] += first_start - driver_start
            last, counted = own[-1]
            run["shutdown"] += max(0.0, end - (_number(last.get("start_time")) or 0.0)
                                   - counted.wall)
        else:
            run["startup"] += max(0.0, end - driver_start)
    return Goodput(**run, status=status, attempts=tuple(per_attempt), live=live,
                   reported=any(g.reported for g in per_attempt) or bool(reported))


def _attempt(a: dict, following: dict | None, reported: list[tuple[float, Any]],
             now: float | None) -> Goodput:
    """One attempt's parts (module docstring); `now` ends a RUNNING attempt of a live run."""
    start = _number(a.get("start_time")) or 0.0
    status = str(a.get("status", ""))
    failure = a.get("failure") if isinstance(a.get("failure"), dict) else None
    failed_at = _number(failure.get("time")) if failure else None
    ended = _number(a.get("end_time"))
    if ended is None:  # RUNNING (to now), or CRASHED: its driver left no end; its last record
        ended = now if status == "RUNNING" and now is not None else max(_times(a) + [start])
    restarted = (failure is not None and following is not None
                 and (failure.get("decision") or {}).get("action") == "retry"
                 and _number(following.get("start_time")) is not None)
    span_end = max(ended, _number(following.get("start_time"))) if restarted else ended
    stop = _clamp(failed_at if failed_at is not None else ended, start, span_end)
    times = [t for t, _ in reported if start <= t <= stop]
    ready = _number(a.get("ready_time"))
    if ready is None and times:
        ready = times[0]  # not recorded (an older run.json): start-up until the first report
    parts = dict.fromkeys(PARTS, 0.0)
    if ready is None:  # never started training
        parts["startup"] = stop - start
    else:
        ready = _clamp(ready, start, stop)
        parts["startup"] = ready - start
        times = [t for t in times if t >= ready]
        first = times[0] if times else ready
        parts["compile"] = first - ready
        if failed_at is not None:
            # Kept: up to the report of the checkpoint the next attempt restored (without one,
            # the latest checkpoint reported in this attempt); the rest is redone. A commit that
            # ended after the failure was noticed kept everything before it.
            kept = first
            restored = (following or {}).get("restored_from") if restarted else None
            for t, checkpoint in reported:
                if checkpoint and first <= t < span_end and (
                        restored is None or _same_checkpoint(checkpoint, restored)):
                    kept = min(t, stop)
            parts["training"] = kept - first
            parts["lost"] = stop - kept
        elif not times:
            # No report (yet): training cannot be told from import and compilation. A finished
            # attempt's function ran up to its return; what follows is shutdown.
            returned = _number(a.get("returned_time"))
            trained = _clamp(returned, ready, stop) if returned is not None else stop
            parts["compile"] = trained - ready
            parts["shutdown"] = stop - trained
        elif status == "RUNNING" and now is not None:
            parts["training"] = stop - first
        else:
            # Training ends when the last rank's function returned (steps after the last
            # report are training too); an older run.json without that time: at the last report.
            returned = _number(a.get("returned_time"))
            trained = _clamp(returned, times[-1], stop) if returned is not None else times[-1]
            parts["training"] = trained - first
            parts["shutdown"] = stop - trained
    # The launch's wait in a queue (Kueue's admission, a new Slurm allocation) is inside its
    # start-up: `queue`, not start-up. An attempt still queued has waited all its time so far.
    waited = (stop - start if a.get("phase") == "queued"
              else max(0.0, _number(a.get("queue_wait_s")) or 0.0))
    parts["queue"] = min(waited, parts["startup"])
    parts["startup"] -= parts["queue"]
    if failed_at is not None:
        parts["restart"] = span_end - stop
    else:
        parts["shutdown"] += span_end - stop
    return Goodput(**parts, attempt=int(a.get("attempt", 0)), status=status,
                   cause=failure.get("cause") if failure else None, reported=bool(times))


def from_run_dir(path_or_url: str | os.PathLike, now: float | None = None,
                 storage_filesystem: Any = None) -> Goodput:
    """The Goodput of the run directory at a local path or a URL (``s3://``, ``gs://``, any
    fsspec URL; or a path on ``storage_filesystem``). Reads run.json and result.jsonl only. A
    RUNNING run is counted up to ``now`` (default: the current time)."""
    from jaxtrain import storage

    path = os.fspath(path_or_url)
    remote = storage.remote_filesystem(path, storage_filesystem, field="goodput path")
    if remote is None:
        local = os.path.abspath(path.removeprefix("file://"))

        def read(name: str) -> bytes | None:
            try:
                with open(os.path.join(local, name), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
    else:
        fs, root = remote

        def read(name: str) -> bytes | None:
            try:
                return fs.cat_file(posixpath.join(root, name))
            except FileNotFoundError:
                return None
    text = read(records.RUN_FILE)
    if text is None:
        raise FileNotFoundError(f"'{path}' is not a jaxtrain run directory: it has no run.json")
    state = json.loads(text)
    return compute(state, records.parse_rounds(read(records.ROUNDS_FILE) or b""),
                   now=time.time() if now is None else now)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return float(value)
    return None


def _times(a: dict) -> list[float]:
    """An attempt's recorded times."""
    failure = a.get("failure") if isinstance(a.get("failure"), dict) else {}
    values = (a.get("start_time"), a.get("ready_time"), a.get("end_time"), failure.get("time"))
    return [t for t in map(_number, values) if t is not None]


def _clamp(t: float, low: float, high: float) -> float:
    return min(max(t, low), high)


def _same_checkpoint(name: str, restored: str) -> bool:
    """result.jsonl names a checkpoint by its directory name, run.json by its path."""
    return os.path.basename(str(restored).rstrip("/")) == os.path.basename(str(name).rstrip("/"))

