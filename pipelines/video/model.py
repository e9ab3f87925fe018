"""The VTN a video stage starts from: its backbone from an image-pipeline run (or fresh), the rest fresh.

`build_initial_model` is shared by the training stage (`pipelines.video.train`)
and the features stage (`pipelines.video.features`, which runs the frozen
backbone alone); `check_backbone_choice` and `check_vtn_fields` are the checks
both stages' configs make of the fields it reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

import vit
from pipelines.training.starting_weights import Origin, fetch_starting_weights, init_kind
from vit.longformer import LongformerConfig
from vit.vtn import VTN, VTN_PRESETS, VTNConfig
from vit.weights import one_line

# VTNConfig fields the stages set themselves (the rest may be given in `vtn`).
MANAGED_VTN_FIELDS = {"backbone", "backbone_overrides", "freeze_backbone", "num_classes", "num_frames",
                      "temporal_pos_embed"}
# The spec's names for the temporal position embedding → VTNConfig's.
_POS_EMBED = {"learned": "learned", "fixed": "sincos", "sincos": "sincos", "none": "none"}


class ModelFields(Protocol):
    """The config fields `build_initial_model` reads (a `VideoTrainConfig` has them all)."""

    init: str | None
    backbone: str | None
    backbone_overrides: dict[str, Any]
    frame_size: int | None
    freeze_backbone: bool
    train_frames: int
    temporal_pos_embed: str
    vtn: dict[str, Any]
    seed: int
    endpoint_url: str | None


@dataclasses.dataclass(frozen=True)
class FrozenBackbone:
    """`ModelFields` of a frozen backbone under the smallest temporal encoder (the features stage runs no encoder)."""

    init: str | None
    backbone: str | None
    backbone_overrides: dict[str, Any]
    frame_size: int | None
    seed: int
    endpoint_url: str | None
    freeze_backbone: bool = True
    train_frames: int = 16
    temporal_pos_embed: str = "learned"
    vtn: dict[str, Any] = dataclasses.field(default_factory=lambda: {"depth": 1, "num_heads": 1})


@dataclasses.dataclass
class InitialModel:
    """The VTN training starts from, and where its backbone came from."""

    model: VTN
    frame_size: int
    backbone_source: str  # "none" (scratch) or the init as given (userinfo stripped)
    backbone_run_id: str | None  # the MLflow run that produced the backbone, when known


def check_backbone_choice(init: str | None, backbone: str | None, overrides: dict[str, Any]) -> None:
    """A one-line ValueError unless the backbone can be built: from `init`, or from scratch by name."""
    if init_kind(init) == "scratch" and not backbone:
        raise ValueError("backbone: required when training from scratch (init is none)")
    if not backbone:
        return
    if backbone in VTN_PRESETS:
        raise ValueError(f"backbone {backbone!r} is a video model, not a 2-D image model")
    if vit.is_vit_name(backbone):
        try:
            vit.preset_config(backbone, **overrides)
        except (TypeError, ValueError) as err:
            raise ValueError(f"backbone {backbone!r}: {one_line(err)}") from None
    elif backbone not in vit.list_models():
        raise ValueError(f"backbone {backbone!r}: unknown model (a ViT such as 'ViT-B/16', or one of "
                         f"{', '.join(m for m in vit.list_models() if m not in VTN_PRESETS)})")


def check_vtn_fields(value: dict[str, Any]) -> dict[str, Any]:
    """`value` if it holds valid VTNConfig fields the stage does not set itself, else a one-line ValueError."""
    valid = {f.name for f in dataclasses.fields(VTNConfig)} - MANAGED_VTN_FIELDS
    managed = sorted(set(value) & MANAGED_VTN_FIELDS)
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
        raise ValueError(one_line(err)) from None
    return value


def _square_size(image_size: Any, what: str) -> int:
    if isinstance(image_size, (list, tuple)):
        if len(set(image_size)) != 1:
            raise ValueError(f"{what} has non-square image_size {tuple(image_size)}; set frame_size")
        image_size = image_size[0]
    return int(image_size)


def _backbone(config: ModelFields, tracking_uri: str,
              origin: Origin | None) -> tuple[str, dict[str, Any], int, tuple[str, str | None, Any]]:
    """`(name, overrides, frame size, (source, source run id, weights or None))` of the VTN's backbone."""
    if init_kind(config.init) != "scratch":
        start = fetch_starting_weights(
            config.init, model_name=config.backbone, model_overrides=config.backbone_overrides,
            tracking_uri=tracking_uri, endpoint_url=config.endpoint_url, seed=config.seed, origin=origin,
        )
        size = config.frame_size or _square_size(start.model.config.image_size, f"init {start.source}")
        backbone = vit.at_resolution(start.model, size, 0)  # position embeddings resampled to the frame grid
        name = "R50+ViT-B/16" if backbone.config.hybrid is not None else "ViT-B/16"  # every field overridden below
        overrides = {k: v for k, v in backbone.config.to_dict().items() if k != "num_classes"}
        return name, overrides, size, (start.source, start.source_run_id, backbone.state_dict())
    name = str(config.backbone)
    overrides = dict(config.backbone_overrides)
    if config.frame_size is not None and vit.is_vit_name(name):
        overrides["image_size"] = config.frame_size
    size = config.frame_size
    if size is None:
        if not vit.is_vit_name(name):
            raise ValueError(f"frame_size: required for backbone {name!r}")
        size = _square_size(vit.preset_config(name, **overrides).image_size, f"backbone {name!r}")
    return name, overrides, size, ("none", None, None)


def build_initial_model(config: ModelFields, num_classes: int, tracking_uri: str,
                        origin: Origin | None = None) -> InitialModel:
    """The VTN to train: backbone from `config.init` (at `frame_size`, head removed) or fresh, the rest fresh.
    `origin`: `starting_origin`'s answer for `config.init`, when the caller already has it.

    Raises a one-line ValueError for backbones that do not fit (names, shapes, head count).
    """
    name, overrides, size, (source, run_id, weights) = _backbone(config, tracking_uri, origin)
    vtn_config = VTNConfig(
        backbone=name, backbone_overrides=overrides, freeze_backbone=config.freeze_backbone, num_classes=num_classes,
        num_frames=config.train_frames, temporal_pos_embed=_POS_EMBED[config.temporal_pos_embed], **config.vtn,
    )
    torch.manual_seed(config.seed)
    try:
        model = VTN(vtn_config)
    except ValueError as err:
        raise ValueError(f"vtn: {one_line(err)}") from None
    if weights is not None:
        model.backbone.load_state_dict(weights)
    return InitialModel(model, size, source, run_id)
