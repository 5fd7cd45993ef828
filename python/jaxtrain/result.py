"""Result: what a run produced."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    """The outcome of ``JaxTrainer.fit()``.

    ``metrics`` is rank 0's last reported metrics (None if nothing was reported), ``path`` the run
    directory, ``error`` the TrainingFailedError when the run failed, ``checkpoint`` the latest
    checkpoint (None: this version does not write checkpoints).
    """

    metrics: dict[str, Any] | None
    path: str
    error: BaseException | None = None
    checkpoint: Any = None
    _rounds: list[dict] | None = field(default=None, repr=False)

    @property
    def metrics_dataframe(self):
        """One row per report round: ``round``, ``time`` and rank 0's metrics (nested keys joined
        with '/'). Needs pandas."""
        import pandas as pd

        rows = self._read_rounds()
        if not rows:
            return pd.DataFrame()
        frame = pd.json_normalize([r["metrics"] for r in rows], sep="/")
        frame.insert(0, "time", [r["time"] for r in rows])
        frame.insert(0, "round", [r["round"] for r in rows])
        return frame

    def _read_rounds(self) -> list[dict]:
        if self._rounds is None:
            path = os.path.join(self.path, "result.jsonl")
            rows = []
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    rows = [json.loads(line) for line in f if line.strip()]
            self._rounds = rows
        return self._rounds
