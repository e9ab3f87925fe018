"""Specification of the Video Transformer Network (`vit.vtn`)."""

from __future__ import annotations

import pytest
import torch

import vit
from vit.vtn import VTN, VTNConfig, create_vtn, sample_frame_indices

# A tiny 2-D backbone: 32×32 frames, 4 patches, one 32-wide block.
TINY_VIT = dict(image_size=32, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)


def tiny_vtn(**overrides) -> VTN:
    base = dict(backbone="ViT-Ti/16", backbone_overrides=TINY_VIT, num_classes=5, num_frames=4, window=4,
                depth=2, num_heads=4, max_frames=64, head_dropout=0.0)
    torch.manual_seed(0)
    return VTN(VTNConfig(**{**base, **overrides}))


def video(bsz=2, frames=8, size=32, seed=0):
    return torch.randn(bsz, frames, 3, size, size, generator=torch.Generator().manual_seed(seed))


class FrameCounter:
    """Records the batch shapes the backbone is called with (a real forward hook, not a mock)."""

    def __init__(self, model: VTN):
        self.shapes = []
        model.backbone.register_forward_pre_hook(lambda _m, args: self.shapes.append(tuple(args[0].shape)))

    @property
    def frames(self) -> int:
        return sum(s[0] for s in self.shapes)


def test_logits_have_one_row_per_video():
    assert tiny_vtn().eval()(video()).shape == (2, 5)


def test_frames_go_through_the_backbone_as_one_batch_of_b_times_t_images():
    model = tiny_vtn().eval()
    model.backbone.pooled_features = _counting(model.backbone.pooled_features, shapes := [])
    model(video(bsz=2, frames=7))
    assert shapes == [(14, 3, 32, 32)]


def _counting(fn, shapes):
    def wrapped(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return fn(x, *args, **kwargs)

    return wrapped


def test_end_to_end_chunked_and_precomputed_features_give_the_same_logits():
    model = tiny_vtn().eval()
    v = video(frames=9)
    idx = torch.arange(9) * 3
    with torch.no_grad():
        end_to_end = model(v, frame_indices=idx)
        chunked = model(v, frame_indices=idx, chunk_size=4)  # 18 frames in chunks of 4, 4, 4, 4, 2
        features = model.frame_features(v)
        precomputed = model.forward_features_from_frames(features, idx)
    torch.testing.assert_close(chunked, end_to_end, atol=1e-5, rtol=0)
    torch.testing.assert_close(precomputed, end_to_end, atol=1e-5, rtol=0)


def test_chunking_bounds_the_backbone_batch():
    model = tiny_vtn().eval()
    model.backbone.pooled_features = _counting(model.backbone.pooled_features, shapes := [])
    with torch.no_grad():
        model(video(bsz=2, frames=9), chunk_size=4)
    assert [s[0] for s in shapes] == [4, 4, 4, 4, 2]


def changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Clearly different, not rounding: the sensitivity tests use init_std=0.2 so effects are large."""
    return (a - b).abs().max().item() > 1e-3


def test_cls_token_is_global_and_sees_frames_beyond_the_window():
    model = tiny_vtn(depth=1, window=2, init_std=0.2).eval()
    v = video(frames=12)
    late = v.clone()
    late[:, 11] = torch.randn(2, 3, 32, 32)
    assert changed(model(v), model(late))


def test_learned_position_embedding_encodes_the_frame_index_in_the_whole_video():
    model = tiny_vtn(temporal_pos_embed="learned", init_std=0.2).eval()
    v = video()
    assert changed(model(v, frame_indices=torch.arange(8)), model(v, frame_indices=torch.arange(8) + 40))
    model.pos_embed.weight.data[40:48] = model.pos_embed.weight.data[0:8]
    torch.testing.assert_close(model(v, frame_indices=torch.arange(8)), model(v, frame_indices=torch.arange(8) + 40))


def test_learned_position_embedding_rejects_indices_past_max_frames():
    with pytest.raises(ValueError, match=r"frame_indices must lie in \[0, max_frames=64\)"):
        tiny_vtn()(video(frames=3), frame_indices=torch.tensor([0, 30, 64]))


def test_sincos_position_embedding_is_fixed_and_works_for_any_index():
    model = tiny_vtn(temporal_pos_embed="sincos", init_std=0.2).eval()
    assert model.pos_embed is None
    v = video()
    far = model(v, frame_indices=torch.arange(8) + 10_000)
    assert torch.isfinite(far).all()
    assert changed(model(v), far)


def test_without_position_embedding_the_frame_indices_do_not_matter():
    model = tiny_vtn(temporal_pos_embed="none").eval()
    v = video()
    torch.testing.assert_close(model(v), model(v, frame_indices=torch.arange(8) * 7 + 3))


def test_per_video_frame_indices_are_accepted():
    model = tiny_vtn().eval()
    v = video()
    idx = torch.stack([torch.arange(8), torch.arange(8) + 20])
    both = model(v, frame_indices=idx)
    torch.testing.assert_close(both[1:], model(v[1:], frame_indices=idx[1]))


def test_padded_frames_do_not_change_the_logits():
    model = tiny_vtn().eval()
    v = video(frames=8)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[0, 5:] = True
    noisy = v.clone()
    noisy[0, 5:] = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(model(noisy, padding_mask=pad), model(v, padding_mask=pad))
    torch.testing.assert_close(model(v, padding_mask=pad)[0:1], model(v[0:1, :5]), atol=1e-5, rtol=0)


def test_cls_attention_map_covers_cls_and_every_frame_and_sums_to_one():
    model = tiny_vtn(depth=2, num_heads=4).eval()
    logits, attn = model(video(frames=8), return_attention=True)
    assert logits.shape == (2, 5)
    assert attn.shape == (2, 2, 4, 9)  # (B, depth, heads, 1 + T)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 2, 4))
    assert (attn >= 0).all()


def test_full_video_inference_uses_the_requested_number_of_frames_over_the_whole_video():
    model = tiny_vtn()
    model.backbone.pooled_features = _counting(model.backbone.pooled_features, shapes := [])
    probs = model.predict_full_video(video(bsz=2, frames=40), num_frames=10)
    assert shapes == [(20, 3, 32, 32)]
    assert probs.shape == (2, 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert sample_frame_indices(40, 10).tolist() == [2, 6, 10, 14, 18, 22, 26, 30, 34, 38]


def test_a_video_with_fewer_frames_than_asked_is_resampled_with_repetition():
    assert sample_frame_indices(3, 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    model = tiny_vtn()
    probs = model.predict_full_video(video(bsz=1, frames=3), num_frames=8)
    assert probs.shape == (1, 5) and torch.isfinite(probs).all()
    assert model.predict_multiview(video(bsz=1, frames=2), clips=2, crops=1, clip_frames=4).shape == (1, 5)


def test_multiview_averages_the_softmax_over_clips_times_crops():
    model = tiny_vtn().eval()
    v = torch.randn(1, 12, 3, 32, 40)  # wider than tall: crops slide horizontally
    got = model.predict_multiview(v, clips=2, crops=3, clip_frames=4, frame_stride=2, crop_size=32)
    want = 0
    for start in (0, 5):  # clips span 7 frames, spread over 12
        idx = torch.arange(start, start + 7, 2)
        for left in (0, 4, 8):
            want = want + model(v[:, idx, :, :, left:left + 32], frame_indices=idx).softmax(-1)
    torch.testing.assert_close(got, want / 6, atol=1e-5, rtol=0)


def test_multiview_default_is_ten_clips_by_three_crops():
    model = tiny_vtn()
    model.backbone.pooled_features = _counting(model.backbone.pooled_features, shapes := [])
    model.predict_multiview(video(bsz=1, frames=20), clip_frames=4)
    assert shapes == [(30 * 4, 3, 32, 32)]


def test_inference_modes_leave_the_model_in_its_training_mode():
    model = tiny_vtn().train()
    model.predict_full_video(video(bsz=1, frames=5), num_frames=4)
    assert model.training and model.head.training


def test_frozen_backbone_gets_no_gradients_and_stays_in_eval_mode():
    model = tiny_vtn(freeze_backbone=True).train()
    assert not model.backbone.training
    model(video()).square().sum().backward()
    assert all(p.grad is None for p in model.backbone.parameters())
    assert all(p.grad is not None for p in model.encoder.parameters())
    assert model.cls_token.grad is not None and model.head[-1].weight.grad is not None


def test_trained_backbone_gets_gradients():
    model = tiny_vtn(freeze_backbone=False).train()
    model(video()).square().sum().backward()
    assert all(p.grad is not None for p in model.backbone.blocks.parameters())


def test_a_plain_resnet_backbone_works():
    model = tiny_vtn(backbone="ResNet-50", backbone_overrides=dict(layers=(1, 1), width=8)).eval()
    assert model.backbone.num_features == 64 and model.hidden_size == 64
    assert model(video(frames=3)).shape == (2, 5)


def test_a_hybrid_backbone_works():
    hybrid = dict(image_size=32, embed_dim=32, depth=1, num_heads=2, mlp_dim=64, hybrid={"layers": (1,), "width": 8})
    model = tiny_vtn(backbone="R50+ViT-B/16", backbone_overrides=hybrid).eval()
    assert model(video(frames=3)).shape == (2, 5)


def test_a_hidden_size_other_than_the_backbone_width_adds_a_projection():
    model = tiny_vtn(hidden_size=16, ffn_size=24).eval()
    assert isinstance(model.frame_proj, torch.nn.Linear) and model.encoder.config.ffn_size == 24
    assert model(video(frames=3)).shape == (2, 5)


def test_vit_b_preset_has_the_paper_defaults():
    with torch.device("meta"):  # shapes and config only: no 86 M-parameter initialisation
        model = vit.create_model("ViT-B-VTN", num_classes=400)
    enc = model.encoder.config
    assert (enc.hidden_size, enc.ffn_size, enc.num_heads, enc.depth, enc.windows, enc.attn_dropout) == (
        768, 3072, 12, 3, [32, 32, 32], 0.1)
    assert model.cls_token.shape == (1, 1, 768) and model.head[-1].out_features == 400
    assert [type(m).__name__ for m in model.head] == ["LayerNorm", "Linear", "GELU", "Dropout", "Linear"]


def test_temporal_weights_are_initialised_from_normal_0_02():
    model = tiny_vtn(hidden_size=256, num_heads=4)
    for w in (model.head[1].weight, model.encoder.layers[0].mlp[0].weight, model.pos_embed.weight):
        assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002


def test_checkpoint_round_trip_rebuilds_the_same_model(tmp_path):
    model = tiny_vtn().eval()
    vit.save_checkpoint(model, tmp_path)
    loaded = vit.load_checkpoint(tmp_path).eval()
    v = video(frames=3)
    torch.testing.assert_close(loaded(v), model(v))


def test_unknown_backbone_raises_a_clear_error():
    with pytest.raises(ValueError, match="VTN backbone 'ViT-Q/99'"):
        tiny_vtn(backbone="ViT-Q/99")
    with pytest.raises(ValueError, match="VTN backbone 'NoSuchNet'.*unknown model"):
        tiny_vtn(backbone="NoSuchNet")


def test_a_video_model_is_not_accepted_as_a_backbone():
    with pytest.raises(ValueError, match="not a 2-D image model"):
        tiny_vtn(backbone="ViT-Ti-VTN", backbone_overrides={"backbone_overrides": TINY_VIT, "num_heads": 4})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"window": 3}, "window must be a positive even integer"),
        ({"window": -2}, "window must be a positive even integer"),
        ({"dilation": 0}, "dilation must be an integer >= 1"),
        ({"num_heads": 3}, "not divisible by num_heads 3"),
        ({"temporal_pos_embed": "rope"}, "temporal_pos_embed must be one of"),
        ({"num_frames": 0}, "num_frames must be a positive int"),
    ],
)
def test_bad_config_raises_a_clear_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_vtn(**overrides)


def test_unknown_preset_and_unknown_field_raise():
    with pytest.raises(ValueError, match="unknown VTN preset 'ViT-X-VTN'"):
        create_vtn("ViT-X-VTN")
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['frames'\]"):
        create_vtn("ViT-Ti-VTN", frames=3)


@pytest.mark.parametrize("name, value", [("crop_size", -3), ("crop_size", 0), ("clip_frames", 0), ("clip_frames", -2)])
def test_multiview_refuses_a_crop_size_or_clip_length_that_is_not_positive_instead_of_defaulting(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got {value}"):
        tiny_vtn().predict_multiview(video(bsz=1), clips=1, crops=1, **{name: value})


def test_bad_inputs_raise_clear_errors():
    model = tiny_vtn()
    with pytest.raises(ValueError, match=r"expected a video \(B, T, C, H, W\)"):
        model(torch.randn(8, 3, 32, 32))
    with pytest.raises(ValueError, match=r"frame_indices must have shape \(8,\) or \(2, 8\)"):
        model(video(), frame_indices=torch.arange(7))
    with pytest.raises(ValueError, match="the video has no frames"):
        model.predict_full_video(torch.randn(1, 0, 3, 32, 32))
    with pytest.raises(ValueError, match="crop_size 48 is larger than the frames"):
        model.predict_multiview(video(bsz=1), crop_size=48)
    with pytest.raises(ValueError, match=r"expected frame features \(B, T, 32\)"):
        model.forward_features_from_frames(torch.randn(2, 8, 16))


def test_an_empty_batch_of_videos_gives_an_empty_batch_of_logits():
    assert tiny_vtn().eval()(video(bsz=0)).shape == (0, 5)


def test_a_video_of_zero_frames_is_refused_with_one_value_error():
    with pytest.raises(ValueError, match=r"the video has no frames: got shape \(2, 0, 3, 32, 32\)"):
        tiny_vtn()(video(frames=0))


@pytest.mark.parametrize("name", ["dropout", "attn_dropout", "head_dropout"])
def test_a_rate_that_is_not_a_number_is_one_value_error(name):
    with pytest.raises(ValueError, match=rf"{name} must be in \[0, 1\), got '0.1'"):
        VTNConfig(**{name: "0.1"})
