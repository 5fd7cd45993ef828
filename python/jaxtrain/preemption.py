"""Preemption notices inside the training function (docs/preemption.md), with Ray Train V2's
names: ``get_preemption_info()`` and ``PreemptionInfo``.

A worker's SIGTERM (a spot VM or TPU VM reclaimed, a node drained, a pod deleted, a Slurm job at
its time limit) is a notice, not a failure: the controller asks every rank how far it is, and
agrees with all of them on the call of ``get_preemption_info()`` that returns the notice first,
the same call on every rank. The pattern: on a notice, ``report(..., checkpoint=...)`` once (a
just-in-time checkpoint) and go on; once it is committed the group is stopped and restarted from
it, against ``FailureConfig.max_preemption_failures`` (without limit by default), not
``max_failures``.

For a training function that writes no code for it, ``on_preemption(save_fn)`` (or
``jaxtrain.orbax.save_on_preemption(state_fn)``) registers the just-in-time save: ``report()``
then takes part in the agreement itself, and at the agreed call runs the save and reports its
files with that call's metrics (docs/preemption.md, "Automatic save").
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionInfo:
    """An imminent preemption: when (``deadline_ms``, UNIX time in milliseconds, the earliest of
    the preempted hosts'; None when no deadline is known) and where (each preempted host's name
    to the world ranks it runs)."""

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]]

    @property
    def preempted_node_ids(self) -> list[str]:
        """The preempted hosts, sorted."""
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        """Every rank on a preempted host, sorted."""
        return sorted(r for ranks in self.preempted_node_to_ranks.values() for r in ranks)

    @classmethod
    def _from_json(cls, text: str) -> PreemptionInfo:
        j = json.loads(text)
        return cls(deadline_ms=j.get("deadline_ms") or None,
                   preempted_node_to_ranks={node: list(ranks) for node, ranks
                                            in j.get("preempted_node_to_ranks", {}).items()})


def get_preemption_info() -> PreemptionInfo | None:
    """The preemption notice for this run's group, or None while there is none.

    Call it once per step on every rank, the same number of times (as ``report``): every rank
    gets the notice first at the same call, so every rank takes the same branch. It costs a lock
    and a counter; after a notice arrives, the next call may wait for the other ranks' answers (a
    round trip to the controller, not a collective: a rank that is stuck does not hold it up for
    longer than the controller waits for answers). Once returned, the notice is returned by every
    later call of the attempt. With a save registered (``on_preemption``), each ``report()`` is
    such a call too, until the just-in-time checkpoint is reported.
    """
    from jaxtrain import session

    s = session.require("get_preemption_info")
    if s.client is None:  # the function runs in the driver's process: no group to preempt
        return None
    agreed = s.client.preemption_call()
    if not agreed:
        return None
    s.preempted = True
    return PreemptionInfo._from_json(agreed)


def on_preemption(save_fn: Callable[[str], None] | None) -> None:
    """Registers this rank's just-in-time save, for a training function that does not call
    ``get_preemption_info()`` itself (docs/preemption.md, "Automatic save").

    From now on each ``report()`` of this attempt takes part in the preemption agreement (as a
    ``get_preemption_info()`` call would, before the round is counted). At the agreed call, on
    every rank, and once per attempt: a report without a checkpoint runs ``save_fn(directory)``,
    which writes this rank's files of the checkpoint into ``directory`` (a fresh, empty
    directory on this host; a rank with nothing to save leaves it empty), and reports them with
    the call's metrics as the just-in-time checkpoint; jaxtrain deletes the directory once its
    files are in the run's storage. A report that passes a checkpoint of its own at that call is
    the just-in-time checkpoint itself, and ``save_fn`` is not called. Either way ``report()``
    returns once the checkpoint is committed, and the controller stops the group, which is
    restarted from it. Call it on every rank, before the first ``report()`` (every rank must
    make the same number of agreement calls); ``None`` takes the registration back. A second
    registration replaces the first.
    """
    from jaxtrain import session

    s = session.require("on_preemption")
    if save_fn is None:
        s.preemption_save = None
        return
    if not callable(save_fn):
        raise TypeError(
            f"on_preemption(save_fn={save_fn!r}) is not allowed: save_fn must be a function "
            "(directory: str) -> None that writes this rank's files of the just-in-time "
            "checkpoint into directory, or None to take the registration back")

    def save(metrics: dict, checkpoint_dir_name: str | None) -> None:
        from jaxtrain.checkpoint import Checkpoint

        directory = tempfile.mkdtemp(prefix=f"jaxtrain-preemption-r{s.context.world_rank}-")
        try:
            result = save_fn(directory)
            if result is not None:
                raise TypeError(
                    f"on_preemption(save_fn={getattr(save_fn, '__name__', save_fn)!r}): the "
                    f"function must write its files into the directory it is given and return "
                    f"None; it returned {result!r}")
            session.report(metrics, checkpoint=Checkpoint.from_directory(directory),
                           checkpoint_dir_name=checkpoint_dir_name)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    s.preemption_save = save


def _save_on_notice(s, metrics: dict, has_checkpoint: bool,
                    checkpoint_dir_name: str | None) -> bool:
    """report()'s part in the agreement when a save is registered (on_preemption): one
    agreement call per report until the notice is agreed; at it, the registered save reports
    this round with its checkpoint (True: the report is made), unless the report carries a
    checkpoint itself (False: it is the just-in-time one). False otherwise."""
    save = s.preemption_save
    if save is None or s.saved_on_preemption or s.client is None:
        return False
    if not s.preempted and not s.client.preemption_call():
        return False
    s.preempted = True
    s.saved_on_preemption = True
    if has_checkpoint:
        return False
    sys.stderr.write(f"jaxtrain worker: rank {s.context.world_rank}: preemption notice: saving the "
                     f"just-in-time checkpoint of round {s.first_round + s.round} with the "
                     "registered save (on_preemption)\n")
    sys.stderr.flush()
    save(metrics, checkpoint_dir_name)
    return True
