"""The training function of ``jaxtrain run``: runs the user's script in every worker."""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any


def run_script(config: dict) -> None:
    """Runs ``config["script"]`` (a path) or ``config["module"]`` as ``__main__`` with
    ``sys.argv = [script, *config["args"]]``, in a worker where jax.distributed is initialised.

    A script's ``sys.exit(0)`` is a success; ``sys.exit(n)`` ends the worker with status n, which
    ``jaxtrain run`` returns.
    """
    _make_initialize_idempotent()
    args = list(config.get("args") or [])
    try:
        if config.get("module"):
            # As `python -m`: the working directory first on the path; run_module sets argv[0].
            sys.path.insert(0, os.getcwd())
            sys.argv = [config["module"], *args]
            runpy.run_module(config["module"], run_name="__main__", alter_sys=True)
        else:
            # As `python script.py`: the script's directory first on the path.
            script = config["script"]
            sys.path.insert(0, os.path.dirname(script))
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = _python_exit_status(e.code)
        if status:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def _python_exit_status(code: Any) -> int:
    """The status `python script.py` exits with after ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code % 256
    sys.stderr.write(f"{code}\n")
    return 1


def _make_initialize_idempotent() -> None:
    """Scripts written for plain JAX call ``jax.distributed.initialize()`` themselves; in a
    ``jaxtrain run`` worker it is already initialised, so a second call does nothing."""
    import jax
    import jax.distributed

    original = jax.distributed.initialize
    if getattr(original, "_jaxtrain_idempotent", False):
        return

    def initialize(*args: Any, **kwargs: Any) -> None:
        if _distributed_initialized():
            return None
        return original(*args, **kwargs)

    initialize.__doc__ = original.__doc__
    initialize._jaxtrain_idempotent = True  # type: ignore[attr-defined]
    jax.distributed.initialize = initialize


def _distributed_initialized() -> bool:
    import jax.distributed

    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None:
        return bool(is_initialized())
    from jax._src import distributed  # jax < 0.6 has no public is_initialized()

    return distributed.global_state.client is not None

