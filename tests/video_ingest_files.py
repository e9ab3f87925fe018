"""Real video files for the video ingest tests: the generated corpus plus one good video in each other
container, the encoder that makes them, and the stage's config and shard rows as the tests read them."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.core import shards
from pipelines.corpora.videos import class_specs, make_video, synth_video_corpus
from pipelines.video import shards as video_shards
from pipelines.video.configs import VideoIngestConfig

SEED, SIZE, FRAMES, CLASSES, VIDEOS = 0, 32, 16, 4, 24
FRAME_SIZE, MAX_FRAMES = 16, 16
# Extra good videos in the other containers: key -> (class, video index, FFmpeg format, codec).
OTHER_CONTAINERS = {"webm": ("webm", "libvpx-vp9"), "avi": ("avi", "mpeg4"), "mkv": ("matroska", "libx264")}


def encode(frames: np.ndarray, fps: int, fmt: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 4_000_000  # high quality, so decoded frames stay close to the rendered ones
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def config(source, output, **overrides) -> VideoIngestConfig:
    fields = dict(source=str(source), output=str(output), frame_size=FRAME_SIZE, max_frames=MAX_FRAMES,
                  val_fraction=0.2, test_fraction=0.1, shard_size=8, mix_window=4)
    fields.update(overrides)
    return VideoIngestConfig(**fields)


def read_rows(output: str) -> dict[str, dict]:
    rows = {}
    for path in sorted(Path(output, shards.SHARD_DIR).glob("*.parquet")):
        for row in video_shards.read_video_rows(pq.read_table(path)):
            assert row["key"] not in rows, f"{row['key']} appears twice"
            rows[row["key"]] = row
    return rows


@pytest.fixture(scope="module")
def corpus(ray_cluster, tmp_path_factory):
    """The generated corpus plus one good video per other container; returns (root, {key: (frames, fps)})."""
    root = tmp_path_factory.mktemp("video-corpus")
    synth_video_corpus(str(root), videos=VIDEOS, classes=CLASSES, size=SIZE, frames=FRAMES, seed=SEED)
    specs = class_specs(CLASSES)
    expected = {}
    for spec in specs:
        for i in range(VIDEOS // CLASSES):
            expected[f"{spec.name}/{i:06d}.mp4"] = make_video(spec, i, seed=SEED, size=SIZE, frames=FRAMES)
    for n, (ext, (fmt, codec)) in enumerate(OTHER_CONTAINERS.items()):
        spec = specs[2 + n % 2]
        video = make_video(spec, 100 + n, seed=SEED, size=SIZE, frames=FRAMES)
        key = f"{spec.name}/other-{n}.{ext}"
        (root / key).write_bytes(encode(*video, fmt, codec))
        expected[key] = video
    return root, expected
