"""Figures the stages log: the sweep at a glance, the trials' learning curves, the best model's confusion
matrix, where a pretrained ViT looks and what a masked autoencoder reconstructs.

Plain matplotlib, without pyplot: every function returns a `matplotlib.figure.Figure` for
`MlflowClient.log_figure`, which no global registry keeps (pyplot's held every figure a
long-running driver made, until it was closed), so a figure goes when its caller drops it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

STATUS_COLOURS = {"completed": "tab:blue", "early_stopped": "tab:orange", "failed": "tab:red"}


def _subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """`pyplot.subplots` without pyplot: a Figure (rendered by Agg when saved) and its axes."""
    from matplotlib.figure import Figure

    figsize = kwargs.pop("figsize", None)
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kwargs)


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
    fig, ax = _subplots(figsize=(2.2 * len(axes_names) + 2, 4.5))
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
    matrix = np.asarray(matrix)
    n = len(class_names)
    size = min(12.0, 2.0 + 0.45 * n)
    fig, ax = _subplots(figsize=(size, size))
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


def trial_curves_figure(curves: Sequence[dict[str, Any]], keys: Sequence[str] = ("val_top1", "train_loss")) -> Any:
    """One panel per metric in `keys`, one line per trial against step, coloured by the trial's status.

    Each curve is `{"label": str, "status": str, "metrics": {key: [(step, value), ...]}}`.
    """
    fig, axes = _subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for curve in curves:
            points = curve["metrics"].get(key) or []
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, color=STATUS_COLOURS.get(curve["status"], "tab:gray"), alpha=0.8,
                        marker="." if len(points) < 30 else None, label=curve["label"])
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if len(curves) <= 12:  # past that a legend hides the curves; the colours still tell the status
        axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"{len(curves)} trials; blue completed, orange stopped early, red failed")
    fig.tight_layout()
    return fig


def attention_figure(images: np.ndarray, maps: np.ndarray, titles: Sequence[str]) -> Any:
    """Each image (top) above its attention map laid over it (bottom).

    `images` is `(B, H, W, C)` in [0, 1]; `maps` is `(B, grid_h, grid_w)`, stretched over the image.
    """
    n = len(images)
    fig, axes = _subplots(2, n, figsize=(2.4 * n, 5), squeeze=False)
    for i in range(n):
        image = images[i].squeeze(-1) if images[i].shape[-1] == 1 else images[i]
        height, width = image.shape[:2]
        for ax in axes[:, i]:
            ax.imshow(image, cmap="gray" if image.ndim == 2 else None)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[1, i].imshow(maps[i], cmap="inferno", alpha=0.6, extent=(-0.5, width - 0.5, height - 0.5, -0.5),
                          interpolation="nearest")
        axes[0, i].set_title(str(titles[i]), fontsize=9)
    fig.suptitle("attention rollout from the pooled token (bright: the patches the prediction draws on)", fontsize=9)
    fig.tight_layout()
    return fig


def reconstruction_figure(columns: dict[str, np.ndarray], title: str) -> Any:
    """One row per image, one column per entry of `columns` (e.g. original | masked | reconstructed).

    Each value is `(B, H, W, C)` in [0, 1]; the keys title the columns.
    """
    names = list(columns)
    n = len(columns[names[0]])
    fig, axes = _subplots(n, len(names), figsize=(2.2 * len(names), 2.2 * n), squeeze=False)
    for j, name in enumerate(names):
        for i in range(n):
            image = columns[name][i]
            image = image.squeeze(-1) if image.shape[-1] == 1 else image
            axes[i, j].imshow(image, cmap="gray" if image.ndim == 2 else None, interpolation="nearest")
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
        axes[0, j].set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["attention_figure", "confusion_figure", "reconstruction_figure", "sweep_figure", "trial_curves_figure"]
