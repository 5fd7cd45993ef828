"""Collectives across the workers of a run, as Ray Train V2's ``ray.train.collective``:
``barrier()`` and ``broadcast_from_rank_zero(data)``.

    from jaxtrain.collective import barrier, broadcast_from_rank_zero

They go through the controller over each worker's control connection, not through JAX: they work
before any JAX collective, after one, and in a group where a JAX collective would hang. Every rank
must make the same calls in the same order; ranks that do not (one calls ``barrier()`` while
another calls ``broadcast_from_rank_zero()``, or one returns from the training function while the
others wait) fail the attempt with a message naming the ranks and their calls, and a rank that
fails while the others wait ends the attempt as any failure does. There is no timeout of their
own: while ranks wait, the controller names the ranks missing every 60 s, and the progress
watchdog (on by default, ``FailureConfig(progress_timeout_s=...)``) ends a group that stays stuck.
"""

from __future__ import annotations

import pickle
from typing import TypeVar

from jaxtrain import _core
from jaxtrain.session import require

__all__ = ["barrier", "broadcast_from_rank_zero"]

# The most bytes that broadcast_from_rank_zero() carries: rank 0's object, pickled.
MAX_BROADCAST_BYTES: int = _core.MAX_BROADCAST_BYTES

T = TypeVar("T")


def broadcast_from_rank_zero(data: T) -> T:
    """Broadcasts small data from the rank 0 worker to all other workers, and returns it on every
    rank; the other ranks' ``data`` is ignored.

    Serves as a barrier: every worker must call it before any returns. Rank 0's ``data`` is
    pickled (with cloudpickle) and may be up to ``MAX_BROADCAST_BYTES`` (1 MiB) pickled; every rank,
    rank 0 too, gets an unpickled copy.

    Raises:
        ValueError: on rank 0, when the pickled data is larger than ``MAX_BROADCAST_BYTES``
            (nothing is sent; write large data to a file and broadcast its path).
        pickle.PicklingError, TypeError: on rank 0, when the data cannot be pickled.
        RuntimeError: outside the training function that ``JaxTrainer.fit()`` runs.
    """
    session = require("collective.broadcast_from_rank_zero")
    payload = b""
    if session.context.world_rank == 0 and session.client is not None:
        import cloudpickle

        payload = cloudpickle.dumps(data)
        if len(payload) > MAX_BROADCAST_BYTES:
            raise ValueError(
                f"broadcast_from_rank_zero(data): the data is {len(payload)} bytes pickled, more "
                f"than the limit of {MAX_BROADCAST_BYTES} (MAX_BROADCAST_BYTES); broadcast small "
                "objects only: write large data to a file and broadcast its path")
    released = session.collective(broadcast=True, payload=payload)
    return data if released is None else pickle.loads(released)


def barrier() -> None:
    """Waits until every worker has called ``barrier()``.

    Raises:
        RuntimeError: outside the training function that ``JaxTrainer.fit()`` runs.
    """
    require("collective.barrier").collective(broadcast=False, payload=b"")
