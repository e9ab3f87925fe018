"""`vit.create_model` is the one door to every model family."""

import torch

import vit


def test_create_model_builds_vtn_presets_by_name() -> None:
    model = vit.create_model("ViT-Ti-VTN", num_classes=5)
    assert isinstance(model, vit.VTN)
    assert "ViT-B-VTN" in vit.list_models()


def test_vtn_checkpoint_round_trips_through_load_checkpoint(tmp_path) -> None:
    overrides = dict(num_classes=3, num_heads=2, window=2, backbone_overrides=dict(image_size=16, patch_size=8, depth=1, embed_dim=32, num_heads=2, mlp_dim=64))
    model = vit.create_model("ViT-Ti-VTN", **overrides).eval()
    vit.save_checkpoint(model, tmp_path)
    loaded = vit.load_checkpoint(tmp_path).eval()
    video = torch.randn(1, 4, 3, 16, 16)
    torch.testing.assert_close(loaded(video), model(video))
