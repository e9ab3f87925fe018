"""The video training stage: a VTN trained on ingested video shards, evaluated in both of the paper's modes.

VTN (Neimark et al. 2021) runs a 2-D backbone on every frame and a Longformer
across time. This stage

* builds the VTN: its backbone from an image-pipeline run (`init`: a pretrain
  run id or `runs:/` URI, a registered model, a checkpoint directory or a
  timm/HF file, read by `pipelines.training.starting_weights`) or from scratch, frozen
  or fine-tuned, at the frame size of the clips (learned position embeddings
  interpolated as for fine-tuning);
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
  as a picture, the checkpoints, the learning curve and the MLflow model, and
  registers the model when `registry_model` is set.

One MLflow run per execution, resumed by config hash as the pretrain stage is
(`pipelines.image.pretrain`): a rerun of a finished config returns it untouched.

    python -m pipelines.video.train --config video_train.yaml [--ray-address ADDR]
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from pipelines.core import tracking
from pipelines.training.recipe import TrainRecipe
from pipelines.training.trainer import build_trainer, fit_trainer, log_outputs, stage_init, storage_location
from pipelines.core.stage_config import load_stage_config, stage_main
from pipelines.video.loop_hooks import ClipHooks, FeatureHooks
from pipelines.video.eval import (
    EVAL_TABLE,
    evaluate_modes,
    evaluation_inputs,
    evaluation_metrics,
    log_attention_picture,
)

logger = logging.getLogger(__name__)
STAGE = "video_train"
TAG_VIDEO_RUN = "vitpipe.video_train_run_id"
TAG_BACKBONE_RUN = "vitpipe.backbone_run_id"
MODES = ("full_video", "multiview")
# Fields that say where to record or how to retry, not what is trained: out of the run identity.
_NOT_IDENTITY = {"tracking_uri", "experiment", "parent_run_id", "ingest_run_id", "max_failures", "registry_model",
                 "torch_threads"}
# VTNConfig fields this stage sets itself (the rest may be given in `vtn`).
_MANAGED_VTN_FIELDS = {"backbone", "backbone_overrides", "freeze_backbone", "num_classes", "num_frames",
                       "temporal_pos_embed"}
# The spec's names for the temporal position embedding → VTNConfig's.
_POS_EMBED = {"learned": "learned", "fixed": "sincos", "sincos": "sincos", "none": "none"}


class VideoTrainConfig(TrainRecipe):
    """Video (VTN) training stage config; defaults follow the VTN paper's training and evaluation."""

    # A video ingest output, or a video features output (`pipelines.video.features`): then the backbone is
    # frozen and not run, and the temporal encoder trains on the stored features alone (`pipelines.video.feature_data`).
    data: str = Field(description="video ingest or video features output (local dir or s3://bucket/prefix)")
    # The model.
    init: str | None = None  # the backbone's weights: pretrain run id, runs:/, models:/, checkpoint dir, timm/HF file
    backbone: str | None = None  # 2-D backbone architecture; default: the init checkpoint's. Required from scratch
    backbone_overrides: dict[str, Any] = Field(default_factory=dict)
    freeze_backbone: bool = False  # True: train the temporal encoder and head only
    temporal_pos_embed: Literal["learned", "fixed", "sincos", "none"] = "learned"  # fixed = sine-cosine
    vtn: dict[str, Any] = Field(default_factory=dict)  # other VTNConfig fields: depth, num_heads, window, ...
    frame_size: int | None = Field(None, gt=0)  # square frame side the model sees; default: the backbone's image size
    # Training clips.
    train_frames: int = Field(16, gt=0)  # frames per training clip (the paper: 16 or 32); also the multi-view clip length
    train_sampling: Literal["segments", "clip"] = "segments"  # one frame per segment of the video, or consecutive frames
    clip_stride: int = Field(1, gt=0)  # frames between a "clip"'s frames (and the multi-view clips')
    clips_per_video: int = Field(1, gt=0)  # clips drawn from each training video per pass over the data
    hflip: bool = False
    # The VTN paper's recipe where it differs from the shared defaults.
    optimizer: Literal["sgd", "adamw"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)  # SGD only
    # Evaluation of the final model.
    eval_split: Literal["test", "val"] = "test"
    eval_modes: list[Literal["full_video", "multiview"]] = Field(default_factory=lambda: list(MODES))
    full_video_frames: int = Field(250, gt=0)  # frames spread over the whole video (fewer when it stores fewer)
    multiview_clips: int = Field(10, gt=0)
    multiview_crops: int = Field(3, gt=0)
    eval_shuffled: bool = False  # also evaluate on frames in random order
    eval_limit: int | None = Field(None, gt=0)  # evaluate at most this many videos
    attention_videos: int = Field(4, ge=0)  # videos in the [CLS] attention picture
    registry_model: str | None = None  # register the final model as a new version of this name

    @field_validator("eval_modes")
    @classmethod
    def _modes(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("eval_modes is empty; use full_video, multiview or both")
        return list(dict.fromkeys(value))

    @field_validator("vtn")
    @classmethod
    def _vtn(cls, value: dict[str, Any]) -> dict[str, Any]:
        from vit.longformer import LongformerConfig
        from vit.vtn import VTNConfig

        valid = {f.name for f in dataclasses.fields(VTNConfig)} - _MANAGED_VTN_FIELDS
        managed = sorted(set(value) & _MANAGED_VTN_FIELDS)
        if managed:
            raise ValueError(f"{managed[0]} is set by the stage's own fields, not in vtn")
        unknown = sorted(set(value) - valid)
        if unknown:
            raise ValueError(f"unknown VTN field(s) {unknown}; valid: {', '.join(sorted(valid))}")
        try:
            c = VTNConfig(**value)  # field values checked now, the backbone and widths when the model is built
            LongformerConfig(hidden_size=c.num_heads, num_heads=c.num_heads, depth=c.depth, ffn_size=1,
                             window=c.window, dilation=c.dilation)  # windows and dilations per layer
        except (TypeError, ValueError) as err:
            raise ValueError(" ".join(str(err).split())) from None
        return value

    @model_validator(mode="after")
    def _check(self) -> VideoTrainConfig:
        from pipelines.training.starting_weights import init_kind

        if init_kind(self.init) == "scratch" and not self.backbone:
            raise ValueError("backbone: required when training from scratch (init is none)")
        if self.backbone:
            import vit

            from vit.vtn import VTN_PRESETS

            if self.backbone in VTN_PRESETS:
                raise ValueError(f"backbone {self.backbone!r} is a video model, not a 2-D image model")
            if vit.is_vit_name(self.backbone):
                try:
                    vit.preset_config(self.backbone, **self.backbone_overrides)
                except (TypeError, ValueError) as err:
                    raise ValueError(f"backbone {self.backbone!r}: {' '.join(str(err).split())}") from None
            elif self.backbone not in vit.list_models():
                raise ValueError(f"backbone {self.backbone!r}: unknown model (a ViT such as 'ViT-B/16', or one of "
                                 f"{', '.join(m for m in vit.list_models() if m not in VTN_PRESETS)})")
        return self


class VideoTrainResult(BaseModel):
    """What the stage hands on."""

    run_id: str
    final_checkpoint: str  # runs:/<id>/checkpoints/final — a vit checkpoint dir of the VTN
    model_uri: str | None  # the logged MLflow PyTorch model (registrable)
    storage_path: str
    metrics: dict[str, float]
    evaluation: list[dict[str, Any]] = Field(default_factory=list)  # one row per mode (and frame order)
    registered_version: str | None = None
    resumed: bool = False
    reused: bool = False


def load_config(source: str | os.PathLike[str] | dict[str, Any], **overrides: Any) -> VideoTrainConfig:
    """A `VideoTrainConfig` from a YAML/JSON file or a dict, with one-line errors."""
    return load_stage_config(VideoTrainConfig, STAGE, source, overrides)


# ---------------------------------------------------------------- the model


@dataclasses.dataclass
class InitialModel:
    """The VTN training starts from, and where its backbone came from."""

    model: Any  # vit.vtn.VTN
    frame_size: int
    backbone_source: str  # "none" (scratch) or the init as given (userinfo stripped)
    backbone_run_id: str | None  # the MLflow run that produced the backbone, when known


def _square_size(image_size: Any, what: str) -> int:
    if isinstance(image_size, (list, tuple)):
        if len(set(image_size)) != 1:
            raise ValueError(f"{what} has non-square image_size {tuple(image_size)}; set frame_size")
        image_size = image_size[0]
    return int(image_size)


def build_initial_model(config: VideoTrainConfig, num_classes: int, tracking_uri: str) -> InitialModel:
    """The VTN to train: backbone from `config.init` (at `frame_size`, head removed) or fresh, the rest fresh.

    Raises a one-line ValueError for backbones that do not fit (names, shapes, head count).
    """
    import torch

    import vit
    from vit.vtn import VTN, VTNConfig

    source, run_id, weights = "none", None, None
    if config.init is not None and config.init.strip().lower() not in ("", "none", "scratch"):
        from pipelines.image.finetune_trial import at_resolution
        from pipelines.training.starting_weights import fetch_starting_weights

        start = fetch_starting_weights(
            config.init, model_name=config.backbone, model_overrides=config.backbone_overrides,
            tracking_uri=tracking_uri, endpoint_url=config.endpoint_url, seed=config.seed,
        )
        size = config.frame_size or _square_size(start.model.config.image_size, f"init {start.source}")
        backbone = at_resolution(start.model, size, 0)  # position embeddings resampled to the frame grid
        name = "R50+ViT-B/16" if backbone.config.hybrid is not None else "ViT-B/16"  # every field overridden below
        overrides = {k: v for k, v in backbone.config.to_dict().items() if k != "num_classes"}
        source, run_id, weights = start.source, start.source_run_id, backbone.state_dict()
    else:
        name = str(config.backbone)
        overrides = dict(config.backbone_overrides)
        if config.frame_size is not None and vit.is_vit_name(name):
            overrides["image_size"] = config.frame_size
        size = config.frame_size
        if size is None:
            if not vit.is_vit_name(name):
                raise ValueError(f"frame_size: required for backbone {name!r}")
            size = _square_size(vit.preset_config(name, **overrides).image_size, f"backbone {name!r}")
    vtn_config = VTNConfig(
        backbone=name, backbone_overrides=overrides, freeze_backbone=config.freeze_backbone, num_classes=num_classes,
        num_frames=config.train_frames, temporal_pos_embed=_POS_EMBED[config.temporal_pos_embed], **config.vtn,
    )
    torch.manual_seed(config.seed)
    try:
        model = VTN(vtn_config)
    except ValueError as err:
        raise ValueError(f"vtn: {' '.join(str(err).split())}") from None
    if weights is not None:
        model.backbone.load_state_dict(weights)
    return InitialModel(model, size, source, run_id)


# ---------------------------------------------------------------- the stage


def run_identity(config: VideoTrainConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """The part of a config (plus the data's content hash) that decides what is trained and evaluated."""
    from pipelines.video.data import manifest_digest

    tree = tracking.redact(config.model_dump(mode="json", exclude=_NOT_IDENTITY))
    tree["data_content_hash"] = manifest_digest(manifest)
    return tree


def loop_settings(config: VideoTrainConfig, init_path: str, has_val: bool, run_id: str | None,
                  tracking_uri: str | None, train_rows: int | None = None) -> Any:
    """What every worker receives: the shared loop's settings, starting from the staged VTN."""
    return config.loop_settings(
        has_val=has_val, run_id=run_id, tracking_uri=tracking_uri, train_rows=train_rows, model_name="vtn",
        init_checkpoint=init_path,
    )


def train_clips(config: VideoTrainConfig, manifest: dict[str, Any]) -> int | None:
    """Training clips per pass over the data: training videos × `clips_per_video` (None when not counted)."""
    from pipelines.video.data import split_count

    videos = split_count(manifest, "train")
    return videos * config.clips_per_video if videos else None


def clip_datasets(config: VideoTrainConfig, manifest: dict[str, Any], size: int, has_val: bool) -> dict[str, Any]:
    """The Ray Datasets of training clips (random) and validation clips (centred, deterministic): of frames,
    or of stored features when `data` is a video features output."""
    from pipelines.video.feature_data import feature_clip_dataset, is_features
    from pipelines.video.data import ClipSpec, clip_dataset, stored_clip_length

    def dataset(split: str, spec: ClipSpec, **kw: Any) -> Any:
        if is_features(manifest):
            return feature_clip_dataset(config.data, manifest, split, spec, endpoint_url=config.endpoint_url, **kw)
        return clip_dataset(config.data, split, spec, manifest=manifest, endpoint_url=config.endpoint_url, **kw)

    common = dict(frames=config.train_frames, size=size, sampling=config.train_sampling, stride=config.clip_stride,
                  stored_clip_length=stored_clip_length(manifest))
    train = ClipSpec(**common, train=True, clips_per_video=config.clips_per_video, hflip=config.hflip)
    # Reproducible: seeded passes over the videos, chained to cover the run (see `pretrain.patch_datasets`).
    out = {"train": dataset("train", train, seed=config.seed, epochs=config.passes_over(train_clips(config, manifest)))}
    if has_val:
        out["val"] = dataset("val", ClipSpec(**common, train=False))
    return out


def _result_from_run(client: Any, run_id: str, reused: bool) -> VideoTrainResult:
    import json
    import tempfile

    run = client.get_run(run_id)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with open(client.download_artifacts(run_id, EVAL_TABLE, tmp)) as f:
                table = json.load(f)["modes"]
        except Exception:  # noqa: BLE001 — a run that stopped before evaluating has no table
            table = []
    return VideoTrainResult(
        run_id=run_id, final_checkpoint=f"runs:/{run_id}/checkpoints/final",
        model_uri=run.data.tags.get("vitpipe.model_uri") or None,
        storage_path=run.data.tags.get("vitpipe.storage_path", ""), metrics=dict(run.data.metrics), evaluation=table,
        registered_version=run.data.tags.get("vitpipe.registered_version"),
        resumed="vitpipe.resumed_from_step" in run.data.tags, reused=reused,
    )


def run_video_train(config: VideoTrainConfig, *, ray_address: str | None = None) -> VideoTrainResult:
    """Run (or resume) the stage: build, train, evaluate in both modes, log; returns the run and model URIs."""
    import ray
    from mlflow.tracking import MlflowClient

    import vit
    from pipelines.video.feature_data import features_train_config, is_features, read_training_manifest
    from pipelines.video.data import class_names, manifest_digest, split_count

    manifest = read_training_manifest(config.data, endpoint_url=config.endpoint_url)
    features = is_features(manifest)
    if features:  # the temporal encoder alone, on the stored features: see `pipelines.video.feature_data`
        config = features_train_config(config, manifest)
    classes = class_names(manifest)
    if split_count(manifest, "train") == 0:
        raise ValueError(f"data: {tracking.strip_userinfo(config.data)} holds no training videos")
    if split_count(manifest, config.eval_split) == 0:
        other = "val" if config.eval_split == "test" else "test"
        raise ValueError(f"eval_split: the data holds no {config.eval_split!r} videos (try eval_split: {other})")
    has_val = (split_count(manifest, "val") or 0) > 0
    tracking_uri = tracking.resolve_tracking_uri(config.tracking_uri)
    client = MlflowClient(tracking_uri)
    initial = build_initial_model(config, len(classes), tracking_uri)
    if features:
        from pipelines.video.feature_data import check_backbone

        check_backbone(initial.model, manifest, config)
    digest = tracking.config_hash(run_identity(config, manifest))
    run_name = config.run_name or f"{STAGE}-{digest[:12]}"

    if not ray.is_initialized():
        ray.init(address=ray_address or os.environ.get("RAY_ADDRESS"))
    tags = {
        "vitpipe.data_uri": tracking.strip_userinfo(config.data),
        "vitpipe.manifest_hash": manifest_digest(manifest),
        "vitpipe.backbone_init": initial.backbone_source,
        **({TAG_BACKBONE_RUN: initial.backbone_run_id} if initial.backbone_run_id else {}),
        **({"vitpipe.ingest_run_id": config.ingest_run_id} if config.ingest_run_id else {}),
        **tracking.system_info(config.num_workers, config.use_gpu),
    }
    run_id, previous = tracking.start_stage_run(
        client, config.experiment, STAGE, digest, run_name=run_name, parent_run_id=config.parent_run_id, tags=tags
    )
    if previous == "FINISHED":
        logger.info("%s: run %s already finished with this config; not training again", STAGE, run_id)
        return _result_from_run(client, run_id, reused=True)
    if previous:
        logger.info("%s: resuming run %s (was %s)", STAGE, run_id, previous)

    storage_path, filesystem = storage_location(config)
    # Workers read the starting VTN from the run's storage; a resumed execution keeps the one it staged first.
    init_path = stage_init(initial.model, storage_path, filesystem, run_name)
    settings = loop_settings(config, init_path, has_val, run_id, tracking_uri, train_clips(config, manifest))
    resolved = {**config.model_dump(mode="json"), "frame_size": initial.frame_size,
                "grad_accum_steps": config.grad_accum_steps, "vtn_config": initial.model.config.to_dict()}
    tracking.log_params(client, run_id, resolved)
    tracking.log_dict_artifact(client, run_id, resolved, "config.yaml")
    ok = False
    try:
        trainer = build_trainer(
            settings.model_dump(mode="json"), run_name=run_name, location=(storage_path, filesystem), workers=config,
            max_failures=config.max_failures, keep=config.keep_last, hooks=FeatureHooks() if features else ClipHooks(),
            datasets=clip_datasets(config, manifest, initial.frame_size, has_val),
        )
        result = fit_trainer(trainer, config, client, run_id, run_name, stage=STAGE)
        with result.checkpoint.as_directory() as final_dir:
            model = vit.load_checkpoint(final_dir)
        videos, predictor = evaluation_inputs(config, manifest, model)
        table = evaluate_modes(model, videos(), config, initial.frame_size, predictor=predictor)
        if config.eval_shuffled:
            table += evaluate_modes(model, videos(), config, initial.frame_size, shuffled=True, predictor=predictor)
        client.log_batch(run_id, metrics=_metrics(evaluation_metrics(table)))
        client.log_dict(run_id, {"modes": table}, EVAL_TABLE)
        for row in table:
            logger.info("%s: %-10s %-8s top-1 %.3f in %.2fs (%d videos, %d views each)%s", STAGE, row["mode"],
                        row["frame_order"], row["top1"], row["wall_s"], row["videos"], row["views_per_video"],
                        f"; {row['note']}" if row.get("note") else "")
        if not features:  # the picture shows the frames, which features data does not hold
            log_attention_picture(client, run_id, model,
                                  list(videos(config.attention_videos)) if config.attention_videos else [],
                                  initial.frame_size, config.full_video_frames, classes)
        model_uri = log_outputs(client, tracking_uri, run_id, result)
        tracking.set_tags(client, run_id, {"vitpipe.model_uri": model_uri or ""})
        if config.registry_model and model_uri:
            from pipelines.image.finetune_results import register

            lineage = {k: v for k, v in tags.items() if k in ("vitpipe.data_uri", "vitpipe.manifest_hash", TAG_BACKBONE_RUN)}
            version = register(client, tracking_uri, config.registry_model, model_uri, run_id, lineage,
                               run_tag=TAG_VIDEO_RUN)
            tracking.set_tags(client, run_id, {"vitpipe.registered_model": config.registry_model,
                                               "vitpipe.registered_version": version})
        ok = True
    finally:
        tracking.end_run(client, run_id, ok)
    return _result_from_run(client, run_id, reused=False)


def _metrics(values: dict[str, float]) -> list[Any]:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(k, v, now, 0) for k, v in values.items()]


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.video.train --config FILE [--set KEY=VALUE]...`; prints the result JSON."""
    return stage_main(STAGE, load_config, run_video_train, argv)


if __name__ == "__main__":
    sys.exit(main())
