"""The video features stage: per-frame backbone features of a video ingest output, stored as shards.

The VTN paper's third inference method runs the 2-D backbone over every frame
once and keeps the features; the temporal encoder then trains and predicts on
features alone (`pipelines.video.train` with `data` set to this stage's
output). Ray Data reads the video shards, a pool of CPU actors (a callable
class, so each loads the backbone once) turns each video into `(T, D)`
features, and the driver writes one feature shard per video shard, atomically.

Frames are prepared as the video stage's full-video evaluation prepares them:
the shorter side resized to `frame_size`, the centre square cropped,
`normalize_video`; the features are `VTN.frame_features` of those frames.

Layout under `output` (the ingest's conventions, `pipelines.core.shards`)::

    shards/shard-NNNNNN.parquet   one row per video, named as the video shard it comes from
    manifest.json                 format "vitpipe-video-features/1", backbone, feature dim, frame size,
                                  classes, counts and sampling of the source, shard list, content hash
    _SUCCESS                      written last; holds the fingerprint of the finished run

Columns: `features` (binary, float32 or float16 `(T, D)` C order), `num_frames`
(T), `dim` (D), `label`, `key`, `split`, `frame_indices` (list<int32>, each
stored frame's index in the source video), `fps`. A rerun of a finished output
with the same data, backbone weights and settings does nothing; an interrupted
run reuses the feature shards it finished (their footers carry a fingerprint).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import time
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel

import vit
from pipelines.core import shards
from pipelines.core.errors import VitpipeError
from pipelines.core.datasets import read_each_shard
from pipelines.core.uris import resolve_tracking_uri, strip_userinfo
from pipelines.core.cluster import connect
from pipelines.core.stage_config import load_stage_config
from pipelines.core.storage import S3Settings, open_store
from pipelines.training.step import resolve_precision
from pipelines.video import shards as video_shards
from pipelines.core.shards import num_classes
from pipelines.video.data import manifest_digest, prepare_full_video, read_video_manifest, shard_keys
from pipelines.video.feature_data import COLUMNS, DTYPES, FORMAT, SCHEMA, features_table, table_hash
from pipelines.video.model import FrozenBackbone, InitialModel, build_initial_model
from pipelines.video.configs import VideoFeaturesConfig

logger = logging.getLogger("vitpipe.video_features")  # under "vitpipe": its handlers scrub credentials
STAGE = "video_features"
PREPARATION = "shorter side resized to frame_size, centre square crop, normalize_video (as full-video evaluation)"

__all__ = ["NOT_IDENTITY", "FrameFeatures", "frozen_backbone", "VideoFeaturesResult", "load_backbone",
           "load_config", "run_identity", "run_video_features"]
# Fields that do not change the features stored, so they stay out of the output's identity. The identity holds
# the others as what they resolve to: `data` as the source's content hash; `init`, `backbone`,
# `backbone_overrides` and `seed` as the built backbone (its config and its weights' hash); `frame_size`
# and `precision` as resolved.
NOT_IDENTITY = {
    "output", "endpoint_url", "tracking_uri", "experiment",  # where things are read, written and recorded
    "batch_size", "videos_per_batch", "num_workers", "cpus_per_worker",  # how fast
    "compression",  # how shards are encoded on disk: the features read back are the same
}


class VideoFeaturesResult(BaseModel):
    """What the stage hands on (`output` is a `data` for video_train)."""

    output: str
    manifest: dict[str, Any]
    counts: dict[str, Any]
    shards_written: int
    shards_reused: int
    skipped: bool  # the output was already complete for this config: nothing was done
    seconds: float


def load_config(source: str | os.PathLike[str] | dict[str, Any], **overrides: Any) -> VideoFeaturesConfig:
    """A `VideoFeaturesConfig` from a YAML/JSON file or a dict, with one-line errors."""
    return load_stage_config(VideoFeaturesConfig, STAGE, source, overrides)


# ---------------------------------------------------------------- the actors


class FrameFeatures:
    """Ray Data UDF (one per actor): video rows → feature rows, with the backbone loaded once."""

    def __init__(self, model: list[Any], frame_size: int, batch_size: int, bf16: bool, dtype: str, threads: int) -> None:
        import ray
        import torch

        torch.set_num_threads(threads)
        ref = model[0]  # in a list, so Ray hands over the reference and the actor fetches the model once
        self.model = (ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref).eval()
        self.size, self.batch_size, self.bf16, self.dtype = frame_size, batch_size, bf16, DTYPES[dtype]

    def features(self, frames: np.ndarray) -> np.ndarray:
        """`(T, D)` features of one stored video's uint8 frames `(T, H, W, 3)`."""
        import torch

        square = prepare_full_video(frames, self.size)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            feats = self.model.frame_features(square[None], chunk_size=self.batch_size)[0]
        return feats.float().numpy().astype(self.dtype)

    def __call__(self, table: pa.Table) -> pa.Table:
        rows = list(video_shards.read_video_rows(table))
        out = features_table([self.features(r["frames"]) for r in rows], [r["label"] for r in rows],
                             [r["key"] for r in rows], [r["split"] for r in rows],
                             [r["frame_indices"] for r in rows], [r["fps"] for r in rows])
        if "path" not in table.column_names:
            return out
        # Which video shard each row came from (Ray Data's `include_paths`): the driver groups rows by it.
        return out.append_column("path", pa.array([posixpath.basename(p) for p in table.column("path").to_pylist()]))


# ---------------------------------------------------------------- the stage


def run_video_features(config: VideoFeaturesConfig, *, force: bool = False,
                       ray_address: str | None = None) -> VideoFeaturesResult:
    """Run (or resume, or skip) the stage; `force` recomputes every shard.

    Raises `VitpipeError`/`StorageError` (one line naming the URI) when the data is
    not a finished video ingest output or the output cannot be written, and a
    one-line ValueError naming the field for a backbone that cannot be built.
    """
    import torch

    start = time.perf_counter()
    source_manifest = read_video_manifest(config.data, endpoint_url=config.endpoint_url)
    source = open_store(config.data, endpoint_url=config.endpoint_url)
    out = open_store(config.output, endpoint_url=config.endpoint_url)
    shards.check_output(out, FORMAT)
    initial, backbone = load_backbone(config, source_manifest)
    bf16 = resolve_precision(config.precision, torch.device("cpu")) is not None  # resolved here, the same for all actors
    identity = run_identity(config, source_manifest, backbone, initial.frame_size, bf16)
    fingerprint = shards.fingerprint(identity)
    done = None if force else shards.finished_manifest(out, fingerprint)
    if done is not None:
        logger.info("%s: %s is complete for this config; nothing to do", STAGE, config.output)
        return VideoFeaturesResult(output=config.output, manifest=done, counts=done["counts"], shards_written=0,
                                   shards_reused=0, skipped=True, seconds=time.perf_counter() - start)
    out.delete(shards.SUCCESS)  # whatever happens next, an older marker no longer describes the output
    if force:
        shards.remove_stale_shards(out, keep=set())

    keys = shard_keys(source, source_manifest)
    summaries, todo = {}, []
    for key in keys:
        reused = shards.existing_summary(out, key, _shard_fingerprint(fingerprint, key))  # finished by an earlier run
        if reused is not None:
            summaries[key] = reused
        else:
            todo.append(key)
    if todo:
        connect(ray_address)
        summaries.update(_compute(config, initial, bf16, source, out, todo, fingerprint))
    ordered = [summaries[k] for k in keys]
    shards.remove_stale_shards(out, set(keys))
    manifest = _assemble_manifest(config, source_manifest, initial.frame_size, backbone, identity, fingerprint, ordered)
    listed = (source_manifest.get("counts") or {}).get("videos")
    if listed is not None and listed != manifest["counts"]["videos"]:
        raise VitpipeError(f"{strip_userinfo(config.data)}: the manifest lists {listed} videos, the shards hold "
                           f"{manifest['counts']['videos']}")
    out.write(shards.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    out.write(shards.SUCCESS, json.dumps({"fingerprint": fingerprint, "content_hash": manifest["content_hash"]}).encode())
    written = sum(not s.get("reused") for s in ordered)
    logger.info("%s: %d videos in %d shards (%d written, %d reused) -> %s", STAGE, manifest["counts"]["videos"],
                len(ordered), written, len(ordered) - written, config.output)
    return VideoFeaturesResult(output=config.output, manifest=manifest, counts=manifest["counts"],
                               shards_written=written, shards_reused=len(ordered) - written, skipped=False,
                               seconds=time.perf_counter() - start)


def run_identity(config: VideoFeaturesConfig, source_manifest: dict[str, Any], backbone: dict[str, Any],
                 frame_size: int, bf16: bool) -> dict[str, Any]:
    """What decides the features stored: the source's content, the backbone (`load_backbone`'s record: its
    architecture and its weights' hash), the resolved frame size and precision, and the stored dtype."""
    return {"format": FORMAT, "data": manifest_digest(source_manifest), "weights": backbone["weights_hash"],
            "backbone": {"name": backbone["name"], "overrides": backbone["overrides"]},
            "frame_size": frame_size, "precision": "bf16" if bf16 else "fp32", "feature_dtype": config.feature_dtype}


def frozen_backbone(config: VideoFeaturesConfig) -> FrozenBackbone:
    """What `pipelines.video.model.build_initial_model` needs to build this stage's backbone (frozen)."""
    return FrozenBackbone(init=config.init, backbone=config.backbone, backbone_overrides=config.backbone_overrides,
                          frame_size=config.frame_size, seed=config.seed, endpoint_url=config.endpoint_url)


def load_backbone(config: VideoFeaturesConfig, source_manifest: dict[str, Any]) -> tuple[InitialModel, dict[str, Any]]:
    """The frozen VTN whose backbone computes the features (built as video_train builds its model),
    and the backbone as the manifest records it."""
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    initial = build_initial_model(frozen_backbone(config), num_classes(source_manifest), tracking_uri)
    return initial, {
        "init": initial.backbone_source, "run_id": initial.backbone_run_id, "name": initial.model.config.backbone,
        "overrides": initial.model.config.backbone_overrides, "weights_hash": vit.weights_hash(initial.model.backbone),
        "feature_dim": int(initial.model.backbone.num_features),
    }


def _shard_fingerprint(fingerprint: str, key: str) -> str:
    return shards.fingerprint({"run": fingerprint, "source_shard": key})


def _compute(config: VideoFeaturesConfig, initial: Any, bf16: bool, source: Any, out: Any, keys: list[str],
             fingerprint: str) -> dict[str, dict[str, Any]]:
    """Features of the video shards `keys` on the actor pool; each feature shard is written once all its rows came."""
    stream = functools.partial(_feature_batches, config, initial, bf16)
    return {key: _write(config, out, key, parts, fingerprint)
            for key, parts in shards.regroup(source, keys, stream, unit="videos")}


def _feature_batches(config: VideoFeaturesConfig, initial: Any, bf16: bool, filesystem: Any, paths: list[str]) -> Any:
    """The feature rows of the video shards at `paths` (with each row's shard `path`), as the actor pool
    streams them back."""
    import ray

    ds = read_each_shard(paths, filesystem, video_shards.COLUMNS, readers=2 * config.num_workers)  # two per actor
    threads = max(1, round(config.cpus_per_worker))
    ds = ds.map_batches(
        FrameFeatures, fn_constructor_kwargs=dict(model=[ray.put(initial.model)], frame_size=initial.frame_size,
                                                  batch_size=config.batch_size, bf16=bf16,
                                                  dtype=config.feature_dtype, threads=threads),
        batch_size=config.videos_per_batch, batch_format="pyarrow", concurrency=config.num_workers,
        num_cpus=config.cpus_per_worker,
    )
    return ds.iter_batches(batch_format="pyarrow", batch_size=None)


def _write(config: VideoFeaturesConfig, out: Any, key: str, parts: list[pa.Table], fingerprint: str) -> dict[str, Any]:
    """Write one feature shard atomically (rows in key order), its summary in the Parquet footer."""
    table = pa.concat_tables(parts) if parts else SCHEMA.empty_table()
    table = table.select(list(COLUMNS)).cast(SCHEMA).sort_by("key")
    splits = table.column("split").to_pylist()
    summary = {"key": key, "plan_fingerprint": _shard_fingerprint(fingerprint, key), "rows": table.num_rows,
               "split": dict(Counter(splits)), "frames": int(sum(table.column("num_frames").to_pylist())),
               "hash": table_hash(table)}
    shards.write_shard(out, key, table, summary, config.compression)
    return summary


def _assemble_manifest(config: VideoFeaturesConfig, source: dict[str, Any], frame_size: int, backbone: dict[str, Any],
                       identity: dict[str, Any], fingerprint: str, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    from pipelines.core.tracking import redact  # deferred: it loads MLflow, which the feature actors never need

    counts = dict(source.get("counts") or {})
    counts["videos"] = sum(s["rows"] for s in summaries)
    counts["frames"] = sum(s["frames"] for s in summaries)
    tree = {"identity": identity, "shards": [s["hash"] for s in summaries]}
    public = redact(config.model_dump(mode="json"))  # the manifest outlives the run: no `user:password@`
    public["endpoint_url"] = S3Settings.resolve(config.endpoint_url).public()["endpoint_url"]
    return {
        "format": FORMAT,
        "source": {"uri": strip_userinfo(config.data), "format": source.get("format"),
                   "content_hash": identity["data"]},
        "backbone": backbone,
        "feature_dim": backbone["feature_dim"],
        "feature_dtype": config.feature_dtype,
        "frame_size": frame_size,
        "frame_preparation": PREPARATION,
        "precision": identity["precision"],
        "sampling": source.get("sampling") or {},
        "classes": source["classes"],
        "num_classes": num_classes(source),
        "counts": counts,
        "shards": [{"path": s["key"], "rows": s["rows"], "split": s["split"]} for s in summaries],
        "content_hash": "sha256:" + hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest(),
        "fingerprint": fingerprint,
        "config": public,
    }
