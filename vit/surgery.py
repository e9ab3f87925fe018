"""Model surgery: a ViT at another resolution with a new head, a frozen backbone, a weights hash.

As big_vision's `models/vit.py` keeps its `load()` (resize the position
embeddings, reset the head) with the model, these live with the model too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
from torch import nn

from vit.model import VisionTransformer
from vit.pos_embed import resample_1d
from vit.resnet import ResNet


# ViTConfig fields that hold no weights: the only ones a copy of a trained model may change.
WEIGHTLESS_FIELDS = ("dropout", "attn_dropout", "drop_path", "layer_norm_eps", "attn_impl")


def _check_overrides(overrides: Any) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"overrides must be a dict of ViTConfig fields, got {type(overrides).__name__}")
    bad = sorted(set(overrides) - set(WEIGHTLESS_FIELDS))
    if bad:
        own = {"image_size", "num_classes"} & set(bad)
        where = " (image_size and num_classes are arguments of their own)" if own else ""
        raise ValueError(f"overrides may change only fields that hold no weights ({', '.join(WEIGHTLESS_FIELDS)}); "
                         f"got {bad}{where}")
    return overrides


def at_resolution(base: VisionTransformer, image_size: int | tuple[int, int], num_classes: int,
                  overrides: dict[str, Any] | None = None) -> VisionTransformer:
    """A copy of ViT `base` for `image_size` inputs with a fresh zero-initialised `num_classes` head.

    Learned position embeddings are interpolated to the new grid (paper §3.2)
    by the model's own call-time resampling; `overrides` may change only fields that
    hold no weights (`WEIGHTLESS_FIELDS`). Bad arguments raise one ValueError naming them.
    """
    if not isinstance(base, VisionTransformer):
        raise ValueError(f"base must be a VisionTransformer, got {type(base).__name__}")
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 0:
        raise ValueError(f"num_classes must be an int >= 0 (0 = no head), got {num_classes!r}")
    config = dataclasses.replace(base.config, image_size=image_size, **_check_overrides(overrides))
    model = VisionTransformer(config)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    if config.pos_embed == "learned":
        with torch.no_grad():
            state["pos_embed"] = base.position_embeddings(config.grid).detach().clone()
    elif config.pos_embed == "learned_2d":
        state["pos_embed_row"] = resample_1d(state["pos_embed_row"], config.grid[0])
        state["pos_embed_col"] = resample_1d(state["pos_embed_col"], config.grid[1])
    model.load_state_dict(state)
    model.replace_head(num_classes)
    return model


def freeze_backbone(model: nn.Module) -> None:
    """Train the head only (linear probe): every other parameter stops taking gradients.

    The head is `fc` on a ResNet, `head` otherwise (as `load_pretrained` names them); a model
    whose head holds no parameters (num_classes=0) raises, since nothing would be left to train."""
    head = "fc." if isinstance(model, ResNet) else "head."
    if not any(name.startswith(head) for name, _ in model.named_parameters()):
        raise ValueError(f"freeze_backbone: {type(model).__name__} has no head parameters ({head[:-1]}; "
                         "num_classes=0?), so freezing the backbone would leave nothing to train")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(head))


def weights_hash(module: nn.Module) -> str:
    """sha256 of a module's state dict (names, dtypes, shapes and values), as "sha256:<hex>"."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()
