"""The video stage's hooks into the one worker loop (`pipelines.training.loop`).

Everything else (steps, checkpoints, resume, NaN stop, rank-0 logging, the
best-model copy) is the pretrain stage's, as `LoopHooks` defines it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipelines.training.hooks import LoopHooks
from pipelines.video.data import clip_inputs
from pipelines.video.feature_data import FromFrameFeatures, feature_inputs


class ClipHooks(LoopHooks):
    """Batches of clips (see `pipelines.video.data`): the VTN reads `(clip, frame indices)`."""

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        return clip_inputs(batch), batch["label"].long()


class FeatureHooks(LoopHooks):
    """Batches of precomputed frame features (see `pipelines.video.feature_data`): the VTN runs without its
    backbone, through `FromFrameFeatures`; checkpoints still hold the VTN itself."""

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        return feature_inputs(batch), batch["label"].long()

    def forward_model(self, model: nn.Module) -> nn.Module:
        return FromFrameFeatures(model)
