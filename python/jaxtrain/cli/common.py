"""What every ``jaxtrain`` command shares: exit statuses, usage errors, messages, tables."""

from __future__ import annotations

import sys
from collections.abc import Sequence

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

