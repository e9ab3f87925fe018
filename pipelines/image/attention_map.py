"""Where the pretrained ViT looks: attention rollout from its pooled token over a few held-out images.

Attention rollout (Abnar & Zuidema, 2020): each layer's head-averaged attention,
with the residual path added as 0.5·I and rows renormalised, multiplied through
the layers. The row of the token the head reads ([CLS], or the mean over patch
tokens for a global-average-pooled model) then says how much each patch feeds
the prediction. Logged into the pretrain run as an MLflow image.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import vit
from pipelines.core import plots
from pipelines.core.datasets import PATCH_MEAN, PATCH_STD
from pipelines.core.shards import class_names
from pipelines.image.data import load_split

ATTENTION_FIGURE = "attention/cls_attention_rollout.png"
IMAGES = 4


def rollout(attentions: list[torch.Tensor], num_prefix_tokens: int) -> torch.Tensor:
    """Per image, the pooled token's rolled-out attention over the patch tokens, `(B, N)`, summing to 1."""
    tokens = attentions[0].shape[-1]
    eye = torch.eye(tokens, dtype=attentions[0].dtype)
    joint = eye.expand(attentions[0].shape[0], tokens, tokens)
    for weights in attentions:
        layer = 0.5 * weights.mean(dim=1) + 0.5 * eye
        joint = (layer / layer.sum(dim=-1, keepdim=True)) @ joint
    rows = joint[:, 0] if num_prefix_tokens else joint.mean(dim=1)  # what the head pools
    patches = rows[:, num_prefix_tokens:]
    return patches / patches.sum(dim=-1, keepdim=True)


def attention_maps(model: Any, patches: torch.Tensor, grid: tuple[int, int]) -> np.ndarray:
    """Rollout maps `(B, grid_h, grid_w)` of `model` over normalised patch sequences."""
    model.eval()
    with torch.no_grad():
        _, attentions = model(patches.float(), return_attention=True)
    maps = rollout([a.float() for a in attentions], model.num_prefix_tokens)
    return maps.reshape(len(patches), *grid).numpy()


def pixels(patches: torch.Tensor, patch_size: int, grid: tuple[int, int]) -> np.ndarray:
    """Normalised patch sequences back to displayable `(B, H, W, C)` images in [0, 1]."""
    channels = patches.shape[-1] // (patch_size * patch_size)
    images = vit.unpatchify(patches * PATCH_STD + PATCH_MEAN, patch_size, grid, channels)
    return images.permute(0, 2, 3, 1).clamp(0, 1).numpy()


def log_attention_picture(client: Any, run_id: str, model: Any, data: str, manifest: dict[str, Any], *,
                          endpoint_url: str | None = None, count: int = IMAGES) -> bool:
    """Log the rollout over the first `count` held-out images (val, else test) of `data`; False when
    the model is no plain ViT (no patch grid to draw on) or no split is held out."""
    if not isinstance(model, vit.VisionTransformer) or model.config.patch_size != manifest["patch_size"]:
        return False
    counts = manifest.get("counts", {})
    split = next((s for s in ("val", "test") if int(counts.get(s, 0)) > 0), None)
    if split is None:
        return False
    patches, labels = load_split(data, split, limit=count, endpoint_url=endpoint_url)
    grid = vit.grid_size(manifest["image_size"], manifest["image_size"], manifest["patch_size"])
    names = class_names(manifest)
    titles = [names[i] for i in labels.tolist()]
    figure = plots.attention_figure(pixels(patches, manifest["patch_size"], grid),
                                    attention_maps(model, patches, grid), titles)
    client.log_figure(run_id, figure, ATTENTION_FIGURE)
    figure.clf()
    return True
