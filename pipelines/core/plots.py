"""Figures a transfer stage logs: the sweep at a glance and the best model's confusion matrix.

Plain matplotlib on the Agg backend (drivers run headless); every function
returns a Figure for `MlflowClient.log_figure` and leaves closing it to the caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

STATUS_COLOURS = {"completed": "tab:blue", "early_stopped": "tab:orange", "failed": "tab:red"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axis(values: Sequence[float]) -> bool:
    """Spread over more than a decade of positive values: show on a log scale."""
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and len(positive) > 1 and max(positive) / min(positive) > 10


def sweep_figure(trials: Sequence[dict[str, Any]], params: Sequence[str], metric: str, mode: str = "max") -> Any:
    """Parallel coordinates of the searched `params` against `metric`, one line per trial.

    Each trial is `{"params": {...}, "metric": float | None, "status": str}`.
    Each axis is min-max scaled (log-scaled when its values span more than a
    decade); the metric axis puts the better end on top, and failed trials
    (no metric) are drawn dashed below it.
    """
    plt = _pyplot()
    axes_names = [*params, metric]
    columns = []
    for name in axes_names:
        raw = [t["metric"] if name == metric else t["params"].get(name) for t in trials]
        known = [float(v) for v in raw if v is not None]
        log = _log_axis(known)
        scaled_known = [math.log10(v) for v in known] if log else known
        low, high = (min(scaled_known), max(scaled_known)) if scaled_known else (0.0, 1.0)
        span = high - low
        flip = name == metric and mode == "min"  # better on top
        column = []
        for v in raw:
            if v is None:
                column.append(-0.08)
            elif not span:
                column.append(0.5)
            else:
                x = math.log10(float(v)) if log else float(v)
                position = (x - low) / span
                column.append(1 - position if flip else position)
        columns.append((name, column, (high, low) if flip else (low, high), log))
    fig, ax = plt.subplots(figsize=(2.2 * len(axes_names) + 2, 4.5))
    xs = np.arange(len(axes_names))
    for i, trial in enumerate(trials):
        ys = [col[1][i] for col in columns]
        colour = STATUS_COLOURS.get(trial["status"], "tab:gray")
        ax.plot(xs, ys, color=colour, alpha=0.85, marker="o", linestyle="--" if trial["metric"] is None else "-")
    for x, (name, _, (low, high), log) in zip(xs, columns):
        ax.axvline(x, color="black", linewidth=0.8)
        fmt = (lambda v: f"{10 ** v:.3g}") if log else (lambda v: f"{v:.3g}")
        ax.text(x, 1.04, fmt(high), ha="center", fontsize=8)
        ax.text(x, -0.12, fmt(low), ha="center", fontsize=8)
    ax.set_xticks(xs, [*params, f"{metric} ({mode})"])
    ax.set_yticks([])
    ax.set_ylim(-0.18, 1.1)
    for status, colour in STATUS_COLOURS.items():
        ax.plot([], [], color=colour, label=status.replace("_", " "))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"sweep: {len(trials)} trials; better {metric} on top, failed trials dashed at the bottom")
    fig.tight_layout()
    return fig


def confusion_figure(matrix: np.ndarray, class_names: Sequence[str], title: str = "confusion matrix") -> Any:
    """Counts of (true class, predicted class) as a heat map, numbers written in the cells when few."""
    plt = _pyplot()
    matrix = np.asarray(matrix)
    n = len(class_names)
    size = min(12.0, 2.0 + 0.45 * n)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(matrix, cmap="Blues")
    if n <= 30:
        threshold = matrix.max() / 2 if matrix.size else 0
        for i in range(n):
            for j in range(n):
                ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=7,
                        color="white" if matrix[i, j] > threshold else "black")
    ticks = np.arange(n)
    labels = list(class_names) if n <= 50 else [""] * n
    ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = np.trace(matrix) / max(1, matrix.sum())
    ax.set_title(f"{title} (top-1 {accuracy:.3f})")
    fig.tight_layout()
    return fig


__all__ = ["confusion_figure", "sweep_figure"]
