"""Preemption notices inside the training function (docs/preemption.md), with Ray Train V2's
names: ``get_preemption_info()`` and ``PreemptionInfo``.

A worker's SIGTERM (a spot VM or TPU VM reclaimed, a node drained, a pod deleted, a Slurm job at
its time limit) is a notice, not a failure: the controller asks every rank how far it is, and
agrees with all of them on the call of ``get_preemption_info()`` that returns the notice first,
the same call on every rank. The pattern: on a notice, ``report(..., checkpoint=...)`` once (a
just-in-time checkpoint) and go on; once it is committed the group is stopped and restarted from
it, against ``FailureConfig.max_preemption_failures`` (without limit by default), not
``max_failures``.
"""

from __future__ import annotations

import json
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
    later call of the attempt.
    """
    from jaxtrain import session

    s = session._require("get_preemption_info")
    if s.client is None:  # the function runs in the driver's process: no group to preempt
        return None
    agreed = s.client.preemption_call()
    if not agreed:
        return None
    s.preempted = True
    return PreemptionInfo._from_json(agreed)
