"""Video shards in the ingest's on-storage format (`pipelines.video.shards`), without decoding any video.

`write_video_shards` produces what the video ingest stage writes
(`shards/shard-NNNNNN.parquet`, `manifest.json` with format `vitpipe-video/1`,
`_SUCCESS`) for a small, generated, order-matters corpus: a bright square
crosses the frame left to right ("forward") or right to left ("backward").
Both classes are made of the same kind of frames; only their order tells them
apart, so a model that ignores frame order is at chance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from pipelines.core import shards
from pipelines.video import shards as video_shards

CLASSES = {"forward": 0, "backward": 1}
FRAMES = 8  # frames stored per video in the stage tests, and per training clip: each frame keeps its position
TEMPORAL = dict(depth=2, num_heads=2, window=8, head_dropout=0.0, attn_dropout=0.0)  # a tiny temporal encoder


def moving_square(label: int, frames: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `(T, size, size, 3)`: a square crossing the frame, left→right for label 0, right→left for 1."""
    side = size // 4
    top = int(rng.integers(0, size - side + 1))
    colour = rng.integers(160, 256, size=3).astype(np.uint8)
    video = rng.integers(0, 40, size=(frames, size, size, 3)).astype(np.uint8)
    lefts = np.linspace(0, size - side, frames).round().astype(int)
    if label == 1:
        lefts = lefts[::-1]
    for t, left in enumerate(lefts):
        video[t, top:top + side, left:left + side] = colour
    return video


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return out


def write_video_shards(out: str | Path, *, videos: int = 48, size: int = 32, frames: tuple[int, int] = (12, 24),
                       splits: dict[str, float] | None = None, per_shard: int = 16, seed: int = 0) -> str:
    """Write a finished video ingest output of `videos` videos (classes alternate); returns `out`.

    Each video stores a random number of frames in `frames` (inclusive), as if
    sampled from a longer source video (`frame_indices` every 3rd frame at 30 fps).
    Splits follow the `splits` fractions (default 60/20/20 train/val/test), in a seeded random order.
    """
    out = Path(out)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    fractions = splits or {"train": 0.6, "val": 0.2, "test": 0.2}
    order = []
    for name, frac in fractions.items():
        order += [name] * int(round(frac * videos))
    order = (order + ["train"] * videos)[:videos]
    rng.shuffle(order)
    rows = []
    for i in range(videos):
        label = i % len(CLASSES)
        count = int(rng.integers(frames[0], frames[1] + 1))
        rows.append({
            "frames": moving_square(label, count, size, rng), "label": label,
            "key": f"{'forward' if label == 0 else 'backward'}/video-{i:04d}.mp4", "split": order[i],
            "frame_indices": list(range(0, 3 * count, 3)), "fps": 30.0,
        })
    listed = []
    for shard, start in enumerate(range(0, videos, per_shard)):
        part = rows[start:start + per_shard]
        table = video_shards.build_table(*([row[name] for row in part]
                                           for name in ("frames", "label", "key", "split", "frame_indices", "fps")))
        key = shards.shard_key(shard)
        pq.write_table(table, out / key)
        listed.append({"path": key, "rows": len(part), "split": _count(row["split"] for row in part)})
    counts = _count(row["split"] for row in rows)
    manifest = {
        "format": video_shards.FORMAT, "frame_size": size, "height": size, "width": size, "channels": 3,
        "sampling": {"mode": "full", "max_frames": frames[1]}, "classes": CLASSES, "num_classes": len(CLASSES),
        "counts": {**{name: counts.get(name, 0) for name in shards.SPLITS}, "videos": videos, "rejected": 0},
        "rejected": [], "shards": listed,
        "stats": {"stored_frames": list(frames), "source_frames": list(frames), "fps": []},  # as ingest writes them
    }
    (out / shards.MANIFEST).write_text(json.dumps(manifest, indent=2))
    (out / shards.SUCCESS).write_text("{}")
    return str(out)


TINY_BACKBONE = dict(image_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, mlp_dim=64)


def pretrain_position_backbone(directory: str | Path, *, size: int = 32, steps: int = 200, seed: int = 0) -> str:
    """A tiny ViT trained on single frames of the corpus to tell where the square is (4 horizontal bins).

    Stands in for an image-pipeline pretrain run (a few seconds in-process): its
    features locate the square, so a temporal encoder on top can learn the
    direction of motion. Saved with `vit.save_checkpoint`; returns the directory.
    """
    import torch
    import torch.nn.functional as F

    import vit
    from pipelines.video.data import normalize_video

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = vit.create_model("ViT-Ti/16", **{**TINY_BACKBONE, "image_size": size}, num_classes=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    frames = 8
    bins = torch.as_tensor(np.arange(frames) * 4 // frames)
    for _ in range(steps):
        labels = rng.integers(0, 2, size=4)
        video = np.concatenate([moving_square(int(y), frames, size, rng) for y in labels])
        target = torch.cat([bins if y == 0 else bins.flip(0) for y in labels])
        loss = F.cross_entropy(model(normalize_video(video)), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vit.save_checkpoint(model, directory)
    return str(directory)


def order_matters_videos(out: str | Path) -> str:
    """The stage tests' data: 48 videos of `FRAMES` stored 32×32 frames in 3 shards, 60/20/20 split."""
    return write_video_shards(out, videos=48, frames=(FRAMES, FRAMES))


def logged_backbone_run(tmp: str | Path, experiment: str, *, steps: int = 200) -> dict[str, str]:
    """The pretrained tiny ViT logged as an image pretrain run leaves it, `checkpoints/final` of an MLflow run in
    `<tmp>/mlflow.db`: `run_id`, `tracking_uri`, `checkpoint` (the local copy), `tmp` and `init` (its runs:/ URI)."""
    from mlflow.tracking import MlflowClient

    from pipelines.core import tracking

    checkpoint = pretrain_position_backbone(Path(tmp) / "checkpoint", steps=steps)
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(tracking.get_or_create_experiment(client, experiment),
                               tags={tracking.TAG_STAGE: "pretrain"}).info.run_id
    tracking.log_checkpoint_dir(client, run_id, checkpoint, "checkpoints/final")
    client.set_terminated(run_id)
    return {"run_id": run_id, "tracking_uri": uri, "checkpoint": checkpoint, "tmp": str(tmp),
            "init": f"runs:/{run_id}/checkpoints/final"}


def vtn_train_fields(data: str, backbone_run: dict[str, str], experiment: str) -> dict[str, Any]:
    """The video_train fields the stage tests share: 100 steps of a tiny VTN on 2 workers, starting from
    `backbone_run`, recorded under its tmp dir and tracking store."""
    return dict(
        data=data, init=backbone_run["init"], vtn=TEMPORAL,
        # A short warm-up: AdamW's first steps move every weight by ~lr, which at 1e-2 with no warm-up
        # sometimes kicks this tiny model onto a plateau (or a loss spike) instead of down.
        train_frames=FRAMES, clips_per_video=16, optimizer="adamw", lr=5e-3, warmup_steps=10, steps=100, num_workers=2,
        # Sine-cosine positions: from a tiny VTN's small initial logits, the learned table (the default)
        # leaves a plateau of 50-200 steps before the loss falls; fixed positions fall within ~40.
        temporal_pos_embed="fixed",
        batch_size_per_worker=8, log_interval=5, checkpoint_interval=0, precision="fp32",
        storage=f"{backbone_run['tmp']}/runs", tracking_uri=backbone_run["tracking_uri"], experiment=experiment,
    )


def upload_tree(s3: Any, root: str | Path, bucket: str, prefix: str) -> str:
    """Put every file under `root` into `s3://bucket/prefix/<relative path>` with boto3 client `s3`; returns that URI."""
    root = Path(root)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")
    return f"s3://{bucket}/{prefix}"
