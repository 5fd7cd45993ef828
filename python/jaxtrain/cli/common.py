"""What every ``jaxtrain`` command shares: exit statuses, usage errors, messages, tables."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """The command line asks for something that cannot be: exit status 2, message on stderr."""


def say(message: str) -> None:
    sys.stderr.write(f"jaxtrain: {message}\n")
    sys.stderr.flush()


def table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )



class _ReaderMayLeave:
    """A text stream whose reader may go away (``jaxtrain run ... | head``): once a write or flush
    finds the pipe closed, its file descriptor is pointed at /dev/null, so what the driver, the
    controller and a local-mode training function write next is dropped instead of failing."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        self._stream.flush()  # what was left in the buffer goes to /dev/null now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def outlive_readers() -> Iterator[None]:
    """Within it, stdout and stderr whose reader leaves are written to /dev/null from then on
    (_ReaderMayLeave), so a run ends with its own status whether or not anyone still reads its
    output. On leaving, both are flushed and put back."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ReaderMayLeave(sys.stdout), _ReaderMayLeave(sys.stderr)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
