"""Driver-side callbacks: ``RunConfig(callbacks=[...])``, in the shape of Ray Train V2's
``UserCallback``.

The controller writes ``result.jsonl`` (a line per report round) and ``run.json`` (the attempts)
as the run goes; while ``fit()`` waits, it follows those two files and calls each callback's
hooks in the driver process, in order: ``on_run_start``, then ``after_report`` per round,
``on_straggler`` when a rank starts or stops being a straggler, and ``after_exception`` per failed
attempt (``on_restart`` when the group starts again), and ``on_run_end`` with the Result last.
Hooks run in the driver's thread, never in a worker, and never in parallel with each other.

A hook that raises is reported on stderr with its traceback and that callback is not called again
in this run; the run goes on. A callback with ``raise_on_error = True`` stops the run instead,
and ``fit()`` raises a ControllerError whose ``controller_failure`` is the hook's exception.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxtrain import records
from jaxtrain.checkpoint import Checkpoint
from jaxtrain.errors import ControllerError

if TYPE_CHECKING:
    from jaxtrain.config import RunConfig, ScalingConfig
    from jaxtrain.result import Result


@dataclass
class RunContext:
    """What a callback knows of the run. ``path`` is the run directory on this machine (for a
    run on remote storage, its local staging copy); ``round`` is the report round being
    delivered to ``after_report``; ``attempt`` the attempt that is running, or that failed in
    ``after_exception``."""

    name: str
    path: str
    world_size: int
    run_config: RunConfig
    scaling_config: ScalingConfig
    train_loop_config: dict | None
    round: int = 0
    attempt: int = 0

    def get_run_config(self) -> RunConfig:
        return self.run_config

    def get_scaling_config(self) -> ScalingConfig:
        return self.scaling_config


@dataclass(frozen=True)
class StragglerEvent:
    """A rank started (``slow``) or stopped (not ``slow``) being a straggler: its step time
    (the median of its last intervals between reports) against the other ranks' median, in
    seconds; ``time`` is the controller's Unix time of the change. See docs/observability.md for
    the rule."""

    rank: int
    slow: bool
    step_time_s: float
    median_step_time_s: float
    attempt: int
    time: float


class UserCallback:
    """Subclass and override the hooks you need; each does nothing by default."""

    #: True: a failure of this callback stops the run (``fit()`` raises ControllerError).
    raise_on_error: bool = False

    def on_run_start(self, run_context: RunContext) -> None:
        """Before the first worker starts."""

    def after_report(self, run_context: RunContext, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        """After a report round is recorded. ``metrics`` is ``[rank 0's metrics]`` (Ray passes
        every rank's; jaxtrain's controller keeps rank 0's only); ``checkpoint`` the round's
        committed checkpoint, or None. ``run_context.round`` is the round."""

    def after_exception(self, run_context: RunContext,
                        worker_exceptions: dict[int, Exception]) -> None:
        """After an attempt failed: the failing rank and its error (``run_context.attempt``
        is the failed attempt). ``on_restart`` follows when the group is started again."""

    def on_straggler(self, run_context: RunContext, event: StragglerEvent) -> None:
        """When a rank starts or stops being a straggler (``event.slow``); said once for each
        change. ``run_context.attempt`` is the attempt it happened in."""

    def on_restart(self, run_context: RunContext) -> None:
        """When the group starts again after a failure (``run_context.attempt`` is the new
        attempt), from the latest committed checkpoint."""

    def on_run_end(self, run_context: RunContext, result: Result) -> None:
        """When the run has ended, with its Result (``result.error`` is set when it failed),
        before ``fit()`` returns or raises."""


@dataclass
class _CallbackFailure:
    callback: UserCallback
    hook: str
    error: BaseException


@dataclass
class Dispatcher:
    """Follows a run directory and calls the callbacks. Not thread-safe: the driver's thread
    calls ``poll`` while it waits, and ``finish`` once at the end."""

    callbacks: list[UserCallback]
    context: RunContext
    _rounds: records.RoundTail | None = None  # result.jsonl from where the run starts
    _attempts_seen: int = 0  # entries of run.json's attempts already handled
    _stragglers_seen: int = 0  # straggler changes of attempts[_attempts_seen] already handled
    _state_stamp: tuple = ()
    _started: int = 0  # the newest attempt whose start was seen
    _failed: set[int] = field(default_factory=set)  # callbacks (by index) not called again
    fatal: _CallbackFailure | None = None

    @classmethod
    def start(cls, trainer: Any, run_dir: str) -> Dispatcher:
        """Called before the controller starts: what the run directory holds now (rounds and
        attempts of earlier runs of the same name) is not delivered again."""
        context = RunContext(name=trainer.run_config.name, path=run_dir,
                             world_size=trainer.scaling_config.max_workers,
                             run_config=trainer.run_config, scaling_config=trainer.scaling_config,
                             train_loop_config=trainer.train_loop_config)
        d = cls(list(trainer.run_config.callbacks), context)
        d._rounds = records.RoundTail(run_dir, from_end=True)
        state = records.read_state_or_none(run_dir) or {}
        d._attempts_seen = len(records.attempts(state))
        d.context.attempt = d._started = d._attempts_seen
        d._call("on_run_start", context)
        return d

    def poll(self, state: dict | None = None) -> bool:
        """Delivers what the run directory gained since the last call, in the order it
        happened; True when a ``raise_on_error`` callback failed and the run must be stopped.
        `state`: run.json as the run left it (the controller's outcome carries it); None: read
        from the run directory when it changed."""
        events = self._new_rounds() + self._new_attempt_events(state)
        events.sort(key=lambda e: (e[0], e[1]))  # by the controller's clock; rounds first
        for _, _, hook, attempt_or_round, args in events:
            if self.fatal is not None:
                break
            if hook == "after_report":
                self.context.round = attempt_or_round
            else:
                self.context.attempt = attempt_or_round
            self._call(hook, self.context, *args)
        return self.fatal is not None

    def finish(self, result: Result, state: dict | None = None) -> None:
        """Delivers the rest, then ``on_run_end``; `state`: the run's last run.json, as poll()
        takes it. Raises ControllerError when a callback with ``raise_on_error`` failed."""
        self.poll(state)
        if self.fatal is None:
            self._call("on_run_end", self.context, result)
        if self.fatal is not None:
            raise ControllerError(
                f"Training stopped: {self.fatal_reason()} (the callback has raise_on_error=True)",
                controller_failure=self.fatal.error) from self.fatal.error

    def _new_rounds(self) -> list[tuple]:
        if self._rounds is None:
            return []
        events = []
        for row in self._rounds.new():
            name = row.get("checkpoint")
            checkpoint = Checkpoint(os.path.join(self.context.path, name)) if name else None
            events.append((row.get("time", 0.0), 0, "after_report", int(row.get("round", 0)),
                           ([row.get("metrics", {})], checkpoint)))
        return events

    def _new_attempt_events(self, state: dict | None = None) -> list[tuple]:
        if state is None:
            state = self._changed_state()
        if state is None:
            return []
        events = []
        for a in records.attempts(state)[self._attempts_seen:]:
            number = a.get("attempt", 0)
            if number > self._started:
                self._started = number
                events.append((a.get("start_time", 0.0), 1, "on_restart", number, ()))
            stragglers = a.get("stragglers", [])
            for e in stragglers[self._stragglers_seen:]:
                event = StragglerEvent(rank=int(e.get("rank", -1)), slow=bool(e.get("slow")),
                                       step_time_s=float(e.get("step_time_s", 0.0)),
                                       median_step_time_s=float(e.get("median_step_time_s", 0.0)),
                                       attempt=number, time=float(e.get("time", 0.0)))
                events.append((event.time, 1, "on_straggler", number, (event,)))
            self._stragglers_seen = len(stragglers)
            if a.get("status") == "RUNNING":
                break  # looked at again when it ends
            self._attempts_seen += 1
            self._stragglers_seen = 0
            failure = a.get("failure")
            if failure:
                rank = failure.get("rank", -1)
                error = RuntimeError(
                    f"rank {rank} (host {failure.get('host') or '?'}, attempt {number}) "
                    f"{failure.get('cause')}: {failure.get('message')}")
                events.append((a.get("end_time", 0.0), 1, "after_exception", number,
                               ({rank: error},)))
        return events

    def _changed_state(self) -> dict | None:
        """run.json when it changed since it was last read; None when it did not (or cannot be
        read yet)."""
        path = os.path.join(self.context.path, records.RUN_FILE)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._state_stamp:
            return None
        state = records.read_state_or_none(self.context.path)
        if state is None:
            return None  # rewritten atomically, so a race with the rename; read it next time
        self._state_stamp = stamp
        return state

    def _call(self, hook: str, *args: Any) -> None:
        for i, callback in enumerate(self.callbacks):
            if i in self._failed:
                continue
            try:
                getattr(callback, hook)(*args)
            except Exception as e:  # noqa: BLE001 -- a callback's bug must not end the run
                self._failed.add(i)
                name = f"{type(callback).__name__}.{hook}"
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
                if callback.raise_on_error:
                    self.fatal = _CallbackFailure(callback, hook, e)
                    print(f"jaxtrain: callback {name} failed; it has raise_on_error=True, so "
                          f"the run is stopped:\n{tb}", file=sys.stderr, flush=True)
                    return
                print(f"jaxtrain: callback {name} failed; the run goes on without it (set "
                      f"raise_on_error = True on the callback to stop the run instead):\n{tb}",
                      file=sys.stderr, flush=True)

    def fatal_reason(self) -> str:
        f = self.fatal
        assert f is not None
        return f"callback {type(f.callback).__name__}.{f.hook} raised {f.error!r}"
