"""Specification of `vit.longformer.LongformerEncoder` (pre-LN Longformer layers)."""

from __future__ import annotations

import pytest
import torch

from vit.longformer import LongformerConfig, LongformerEncoder, LongformerSelfAttention


def tiny(**overrides) -> LongformerConfig:
    base = dict(hidden_size=16, num_heads=2, depth=2, ffn_size=32, window=4, attn_dropout=0.0)
    return LongformerConfig(**{**base, **overrides})


def test_encoder_maps_tokens_to_tokens_of_the_same_shape():
    enc = LongformerEncoder(tiny()).eval()
    assert enc(torch.randn(3, 11, 16)).shape == (3, 11, 16)


def test_window_and_dilation_are_set_per_layer():
    enc = LongformerEncoder(tiny(depth=3, window=[2, 4, 8], dilation=[1, 2, 3]))
    assert [(layer.attn.window, layer.attn.dilation) for layer in enc.layers] == [(2, 1), (4, 2), (8, 3)]


def test_global_projections_start_as_copies_of_the_local_ones_but_are_separate_parameters():
    attn = LongformerEncoder(tiny()).layers[0].attn
    for local, glob in ((attn.query, attn.query_global), (attn.key, attn.key_global), (attn.value, attn.value_global)):
        assert torch.equal(local.weight, glob.weight) and torch.equal(local.bias, glob.bias)
        assert local.weight.data_ptr() != glob.weight.data_ptr()


def test_linear_weights_are_drawn_from_normal_0_02_and_biases_are_zero():
    enc = LongformerEncoder(tiny(hidden_size=256, num_heads=4, ffn_size=1024, depth=1))
    w = enc.layers[0].mlp[0].weight
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    assert torch.all(enc.layers[0].mlp[0].bias == 0)


def test_layers_are_pre_layer_norm_residual_branches_add_to_an_unnormalised_stream():
    enc = LongformerEncoder(tiny(depth=1)).eval()
    layer = enc.layers[0]
    with torch.no_grad():
        layer.proj.weight.zero_()
        layer.proj.bias.zero_()
        layer.mlp[-1].weight.zero_()
        layer.mlp[-1].bias.zero_()
    x = torch.randn(2, 9, 16) * 5 + 3
    torch.testing.assert_close(layer(x), x)


def test_a_token_sees_only_its_window_without_global_tokens():
    enc = LongformerEncoder(tiny(depth=1, window=4)).eval()
    x = torch.randn(1, 12, 16)
    far = x.clone()
    far[0, 5:] += torch.randn(7, 16)  # token 0 sees tokens 0..2 only (a constant shift would vanish in LN)
    out, out_far = enc(x), enc(far)
    torch.testing.assert_close(out[0, :3], out_far[0, :3])
    assert not torch.allclose(out[0, 3:], out_far[0, 3:])


def test_a_global_token_carries_information_across_the_whole_sequence():
    torch.manual_seed(0)
    # Large weights, so that one token's influence through two attention hops is not lost in rounding.
    enc = LongformerEncoder(tiny(depth=2, window=2, init_std=0.2)).eval()
    x = torch.randn(1, 12, 16)
    far = x.clone()
    far[0, 11] += torch.randn(16)
    gm = torch.zeros(1, 12, dtype=torch.bool)
    gm[0, 6] = True
    # Layer 1: token 6 (global) reads token 11; layer 2: token 0 reads token 6.
    assert (enc(x, gm)[0, 0] - enc(far, gm)[0, 0]).abs().max() > 1e-3
    torch.testing.assert_close(enc(x)[0, 0], enc(far)[0, 0])


def test_padding_does_not_change_the_other_tokens_outputs():
    enc = LongformerEncoder(tiny(window=6, dilation=[1, 2])).eval()
    x = torch.randn(2, 10, 16)
    pm = torch.zeros(2, 10, dtype=torch.bool)
    pm[0, 7:] = True
    pm[1, 3:5] = True
    gm = torch.zeros(2, 10, dtype=torch.bool)
    gm[:, 0] = True
    noisy = x + pm[..., None] * torch.randn(2, 10, 16) * 10
    keep = ~pm[..., None]
    torch.testing.assert_close(enc(noisy, gm, pm) * keep, enc(x, gm, pm) * keep)


def test_global_attention_maps_are_returned_per_layer_and_are_distributions_over_real_tokens():
    enc = LongformerEncoder(tiny(depth=2)).eval()
    gm = torch.zeros(2, 10, dtype=torch.bool)
    gm[:, 0] = True
    gm[1, 4] = True
    pm = torch.zeros(2, 10, dtype=torch.bool)
    pm[0, 8:] = True
    _, maps = enc(torch.randn(2, 10, 16), gm, pm, return_global_attention=True)
    assert len(maps) == 2
    for probs in maps:
        assert probs.shape == (2, 2, 2, 10)  # (B, heads, most globals in a sequence, N)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 2))
        assert torch.all(probs[0, :, :, 8:] == 0)


def test_global_projections_receive_gradients_when_there_are_global_tokens():
    enc = LongformerEncoder(tiny())
    gm = torch.zeros(2, 7, dtype=torch.bool)
    gm[:, 0] = True
    enc(torch.randn(2, 7, 16), gm).square().mean().backward()
    attn = enc.layers[0].attn
    for proj in (attn.query_global, attn.key_global, attn.value_global):
        assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0


def test_attention_dropout_is_active_in_training_only():
    enc = LongformerEncoder(tiny(attn_dropout=0.5))
    x = torch.randn(1, 8, 16)
    enc.eval()
    torch.testing.assert_close(enc(x), enc(x))
    enc.train()
    torch.manual_seed(0)
    a = enc(x)
    torch.manual_seed(1)
    assert not torch.allclose(a, enc(x))


def test_encoder_runs_forward_and_backward_in_bf16():
    enc = LongformerEncoder(tiny()).to(torch.bfloat16)
    gm = torch.zeros(2, 13, dtype=torch.bool)
    gm[:, 0] = True
    out = enc(torch.randn(2, 13, 16, dtype=torch.bfloat16), gm)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.isfinite(enc.layers[0].attn.query.weight.grad).all()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"window": 3}, "window must be a positive even integer"),
        ({"window": [4, 4, 4]}, "window must be one int or a list of 2"),
        ({"dilation": [1, 0]}, "dilation must be an integer >= 1"),
        ({"hidden_size": 10, "num_heads": 4}, "must be a positive multiple of num_heads"),
        ({"attn_dropout": 1.0}, r"attn_dropout must be in \[0, 1\)"),
        ({"depth": 0}, "depth must be >= 1"),
    ],
)
def test_bad_config_raises_a_clear_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_wrong_token_width_raises():
    with pytest.raises(ValueError, match=r"expected tokens \(B, N, 16\)"):
        LongformerEncoder(tiny())(torch.randn(2, 5, 8))


@pytest.mark.parametrize("rate", [2.0, -0.1, 1.0])
def test_self_attention_refuses_an_attention_dropout_outside_0_to_1(rate):
    with pytest.raises(ValueError, match=rf"attn_dropout must be a probability in \[0, 1\), got {rate}"):
        LongformerSelfAttention(8, 2, window=4, attn_dropout=rate)


@pytest.mark.parametrize("name, value", [("window", 4.0), ("dilation", "2"), ("window", None)])
def test_a_window_or_dilation_that_is_neither_an_int_nor_a_list_is_one_value_error(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be one int or a list of 2 \(one per layer\), got {value!r}"):
        tiny(**{name: value})


@pytest.mark.parametrize("name", ["dropout", "attn_dropout"])
def test_a_config_rate_that_is_not_a_number_is_one_value_error(name):
    with pytest.raises(ValueError, match=rf"{name} must be in \[0, 1\), got '0.1'"):
        tiny(**{name: "0.1"})
