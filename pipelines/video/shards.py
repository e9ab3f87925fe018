"""The on-storage format of an ingested video dataset ("vitpipe-video/1"): Parquet shards plus `manifest.json`.

Layout under the output URI (the same as for images, `pipelines.core.shards`)::

    shards/shard-<window>-<part>.parquet   one row per video, columns below
    manifest.json                 format, frame size, sampling, classes, counts, rejected objects, content hash, config
    _SUCCESS                      written last; the config fingerprint and input digest of the finished run

Columns (`SCHEMA`, all non-null):

    frames         binary        uint8 array of shape (T, H, W, 3), C-contiguous, RGB
    num_frames     int32         T
    height         int32         H (= manifest["frame_size"])
    width          int32         W (= manifest["frame_size"])
    label          int32         class index, see manifest["classes"] (name -> index)
    key            string        the video's key relative to the source (unique in the dataset)
    split          string        train / val / test: `pipelines.core.shards.split_of(key, ...)`, or the manifest's
    frame_indices  list<int32>   index of each stored frame in the source video (decode order), length T
    fps            float32       the source video's average frame rate (0 when the container gives none)

Sampling (manifest["sampling"]["mode"]):

* ``full``: up to `max_frames` frames spread uniformly over the whole video (the
  centres of T equal segments, as `vit.vtn.sample_frame_indices`); a video with
  fewer frames keeps all of them, so T varies per row.
* ``clips``: one row per video still; its clips are stored back to back. Every
  clip has `clip_length` frames `frame_stride` apart, clips start `clip_stride`
  frames apart (at most `max_clips`, spread evenly over the possible starts), so
  T = n_clips * clip_length and clip k is ``frames[k*L:(k+1)*L]`` (`split_clips`).
  A video shorter than one clip gives one clip of repeated frames.

`decode_frames(row)` turns a row (a dict from `table.to_pylist()`, a Ray Data
row, or one row of a numpy batch) back into its `(T, H, W, 3)` array, and
`read_video_rows(table)` yields every row of a table with `frames` decoded.
Each shard's Parquet footer carries its own summary (counts, rejects, hash,
plan fingerprint), so a resumed run reuses a shard without reading its rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from pipelines.core.shards import Holds

__all__ = [
    "COLUMNS", "FORMAT", "SCHEMA", "VIDEOS", "VIDEO_FIELDS", "build_table", "content_hash", "decode_frames",
    "read_video_rows", "rows_hash", "split_clips", "table_hash", "video_arrays",
]

FORMAT = "vitpipe-video/1"
VIDEOS = Holds(FORMAT, "a video dataset")

# What every row says of its video, beside its frames (or, in `pipelines.video.features`, their features).
VIDEO_FIELDS = [
    pa.field("label", pa.int32(), nullable=False),
    pa.field("key", pa.string(), nullable=False),
    pa.field("split", pa.string(), nullable=False),
    pa.field("frame_indices", pa.list_(pa.int32()), nullable=False),
    pa.field("fps", pa.float32(), nullable=False),
]
SCHEMA = pa.schema(
    [
        pa.field("frames", pa.binary(), nullable=False),
        pa.field("num_frames", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        *VIDEO_FIELDS,
    ]
)
COLUMNS = tuple(SCHEMA.names)


def decode_frames(row: Mapping[str, Any]) -> np.ndarray:
    """The `(T, H, W, 3)` uint8 frames of one row (read-only when the bytes are; zero-copy)."""
    t, h, w = int(row["num_frames"]), int(row["height"]), int(row["width"])
    data = row["frames"]
    if isinstance(data, pa.Scalar):
        data = data.as_buffer()
    frames = np.frombuffer(data, dtype=np.uint8)
    if frames.size != t * h * w * 3:
        raise ValueError(f"{row.get('key', 'row')}: {frames.size} frame bytes do not make ({t}, {h}, {w}, 3)")
    return frames.reshape(t, h, w, 3)


def read_video_rows(table: pa.Table) -> Iterator[dict[str, Any]]:
    """Every row of a shard table as a dict, `frames` decoded to `(T, H, W, 3)` and
    `frame_indices` to an int32 array."""
    for batch in table.to_batches():
        columns = {name: batch.column(name) for name in batch.schema.names}
        for i in range(batch.num_rows):
            row = {name: col[i].as_py() for name, col in columns.items() if name != "frames"}
            row["frames"] = decode_frames({**row, "frames": columns["frames"][i]})
            row["frame_indices"] = np.asarray(row["frame_indices"], dtype=np.int32)
            yield row


def split_clips(frames: np.ndarray, clip_length: int) -> np.ndarray:
    """A `clips`-mode row's frames `(n·L, H, W, 3)` as `(n, L, H, W, 3)` clips."""
    if frames.shape[0] % clip_length:
        raise ValueError(f"{frames.shape[0]} frames are not a whole number of clips of {clip_length}")
    return frames.reshape(frames.shape[0] // clip_length, clip_length, *frames.shape[1:])


def build_table(
    frames: Sequence[np.ndarray],
    labels: Sequence[int],
    keys: Sequence[str],
    splits: Sequence[str],
    frame_indices: Sequence[Sequence[int]],
    fps: Sequence[float],
) -> pa.Table:
    """A shard table from per-video `(T, H, W, 3)` uint8 arrays (T may differ between rows)."""
    n = len(keys)
    sizes = np.array([f.nbytes for f in frames], dtype=np.int64)
    if sizes.sum() >= 2**31:
        raise ValueError(f"a shard of {n} videos holds {sizes.sum()} frame bytes, over 2 GiB; lower shard_size")
    offsets = pa.py_buffer(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32).tobytes())
    flat = [np.ascontiguousarray(f, dtype=np.uint8).reshape(-1) for f in frames]
    data = pa.py_buffer(np.concatenate(flat) if flat else np.zeros(0, np.uint8))  # one copy of the frames
    column = pa.Array.from_buffers(pa.binary(), n, [None, offsets, data])
    shape = np.array([f.shape[:3] for f in frames], dtype=np.int32).reshape(n, 3)
    return pa.Table.from_arrays(
        [
            column,
            pa.array(shape[:, 0], pa.int32()),
            pa.array(shape[:, 1], pa.int32()),
            pa.array(shape[:, 2], pa.int32()),
            *video_arrays(labels, keys, splits, frame_indices, fps),
        ],
        schema=SCHEMA,
    )


def video_arrays(
    labels: Sequence[int], keys: Sequence[str], splits: Sequence[str], frame_indices: Sequence[Sequence[int]],
    fps: Sequence[float],
) -> list[pa.Array]:
    """The `VIDEO_FIELDS` columns of a shard, one value per video."""
    return [
        pa.array(labels, pa.int32()),
        pa.array(keys, pa.string()),
        pa.array(splits, pa.string()),
        pa.array([[int(i) for i in ix] for ix in frame_indices], pa.list_(pa.int32())),
        pa.array(np.asarray(fps, dtype=np.float32), pa.float32()),
    ]


def rows_hash(
    keys: Sequence[str],
    labels: Sequence[int],
    splits: Sequence[str],
    frame_indices: Sequence[Sequence[int]],
    fps: Sequence[float],
    frames: Iterable[bytes | memoryview],
) -> str:
    """sha256 over a shard's rows: keys, labels, splits, frame indices and fps, then all frame bytes in row order."""
    h = hashlib.sha256()
    meta = [list(keys), [int(x) for x in labels], list(splits), [[int(i) for i in ix] for ix in frame_indices],
            [float(np.float32(x)) for x in fps]]
    h.update(json.dumps(meta).encode())
    for chunk in frames:
        h.update(chunk)
    return h.hexdigest()


def table_hash(table: pa.Table) -> str:
    """`rows_hash` of a shard table read back from storage."""
    frames = (memoryview(s.as_buffer()) for s in table.column("frames").combine_chunks())
    return rows_hash(
        table.column("key").to_pylist(), table.column("label").to_pylist(), table.column("split").to_pylist(),
        table.column("frame_indices").to_pylist(), table.column("fps").to_pylist(), frames,
    )


def content_hash(frame_size: int, sampling: Mapping[str, Any], classes: Mapping[str, int],
                 shard_hashes: Iterable[str]) -> str:
    """The dataset's content hash: same frames, indices, fps, labels, keys and splits give the same hash."""
    tree = {
        "format": FORMAT,
        "frame_size": frame_size,
        "sampling": dict(sampling),
        "classes": dict(classes),
        "shards": list(shard_hashes),
    }
    return "sha256:" + hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()
