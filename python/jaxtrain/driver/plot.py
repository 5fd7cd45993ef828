"""The metrics of a run as a PNG: one panel per metric against the report round
(``Result.plot()``, ``jaxtrain show RUN --plot``). Needs matplotlib: ``pip install
'jaxtrain[plot]'``."""

from __future__ import annotations

import math
import os
from typing import Any

from jaxtrain.records import ROUND_COLUMN, TIME_COLUMN

_NOT_METRICS = (ROUND_COLUMN, TIME_COLUMN)


def numeric_metrics(frame: Any) -> list[str]:
    """The columns of a ``metrics_dataframe`` that hold numbers, jaxtrain's round and time
    excepted."""
    import pandas as pd

    types = pd.api.types
    return [c for c in frame.columns if c not in _NOT_METRICS
            and types.is_numeric_dtype(frame[c]) and not types.is_bool_dtype(frame[c])]


def plot_metrics(frame: Any, path: str, metrics: list[str] | None = None,
                 title: str | None = None) -> str:
    """Draws ``metrics`` (default: every numeric column) of ``frame`` (a ``metrics_dataframe``)
    against its round (ROUND_COLUMN) into the PNG ``path``; returns ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plotting a run needs matplotlib: pip install 'jaxtrain[plot]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only; never a window
    from matplotlib import pyplot as plt

    if frame.empty:
        raise ValueError("the run reported no metrics yet: nothing to plot")
    available = numeric_metrics(frame)
    if metrics is None:
        metrics = available
    else:
        for name in metrics:
            if name not in available:
                raise ValueError(f"metrics: {name!r} is not a numeric metric of the run; "
                                 f"allowed: {available}")
    if not metrics:
        raise ValueError("the run reported no numeric metrics: nothing to plot")
    columns = min(len(metrics), 2)
    rows = math.ceil(len(metrics) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    try:
        for ax, name in zip(axes.flat, metrics, strict=False):
            ax.plot(frame[ROUND_COLUMN], frame[name], marker="." if len(frame) < 50 else None)
            ax.set_title(name)
            ax.set_xlabel("round")
            ax.grid(True, alpha=0.3)
        for ax in list(axes.flat)[len(metrics):]:
            ax.set_visible(False)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)
    return path
