"""Evaluating a trained VTN in the paper's two inference modes, and the [CLS] attention picture.

* full-video: up to `full_video_frames` frames spread over the whole video, one pass;
* multi-view: `multiview_clips` clips × `multiview_crops` crops, softmax averaged.

Both run on the stored frames of a video ingest output (`FramePredictor`) or on
stored per-frame features (`pipelines.video.feature_data.FeaturePredictor`); each row
of the table holds top-1 and wall time, in frame order or shuffled (the paper's
order ablation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipelines.core.uris import strip_userinfo
from pipelines.core.errors import VitpipeError
from pipelines.video.data import iter_videos, normalize_video, prepare_full_video, resize_frames
from pipelines.video.feature_data import FeaturePredictor, is_features, iter_feature_videos
from vit.vtn import sample_frame_indices

logger = logging.getLogger("vitpipe.video_eval")  # under "vitpipe": its handlers scrub credentials

EVAL_TABLE = "evaluation/modes.json"
ATTENTION_FIGURE = "attention/cls_attention_over_frames.png"
ATTENTION_VALUES = "attention/cls_attention_over_frames.json"


def frame_views(frames: np.ndarray, size: int) -> tuple[Any, Any]:
    """A stored video → `(full frame video (T, 3, h, w), centre square (T, 3, S, S))`, shorter side `size`."""
    resized = resize_frames(frames, size)  # done once: prepare_full_video leaves a `size` shorter side as it is
    return normalize_video(resized), prepare_full_video(resized, size)


class FramePredictor:
    """`evaluate_modes`' predictor on stored frames: the VTN's `predict_full_video` and `predict_multiview`."""

    def __init__(self, model: Any, config: Any, size: int) -> None:
        self.model, self.config, self.size = model, config, size

    @staticmethod
    def length(row: Any) -> int:
        return len(row.frames)

    def prepare(self, row: Any, order: np.ndarray | None) -> tuple[Any, Any, int]:
        frames = row.frames[order] if order is not None else row.frames
        return (*frame_views(frames, self.size), len(frames))

    def views(self, mode: str) -> int:
        return self.config.multiview_clips * self.config.multiview_crops if mode == "multiview" else 1

    def note(self, mode: str) -> str | None:
        return None

    def __call__(self, mode: str, inputs: tuple[Any, Any, int]) -> Any:
        (full, square, frames), c = inputs, self.config
        if mode == "full_video":
            return self.model.predict_full_video(square, num_frames=min(frames, c.full_video_frames))
        return self.model.predict_multiview(full, clips=c.multiview_clips, crops=c.multiview_crops,
                                            clip_frames=c.train_frames, frame_stride=c.clip_stride, crop_size=self.size)


def evaluate_modes(model: Any, videos: Iterable[Any], config: Any, size: int,
                   shuffled: bool = False, predictor: Any = None) -> list[dict[str, Any]]:
    """Top-1 and wall time of each evaluation mode over `videos`, one row per mode (`config`: a VideoTrainConfig).

    Each video runs through every mode in turn, so the modes see the same
    machine load; only the model calls are timed (reading and resizing are
    common to both), after one untimed warm-up call of each mode. With `shuffled`, each video's stored frames are put in a
    random (seeded) order first. `predictor` runs the modes (default: on frames, `FramePredictor`;
    `feature_data.FeaturePredictor` on stored features).
    """
    import torch

    predict = predictor or FramePredictor(model, config, size)
    rng = np.random.default_rng(config.seed)
    correct = dict.fromkeys(config.eval_modes, 0)
    seconds = dict.fromkeys(config.eval_modes, 0.0)
    count = 0
    model.eval()
    for row in videos:
        inputs = predict.prepare(row, rng.permutation(predict.length(row)) if shuffled else None)
        with torch.inference_mode():
            if count == 0:  # warm-up, untimed: the first calls pay one-off costs that would go to one mode only
                for mode in config.eval_modes:
                    predict(mode, inputs)
            for mode in config.eval_modes:
                t0 = time.perf_counter()
                probs = predict(mode, inputs)
                seconds[mode] += time.perf_counter() - t0
                correct[mode] += int(int(probs.argmax(-1)[0]) == row.label)
        count += 1
    if count == 0:
        raise VitpipeError(f"{strip_userinfo(config.data)}: split {config.eval_split!r} has no videos to evaluate")
    rows = []
    for mode in config.eval_modes:
        note = predict.note(mode)
        rows.append({
            "mode": mode, "frame_order": "shuffled" if shuffled else "original", "videos": count,
            "views_per_video": predict.views(mode), "top1": correct[mode] / count, "wall_s": seconds[mode],
            "videos_per_s": count / max(seconds[mode], 1e-9), **({"note": note} if note else {}),
        })
    return rows


def evaluation_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """MLflow metrics of the evaluation table: `[shuffled_]<mode>_{top1,wall_s,videos_per_s}` and the speed-up."""
    out: dict[str, float] = {}
    for row in rows:
        prefix = ("shuffled_" if row["frame_order"] == "shuffled" else "") + row["mode"]
        for key in ("top1", "wall_s", "videos_per_s"):
            out[f"{prefix}_{key}"] = float(row[key])
    if out.get("full_video_wall_s") and "multiview_wall_s" in out:
        out["full_vs_multiview_speedup"] = out["multiview_wall_s"] / out["full_video_wall_s"]
    return out


def cls_attention(model: Any, frames: np.ndarray, size: int, max_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The [CLS] token's last-layer attention over the frames of a full-video pass (mean over heads).

    Returns `(stored-frame indices, attention weights)`; the weights over frames
    and [CLS] itself sum to 1, so these sum to at most 1.
    """
    import torch

    _, square = frame_views(frames, size)
    idx = sample_frame_indices(len(frames), min(len(frames), max_frames))
    model.eval()
    with torch.inference_mode():
        _, maps = model(square[idx][None], frame_indices=idx, return_attention=True)
    return idx.numpy(), maps[0, -1].float().mean(0)[1:].numpy()


def log_attention_picture(client: Any, run_id: str, model: Any, videos: list[Any], size: int, max_frames: int,
                          classes: list[str]) -> bool:
    """Log a picture of the [CLS] attention over frames for `videos` (and the values as JSON)."""
    if not videos:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(videos), 1, figsize=(9, 2.6 * len(videos)), squeeze=False,
                             gridspec_kw={"height_ratios": [1, 1.4] * len(videos)})
    values = []
    for i, row in enumerate(videos):
        idx, weights = cls_attention(model, row.frames, size, max_frames)
        values.append({"key": row.key, "label": int(row.label), "frames": idx.tolist(), "attention": weights.tolist()})
        shown = idx[np.linspace(0, len(idx) - 1, min(8, len(idx))).round().astype(int)]
        strip = np.concatenate(list(resize_frames(row.frames[shown], 48)), axis=1)
        top, bottom = axes[2 * i, 0], axes[2 * i + 1, 0]
        top.imshow(strip)
        top.set_axis_off()
        name = classes[row.label] if 0 <= row.label < len(classes) else str(row.label)
        top.set_title(f"{row.key} ({name}); frames {', '.join(str(int(s)) for s in shown)}", fontsize=8)
        bottom.bar(idx, weights, width=0.8 * max(1.0, float(np.diff(idx).mean()) if len(idx) > 1 else 1.0))
        bottom.set_xlabel("stored frame")
        bottom.set_ylabel("[CLS] attention")
        bottom.set_xlim(-0.5, max(len(row.frames), 1) - 0.5)
    fig.suptitle("VTN [CLS] attention over frames (last layer, mean over heads)", fontsize=10)
    fig.tight_layout()
    client.log_figure(run_id, fig, ATTENTION_FIGURE)
    plt.close(fig)
    client.log_dict(run_id, {"videos": values}, ATTENTION_VALUES)
    return True


def evaluation_inputs(config: Any, manifest: dict[str, Any], model: Any) -> tuple[Any, Any]:
    """`(videos(limit) → the eval split's videos, predictor)`: stored frames, or stored features with
    `feature_data.FeaturePredictor` (None: `evaluate_modes`' own frame predictor)."""
    if is_features(manifest):
        def videos(limit: int | None = config.eval_limit) -> Iterable[Any]:
            return iter_feature_videos(config.data, manifest, config.eval_split, endpoint_url=config.endpoint_url,
                                       limit=limit)

        return videos, FeaturePredictor(model, config)

    def frame_videos(limit: int | None = config.eval_limit) -> Iterable[Any]:
        return iter_videos(config.data, config.eval_split, manifest=manifest, endpoint_url=config.endpoint_url,
                           limit=limit)

    return frame_videos, None


def log_evaluation(client: Any, run_id: str, model: Any, config: Any, manifest: dict[str, Any], size: int,
                   classes: list[str]) -> list[dict[str, Any]]:
    """Evaluate the final model in `config.eval_modes` (again on shuffled frames with `eval_shuffled`) and log the
    table (`EVAL_TABLE`), its metrics and, on frames, the [CLS] attention picture; returns the table."""
    from mlflow.entities import Metric

    videos, predictor = evaluation_inputs(config, manifest, model)
    table = evaluate_modes(model, videos(), config, size, predictor=predictor)
    if config.eval_shuffled:
        table += evaluate_modes(model, videos(), config, size, shuffled=True, predictor=predictor)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in evaluation_metrics(table).items()])
    client.log_dict(run_id, {"modes": table}, EVAL_TABLE)
    for row in table:
        logger.info("video_train: %-10s %-8s top-1 %.3f in %.2fs (%d videos, %d views each)%s", row["mode"],
                    row["frame_order"], row["top1"], row["wall_s"], row["videos"], row["views_per_video"],
                    f"; {row['note']}" if row.get("note") else "")
    if not is_features(manifest):  # the picture shows the frames, which features data does not hold
        log_attention_picture(client, run_id, model,
                              list(videos(config.attention_videos)) if config.attention_videos else [],
                              size, config.full_video_frames, classes)
    return table
