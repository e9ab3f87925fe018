"""A generated, labelled video corpus: scikit-learn digits moving along class-specific paths, as real MP4 files.

`synth_video_corpus(dest, videos=N, classes=K, size=S, frames=F, seed=...)` writes
`<dest>/<class>/<i>.mp4` (H.264, yuv420p, `S`×`S`) from parallel Ray tasks; every
byte is a function of the seed. Videos vary in length (about 0.75·F to 1.25·F
frames) and frame rate (10 to 30 fps).

Two kinds of class, so that frame order matters for some and not for others:

* *ordered pairs*: class 2p moves digit p in a straight line across the frame
  (left→right, top→bottom, along a diagonal, ...); class 2p+1 is the same
  process played backwards: the same frames in reverse order. Only the order
  of the frames tells the two apart.
* *appearance* classes: a digit of their own circling the centre, clockwise or
  anticlockwise at random, so any single frame names the class and the order
  carries no information.

There are `max(1, K // 3)` pairs and the rest are appearance classes (K from 2 to
15: each pair and each appearance class has its own digit). `class_specs(K)` says
which is which; the same list is written to `<dest>/.corpus.json` (a hidden name,
so ingest does not list it).
"""

from __future__ import annotations

import functools
import io
import json
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from pipelines.corpora.images import CorpusResult, assignments, open_dest
from pipelines.core.cluster import connect
from pipelines.core.storage import Store

MAX_CLASSES = 15
FPS_CHOICES = (10, 12, 15, 24, 25, 30)
CHUNK = 8  # videos per Ray task
CRF = 12  # x264 quality: near-lossless at these sizes, so decoded frames stay close to the rendered ones
X264_PARAMS = "threads=1:lookahead-threads=1:no-mbtree=1:rc-lookahead=0"  # reproducible bytes: see encode_mp4
META_KEY = ".corpus.json"
# Straight-line directions of the ordered pairs (image coordinates: y grows downwards).
DIRECTIONS = (
    ("rightward", 0.0), ("downward", math.pi / 2), ("down-right", math.pi / 4), ("down-left", 3 * math.pi / 4),
    ("right-up", -math.pi / 8), ("right-down", math.pi / 8),
)
REVERSED_NAMES = {"rightward": "leftward", "downward": "upward", "down-right": "up-left", "down-left": "up-right",
                  "right-up": "left-down", "right-down": "left-up"}


@dataclass(frozen=True)
class MotionClass:
    """One class of the corpus: its digit and how it moves."""

    label: int
    name: str  # the class folder; zero-padded label first, so listing order is label order
    digit: int
    kind: str  # "forward", "reversed" (of `reverse_of`) or "appearance"
    direction: float  # radians, for forward/reversed
    reverse_of: int | None = None

    @property
    def order_matters(self) -> bool:
        return self.kind != "appearance"


def class_specs(classes: int) -> list[MotionClass]:
    """The `classes` classes: `max(1, classes // 3)` ordered pairs first, then appearance classes."""
    if not 2 <= classes <= MAX_CLASSES:
        raise ValueError(f"classes must be within 2..{MAX_CLASSES}, got {classes}")
    pairs = max(1, classes // 3)
    specs: list[MotionClass] = []
    for p in range(pairs):
        word, angle = DIRECTIONS[p % len(DIRECTIONS)]
        specs.append(MotionClass(2 * p, f"{2 * p:02d}-digit{p}-{word}", p, "forward", angle))
        specs.append(MotionClass(2 * p + 1, f"{2 * p + 1:02d}-digit{p}-{REVERSED_NAMES[word]}", p, "reversed",
                                 angle, reverse_of=2 * p))
    for label in range(2 * pairs, classes):
        digit = pairs + label - 2 * pairs
        specs.append(MotionClass(label, f"{label:02d}-digit{digit}-circling", digit, "appearance", 0.0))
    return specs


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32) / 16.0, d.target.astype(int)


def _sprite(digit: int, side: int, rng: np.random.Generator) -> np.ndarray:
    """A random handwritten instance of `digit`, upscaled to `side`×`side`, as alpha in [0, 1]."""
    from PIL import Image

    images, targets = _digits()
    choices = np.flatnonzero(targets == digit)
    img = images[choices[rng.integers(len(choices))]]
    up = Image.fromarray((img * 255).astype(np.uint8)).resize((side, side), Image.Resampling.BILINEAR)
    return np.asarray(up, dtype=np.float32) / 255.0


def video_length(frames: int, rng: np.random.Generator) -> tuple[int, int]:
    """(frame count, fps) of one video: about 0.75·frames to 1.25·frames, fps from `FPS_CHOICES`."""
    low, high = max(4, (3 * frames) // 4), max(4, (5 * frames) // 4)
    return int(rng.integers(low, high + 1)), int(rng.choice(FPS_CHOICES))


def render_video(spec: MotionClass, frames: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """`(frames, size, size, 3)` uint8: the class's digit moving its way over a textured background.

    A `reversed` class draws exactly what its forward class would with the same
    generator state, in reverse order.
    """
    if spec.kind == "reversed":
        return render_video(MotionClass(spec.label, spec.name, spec.digit, "forward", spec.direction), frames, size,
                            rng)[::-1].copy()
    side = max(4, size // 2)
    alpha = _sprite(spec.digit, side, rng)[None, :, :, None]  # (1, s, s, 1)
    colour = rng.uniform(0.55, 1.0, size=3).astype(np.float32)
    base = rng.uniform(0.0, 0.25, size=3).astype(np.float32)
    texture = rng.normal(0.0, 0.04, size=(size // 4 + 1, size // 4 + 1, 1)).astype(np.float32)
    background = np.clip(base + np.kron(texture, np.ones((4, 4, 1), np.float32))[:size, :size], 0, 1)
    t = np.linspace(0.0, 1.0, frames)
    room = size - side  # how far the sprite's corner can move
    centre = room / 2 + rng.uniform(-0.08, 0.08, size=2) * room
    if spec.kind == "forward":
        travel = 0.85 * room
        step = np.array([math.cos(spec.direction), math.sin(spec.direction)])
        xy = centre + (t[:, None] - 0.5) * travel * step
    else:  # appearance: one to two turns around the centre, either way round
        turns = rng.uniform(1.0, 2.0) * rng.choice([-1.0, 1.0])
        phase = rng.uniform(0, 2 * math.pi)
        radius = room / 3
        angle = phase + 2 * math.pi * turns * t
        xy = centre + radius * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    xy = np.clip(np.round(xy), 0, room).astype(int)
    video = np.repeat(background[None], frames, axis=0)
    for f, (x, y) in enumerate(xy):
        patch = video[f, y:y + side, x:x + side]
        video[f, y:y + side, x:x + side] = patch * (1 - alpha[0]) + colour * alpha[0]
    return (np.clip(video, 0, 1) * 255 + 0.5).astype(np.uint8)


def encode_mp4(video: np.ndarray, fps: int) -> bytes:
    """H.264 in MP4 (yuv420p), reproducible byte for byte.

    One encoder thread, frames converted to yuv420p before they reach the
    encoder, and no macroblock-tree rate control or rate-control lookahead: with
    x264's defaults a fresh process wrote a different file about once in 150
    (the streams parted at a B-frame's rate decision); without them, 1,200 of
    1,200 processes wrote the same bytes here.
    """
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        options = {"crf": str(CRF), "preset": "medium", "threads": "1", "x264-params": X264_PARAMS}
        stream = container.add_stream("libx264", rate=fps, options=options)
        stream.width, stream.height = video.shape[2], video.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1
        stream.codec_context.thread_type = "NONE"
        for frame in video:
            yuv = av.VideoFrame.from_ndarray(frame, format="rgb24").reformat(format="yuv420p")
            for packet in stream.encode(yuv):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def video_rng(seed: int, label: int, index: int) -> np.random.Generator:
    """The generator of video `index` of class `label`: its length, fps and pixels come from it."""
    return np.random.default_rng([seed, label, index, 0x51DE0])


def make_video(spec: MotionClass, index: int, *, seed: int, size: int, frames: int) -> tuple[np.ndarray, int]:
    """The rendered frames and fps of one video of the corpus (what `synth_video_corpus` encodes)."""
    rng = video_rng(seed, spec.label, index)
    count, fps = video_length(frames, rng)
    return render_video(spec, count, size, rng), fps


def _render_chunk(store: Store, seed: int, size: int, frames: int, specs: list[MotionClass],
                  items: list[tuple[int, int]]) -> int:
    for c, i in items:
        video, fps = make_video(specs[c], i, seed=seed, size=size, frames=frames)
        store.write(f"{specs[c].name}/{i:06d}.mp4", encode_mp4(video, fps))
    return len(items)


def synth_video_corpus(
    dest: str,
    *,
    videos: int,
    classes: int,
    size: int = 32,
    frames: int = 32,
    seed: int = 0,
    endpoint_url: str | None = None,
    max_in_flight: int = 16,
) -> CorpusResult:
    """Write `videos` MP4s in `classes` class folders to `dest` (local or s3://), in Ray tasks.

    `CorpusResult.images` is the number of videos written.
    """
    import ray

    if videos < classes:
        raise ValueError(f"need videos >= classes, got videos={videos}, classes={classes}")
    specs = class_specs(classes)
    if not 16 <= size <= 1024 or size % 2:
        raise ValueError(f"size must be even and within 16..1024 (H.264 4:2:0), got {size}")
    if not 4 <= frames <= 10_000:
        raise ValueError(f"frames must be within 4..10000, got {frames}")
    start = time.perf_counter()
    store = open_dest(dest, endpoint_url)
    connect()  # joined here, not by Ray's auto-init: see pipelines.core.cluster
    task = ray.remote(num_cpus=1)(_render_chunk)
    pending: list[ray.ObjectRef] = []
    done = 0
    chunk: list[tuple[int, int]] = []
    for item in assignments(videos, classes):
        chunk.append(item)
        if len(chunk) == CHUNK:
            pending.append(task.remote(store, seed, size, frames, specs, chunk))
            chunk = []
        while len(pending) >= max_in_flight:
            ready, pending[:] = ray.wait(pending, num_returns=1)
            done += sum(ray.get(ready))
    if chunk:
        pending.append(task.remote(store, seed, size, frames, specs, chunk))
    done += sum(ray.get(pending))
    meta = {"format": "vitpipe-video-corpus/1", "seed": seed, "size": size, "frames": frames,
            "classes": [{**asdict(s), "order_matters": s.order_matters} for s in specs]}
    store.write(META_KEY, json.dumps(meta, indent=1).encode())
    return CorpusResult(dest, done, [s.name for s in specs], time.perf_counter() - start)
