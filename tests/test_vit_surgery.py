"""Model surgery in `vit.surgery`: another resolution with a new head, a frozen backbone, the weights hash."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import vit
from vit import at_resolution, freeze_backbone, weights_hash
from vit.resnet import resnet50

TINY = dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=4, image_size=16, num_classes=4)


def tiny(**overrides) -> vit.VisionTransformer:
    torch.manual_seed(0)
    return vit.create_model("ViT-Ti/16", **{**TINY, **overrides})


def test_at_resolution_interpolates_position_embeddings_like_the_model_does_at_call_time():
    base = tiny()
    model = at_resolution(base, 32, 10)
    images = torch.randn(2, 3, 32, 32)
    assert model.pos_embed.shape == (1, 1 + 64, 32)  # 8x8 grid + class token
    expected = base.pooled_features(images)  # the 4x4-grid model resamples on the fly for 32x32 inputs
    torch.testing.assert_close(model.pooled_features(images), expected)


def test_at_resolution_resamples_row_and_column_tables_of_2d_embeddings():
    base = tiny(pos_embed="learned_2d")
    model = at_resolution(base, 32, 10)
    assert model.pos_embed_row.shape == (8, 16) and model.pos_embed_col.shape == (8, 16)
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model.pooled_features(images), base.pooled_features(images))


def test_at_resolution_keeps_every_weight_but_the_position_embeddings_and_the_head():
    base = tiny()
    model = at_resolution(base, 32, 10, {"drop_path": 0.1})
    kept = {k for k in base.state_dict() if not k.startswith(("head.", "pos_embed"))}
    assert kept and all(torch.equal(model.state_dict()[k], base.state_dict()[k]) for k in kept)
    assert model.config.drop_path == 0.1 and base.config.image_size == 16  # the base is left as it was


def test_the_new_head_is_zero_initialised_for_the_new_classes():
    model = at_resolution(tiny(), 32, 10)
    assert model.head.out_features == 10
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    logits = model(torch.randn(3, 3, 32, 32))
    torch.testing.assert_close(torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2])), torch.tensor(math.log(10)))


def test_a_frozen_backbone_trains_only_the_head():
    model = at_resolution(tiny(), 16, 4)
    freeze_backbone(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    torch.nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)), torch.randint(0, 4, (8,))).backward()
    optimizer.step()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"head.weight", "head.bias"}
    assert all(p.grad is None for name, p in model.named_parameters() if not name.startswith("head."))


def test_the_weights_hash_names_the_weights_and_changes_when_one_weight_does():
    a, b = tiny(), tiny()
    assert weights_hash(a) == weights_hash(b) and weights_hash(a).startswith("sha256:")
    with torch.no_grad():
        b.blocks[1].mlp.fc2.bias[3] += 1e-3
    assert weights_hash(a) != weights_hash(b)
    assert weights_hash(a) != weights_hash(copy.deepcopy(a).half())  # the dtype is part of it


@pytest.mark.parametrize("field", ["embed_dim", "pos_embed", "num_classes", "image_size", "dropuot"])
def test_at_resolution_refuses_overrides_of_fields_that_hold_weights_or_do_not_exist(field):
    with pytest.raises(ValueError, match=rf"overrides may change only fields that hold no weights.*'{field}'"):
        at_resolution(tiny(), 32, 10, {field: 64})


def test_at_resolution_accepts_every_field_that_holds_no_weights():
    overrides = {"dropout": 0.1, "attn_dropout": 0.1, "drop_path": 0.1, "layer_norm_eps": 1e-5, "attn_impl": "matmul"}
    model = at_resolution(tiny(), 32, 10, overrides)
    assert all(getattr(model.config, k) == v for k, v in overrides.items())


def test_at_resolution_refuses_a_base_that_is_not_a_vision_transformer():
    with pytest.raises(ValueError, match="base must be a VisionTransformer, got ResNet"):
        at_resolution(resnet50(num_classes=4), 224, 5)


def test_a_frozen_resnet_trains_only_its_fc_head():
    model = vit.ResNet(vit.ResNetConfig(num_classes=3, layers=(1, 1, 1, 1), width=8))
    freeze_backbone(model)
    assert {name for name, p in model.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}


def test_freezing_a_model_without_head_parameters_raises_instead_of_leaving_nothing_to_train():
    model = tiny(num_classes=0)
    with pytest.raises(ValueError, match="has no head parameters.*leave nothing to train"):
        freeze_backbone(model)
    assert all(p.requires_grad for p in model.parameters())  # left as it was
