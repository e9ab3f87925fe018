"""The video training stage: a VTN trained on ingested video shards, evaluated in both of the paper's modes.

VTN (Neimark et al. 2021) runs a 2-D backbone on every frame and a Longformer
across time. This stage

* builds the VTN (`pipelines.video.model`): its backbone from an image-pipeline
  run (`init`: a pretrain run id or `runs:/` URI, a registered model, a
  checkpoint directory or a timm/HF file, read by
  `pipelines.training.starting_weights`) or from scratch, frozen or fine-tuned,
  at the frame size of the clips (learned position embeddings interpolated as
  for fine-tuning, `vit.at_resolution`);
* trains it on Ray Train with the image pipeline's worker loop
  (`pipelines.training.loop` with `pipelines.video.loop_hooks`: the same steps, checkpoints,
  resume, NaN stop and rank-0 logging), on clips of `train_frames` frames
  sampled from each video's stored frames, with the paper's recipe by default
  (SGD, lr 1e-3, momentum 0.9, 16 frames);
* evaluates the final model on the driver in both of the paper's inference
  modes, full-video (up to `full_video_frames` frames spread over the whole
  video, one pass) and multi-view (`multiview_clips` clips × `multiview_crops`
  crops, softmax averaged), and logs accuracy and wall time of each side by
  side (metrics and the table `evaluation/modes.json`); with `eval_shuffled`
  again on frames in random order (the paper's order ablation), with
  `pipelines.video.eval`;
* logs the [CLS] token's last-layer attention over the frames of a few videos
  as a picture, the checkpoints, the learning curve and the MLflow model
  (safetensors, no pickle), and registers the model when `registry_model` is set.

One MLflow run per execution, found again by config hash (`pipelines.core.stage_run`):
a rerun of a finished config returns it untouched, an interrupted one resumes.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from mlflow.tracking import MlflowClient
from pydantic import BaseModel, Field

import vit
from pipelines.core import tracking
from pipelines.core.registry import TAG_MODEL_URI, TAG_REGISTERED_VERSION, Score, register_run_model
from pipelines.core.uris import resolve_tracking_uri, strip_userinfo
from pipelines.core.cluster import connect
from pipelines.core.stage_config import load_stage_config
from pipelines.core.stage_run import StageRun, finished_run_id, stage_run
from pipelines.training.recipe import TRAIN_NOT_IDENTITY, pinned_identity
from pipelines.training.starting_weights import Origin, origin_identity, starting_origin
from pipelines.training.trainer import build_trainer, fit_trainer, log_outputs, stage_init, storage_location
from pipelines.video.loop_hooks import ClipHooks, FeatureHooks
from pipelines.core.shards import class_names
from pipelines.video.data import ClipSpec, clip_dataset, manifest_digest, split_count, stored_clip_length
from pipelines.video.eval import EVAL_TABLE, log_evaluation
from pipelines.video.feature_data import (
    check_backbone,
    feature_clip_dataset,
    features_train_config,
    is_features,
    read_training_manifest,
)
from pipelines.video.model import InitialModel, build_initial_model
from pipelines.video.configs import VideoTrainConfig

logger = logging.getLogger("vitpipe.video_train")  # under "vitpipe": its handlers scrub credentials
STAGE = "video_train"
TAG_VIDEO_RUN = "vitpipe.video_train_run_id"
TAG_BACKBONE_RUN = "vitpipe.backbone_run_id"
# Fields that do not change what is trained and evaluated, so they stay out of the run identity; every other
# field is in it.
NOT_IDENTITY = TRAIN_NOT_IDENTITY | {"registry_model"}  # + where the finished model is registered
PINNED = ("keep_last",)  # left out of the identity later: held at its default in it (`pinned_identity`)


class VideoTrainResult(BaseModel):
    """What the stage hands on."""

    run_id: str
    final_checkpoint: str  # runs:/<id>/checkpoints/final — a vit checkpoint dir of the VTN
    model_uri: str | None  # the logged MLflow model (pyfunc over safetensors; registrable)
    storage_path: str
    metrics: dict[str, float]
    evaluation: list[dict[str, Any]] = Field(default_factory=list)  # one row per mode (and frame order)
    registered_version: str | None = None
    resumed: bool = False
    reused: bool = False


def load_config(source: str | os.PathLike[str] | dict[str, Any], **overrides: Any) -> VideoTrainConfig:
    """A `VideoTrainConfig` from a YAML/JSON file or a dict, with one-line errors."""
    return load_stage_config(VideoTrainConfig, STAGE, source, overrides)


# ---------------------------------------------------------------- the stage


def run_identity(config: VideoTrainConfig, manifest: dict[str, Any], backbone: Origin) -> dict[str, Any]:
    """The part of a config (plus the data's content hash and what names the backbone's weights: their run or
    their files' digest) that decides what is trained and evaluated; known before anything runs."""
    tree = pinned_identity(tracking.redact(config.model_dump(mode="json", exclude=NOT_IDENTITY)), config, PINNED)
    tree.update(data_content_hash=manifest_digest(manifest), **_backbone_identity(backbone))
    return tree


def _backbone_identity(backbone: Origin) -> dict[str, str]:
    """What `init` itself does not pin: the run behind a registered version (an alias or `latest` moves) and
    the digest of a checkpoint's or weights file's bytes. A run id or scratch adds nothing, so the video runs
    recorded before these were added are still found."""
    named = origin_identity(backbone)
    return {key: value for key, value in named.items()
            if value is not None and (key != "init_source_run" or backbone.kind == "registry")}


def loop_settings(config: VideoTrainConfig, init_path: str, has_val: bool, run_id: str | None,
                  tracking_uri: str | None, train_rows: int | None = None) -> Any:
    """What every worker receives: the shared loop's settings, starting from the staged VTN."""
    return config.loop_settings(
        has_val=has_val, run_id=run_id, tracking_uri=tracking_uri, train_rows=train_rows, model_name="vtn",
        init_checkpoint=init_path,
    )


def train_clips(config: VideoTrainConfig, manifest: dict[str, Any]) -> int | None:
    """Training clips per pass over the data: training videos × `clips_per_video` (None when not counted)."""
    videos = split_count(manifest, "train")
    return videos * config.clips_per_video if videos else None


def clip_datasets(config: VideoTrainConfig, manifest: dict[str, Any], size: int, has_val: bool) -> dict[str, Any]:
    """The Ray Datasets of training clips (random) and validation clips (centred, deterministic): of frames,
    or of stored features when `data` is a video features output."""
    def dataset(split: str, spec: ClipSpec, **kw: Any) -> Any:
        if is_features(manifest):
            return feature_clip_dataset(config.data, manifest, split, spec, endpoint_url=config.endpoint_url, **kw)
        return clip_dataset(config.data, split, spec, manifest=manifest, endpoint_url=config.endpoint_url, **kw)

    common = dict(frames=config.train_frames, size=size, sampling=config.train_sampling, stride=config.clip_stride,
                  stored_clip_length=stored_clip_length(manifest))
    train = ClipSpec(**common, train=True, clips_per_video=config.clips_per_video, hflip=config.hflip)
    # Reproducible: seeded passes over the videos, chained to cover the run (see `pretrain.build_trainer`).
    out = {"train": dataset("train", train, seed=config.seed, epochs=config.passes_over(train_clips(config, manifest)))}
    if has_val:
        out["val"] = dataset("val", ClipSpec(**common, train=False))
    return out


def _result_from_run(client: Any, run_id: str, reused: bool) -> VideoTrainResult:
    run = client.get_run(run_id)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with open(client.download_artifacts(run_id, EVAL_TABLE, tmp)) as f:
                table = json.load(f)["modes"]
        except Exception:  # noqa: BLE001 — a run that stopped before evaluating has no table
            table = []
    return VideoTrainResult(
        run_id=run_id, final_checkpoint=f"runs:/{run_id}/checkpoints/final",
        model_uri=run.data.tags.get(TAG_MODEL_URI) or None,
        storage_path=run.data.tags.get("vitpipe.storage_path", ""), metrics=dict(run.data.metrics), evaluation=table,
        registered_version=run.data.tags.get(TAG_REGISTERED_VERSION),
        resumed="vitpipe.resumed_from_step" in run.data.tags, reused=reused,
    )


def _training_data(config: VideoTrainConfig) -> tuple[VideoTrainConfig, dict[str, Any], bool]:
    """`(config, manifest, features)`: the data's manifest, and the config for features data when it is
    (see `pipelines.video.feature_data`); one-line errors for data without the splits the stage needs."""
    manifest = read_training_manifest(config.data, endpoint_url=config.endpoint_url)
    features = is_features(manifest)
    if features:  # the temporal encoder alone, on the stored features
        config = features_train_config(config, manifest)
    if split_count(manifest, "train") == 0:
        raise ValueError(f"data: {strip_userinfo(config.data)} holds no training videos")
    if split_count(manifest, config.eval_split) == 0:
        other = "val" if config.eval_split == "test" else "test"
        raise ValueError(f"eval_split: the data holds no {config.eval_split!r} videos (try eval_split: {other})")
    _check_positions(config, manifest)
    return config, manifest, features


def _check_positions(config: VideoTrainConfig, manifest: dict[str, Any]) -> None:
    """A learned temporal table must cover every stored frame's position (the VTN's inputs): otherwise the
    first long video fails inside a Ray Train worker, after the cluster has started and the model is built."""
    stored = manifest.get("stats", {}).get("stored_frames") or []
    if config.temporal_pos_embed != "learned" or not stored:
        return
    table = int(config.vtn.get("max_frames", vit.vtn.VTNConfig.max_frames))
    if int(stored[1]) > table:
        raise ValueError(
            f"vtn.max_frames: the learned temporal table has {table} positions, but {strip_userinfo(config.data)} "
            f"stores up to {int(stored[1])} frames a video (set vtn: {{max_frames: {int(stored[1])}}}, "
            "or temporal_pos_embed: sincos)"
        )


def _run_tags(config: VideoTrainConfig, manifest: dict[str, Any], backbone: Origin) -> dict[str, str]:
    """The stage run's tags: the data, the backbone's origin (lineage) and the machine."""
    return {
        "vitpipe.data_uri": strip_userinfo(config.data),
        "vitpipe.manifest_hash": manifest_digest(manifest),
        "vitpipe.backbone_init": backbone.source,
        **({TAG_BACKBONE_RUN: backbone.run_id} if backbone.run_id else {}),
        **({"vitpipe.ingest_run_id": config.ingest_run_id} if config.ingest_run_id else {}),
        **tracking.system_info(config.num_workers, config.use_gpu),
    }


def _fit(config: VideoTrainConfig, manifest: dict[str, Any], initial: InitialModel, run: StageRun,
         tracking_uri: str) -> Any:
    """Train the staged VTN on Ray Train with the shared worker loop; returns the trainer's result."""
    has_val = (split_count(manifest, "val") or 0) > 0
    location = storage_location(config, run.experiment_id)
    # Workers read the starting VTN from the run's storage; a resumed execution keeps the one it staged first.
    init_path = stage_init(initial.model, *location, run.name)
    settings = loop_settings(config, init_path, has_val, run.run_id, tracking_uri, train_clips(config, manifest))
    trainer = build_trainer(
        settings.model_dump(mode="json"), run_name=run.name, location=location, workers=config,
        max_failures=config.max_failures, keep=config.keep_last,
        hooks=FeatureHooks() if is_features(manifest) else ClipHooks(),
        datasets=clip_datasets(config, manifest, initial.frame_size, has_val),
    )
    return fit_trainer(trainer, config, run.client, run.run_id, run.name, stage=STAGE, location=location)


def _reused(client: Any, config: VideoTrainConfig, run_id: str, tags: dict[str, str]) -> VideoTrainResult:
    """A finished run of this config, registered under `registry_model` if asked (once per run and name)."""
    if config.registry_model:
        _register(client, run_id, config.registry_model, config, tags)
    return _result_from_run(client, run_id, reused=True)


def _register(client: Any, run_id: str, name: str, config: VideoTrainConfig, tags: dict[str, str]) -> None:
    """Register the run's logged model as a version of `name` (once per run and name).

    The version's score is the first evaluation mode's test top-1, so `champion` marks the most accurate VTN.
    """
    lineage = {k: v for k, v in tags.items() if k in ("vitpipe.data_uri", "vitpipe.manifest_hash", TAG_BACKBONE_RUN)}
    metric = f"{config.eval_modes[0]}_top1"
    score = Score(metric, client.get_run(run_id).data.metrics[metric])
    register_run_model(client, run_id, name, lineage, run_tag=TAG_VIDEO_RUN, score=score)


def run_video_train(config: VideoTrainConfig, *, ray_address: str | None = None) -> VideoTrainResult:
    """Run (or resume) the stage: build, train, evaluate in both modes, log; returns the run and model URIs."""
    config, manifest, features = _training_data(config)
    classes = class_names(manifest)
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    client = MlflowClient(tracking_uri)
    backbone = starting_origin(config.init, tracking_uri, config.endpoint_url)
    tags = _run_tags(config, manifest, backbone)
    identity = run_identity(config, manifest, backbone)
    # A finished run is handed back before the backbone's weights are downloaded.
    finished = finished_run_id(client, STAGE, config, identity)
    if finished:
        return _reused(client, config, finished, tags)
    initial = build_initial_model(config, len(classes), tracking_uri, backbone)
    if features:
        check_backbone(initial.model, manifest, config)
    connect(ray_address)
    with stage_run(client, STAGE, config, identity, tags=tags) as run:
        if run.finished:  # finished by another vitpipe since the look above
            return _reused(client, config, run.run_id, tags)
        run.log_config({**config.model_dump(mode="json"), "frame_size": initial.frame_size,
                        "grad_accum_steps": config.grad_accum_steps, "vtn_config": initial.model.config.to_dict()})
        result = _fit(config, manifest, initial, run, tracking_uri)
        with result.checkpoint.as_directory() as final_dir:
            model = vit.load_checkpoint(final_dir)
        log_evaluation(client, run.run_id, model, config, manifest, initial.frame_size, classes)
        run.set_tags({TAG_MODEL_URI: log_outputs(client, run.run_id, result)})
        if config.registry_model:
            _register(client, run.run_id, config.registry_model, config, tags)
    return _result_from_run(client, run.run_id, reused=False)
