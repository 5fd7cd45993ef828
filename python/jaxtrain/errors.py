"""Exceptions raised by jaxtrain."""

from __future__ import annotations


class TrainingFailedError(RuntimeError):
    """A run ended because a worker failed. ``fit()`` raises it; ``Result.error`` holds it.

    Attributes name the first failing rank: ``rank``, ``host``, ``attempt``, ``cause`` (one of
    "exception", "exit", "signal", "oom", "connection", "watchdog", "start-up", "checkpoint",
    "storage"), ``worker_traceback`` (the worker's Python traceback, when it raised),
    ``log_path`` and ``log_tail``. ``rank`` is -1 when no rank failed but the driver did: its
    run directory could not be written ("storage"), or the group could not be started.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int = -1,
        host: str = "",
        attempt: int = 0,
        cause: str = "",
        worker_traceback: str = "",
        log_path: str = "",
        log_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.attempt = attempt
        self.cause = cause
        self.worker_traceback = worker_traceback
        self.log_path = log_path
        self.log_tail = log_tail

    @classmethod
    def from_failure(cls, f: dict, attempts: list[dict] | None = None) -> TrainingFailedError:
        """The error for the first failure `f`; `attempts` lists every failed attempt."""
        who = f"rank {f['rank']}" if f["rank"] >= 0 else "the driver"
        where = f"{who} (host {f['host'] or '?'}, attempt {f['attempt']})"
        lines = [f"Training failed: {where}: {f['message']}"]
        if attempts and len(attempts) > 1:
            lines += ["", f"Every failed attempt ({len(attempts)}; the restart budget is spent):"]
            lines += [
                f"  attempt {a['attempt']}: "
                f"{'rank ' + str(a['rank']) if a['rank'] >= 0 else 'the driver'}, "
                f"{a['cause']}: {a['message']}"
                for a in attempts
            ]
        if f["traceback"]:
            lines += ["", f"Traceback from rank {f['rank']}:", f["traceback"].rstrip()]
        elif f["log_tail"]:
            lines += ["", f"Last lines of rank {f['rank']}'s log:", f["log_tail"].rstrip()]
        if f["log_path"]:
            lines += ["", f"Full log: {f['log_path']}"]
        return cls(
            "\n".join(lines),
            rank=f["rank"],
            host=f["host"],
            attempt=f["attempt"],
            cause=f["cause"],
            worker_traceback=f["traceback"],
            log_path=f["log_path"],
            log_tail=f["log_tail"],
        )
