"""The video stages' configs: what a user writes for `video_ingest`, `video_features` and
`video_train`, validated at the edge.

This module imports pydantic and the light config modules below it; the backbone and
VTN field checks load `vit` (torch) as they run, never Ray or MLflow. Each stage's
module (`pipelines.video.<stage>`) runs its config.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import ConfigDict, Field, field_validator, model_validator

from pipelines.core.stage_config import DataToOutput, RegistryName, ShardedIngestConfig
from pipelines.training.recipe import TrainRecipe
from pipelines.video.decode import clip_indices, full_indices

__all__ = ["VideoFeaturesConfig", "VideoIngestConfig", "VideoTrainConfig"]


# ---------------------------------------------------------------- ingest


MAX_FRAME_PIXELS = 7680 * 4320  # 8K UHD


class VideoIngestConfig(ShardedIngestConfig):
    """Configuration of the video ingest stage (validated at construction; holds no credentials).

    `sampling="full"`: up to `max_frames` frames spread uniformly over each whole video.
    `sampling="clips"`: clips of `clip_length` frames `frame_stride` apart, starting every
    `clip_stride` frames, at most `max_clips` per video, stored back to back in the video's row.
    """

    frame_size: int = Field(224, ge=8, le=2048)  # shorter side resized to this, then centre crop
    sampling: Literal["full", "clips"] = "full"
    max_frames: int = Field(250, ge=1, le=8192)
    clip_length: int = Field(16, ge=1, le=1024)
    frame_stride: int = Field(1, ge=1, le=1024)
    clip_stride: int = Field(16, ge=1)
    max_clips: int = Field(10, ge=1, le=1024)
    max_pixels: int = Field(MAX_FRAME_PIXELS, ge=1)  # per source frame, checked before decoding
    shard_size: int = Field(16, ge=1)  # videos per shard (a shard stays under 2 GiB of frames)
    io_threads: int = Field(4, ge=1, le=64)
    max_object_bytes: int = Field(2**30, ge=1)  # a video is read whole: up to io_threads of these per task

    @model_validator(mode="after")
    def _sampling_fields(self) -> VideoIngestConfig:
        frames = self.max_frames if self.sampling == "full" else self.clip_length * self.max_clips
        if self.shard_size * frames * self.frame_size**2 * 3 >= 2**31:
            raise ValueError(
                f"shard_size {self.shard_size} videos of up to {frames} frames of {self.frame_size}px "
                "exceed 2 GiB per shard; lower shard_size"
            )
        return self

    def sampling_settings(self) -> dict[str, Any]:
        """The sampling as recorded in the manifest (only the fields the mode uses)."""
        if self.sampling == "full":
            return {"mode": "full", "max_frames": self.max_frames}
        return {"mode": "clips", "clip_length": self.clip_length, "frame_stride": self.frame_stride,
                "clip_stride": self.clip_stride, "max_clips": self.max_clips}

    def select(self, total: int) -> np.ndarray:
        """The source frame indices to store for a video of `total` frames."""
        if self.sampling == "full":
            return full_indices(total, self.max_frames)
        return clip_indices(total, self.clip_length, self.frame_stride, self.clip_stride, self.max_clips)

    def identity(self) -> dict[str, Any]:
        """The fields that decide the output's content; the other mode's sampling fields are left out."""
        unused = {"clip_length", "frame_stride", "clip_stride", "max_clips"} if self.sampling == "full" else {"max_frames"}
        return {k: v for k, v in super().identity().items() if k not in unused}


# ---------------------------------------------------------------- features


class VideoFeaturesConfig(DataToOutput):
    """Configuration of the video features stage (validated at construction; holds no credentials)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str = Field(description="video ingest output (local dir or s3://bucket/prefix)")
    output: str = Field(description="where the feature shards go (local dir or s3://bucket/prefix)")
    init: str | None = None  # the backbone's weights, as video_train's init: run id, runs:/, models:/, checkpoint dir
    backbone: str | None = None  # 2-D backbone architecture; default: the init checkpoint's
    backbone_overrides: dict[str, Any] = Field(default_factory=dict)
    frame_size: int | None = Field(None, gt=0)  # square side the backbone sees; default: the backbone's image size
    batch_size: int = Field(64, gt=0)  # frames per backbone forward
    videos_per_batch: int = Field(4, gt=0)  # videos per actor call
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # of the backbone's forward ("auto": bf16 where native)
    feature_dtype: Literal["float32", "float16"] = "float32"  # as stored
    num_workers: int = Field(1, gt=0)  # actors in the pool, each with its own copy of the backbone
    cpus_per_worker: float = Field(1.0, gt=0)  # also the actor's torch threads (rounded, at least 1)
    compression: Literal["none", "snappy", "lz4", "zstd"] = "lz4"
    endpoint_url: str | None = None  # S3-compatible endpoint for s3:// data and output
    seed: int = 0  # draws a from-scratch backbone's weights (init none)
    tracking_uri: str | None = None  # resolves runs:/ and models:/ inits; default $MLFLOW_TRACKING_URI
    experiment: str = "vitpipe"  # the pipeline runner records the stage as a child run in this experiment

    @model_validator(mode="after")
    def _check(self) -> VideoFeaturesConfig:
        self.check_output_apart("features")
        _check_backbone(self.init, self.backbone, self.backbone_overrides)  # as video_train checks them
        return self


# ---------------------------------------------------------------- train


MODES = ("full_video", "multiview")


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
    registry_model: RegistryName = None  # register the final model as a new version of this name

    @field_validator("eval_modes")
    @classmethod
    def _modes(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("eval_modes is empty; use full_video, multiview or both")
        return list(dict.fromkeys(value))

    @field_validator("vtn")
    @classmethod
    def _vtn(cls, value: dict[str, Any]) -> dict[str, Any]:
        from pipelines.video.model import check_vtn_fields  # deferred: needs vit's VTNConfig (torch)

        return check_vtn_fields(value)

    @model_validator(mode="after")
    def _check(self) -> VideoTrainConfig:
        _check_backbone(self.init, self.backbone, self.backbone_overrides)
        return self


def _check_backbone(init: str | None, backbone: str | None, overrides: dict[str, Any]) -> None:
    """A one-line ValueError unless the backbone can be built (`pipelines.video.model.check_backbone_choice`)."""
    from pipelines.video.model import check_backbone_choice  # deferred: vit's presets import torch

    check_backbone_choice(init, backbone, overrides)
