"""The video ingest stage: video objects → Parquet shards of sampled, resized frames + `manifest.json`.

Video objects (MP4/MOV, MKV/WebM, AVI) in `<class>/<file>` folders or named by a
CSV/Parquet manifest (key,label[,split]), in a local folder or under `s3://`.
The stage runs on the sharded-ingest engine (`pipelines.core.ingest.run_sharded_ingest`)
with a video shard step: Ray Data streams the listing into shard plans, and CPU
workers fetch each shard's videos, decode them with PyAV (`pipelines.video.decode`),
sample frames (the whole video uniformly, or clips), resize the shorter side to
`frame_size` and centre-crop, and write the shard atomically. Runs are resumable
(finished shards of the same plan are reused) and idempotent (a finished output
with the same input and config is left alone; a changed input rewrites only the
shards whose plans changed). Bad objects (corrupt or truncated, zero
frames, audio only, unsupported container or codec) are rejected with a reason;
the stage fails with one line only when more than `max_reject_fraction` of the
objects are rejected. See `pipelines.video.shards` for the format.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipelines.core import shards
from pipelines.core.fetch import fetch_planned
from pipelines.core.ingest import (IngestKind, IngestResult, manifest_summary, public_config, run_sharded_ingest,
                                   shard_counts)
from pipelines.core.storage import S3Settings, Store
from pipelines.video import shards as video_shards
from pipelines.video.decode import RejectedVideo, decode_video
from pipelines.video.configs import VideoIngestConfig

__all__ = ["run_video_ingest", "process_video_shard"]


def run_video_ingest(config: VideoIngestConfig, *, force: bool = False) -> IngestResult:
    """Run (or resume, or skip) the video ingest (`result.counts["videos"]`: the kept videos); errors as
    `run_sharded_ingest` raises them."""
    return run_sharded_ingest(config, VIDEOS, force=force)


def process_video_shard(plan: dict[str, Any], config: VideoIngestConfig, source: Store, out: Store) -> dict[str, Any]:
    """Decode and write one planned shard of videos; returns its summary (the engine reuses one already written)."""
    key = plan["key"]
    kept: dict[str, list[Any]] = {k: [] for k in ("frames", "indices", "fps", "keys", "labels", "splits", "names")}
    source_frames: list[int] = []
    fixed = 0
    rejected: list[dict[str, str]] = []
    for i, data in fetch_planned(
        plan, source, rejected, io_threads=config.io_threads, max_bytes=config.max_object_bytes
    ):
        obj = plan["keys"][i]
        try:
            video = decode_video(data, config.frame_size, config.select, max_pixels=config.max_pixels)
        except RejectedVideo as why:
            rejected.append({"key": obj, "reason": str(why)})
            continue
        finally:
            del data  # dropped before the next fetch: fetch_planned's memory bound counts on it
        kept["frames"].append(video.frames)
        kept["indices"].append(video.indices)
        kept["fps"].append(float(np.float32(video.fps)))
        kept["keys"].append(obj)
        kept["labels"].append(plan["labels"][i])
        kept["splits"].append(plan["splits"][i] or shards.split_of(obj, config.val_fraction, config.test_fraction))
        kept["names"].append(plan["names"][i])
        fixed += bool(plan["splits"][i])
        source_frames.append(video.total_frames)

    table = video_shards.build_table(
        kept["frames"], kept["labels"], kept["keys"], kept["splits"], kept["indices"], kept["fps"]
    )
    stored = [len(ix) for ix in kept["indices"]]
    summary = {
        "key": key,
        "plan_fingerprint": plan["fingerprint"],
        "rows": len(kept["keys"]),
        "fixed_splits": fixed,
        "hash": video_shards.rows_hash(
            kept["keys"], kept["labels"], kept["splits"], kept["indices"], kept["fps"],
            (f.reshape(-1).data for f in kept["frames"]),
        ),
        **shard_counts(plan, kept["splits"], kept["names"]),
        "frames": sum(stored),
        "stats": _stats(stored, source_frames, kept["fps"]),
        "rejected": rejected,
    }
    shards.write_shard(out, key, table, summary, config.compression)
    return summary


def _stats(stored: list[int], source: list[int], fps: list[float]) -> dict[str, list[float]]:
    """[min, max] of stored frames, source frames and fps over a shard's videos (empty lists if none)."""
    return {name: [min(v), max(v)] if v else [] for name, v in (("stored_frames", stored),
                                                                 ("source_frames", source), ("fps", fps))}


def _assemble_manifest(
    config: VideoIngestConfig, settings: S3Settings, fingerprint: str, summaries: list[dict[str, Any]]
) -> dict[str, Any]:
    common = manifest_summary(summaries, "videos")
    common["counts"]["frames"] = sum(s["frames"] for s in summaries)
    stats: dict[str, list[float]] = {}
    for name in ("stored_frames", "source_frames", "fps"):
        values = [v for s in summaries for v in s["stats"][name]]
        stats[name] = [min(values), max(values)] if values else []
    sampling = config.sampling_settings()
    return {
        "format": video_shards.FORMAT,
        "frame_size": config.frame_size,
        "height": config.frame_size,
        "width": config.frame_size,
        "channels": 3,
        "sampling": sampling,
        **common,
        "stats": stats,
        "content_hash": video_shards.content_hash(
            config.frame_size, sampling, common["classes"], [s["hash"] for s in summaries]
        ),
        "fingerprint": fingerprint,
        "config": public_config(config, settings),
    }


VIDEOS = IngestKind("video-ingest", video_shards.FORMAT, "videos", process_video_shard, _assemble_manifest)
