"""Bad input fails with a one-line ValueError saying what was expected and what came (issue 2 §5)."""

from __future__ import annotations

import pytest
import torch

from vit import ViTConfig, VisionTransformer, create_model, decode_variant, load_pretrained
from vit.pos_embed import resample_pos_embed


@pytest.fixture(scope="module")
def model() -> VisionTransformer:
    config = ViTConfig(image_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=4, mlp_dim=64, num_classes=3)
    return VisionTransformer(config).eval()


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_image_side_not_divisible_by_the_patch_size(model):
    with pytest.raises(ValueError) as e:
        model(torch.randn(1, 3, 18, 16))
    assert "divisible by the patch size 4" in one_line(e) and "18x16" in one_line(e)


def test_hybrid_image_side_not_divisible_by_its_pixel_patch_size():
    hybrid = create_model("R50+ViT-B/16", image_size=32, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                          hybrid={"layers": (1, 1, 1), "width": 8})
    with pytest.raises(ValueError, match=r"patch size 16, got 40x32"):
        hybrid(torch.randn(1, 3, 40, 32))


def test_wrong_channel_count(model):
    with pytest.raises(ValueError) as e:
        model(torch.randn(1, 1, 16, 16))
    assert "(B, 3, H, W)" in one_line(e) and "(1, 1, 16, 16)" in one_line(e)


def test_wrong_patch_sequence_length(model):
    with pytest.raises(ValueError) as e:
        model(torch.randn(1, 15, 48))
    assert "expected 16 patches" in one_line(e) and "got 15" in one_line(e)


def test_wrong_patch_length(model):
    with pytest.raises(ValueError) as e:
        model(torch.randn(1, 16, 47))
    assert "patches of length 48" in one_line(e) and "got 47" in one_line(e)


def test_a_grid_that_does_not_fit_the_sequence(model):
    with pytest.raises(ValueError, match=r"grid 5x5 needs 25 patches, got 16"):
        model(torch.randn(1, 16, 48), grid=(5, 5))


def test_a_grid_with_a_side_that_is_not_positive_is_refused_naming_grid(model):
    with pytest.raises(ValueError, match=r"grid must be two positive ints \(rows, cols\), got \(-4, -4\)"):
        model(torch.randn(1, 16, 48), grid=(-4, -4))


@pytest.mark.parametrize("grid", [(0, 4), (4, -1), (4,), (4.0, 4)])
def test_resample_pos_embed_refuses_a_new_grid_that_is_not_two_positive_ints(grid):
    with pytest.raises(ValueError, match=r"new_grid must be two positive ints \(rows, cols\)"):
        resample_pos_embed(torch.randn(1, 17, 8), grid)


def test_resample_pos_embed_refuses_a_negative_count_of_prefix_tokens():
    with pytest.raises(ValueError, match=r"num_prefix_tokens must be an int >= 0, got -1"):
        resample_pos_embed(torch.randn(1, 17, 8), (4, 4), num_prefix_tokens=-1)


def test_an_input_of_the_wrong_rank(model):
    with pytest.raises(ValueError) as e:
        model(torch.randn(3, 16))
    assert "images (B, C, H, W) or patch sequences" in one_line(e) and "got shape (3, 16)" in one_line(e)


def test_integer_pixels(model):
    with pytest.raises(ValueError) as e:
        model(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))
    assert "float tensor" in one_line(e) and "got dtype torch.uint8" in one_line(e)


def test_unknown_preset_name_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        create_model("ViT-Q/16")
    assert "'ViT-Q/16'" in one_line(e) and "ViT-B/16" in one_line(e) and "ResNet-50" in one_line(e)
    with pytest.raises(ValueError, match="unknown ViT size 'X'"):
        decode_variant("X/16")


def test_unknown_override_is_named_with_the_valid_fields():
    with pytest.raises(ValueError) as e:
        create_model("ViT-B/16", hidden_size=512)
    assert "['hidden_size']" in one_line(e) and "embed_dim" in one_line(e)
    with pytest.raises(ValueError, match=r"\['depth'\] for ResNet-50"):
        create_model("ResNet-50", depth=3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pool="max"), "pool must be one of"),
        (dict(pos_embed="rope"), "pos_embed must be one of"),
        (dict(attn_impl="flash"), "attn_impl must be one of"),
        (dict(num_heads=5), "embed_dim 768 is not divisible by num_heads 5"),
        (dict(image_size=200), "image_size 200x200 is not divisible by the patch size 16"),
        (dict(dropout=-0.1), r"dropout must be in \[0, 1\)"),
        (dict(pool="token", class_token=False), "pool='token' needs class_token=True"),
        (dict(num_classes=-1), "num_classes must be an int >= 0"),
        (dict(depth=0), "depth must be a positive int"),
    ],
)
def test_invalid_config_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        ViTConfig(**overrides)


def test_unsupported_weights_file(tmp_path, model):
    path = tmp_path / "weights.npz"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"weights\.npz: expected \.safetensors, \.bin, \.pth or \.pt"):
        load_pretrained(model, path)


def test_an_image_with_a_side_of_zero_pixels_is_refused_naming_the_image(model):
    with pytest.raises(ValueError) as e:
        model(torch.randn(1, 3, 0, 16))
    assert "0x16" in one_line(e) and "image" in one_line(e)


def test_replace_head_refuses_a_bool_class_count(model):
    with pytest.raises(ValueError, match="num_classes must be an int >= 0, got True"):
        model.replace_head(True)


@pytest.mark.parametrize("name, data", [("w.safetensors", b"junkjunkjunk"), ("w.bin", b"junk"),
                                        ("w.pth", b"PK\x03\x04junk")])
def test_a_corrupt_weights_file_is_one_value_error_naming_it(tmp_path, model, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=rf"{name} cannot be read as weights") as e:
        load_pretrained(model, tmp_path / name)
    one_line(e)


def test_a_pickle_file_that_holds_no_state_dict_is_one_value_error_naming_it(tmp_path, model):
    torch.save([1, 2], tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"w\.pt holds a list, not a dict of tensors"):
        load_pretrained(model, tmp_path / "w.pt")


def test_a_sharded_index_without_a_weight_map_is_one_value_error_naming_it(tmp_path, model):
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json has no weight_map"):
        load_pretrained(model, tmp_path)


@pytest.mark.parametrize("overrides, message", [(dict(num_classes=True), "num_classes must be an int >= 0"),
                                                (dict(dropout="0.1"), r"dropout must be in \[0, 1\)")])
def test_a_config_value_of_the_wrong_type_is_one_value_error_not_a_silent_head_or_type_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        ViTConfig(**overrides)
