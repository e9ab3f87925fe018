"""The ViT forward pass as the paper describes it (issue 2 §2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from vit import ViTConfig, VisionTransformer, create_model, patchify
from vit.config import ResNetStemConfig
from vit.model import pick_attention
from vit.pos_embed import resample_pos_embed, sincos_2d
from vit.resnet import ResNetV2Stem


def tiny(**overrides) -> ViTConfig:
    base = dict(image_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)
    return ViTConfig(**{**base, **overrides})


def tiny_hybrid(**overrides) -> VisionTransformer:
    base = dict(image_size=32, embed_dim=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3,
                hybrid={"layers": (1, 1, 1), "width": 8})
    return create_model("R50+ViT-B/16", **{**base, **overrides}).eval()


def build(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(tiny(**overrides)).eval()


class CallRecorder(TorchFunctionMode):
    """Records which torch functions run, to see which attention path was taken."""

    def __init__(self) -> None:
        super().__init__()
        self.called: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.called.add(func)
        return func(*args, **(kwargs or {}))


# --- inputs ------------------------------------------------------------------------------


def test_images_and_patch_sequences_give_identical_logits():
    model = build()
    images = torch.randn(3, 3, 16, 16)
    assert torch.equal(model(images), model(patchify(images, 4)))


def test_channels_last_pixels_patchify_to_the_same_sequence_the_model_sees():
    model = build()
    hwc = torch.randn(2, 16, 16, 3)
    seq = patchify(hwc, 4, channels_last=True)
    assert torch.equal(model(seq), model(hwc.permute(0, 3, 1, 2)))


def test_hybrid_images_and_patch_sequences_give_identical_logits():
    model = tiny_hybrid()
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(images), model(patchify(images, 16)), rtol=0, atol=1e-6)


def test_hybrid_feature_map_becomes_the_token_grid():
    model = tiny_hybrid()
    tokens = model.forward_features(torch.randn(2, 3, 32, 32))
    assert tokens.shape == (2, 1 + 2 * 2, 32)
    assert model(torch.randn(2, 3, 64, 48)).shape == (2, 3)  # other sizes: a 4x3 grid


def test_r50_stem_turns_224_pixels_into_a_14x14_grid_of_1024_channels():
    with torch.device("meta"):  # the full-size stem, shapes only
        out = ResNetV2Stem(ResNetStemConfig())(torch.empty(1, 3, 224, 224))
    assert out.shape == (1, 1024, 14, 14)


# --- attention paths ---------------------------------------------------------------------


def test_sdpa_and_matmul_paths_give_equal_logits():
    fast, plain = build(attn_impl="sdpa"), build(attn_impl="matmul")
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(fast(x), plain(x), rtol=0, atol=1e-5)


def test_sdpa_and_matmul_paths_give_equal_gradients():
    grads = []
    for impl in ("sdpa", "matmul"):
        model = build(attn_impl=impl).train()
        model(torch.ones(2, 3, 16, 16)).square().sum().backward()
        grads.append(model.blocks[0].attn.qkv.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_auto_attention_rule_prefers_matmul_only_for_cpu_low_precision_short_sequences():
    assert pick_attention("cpu", torch.bfloat16, 197, training=True) == "matmul"
    assert pick_attention("cpu", torch.bfloat16, 197, training=False) == "matmul"
    assert pick_attention("cpu", torch.bfloat16, 2049, training=True) == "sdpa"
    assert pick_attention("cpu", torch.float32, 197, training=True) == "sdpa"
    assert pick_attention("cuda", torch.bfloat16, 197, training=True) == "sdpa"


@pytest.mark.parametrize("bf16, expect_sdpa", [(True, False), (False, True)])
def test_auto_attention_takes_the_path_the_rule_picks(bf16, expect_sdpa):
    model = build(attn_impl="auto")
    recorder = CallRecorder()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), recorder:
        model(torch.randn(2, 3, 16, 16))
    assert (F.scaled_dot_product_attention in recorder.called) is expect_sdpa


def test_return_attention_gives_each_layers_row_stochastic_weights():
    model = build(depth=3, attn_impl="sdpa")
    x = torch.randn(2, 3, 16, 16)
    logits, attentions = model(x, return_attention=True)
    assert len(attentions) == 3
    assert all(a.shape == (2, 4, 17, 17) for a in attentions)
    torch.testing.assert_close(attentions[1].sum(-1), torch.ones(2, 4, 17))
    torch.testing.assert_close(logits, model(x), rtol=0, atol=1e-5)


# --- pooling and heads -------------------------------------------------------------------


def test_token_pooling_reads_the_class_token_after_the_final_norm():
    model = build()
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(model.pooled_features(x), model.forward_features(x)[:, 0])
    assert torch.equal(model(x), model.head(model.forward_features(x)[:, 0]))


def test_gap_pooling_drops_the_class_token_and_averages_patch_tokens():
    model = build(pool="gap")
    x = torch.randn(2, 3, 16, 16)
    tokens = model.forward_features(x)
    assert model.cls_token is None and tokens.shape == (2, 16, 32)
    torch.testing.assert_close(model.pooled_features(x), tokens.mean(1))


def test_representation_layer_is_a_tanh_projection_of_the_pooled_token():
    model = build(representation_size=24)
    x = torch.randn(2, 3, 16, 16)
    pooled = model.pooled_features(x)
    assert model.num_features == 24 and pooled.shape == (2, 24)
    expected = torch.tanh(model.pre_logits(model.forward_features(x)[:, 0]))
    torch.testing.assert_close(pooled, expected)


def test_replace_head_installs_a_zero_initialised_head():
    model = build()
    model.replace_head(7)
    assert model.config.num_classes == 7
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    assert torch.equal(model(torch.randn(2, 3, 16, 16)), torch.zeros(2, 7))


def test_dropout_and_stochastic_depth_act_only_in_training():
    model = build(dropout=0.1, drop_path=0.5)
    x = torch.randn(4, 3, 16, 16)
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


# --- position embeddings -----------------------------------------------------------------


def shuffled(seq: torch.Tensor) -> torch.Tensor:
    return seq[:, torch.randperm(seq.shape[1], generator=torch.Generator().manual_seed(0))]


def test_without_position_embeddings_the_model_ignores_patch_order():
    model = build(pos_embed="none")
    seq = patchify(torch.randn(2, 3, 16, 16), 4)
    torch.testing.assert_close(model(seq), model(shuffled(seq)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["learned", "learned_2d", "sincos"])
def test_position_embeddings_make_the_model_see_patch_order(kind):
    model = build(pos_embed=kind)
    seq = patchify(torch.randn(2, 3, 16, 16), 4)
    assert (model(seq) - model(shuffled(seq))).abs().max() > 1e-4


def test_sincos_embeddings_are_fixed_buffers_with_the_known_values():
    model = build(pos_embed="sincos")
    assert "pos_embed" not in dict(model.named_parameters())
    assert "pos_embed" not in model.state_dict()  # recomputed, never stored
    table = model.position_embeddings((4, 4))
    assert torch.equal(table[0, 0], torch.zeros(32))  # class token gets no position
    assert torch.equal(table[0, 1:], sincos_2d((4, 4), 32))
    origin = sincos_2d((4, 4), 32)[0]  # sin(0)=0, cos(0)=1 in each quarter
    assert torch.equal(origin, torch.tensor(([0.0] * 8 + [1.0] * 8) * 2))


def test_learned_2d_embeddings_share_row_and_column_halves():
    model = build(pos_embed="learned_2d")
    table = model.position_embeddings((4, 4))[0, 1:].reshape(4, 4, 32)
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("pos_embed")) == (4 + 4) * 16
    assert torch.equal(table[2, 0, :16], table[2, 3, :16])  # same row
    assert torch.equal(table[0, 1, 16:], table[3, 1, 16:])  # same column
    assert not torch.equal(table[0, 0, :16], table[1, 0, :16])


def test_resample_keeps_the_class_position_and_is_identity_at_the_same_grid():
    pos = torch.randn(1, 1 + 16, 8)
    assert resample_pos_embed(pos, (4, 4)) is pos
    bigger = resample_pos_embed(pos, (6, 5))
    assert bigger.shape == (1, 1 + 30, 8)
    assert torch.equal(bigger[:, 0], pos[:, 0])


@pytest.mark.parametrize("kind", ["learned", "learned_2d", "sincos"])
def test_larger_inputs_at_call_time_use_embeddings_resized_to_their_grid(kind):
    model = build(pos_embed=kind)
    big = torch.randn(2, 3, 24, 20)  # a 6x5 grid on a model built for 4x4
    tokens = model.patch_embed(big)[0]
    prefix = model.cls_token.expand(2, -1, -1)
    expected = model.norm(_run_blocks(model, torch.cat([prefix, tokens], 1) + model.position_embeddings((6, 5))))
    torch.testing.assert_close(model.forward_features(big), expected)
    assert model.position_embeddings((6, 5)).shape == (1, 31, 32)


def test_call_time_resize_equals_a_model_built_at_that_size_with_resampled_weights():
    small = build()
    large = VisionTransformer(tiny(image_size=24)).eval()
    state = dict(small.state_dict(), pos_embed=resample_pos_embed(small.pos_embed.detach(), (6, 6)))
    large.load_state_dict(state)
    x = torch.randn(2, 3, 24, 24)
    torch.testing.assert_close(small(x), large(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(small(patchify(x, 4), grid=(6, 6)), large(patchify(x, 4)), rtol=0, atol=1e-6)


def _run_blocks(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    for block in model.blocks:
        x = block(x)[0]
    return x


# --- the plain ResNet-50 baseline --------------------------------------------------------


def test_resnet_exposes_pooled_features_and_classifies():
    model = create_model("ResNet-50", num_classes=4, layers=(1, 1, 1, 1), width=8).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = model.pooled_features(x)
    assert model.num_features == 256 and feats.shape == (2, 256)
    torch.testing.assert_close(model(x), model.fc(feats))
    model.replace_head(2)
    assert torch.equal(model(x), torch.zeros(2, 2))
