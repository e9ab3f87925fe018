"""vit: Vision Transformer models in plain PyTorch (no Ray, no MLflow).

`create_model(name, **overrides)` builds any registered model by name; families
register builders with `register_model` (`vit.registry`). Model surgery (another
resolution with a new head, a frozen backbone, a weights hash) is in `vit.surgery`;
`MaskedAutoencoder` (`vit.mae`) pretrains a ViT encoder on unlabeled images.
"""

from __future__ import annotations

from vit.config import ResNetStemConfig, ViTConfig, decode_variant, is_vit_name, preset_config
from vit.model import VisionTransformer
from vit.longformer import LongformerConfig, LongformerEncoder
from vit.mae import MaskedAutoencoder, masking_generator
from vit.patches import grid_size, patchify, unpatchify
from vit.registry import create_model, list_models, register_model
from vit.resnet import ResNet, ResNetConfig
from vit.surgery import at_resolution, freeze_backbone, weights_hash
from vit.vtn import VTN, VTNConfig, create_vtn  # imported here so its presets register with `vit.registry`
from vit.weights import (checkpoint_config, load_checkpoint, load_pretrained, register_arch, save_checkpoint,
                         weights_files)

__all__ = [
    "VTN",
    "VTNConfig",
    "LongformerConfig",
    "LongformerEncoder",
    "MaskedAutoencoder",
    "create_vtn",
    "ResNet",
    "ResNetConfig",
    "ResNetStemConfig",
    "ViTConfig",
    "VisionTransformer",
    "at_resolution",
    "checkpoint_config",
    "create_model",
    "decode_variant",
    "freeze_backbone",
    "grid_size",
    "is_vit_name",
    "list_models",
    "load_checkpoint",
    "load_pretrained",
    "masking_generator",
    "patchify",
    "preset_config",
    "register_arch",
    "register_model",
    "save_checkpoint",
    "unpatchify",
    "weights_files",
    "weights_hash",
]
