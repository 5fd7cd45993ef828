"""Exceptions raised by jaxtrain."""

from __future__ import annotations


class TrainingFailedError(RuntimeError):
    """A run ended because a worker failed. ``fit()`` raises it; ``Result.error`` holds it.

    Attributes name the first failing rank: ``rank``, ``host``, ``attempt``, ``cause`` (one of
    "exception", "exit", "signal", "oom", "connection", "watchdog", "start-up", "checkpoint",
    "storage", "preemption"), ``exit_code`` (the status its process exited with, else None),
    ``signal`` (the signal that ended it, else None), ``status_code`` (for "storage" and
    "checkpoint": the error's code, e.g. "RESOURCE_EXHAUSTED" for a full disk, else None),
    ``worker_traceback``
    (the worker's Python traceback, when it raised), ``log_path`` and ``log_tail``. ``rank`` is
    -1 when no rank failed but the driver did: its run directory could not be written
    ("storage"), or the group could not be started; or when the ranks' parts of a checkpoint
    disagree ("checkpoint": two ranks wrote one file name with different contents).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int = -1,
        host: str = "",
        attempt: int = 0,
        cause: str = "",
        exit_code: int | None = None,
        signal: int | None = None,
        status_code: str | None = None,
        worker_traceback: str = "",
        log_path: str = "",
        log_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.attempt = attempt
        self.cause = cause
        self.exit_code = exit_code
        self.signal = signal
        self.status_code = status_code
        self.worker_traceback = worker_traceback
        self.log_path = log_path
        self.log_tail = log_tail

    @classmethod
    def from_failure(cls, f: dict, attempts: list[dict] | None = None) -> TrainingFailedError:
        """The error for the first failure `f`; `attempts` lists every failed attempt. It is a
        ControllerError when the failure that ended the run was a group that could not start,
        a WorkerGroupError otherwise."""
        who = _who(f)
        where = f"{who} (host {f['host'] or '?'}, attempt {f['attempt']})"
        lines = [f"Training failed: {where}: {f['message']}"]
        if attempts and len(attempts) > 1:
            lines += ["", f"Every failed attempt ({len(attempts)}; the restart budget is spent):"]
            lines += [
                f"  attempt {a['attempt']}: "
                f"{_who(a)}, "
                f"{a['cause']}: {a['message']}"
                for a in attempts
            ]
        if f["traceback"]:
            lines += ["", f"Traceback from rank {f['rank']}:", f["traceback"].rstrip()]
        elif f["log_tail"]:
            lines += ["", f"Last lines of rank {f['rank']}'s log:", f["log_tail"].rstrip()]
        if f["log_path"]:
            lines += ["", f"Full log: {f['log_path']}"]
        last = attempts[-1] if attempts else f
        kind = cls
        extra: dict = {}
        if cls is TrainingFailedError:
            kind = ControllerError if last["cause"] == "start-up" else WorkerGroupError
            if last["cause"] == "preemption":
                kind = PreemptionError
                extra = PreemptionError._details(last.get("preemption"))
        return kind(
            "\n".join(lines),
            rank=f["rank"],
            host=f["host"],
            attempt=f["attempt"],
            cause=f["cause"],
            exit_code=f.get("exit_code"),
            signal=f.get("signal"),
            status_code=f.get("status_code"),
            worker_traceback=f["traceback"],
            log_path=f["log_path"],
            log_tail=f["log_tail"],
            **extra,
        )


def _who(failure: dict) -> str:
    """Whom a failure blames: its rank, else the checkpoint commit (the ranks' parts of a
    checkpoint disagree) or the driver."""
    if failure["rank"] >= 0:
        return f"rank {failure['rank']}"
    return "the checkpoint commit" if failure.get("cause") == "checkpoint" else "the driver"


class WorkerGroupError(TrainingFailedError):
    """A run ended because a worker failed: its function raised, it exited or was killed, it lost
    its connection or made no progress (as Ray Train V2's ``WorkerGroupError``).

    ``worker_failures`` maps the failing rank to an exception that carries its message and, when
    the function raised, its traceback.
    """

    @property
    def worker_failures(self) -> dict[int, Exception]:
        text = str(self).split("\n", 1)[0]
        if self.worker_traceback:
            text += "\n\n" + self.worker_traceback.rstrip()
        return {self.rank: RuntimeError(text)} if self.rank >= 0 else {}


class ControllerError(TrainingFailedError):
    """A run ended because its worker group could not be started, more often than
    ``FailureConfig.controller_failure_limit`` allows, or because a callback marked
    ``raise_on_error`` failed (as Ray Train V2's ``ControllerError``). ``controller_failure``
    is the underlying exception."""

    def __init__(self, message: str, *, controller_failure: BaseException | None = None,
                 **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.controller_failure: BaseException = controller_failure or RuntimeError(message)


class PreemptionError(TrainingFailedError):
    """A run ended by preemptions, more of them than ``FailureConfig.max_preemption_failures``
    allows (as Ray Train V2's ``PreemptionError``; docs/preemption.md). ``preemption_info`` is
    the last preemption's ``PreemptionInfo``; ``drain_timed_out`` is True when its deadline
    passed before a checkpoint reported after the notice was committed (the group was then
    stopped by jaxtrain), False when the commit (or the preempted workers' end) came first."""

    def __init__(self, message: str, *, preemption_info=None, drain_timed_out: bool = False,
                 **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.preemption_info = preemption_info
        self.drain_timed_out = drain_timed_out

    @staticmethod
    def _details(record) -> dict:
        """The keyword arguments for a failure record's "preemption" (JSON text or a dict)."""
        import json

        from jaxtrain.preemption import PreemptionInfo

        if not record:
            return {}
        j = json.loads(record) if isinstance(record, str) else record
        return {"preemption_info": PreemptionInfo._from_json(json.dumps(j)),
                "drain_timed_out": bool(j.get("drain_timed_out", False))}
