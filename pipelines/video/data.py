"""Reading ingested video shards for training and evaluation.

The video ingest writes Parquet shards under `<output>/shards/`, one row per
video: `frames` (uint8 `(T, H, W, 3)` bytes, C order), `num_frames`, `height`,
`width`, `label`, `key`, `split`, `frame_indices` (each stored frame's index in
the source video) and `fps`; plus `manifest.json` (format `vitpipe-video/1`,
`classes`, `counts`) and `_SUCCESS`.

Training and in-loop validation stream fixed-size clips through Ray Data
(`clip_dataset`): `frames` uint8 `(T, S, S, 3)`, `frame_positions` int64 `(T,)`
and `label`. A clip's positions are the indices of its frames among the
video's *stored* frames, the same positions `VTN.predict_full_video` and
`VTN.predict_multiview` give the frames of a stored video at evaluation, so
the temporal position embedding means the same thing in training and in both
evaluation modes. Whole videos for evaluation come from `iter_videos`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipelines.core import shards
from pipelines.core.datasets import PATCH_MEAN, PATCH_STD, key_seed, seeded_passes
from pipelines.core.errors import VitpipeError
from pipelines.core.storage import Store, open_store
from pipelines.video import shards as video_shards

VIDEO_FORMAT = video_shards.FORMAT
COLUMNS = ("frames", "num_frames", "height", "width", "label", "key", "split")  # what training reads
Sampling = Literal["segments", "clip"]

__all__ = [
    "VIDEO_FORMAT",
    "ClipSpec",
    "VideoRow",
    "clip_dataset",
    "clip_inputs",
    "iter_videos",
    "normalize_video",
    "prepare_full_video",
    "read_video_manifest",
    "sample_clip_indices",
    "split_count",
]


# ---------------------------------------------------------------- manifest and shards


def read_video_manifest(uri: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """The manifest of a finished video ingest output (`pipelines.video.shards`); `VitpipeError` otherwise."""
    return check_video_manifest(uri, shards.read_manifest(uri, endpoint_url=endpoint_url))


def check_video_manifest(uri: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest`, read from `uri`, if it is a video ingest output's and lists classes; `VitpipeError` otherwise."""
    return check_classes(uri, shards.check_format(uri, manifest, video_shards.VIDEOS))


def check_classes(uri: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest`, read from `uri`, if it lists classes; `VitpipeError` otherwise."""
    if not manifest.get("classes"):
        raise VitpipeError(f"{uri}: the manifest lists no classes")
    return manifest


def stored_clip_length(manifest: dict[str, Any]) -> int | None:
    """The stored clips' length when the ingest kept clips back to back (`sampling.mode == "clips"`), else None."""
    sampling = manifest.get("sampling") or {}
    return int(sampling["clip_length"]) if sampling.get("mode") == "clips" else None


def split_count(manifest: dict[str, Any], split: str) -> int | None:
    """Videos in `split` per the manifest's `counts` (flat `{split: n}` or nested under `split`/`splits`); None if absent."""
    counts = manifest.get("counts") or {}
    for where in (counts, counts.get("split"), counts.get("splits"), manifest.get("splits")):
        if isinstance(where, dict) and isinstance(where.get(split), (int, float)):
            return int(where[split])
    return None


def shard_keys(store: Store, manifest: dict[str, Any], split: str | None = None) -> list[str]:
    """The shard keys under the output root holding `split` (any split when None): the manifest's
    list when it has one, else a listing of `shards/`."""
    listed = manifest.get("shards")
    if isinstance(listed, list) and listed:
        keys = [
            entry["path"] if isinstance(entry, dict) else str(entry) for entry in listed
            if split is None or not isinstance(entry, dict) or not isinstance(entry.get("split"), dict)
            or entry["split"].get(split, 0) > 0
        ]
        if not keys and split is not None:
            raise VitpipeError(f"{store.uri}: split {split!r} has no videos")
    else:
        keys = [k for page in store.list_pages(f"{shards.SHARD_DIR}/") for k in page if k.endswith(".parquet")]
    if not keys:
        raise VitpipeError(f"{store.uri}: no shards under {shards.SHARD_DIR}/")
    return sorted(keys)


def decode_frames(data: bytes | memoryview, num_frames: int, height: int, width: int) -> np.ndarray:
    """One row's `frames` bytes → uint8 `(T, H, W, 3)` (read-only view; `video_shards.decode_frames`)."""
    try:
        return video_shards.decode_frames({"frames": data, "num_frames": num_frames, "height": height, "width": width})
    except ValueError as err:
        raise VitpipeError(str(err)) from None


# ---------------------------------------------------------------- clips


def sample_clip_indices(total: int, count: int, sampling: Sampling, rng: np.random.Generator | None,
                        stride: int = 1) -> np.ndarray:
    """`count` stored-frame indices of one clip, in time order.

    * "segments": the video cut into `count` equal segments, one frame from each:
      a random frame when `rng` is given (training), each segment's centre
      otherwise. The clip spans the whole video, as the full-video evaluation does.
    * "clip": `count` consecutive frames `stride` apart from a random start
      (centred without `rng`), as the multi-view clips are.

    A video shorter than the clip repeats frames (nearest-neighbour resampling).
    """
    if total < 1:
        raise VitpipeError("a video with no stored frames")
    span = (count - 1) * stride + 1
    if sampling == "clip" and total >= span:
        start = int(rng.integers(0, total - span + 1)) if rng is not None else (total - span) // 2
        return start + np.arange(count, dtype=np.int64) * stride
    offset = rng.random(count) if rng is not None else np.full(count, 0.5)
    idx = np.floor((np.arange(count) + offset) * total / count).astype(np.int64)
    return np.minimum(idx, total - 1)


def square_crop(frames: np.ndarray, where: float) -> np.ndarray:
    """The largest square of `(T, H, W, 3)` frames, at fraction `where` (0 first, 0.5 centre, 1 last) along the longer side."""
    height, width = frames.shape[1:3]
    side = min(height, width)
    offset = int(round(where * (max(height, width) - side)))
    if height >= width:
        return frames[:, offset:offset + side]
    return frames[:, :, offset:offset + side]


def resize_frames(frames: np.ndarray, size: int) -> np.ndarray:
    """uint8 `(T, h, w, 3)` → uint8 `(T, H', W', 3)` with the shorter side `size` (bilinear, antialiased)."""
    import torch
    import torch.nn.functional as F

    height, width = frames.shape[1:3]
    if min(height, width) == size:
        return frames
    scale = size / min(height, width)
    out_hw = (max(size, round(height * scale)), max(size, round(width * scale)))
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=out_hw, mode="bilinear", antialias=True, align_corners=False)
    return x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


@dataclass(frozen=True)
class ClipSpec:
    """How clips are cut from the stored frames."""

    frames: int  # frames per clip
    size: int  # square side the frames are cropped and resized to
    sampling: Sampling = "segments"
    stride: int = 1  # "clip" sampling only
    train: bool = True  # random frames and crop positions; False: centred and deterministic
    stored_clip_length: int | None = None  # rows hold clips of this length back to back: sample within one
    clips_per_video: int = 1  # independent clips drawn from each video per pass (training)
    hflip: bool = False  # random horizontal flips (training); off by default: flips reverse left-right motion


def clip_indices_of(total: int, spec: ClipSpec, rng: np.random.Generator | None) -> np.ndarray:
    """Stored-frame indices of one clip: over the whole row, or within one of its stored clips."""
    length = spec.stored_clip_length
    if not length or total < length:
        return sample_clip_indices(total, spec.frames, spec.sampling, rng, spec.stride)
    count = total // length
    k = int(rng.integers(count)) if rng is not None else count // 2
    return k * length + sample_clip_indices(length, spec.frames, spec.sampling, rng, spec.stride)


def clip_rngs(keys: list[str], spec: ClipSpec, seed: int | None, epoch: int, round_: int) -> list[Any]:
    """One generator per video for one round of clips: `(seed, epoch, round, key)` decides it when
    seeded, so a run's clips do not depend on which worker or batch a video lands in; fresh otherwise."""
    if not spec.train:
        return [None] * len(keys)
    if seed is None:
        fresh = np.random.default_rng()
        return [fresh] * len(keys)
    return [np.random.default_rng([seed, epoch, round_, *key_seed(key)]) for key in keys]


def clip_rounds(videos: list[np.ndarray], labels: Any, keys: list[str], spec: ClipSpec, seed: int | None, epoch: int,
                cut: Callable[[np.ndarray, np.ndarray, Any], np.ndarray],
                ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """A batch's clips: `(clips, frame_positions (N, T), labels (N,))`, where `cut(video, indices, rng)` makes one
    clip from a video's stored rows at `clip_indices_of`'s indices (`rng` is the clip's, None when centred).

    Frame clips and feature clips both come from here, so a seeded run picks the same frames from either.
    """
    clips, positions, out_labels = [], [], []
    # Round by round, one clip of each video per round: a video's clips never come out back to back,
    # so a training batch mixes videos (and classes) rather than holding clips of one video.
    for round_ in range(spec.clips_per_video if spec.train else 1):
        for video, y, rng in zip(videos, labels, clip_rngs(keys, spec, seed, epoch, round_)):
            idx = clip_indices_of(len(video), spec, rng)
            clips.append(cut(video, idx, rng))
            positions.append(idx)
            out_labels.append(int(y))
    if not clips:
        return clips, np.zeros((0, spec.frames), np.int64), np.zeros((0,), np.int64)
    return clips, np.stack(positions), np.asarray(out_labels, np.int64)


def _clip_batch(table: Any, *, spec: ClipSpec, seed: int | None = None, epoch: int = 0) -> dict[str, np.ndarray]:
    """Ray Data UDF: video rows → clips `frames` uint8 `(N, T, S, S, 3)`, `frame_positions`, `label`."""
    column = table.column("frames").to_pylist()
    counts = table.column("num_frames").to_numpy()
    heights, widths = table.column("height").to_numpy(), table.column("width").to_numpy()
    videos = [decode_frames(data, int(t), int(h), int(w)) for data, t, h, w in zip(column, counts, heights, widths)]

    def cut(video: np.ndarray, idx: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        clip = square_crop(video[idx], float(rng.random()) if rng is not None else 0.5)
        clip = resize_frames(clip, spec.size)
        if spec.hflip and rng is not None and rng.random() < 0.5:
            clip = clip[:, :, ::-1]
        return np.ascontiguousarray(clip)

    clips, positions, labels = clip_rounds(videos, table.column("label").to_numpy(), table.column("key").to_pylist(),
                                           spec, seed, epoch, cut)
    frames = np.stack(clips) if clips else np.zeros((0, spec.frames, spec.size, spec.size, 3), np.uint8)
    return {"frames": frames, "frame_positions": positions, "label": labels}


def clip_dataset(uri: str, split: str, spec: ClipSpec, *, manifest: dict[str, Any] | None = None,
                 seed: int | None = None, epochs: int = 1, endpoint_url: str | None = None,
                 batch_size: int = 8) -> Any:
    """A Ray Dataset of clips from one split of a video ingest output.

    Training clips (`spec.train`) come from shards in shuffled order with random
    frames and crops: fresh on every pass with `seed=None`; with an integer seed
    the file order of pass `e` and every clip depend only on `(seed, e, video key)`,
    so a run is reproducible. `epochs` > 1 chains that many passes. `manifest`:
    the output's, when the caller has read it already (read here otherwise).
    """
    if split not in shards.SPLITS:
        raise ValueError(f"split must be one of {', '.join(shards.SPLITS)}, got {split!r}")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    store = open_store(uri, endpoint_url=endpoint_url)
    if manifest is None:
        manifest = read_video_manifest(uri, endpoint_url=endpoint_url)
    filesystem, _ = store.arrow()
    paths = [store.arrow(k)[1] for k in shard_keys(store, manifest, split)]
    return seeded_passes(paths, filesystem, split=split, columns=COLUMNS, shuffle=spec.train, seed=seed, epochs=epochs,
                         decode=_clip_batch, fn_kwargs={"spec": spec}, batch_size=batch_size)


def normalize_video(frames: Any) -> Any:
    """uint8 `(..., T, H, W, 3)` (numpy or torch) → float32 torch `(..., T, 3, H, W)` scaled like the image pipeline."""
    import torch

    if isinstance(frames, np.ndarray) and not frames.flags.writeable:
        frames = frames.copy()  # torch wants writable memory (shard bytes are read-only)
    x = torch.as_tensor(frames)
    x = x.movedim(-1, -3).float()
    return x.mul_(1 / (255 * PATCH_STD)).sub_(PATCH_MEAN / PATCH_STD)


def prepare_full_video(frames: np.ndarray, size: int) -> Any:
    """A stored video's uint8 frames `(T, H, W, 3)` as full-video evaluation and the video features stage see
    them: shorter side resized to `size`, the centre square, normalized → float32 `(T, 3, size, size)`."""
    return normalize_video(np.ascontiguousarray(square_crop(resize_frames(frames, size), 0.5)))


def clip_inputs(batch: dict[str, Any]) -> tuple[Any, Any]:
    """A clip batch from `clip_dataset` → the VTN's inputs `(video (B, T, 3, S, S), frame_indices (B, T))`."""
    return normalize_video(batch["frames"]), batch["frame_positions"].long()


# ---------------------------------------------------------------- whole videos


@dataclass
class VideoRow:
    """One stored video."""

    key: str
    label: int
    frames: np.ndarray  # uint8 (T, H, W, 3)
    frame_indices: np.ndarray | None  # each stored frame's index in the source video
    fps: float | None


def iter_videos(uri: str, split: str, *, manifest: dict[str, Any] | None = None, endpoint_url: str | None = None,
                limit: int | None = None) -> Iterator[VideoRow]:
    """The stored videos of `split`, shard by shard in key order (one shard in memory at a time; no Ray).

    `manifest`: the output's, when the caller has read it already (read here otherwise).
    """
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    store = open_store(uri, endpoint_url=endpoint_url)
    if manifest is None:
        manifest = read_video_manifest(uri, endpoint_url=endpoint_url)
    seen = 0
    for key in shard_keys(store, manifest, split):
        fs, path = store.arrow(key)
        table = pq.read_table(path, filesystem=fs, columns=list(video_shards.COLUMNS),
                              filters=pads.field("split") == split).sort_by("key")
        for row in video_shards.read_video_rows(table):
            if limit is not None and seen >= limit:
                return
            seen += 1
            yield VideoRow(row["key"], int(row["label"]), row["frames"], np.asarray(row["frame_indices"], np.int64),
                           row.get("fps"))


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The manifest's content hash, or a hash of the manifest itself when it carries none."""
    return str(manifest.get("content_hash") or shards.fingerprint(json.loads(json.dumps(manifest, default=str))))
