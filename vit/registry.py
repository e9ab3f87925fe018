"""The model registry: `create_model(name, **overrides)` builds any registered model by name.

Families register builders with `register_model` (the ViT presets and "ResNet-50"
here, the VTN presets in `vit.vtn`).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from vit.config import PRESET_NAMES, is_vit_name, preset_config
from vit.model import VisionTransformer
from vit.resnet import resnet50

# name -> builder(**overrides); names here are what `list_models` shows.
_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str, builder: Callable[..., nn.Module]) -> None:
    """Register `builder(**overrides) -> nn.Module` under `name` for `create_model`."""
    _MODELS[name] = builder


def list_models() -> list[str]:
    """Names `create_model` knows (any "ViT-<size>/<patch>" also works)."""
    return sorted(_MODELS)


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build a model by preset name, e.g. `create_model("ViT-B/16", num_classes=10, image_size=384)`.

    Every config field can be overridden by keyword; an unknown name or field is a ValueError.
    """
    if name in _MODELS:
        return _MODELS[name](**overrides)
    if is_vit_name(name):  # decodable but unlisted, e.g. "ViT-S/8"
        return VisionTransformer(preset_config(name, **overrides))
    known = ", ".join(list_models())
    raise ValueError(f"unknown model {name!r}; known models: {known} (or any 'ViT-<size>/<patch>')")


def _vit_builder(name: str) -> Callable[..., nn.Module]:
    def build(**overrides: Any) -> nn.Module:
        return VisionTransformer(preset_config(name, **overrides))

    return build


for _name in PRESET_NAMES:
    register_model(_name, _vit_builder(_name))
register_model("ResNet-50", lambda **overrides: resnet50(**overrides))
