"""The user's code as it travels to the workers and as its failures come back.

cloudpickle ships functions defined in ``__main__`` (or in a notebook) by value, and writes every
code object's file name as ``<dynamic-code>``: a worker's traceback then shows neither the file nor
the source line. ``dumps`` pickles with cloudpickle but keeps each code object's ``co_filename``
and sends the source lines of its file with it (once per file, at most SOURCE_LIMIT bytes), which
the worker puts into ``linecache`` when it unpickles, so a traceback shows the line even on a host
that does not have the file. ``user_traceback`` formats an exception without jaxtrain's own frames
that ran the function (the worker's entry point, ``jaxtrain run``'s ``runpy``).

Imported by the worker when it unpickles a payload: it imports nothing but the standard library
(and cloudpickle, for ``dumps`` only).
"""

from __future__ import annotations

import linecache
import os
import runpy
import traceback
import types
from typing import Any

# The most bytes of one file's source sent with its code objects; a larger file's lines are read
# by the worker from its own copy, where it has one.
SOURCE_LIMIT = 1 << 20

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# runpy's frames (``jaxtrain run``'s script): by its file, or as a frozen module (Python 3.11+).
_RUNPY = (os.path.abspath(runpy.__file__), "<frozen runpy>")


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, with the file names and source lines of the code it pickles by
    value. Raises what cloudpickle raises."""
    import io

    buffer = io.BytesIO()
    _pickler_class()(buffer).dump(obj)
    return buffer.getvalue()


_PICKLER: type | None = None


def _pickler_class() -> type:
    global _PICKLER
    if _PICKLER is None:
        from collections import ChainMap

        import cloudpickle

        class Pickler(cloudpickle.Pickler):
            def __init__(self, file) -> None:
                # The C pickler reads dispatch_table when it is initialised: set it first.
                self.dispatch_table = ChainMap({types.CodeType: self._reduce_code},
                                               cloudpickle.Pickler.dispatch_table)
                self._sources: dict[str, list[str] | None] = {}
                super().__init__(file)

            def _reduce_code(self, code: types.CodeType):
                rebuild, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
                filename = code.co_filename
                if filename not in self._sources:
                    self._sources[filename] = _source(filename)
                # The same list object for every code object of a file: pickled once.
                return _restore_code, (rebuild, args, filename, self._sources[filename])

        _PICKLER = Pickler
    return _PICKLER


def _source(filename: str) -> list[str] | None:
    lines = linecache.getlines(filename)  # a file, or a notebook cell that IPython registered
    if not lines or sum(len(line) for line in lines) > SOURCE_LIMIT:
        return None
    return lines


def _restore_code(rebuild: Any, args: tuple, filename: str,
                  lines: list[str] | None) -> types.CodeType:
    """The unpickled code object with its own file name; its file's lines go into linecache."""
    if lines is not None:
        # An mtime of None: linecache.checkcache keeps the entry (it has no file to compare).
        linecache.cache[filename] = (sum(len(line) for line in lines), None, lines, filename)
    return rebuild(*args).replace(co_filename=filename)


def _own_frame(tb: types.TracebackType) -> bool:
    filename = tb.tb_frame.f_code.co_filename
    if filename in _RUNPY:
        return True
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def user_traceback(exc: BaseException) -> str:
    """The traceback of `exc` as Python prints it, less the outermost frames that are jaxtrain's
    own (or runpy's) and called the user's code; all of it when every frame is jaxtrain's (the
    failure is jaxtrain's, not the function's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and _own_frame(tb):
        tb = tb.tb_next
    if tb is not None and _own_frame(tb):
        tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb))
