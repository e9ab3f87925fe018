"""Training and evaluating a VTN's temporal encoder on precomputed frame features ("on features alone").

When `video_train`'s `data` is a video features output (`pipelines.video.features`
writes it; its format, "vitpipe-video-features/1", is defined here), the backbone
is frozen and never run:

* training clips are feature clips `features` float32 `(T, D)`, `frame_positions`
  `(T,)`, `label`, their frames chosen by the same seeded rules as frame clips
  (`video_data.clip_indices_of` with `clip_rngs`), so a seeded run picks the same
  frames from features as from pixels; the worker loop (`modality="features"`)
  runs `VTN.forward_features_from_frames` through `FromFrameFeatures`;
* full-video evaluation runs on the stored features of the frames
  `predict_full_video` would pick; multi-view evaluation runs `multiview_clips`
  clips × 1 crop (the features are of the centre square: crops need pixels),
  and its row in the table says so.

The model stays a normal VTN with its backbone's weights, so the final
checkpoint runs on raw video as well.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from torch import nn

import vit
from pipelines.core.datasets import seeded_passes
from pipelines.core.shards import read_manifest
from pipelines.core.storage import open_store
from pipelines.video import shards as video_shards
from pipelines.video.data import ClipSpec, check_classes, check_video_manifest, clip_rounds, shard_keys
from vit.vtn import multiview_clip_indices, sample_frame_indices

FORMAT = "vitpipe-video-features/1"
DTYPES = {"float32": np.float32, "float16": np.float16}
# A features row stands for one stored video: its per-video columns are the video shard's own.
SCHEMA = pa.schema(
    [
        pa.field("features", pa.binary(), nullable=False),
        pa.field("num_frames", pa.int32(), nullable=False),
        pa.field("dim", pa.int32(), nullable=False),
        *video_shards.VIDEO_FIELDS,
    ]
)
COLUMNS = tuple(SCHEMA.names)
TRAIN_COLUMNS = ("features", "num_frames", "dim", "label", "key", "split")  # what training reads
MULTIVIEW_NOTE = "features of the centre square: multiview_clips clips x 1 crop (crops need pixels)"

__all__ = ["COLUMNS", "FORMAT", "FeatureRow", "FromFrameFeatures", "MULTIVIEW_NOTE", "SCHEMA", "decode_features",
           "feature_clip_dataset", "feature_inputs", "features_table", "features_train_config", "is_features",
           "iter_feature_videos", "read_training_manifest", "table_hash"]


# ---------------------------------------------------------------- the format


def decode_features(row: dict[str, Any], dtype: str = "float32") -> np.ndarray:
    """The `(T, D)` features of one row as float32 (`dtype`: the manifest's `feature_dtype`)."""
    data = row["features"]
    if isinstance(data, pa.Scalar):
        data = data.as_buffer()
    values = np.frombuffer(data, dtype=DTYPES[dtype])
    t, d = int(row["num_frames"]), int(row["dim"])
    if values.size != t * d:
        raise ValueError(f"{row.get('key', 'row')}: {values.size} feature values do not make ({t}, {d})")
    return values.reshape(t, d).astype(np.float32)


def features_table(features: list[np.ndarray], labels: list[int], keys: list[str], splits: list[str],
                   frame_indices: list[Any], fps: list[float]) -> pa.Table:
    """A feature shard table from per-video `(T, D)` arrays (already in the stored dtype)."""
    return pa.Table.from_arrays(
        [
            pa.array([np.ascontiguousarray(f).tobytes() for f in features], pa.binary()),
            pa.array([f.shape[0] for f in features], pa.int32()),
            pa.array([f.shape[1] for f in features], pa.int32()),
            *video_shards.video_arrays(labels, keys, splits, frame_indices, fps),
        ],
        schema=SCHEMA,
    )


def table_hash(table: pa.Table) -> str:
    """sha256 over a feature shard's rows: keys, labels, splits, frame indices, then the feature bytes."""
    h = hashlib.sha256()
    meta = [table.column(name).to_pylist() for name in ("key", "label", "split", "frame_indices", "num_frames", "dim")]
    h.update(json.dumps(meta).encode())
    for value in table.column("features").combine_chunks():
        h.update(value.as_buffer())
    return h.hexdigest()


# ---------------------------------------------------------------- reading and checking


def is_features(manifest: dict[str, Any]) -> bool:
    """True when a manifest describes a video features output rather than stored frames."""
    return manifest.get("format") == FORMAT


def read_training_manifest(uri: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """The manifest of a video ingest output or of a video features output; `VitpipeError` (one line) otherwise."""
    manifest = read_manifest(uri, endpoint_url=endpoint_url)
    return check_classes(uri, manifest) if is_features(manifest) else check_video_manifest(uri, manifest)


def features_train_config(config: Any, manifest: dict[str, Any]) -> Any:
    """The video_train config for features data: backbone frozen, frames the size the features were made at.

    One-line ValueErrors for settings that need pixels or contradict the stored features.
    """
    data, size = config.data, int(manifest["frame_size"])
    if "freeze_backbone" in config.model_fields_set and not config.freeze_backbone:
        raise ValueError(f"freeze_backbone: {data} holds precomputed features; the backbone is frozen and not run")
    if config.hflip:
        raise ValueError(f"hflip: {data} holds features of unflipped frames; flips need pixels")
    if config.frame_size is not None and config.frame_size != size:
        raise ValueError(f"frame_size: {data} holds features of {size}px frames, not {config.frame_size}px")
    return config.model_copy(update={"freeze_backbone": True, "frame_size": size})


def check_backbone(model: Any, manifest: dict[str, Any], config: Any) -> None:
    """The VTN's backbone must be the one that computed the features (same weights), or a one-line ValueError."""
    made_by = manifest.get("backbone") or {}
    if vit.weights_hash(model.backbone) != made_by.get("weights_hash"):
        raise ValueError(f"init: the backbone from {config.init} is not the one that computed the features in "
                         f"{config.data} (made by {made_by.get('init')!r}); set init to that")


class FromFrameFeatures(nn.Module):
    """A VTN whose `forward(features, frame_indices)` is `forward_features_from_frames` (for the worker loop and DDP)."""

    def __init__(self, vtn: nn.Module) -> None:
        super().__init__()
        self.vtn = vtn

    def forward(self, features: Any, frame_indices: Any = None) -> Any:
        return self.vtn.forward_features_from_frames(features, frame_indices)


def feature_inputs(batch: dict[str, Any]) -> tuple[Any, Any]:
    """A feature clip batch → `FromFrameFeatures`' inputs `(features (B, T, D), frame_indices (B, T))`."""
    return batch["features"].float(), batch["frame_positions"].long()


# ---------------------------------------------------------------- clips for training


def _decode(table: Any, dtype: str) -> list[np.ndarray]:
    column = table.column("features").to_pylist()
    counts, dims = table.column("num_frames").to_numpy(), table.column("dim").to_numpy()
    return [decode_features({"features": data, "num_frames": t, "dim": d}, dtype)
            for data, t, d in zip(column, counts, dims)]


def _feature_clip_batch(table: Any, *, spec: ClipSpec, dtype: str, dim: int, seed: int | None = None,
                        epoch: int = 0) -> dict[str, np.ndarray]:
    """Ray Data UDF: feature rows → clips `features` float32 `(N, T, D)`, `frame_positions`, `label`."""
    clips, positions, labels = clip_rounds(_decode(table, dtype), table.column("label").to_numpy(),
                                           table.column("key").to_pylist(), spec, seed, epoch,
                                           lambda video, idx, rng: video[idx])
    features = np.stack(clips) if clips else np.zeros((0, spec.frames, dim), np.float32)
    return {"features": features, "frame_positions": positions, "label": labels}


def feature_clip_dataset(uri: str, manifest: dict[str, Any], split: str, spec: ClipSpec, *, seed: int | None = None,
                         epochs: int = 1, endpoint_url: str | None = None, batch_size: int = 8) -> Any:
    """A Ray Dataset of feature clips from one split, with `video_data.clip_dataset`'s passes and seeding."""
    store = open_store(uri, endpoint_url=endpoint_url)
    filesystem, _ = store.arrow()
    paths = [store.arrow(k)[1] for k in shard_keys(store, manifest, split)]
    kwargs = {"spec": spec, "dtype": manifest.get("feature_dtype", "float32"), "dim": int(manifest["feature_dim"])}
    return seeded_passes(paths, filesystem, split=split, columns=TRAIN_COLUMNS, shuffle=spec.train, seed=seed, epochs=epochs,
                         decode=_feature_clip_batch, fn_kwargs=kwargs, batch_size=batch_size)


# ---------------------------------------------------------------- whole videos for evaluation


@dataclass
class FeatureRow:
    """One video's stored features."""

    key: str
    label: int
    features: np.ndarray  # float32 (T, D)
    frame_indices: np.ndarray  # each stored frame's index in the source video


def iter_feature_videos(uri: str, manifest: dict[str, Any], split: str, *, endpoint_url: str | None = None,
                        limit: int | None = None) -> Iterator[FeatureRow]:
    """The stored features of `split`, shard by shard in key order (one shard in memory at a time; no Ray)."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    store = open_store(uri, endpoint_url=endpoint_url)
    dtype = manifest.get("feature_dtype", "float32")
    seen = 0
    for key in shard_keys(store, manifest, split):
        fs, path = store.arrow(key)
        table = pq.read_table(path, filesystem=fs, filters=pads.field("split") == split).sort_by("key")
        for row, features in zip(table.select(["key", "label", "frame_indices"]).to_pylist(), _decode(table, dtype)):
            if limit is not None and seen >= limit:
                return
            seen += 1
            yield FeatureRow(row["key"], int(row["label"]), features, np.asarray(row["frame_indices"], np.int64))


class FeaturePredictor:
    """`video_eval.evaluate_modes`' predictor on stored features: the VTN's two modes without its backbone."""

    def __init__(self, model: Any, config: Any) -> None:
        self.model, self.config = model, config

    @staticmethod
    def length(row: FeatureRow) -> int:
        return len(row.features)

    @staticmethod
    def prepare(row: FeatureRow, order: np.ndarray | None) -> Any:
        import torch

        return torch.from_numpy(row.features[order] if order is not None else row.features)

    def views(self, mode: str) -> int:
        return self.config.multiview_clips if mode == "multiview" else 1

    def note(self, mode: str) -> str | None:
        return MULTIVIEW_NOTE if mode == "multiview" else None

    def __call__(self, mode: str, features: Any) -> Any:
        import torch

        c, total = self.config, len(features)
        if mode == "full_video":
            clips = [sample_frame_indices(total, min(total, c.full_video_frames))]
        else:
            clips = multiview_clip_indices(total, c.multiview_clips, c.train_frames, c.clip_stride)
        idx = torch.stack(clips)
        logits = self.model.forward_features_from_frames(features[idx], frame_indices=idx)
        return logits.float().softmax(dim=-1).mean(dim=0, keepdim=True)
