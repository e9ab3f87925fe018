"""Named presets: the paper's Table 1 (plus DeiT's Ti and S), overrides, parameter counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import ResNetConfig as HFResNetConfig
from transformers import ResNetForImageClassification
from transformers import ViTConfig as HFViTConfig
from transformers import ViTForImageClassification

from vit import ViTConfig, create_model, decode_variant, list_models, register_model
from vit.registry import _MODELS

# (layers, hidden D, MLP size, heads) from ViT Table 1 and DeiT Table 1.
TABLE_1 = {
    "Ti": (12, 192, 768, 3),
    "S": (12, 384, 1536, 6),
    "B": (12, 768, 3072, 12),
    "L": (24, 1024, 4096, 16),
    "H": (32, 1280, 5120, 16),
}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name", ["ViT-Ti/16", "ViT-S/16", "ViT-B/16", "ViT-B/32", "ViT-L/16", "ViT-L/32", "ViT-H/14"]
)
def test_presets_have_the_papers_sizes(name):
    size, patch = name.removeprefix("ViT-").split("/")
    layers, hidden, mlp, heads = TABLE_1[size]
    with torch.device("meta"):
        model = create_model(name)
    assert len(model.blocks) == layers
    assert model.norm.normalized_shape == (hidden,)
    assert model.blocks[0].mlp.fc1.out_features == mlp
    assert model.blocks[0].attn.num_heads == heads
    assert model.config.patch_size == int(patch)


def test_hybrid_preset_is_a_resnet_stem_with_one_pixel_patches_on_a_14x14_grid():
    with torch.device("meta"):
        model = create_model("R50+ViT-B/16")
    assert model.config.hybrid.layers == (3, 4, 9)
    assert model.config.patch_size == 1 and model.config.pixel_patch_size == 16
    assert model.config.grid == (14, 14)
    assert model.patch_embed.proj.in_features == 1024


def test_decode_variant_parses_big_vision_names():
    assert decode_variant("B/16") == dict(embed_dim=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16)
    assert decode_variant("S/8")["patch_size"] == 8
    assert "patch_size" not in decode_variant("L")


def test_unlisted_but_decodable_names_build():
    with torch.device("meta"):
        model = create_model("ViT-S/8", image_size=64)
    assert model.config.patch_size == 8 and model.config.embed_dim == 384
    assert model.pos_embed.shape == (1, 1 + 8 * 8, 384)


def test_every_config_field_can_be_overridden_by_keyword():
    overrides = dict(
        image_size=384, in_channels=1, num_classes=10, pool="gap", pos_embed="sincos", representation_size=64,
        dropout=0.1, attn_dropout=0.1, drop_path=0.2, layer_norm_eps=1e-12, qkv_bias=False, attn_impl="matmul",
        depth=2, embed_dim=64, num_heads=2, mlp_dim=128, patch_size=32, class_token=True,
    )
    model = create_model("ViT-B/16", **overrides)
    for key, value in overrides.items():
        assert getattr(model.config, key) == value, key
    assert model.blocks[0].attn.qkv.bias is None and model.head.out_features == 10


def test_all_named_presets_are_listed():
    names = list_models()
    for name in ("ViT-Ti/16", "ViT-S/16", "ViT-B/16", "ViT-B/32", "ViT-L/16", "ViT-L/32", "ViT-H/14",
                 "R50+ViT-B/16", "ResNet-50"):
        assert name in names


def test_new_model_families_can_register_a_builder():
    register_model("Test-Linear", lambda **kw: nn.Linear(kw.get("n", 2), 1))
    try:
        assert create_model("Test-Linear", n=5).in_features == 5
        assert "Test-Linear" in list_models()
    finally:
        _MODELS.pop("Test-Linear")


# --- parameter counts against Hugging Face's ViTForImageClassification ---------------------


def hf_vit_params(name: str, image_size: int, num_classes: int) -> int:
    size, patch = name.removeprefix("ViT-").split("/")
    layers, hidden, mlp, heads = TABLE_1[size]
    config = HFViTConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp,
                         num_attention_heads=heads, patch_size=int(patch), image_size=image_size,
                         num_labels=num_classes)
    with torch.device("meta"):
        return n_params(ViTForImageClassification(config))


def test_vit_b16_parameter_count_equals_hugging_face_to_the_parameter():
    with torch.device("meta"):
        ours = n_params(create_model("ViT-B/16", num_classes=1000, image_size=224))
    assert ours == hf_vit_params("ViT-B/16", 224, 1000) == 86_567_656


@pytest.mark.parametrize(
    "name, image_size, num_classes",
    [("ViT-Ti/16", 224, 1000), ("ViT-S/16", 224, 100), ("ViT-B/32", 384, 10), ("ViT-L/16", 224, 1000),
     ("ViT-L/32", 224, 1000), ("ViT-H/14", 224, 1000)],
)
def test_preset_parameter_counts_equal_hugging_face(name, image_size, num_classes):
    with torch.device("meta"):
        ours = n_params(create_model(name, num_classes=num_classes, image_size=image_size))
    assert ours == hf_vit_params(name, image_size, num_classes)


def test_resnet50_parameter_count_equals_hugging_face_resnet50():
    with torch.device("meta"):
        ours = n_params(create_model("ResNet-50", num_classes=1000))
        theirs = n_params(ResNetForImageClassification(HFResNetConfig(num_labels=1000)))
    assert ours == theirs


def test_config_fields_survive_a_dict_round_trip():
    config = ViTConfig(image_size=(32, 48), patch_size=2, hybrid={"layers": (1, 2), "width": 16})
    assert ViTConfig(**config.to_dict()) == config
