"""Weights in and out (issue 2 §3): Hugging Face and timm files in, our checkpoints round trip."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import ViTConfig as HFViTConfig
from transformers import ViTForImageClassification, ViTModel

from vit import (
    ViTConfig,
    VisionTransformer,
    create_model,
    load_checkpoint,
    load_pretrained,
    patchify,
    save_checkpoint,
)
from vit.pos_embed import resample_pos_embed
from vit.weights import ARCHS, register_arch

HF_CONFIGS = {
    "p16": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                image_size=32, patch_size=16, num_labels=5),
    "p8-1ch": dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=96,
                   image_size=24, patch_size=8, num_channels=1, num_labels=4),
    "p14": dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=5, intermediate_size=80,
                image_size=28, patch_size=14, num_labels=3),
}


def hf_model(cls=ViTForImageClassification, **config) -> nn.Module:
    """A randomly initialised HF ViT with weights spread wide enough that small mapping errors show."""
    torch.manual_seed(0)
    model = cls(HFViTConfig(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_like(hf_config: HFViTConfig, **overrides) -> VisionTransformer:
    c = hf_config
    config = ViTConfig(image_size=c.image_size, patch_size=c.patch_size, in_channels=c.num_channels,
                       embed_dim=c.hidden_size, depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
                       mlp_dim=c.intermediate_size, num_classes=c.num_labels, layer_norm_eps=c.layer_norm_eps)
    return VisionTransformer(ViTConfig(**{**config.to_dict(), **overrides})).eval()


def images_for(hf: nn.Module, batch: int = 3, size: int | None = None) -> torch.Tensor:
    c = hf.config
    side = size or c.image_size
    return torch.randn(batch, c.num_channels, side, side, generator=torch.Generator().manual_seed(1))


# --- Hugging Face ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hugging_face_weights_give_the_same_logits(name, tmp_path):
    hf = hf_model(**HF_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    ours = ours_like(hf.config)
    load_pretrained(ours, tmp_path)
    x = images_for(hf)
    with torch.no_grad():
        expected = hf(x).logits
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(patchify(x, hf.config.patch_size)), expected, rtol=0, atol=1e-5)


def test_transformers_5_names_in_a_pickle_bin_load_with_weights_only(tmp_path):
    hf = hf_model(**HF_CONFIGS["p16"])
    state = hf.state_dict()
    assert any(".q_proj." in k for k in state)  # the in-memory (new) naming, unlike save_pretrained's
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = ours_like(hf.config)
    load_pretrained(ours, tmp_path)
    x = images_for(hf)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=1e-5)


def test_hugging_face_pooler_becomes_the_tanh_representation_layer(tmp_path):
    hf = hf_model(ViTModel, **HF_CONFIGS["p8-1ch"])
    hf.save_pretrained(tmp_path)
    ours = ours_like(hf.config, num_classes=0, representation_size=hf.config.hidden_size)
    load_pretrained(ours, tmp_path)
    x = images_for(hf)
    with torch.no_grad():
        out = hf(x)
        torch.testing.assert_close(ours.forward_features(x), out.last_hidden_state, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.pooled_features(x), out.pooler_output, rtol=0, atol=1e-5)


def test_attention_weights_equal_hugging_faces(tmp_path):
    hf = hf_model(**HF_CONFIGS["p14"])
    hf.save_pretrained(tmp_path)
    hf.set_attn_implementation("eager")
    ours = ours_like(hf.config)
    load_pretrained(ours, tmp_path)
    x = images_for(hf)
    with torch.no_grad():
        theirs = hf(x, output_attentions=True).attentions
        _, mine = ours(x, return_attention=True)
    assert len(mine) == len(theirs) == 2
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_position_embeddings_are_resized_on_load(tmp_path):
    hf = hf_model(**HF_CONFIGS["p8-1ch"])  # a 3x3 grid
    hf.save_pretrained(tmp_path)
    ours = ours_like(hf.config, image_size=40)  # a 5x5 grid
    load_pretrained(ours, tmp_path)
    expected = resample_pos_embed(hf.vit.embeddings.position_embeddings.detach(), (5, 5))
    torch.testing.assert_close(ours.pos_embed.detach(), expected)
    x = images_for(hf, size=40)
    with torch.no_grad():  # HF's own higher-resolution path interpolates the same way
        torch.testing.assert_close(ours(x), hf(x, interpolate_pos_encoding=True).logits, rtol=0, atol=1e-5)


def test_call_time_resize_matches_hugging_faces_interpolation(tmp_path):
    hf = hf_model(**HF_CONFIGS["p16"])
    hf.save_pretrained(tmp_path)
    ours = ours_like(hf.config)
    load_pretrained(ours, tmp_path)
    x = images_for(hf, size=64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x, interpolate_pos_encoding=True).logits, rtol=0, atol=1e-5)


def test_a_head_of_another_size_is_refused_unless_skipped(tmp_path):
    hf = hf_model(**HF_CONFIGS["p16"])
    hf.save_pretrained(tmp_path)
    ours = ours_like(hf.config, num_classes=7)
    with pytest.raises(ValueError, match=r"head\.weight.*\(5, 32\).*\(7, 32\).*skip_head"):
        load_pretrained(ours, tmp_path)
    ours.replace_head(7)
    load_pretrained(ours, tmp_path, skip_head=True)
    assert torch.count_nonzero(ours.head.weight) == 0
    torch.testing.assert_close(ours.norm.weight.detach(), hf.vit.layernorm.weight.detach())


def _tiny_vit(image_size, **overrides) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(ViTConfig(image_size=image_size, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                       mlp_dim=64, num_classes=3, **overrides))


def _pos_table_with_rows_numbered(model: VisionTransformer) -> torch.Tensor:
    with torch.no_grad():  # distinct, smooth rows: a misplaced row shows
        model.pos_embed.copy_(torch.linspace(-1, 1, model.pos_embed.numel()).view_as(model.pos_embed))
    return model.pos_embed.detach().clone()


def test_a_class_token_checkpoint_on_a_24x40_grid_is_resampled_from_its_config_grid(tmp_path):
    source = _tiny_vit((192, 320))  # 1 + 24*40 = 961 = 31^2 rows: a square guess would misread it
    table = _pos_table_with_rows_numbered(source)
    save_checkpoint(source, tmp_path)
    target = _tiny_vit(224)
    load_pretrained(target, tmp_path)
    want = resample_pos_embed(table, (28, 28), num_prefix_tokens=1, old_grid=(24, 40))
    torch.testing.assert_close(target.pos_embed.detach(), want)


def test_a_table_of_as_many_rows_on_a_transposed_grid_is_resampled_not_copied(tmp_path):
    source = _tiny_vit((192, 320))  # 24x40
    table = _pos_table_with_rows_numbered(source)
    save_checkpoint(source, tmp_path)
    target = _tiny_vit((320, 192))  # 40x24: the same 961 rows
    load_pretrained(target, tmp_path)
    want = resample_pos_embed(table, (40, 24), num_prefix_tokens=1, old_grid=(24, 40))
    torch.testing.assert_close(target.pos_embed.detach(), want)


def test_a_position_table_whose_grid_cannot_be_told_raises_instead_of_guessing(tmp_path):
    source = _tiny_vit((192, 256))  # 1 + 24*32 = 769 rows: neither they nor the 768 past the class token are square
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"cannot tell the grid.*neither 769 rows nor 769 less 1 prefix .*config\.json"):
        load_pretrained(_tiny_vit(224), tmp_path)


def test_a_bare_table_without_a_class_token_row_is_read_as_a_square_grid(tmp_path):
    # timm's no_embed_class models (DeiT III) keep a cls_token but give it no position row.
    source = _tiny_vit(224, pos_embed="learned")
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    state["pos_embed"] = state["pos_embed"][:, 1:].contiguous()  # the 28x28 rows only
    save_file(state, tmp_path / "model.safetensors")
    target = _tiny_vit(112)
    load_pretrained(target, tmp_path)
    want = resample_pos_embed(state["pos_embed"], (14, 14), num_prefix_tokens=0, old_grid=(28, 28))
    torch.testing.assert_close(target.pos_embed.detach()[:, 1:], want)


def test_a_config_json_whose_grid_does_not_fit_the_table_raises(tmp_path):
    hf = hf_model(**HF_CONFIGS["p8-1ch"])  # a 3x3 grid
    hf.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "image_size": 32}))  # says 4x4
    with pytest.raises(ValueError, match=r"pos_embed has 10 rows, but .*config\.json gives a 4x4 grid"):
        load_pretrained(ours_like(hf.config, image_size=40), tmp_path)


# --- timm --------------------------------------------------------------------------------


def to_timm_layout(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """Our weights as timm stores them: conv patch projection, `pre_logits.fc`."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    p, c = model.config.patch_size, model.config.in_channels
    w = sd.pop("patch_embed.proj.weight")
    sd["patch_embed.proj.weight"] = w.reshape(w.shape[0], p, p, c).permute(0, 3, 1, 2).contiguous()
    for leaf in ("weight", "bias"):
        sd[f"pre_logits.fc.{leaf}"] = sd.pop(f"pre_logits.{leaf}")
    return sd


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_timm_layout_weights_load(suffix, tmp_path):
    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_dim=64,
                       num_classes=5, representation_size=16)
    source = VisionTransformer(config).eval()
    path = tmp_path / f"vit{suffix}"
    sd = to_timm_layout(source)
    torch.save({"state_dict": sd}, path) if suffix == ".pth" else save_file(sd, path)
    target = VisionTransformer(config).eval()
    load_pretrained(target, path)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=1e-6)


def test_missing_and_unexpected_keys_are_named_in_one_error(tmp_path):
    model = create_model("ViT-Ti/16", image_size=32, depth=1, num_classes=3)
    sd = dict(model.state_dict())
    del sd["blocks.0.norm2.bias"]
    sd["decoder.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "model.safetensors")
    named = r"missing keys \['blocks\.0\.norm2\.bias'\].*unexpected keys \['decoder\.weight'\]"
    with pytest.raises(ValueError, match=named):
        load_pretrained(model, tmp_path)
    result = load_pretrained(model, tmp_path, strict=False)
    assert result.missing == ["blocks.0.norm2.bias"] and result.unexpected == ["decoder.weight"]


def test_a_missing_path_fails_without_any_download(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(create_model("ViT-Ti/16", image_size=32, depth=1), tmp_path / "google-vit-base")
    with pytest.raises(ValueError, match="no weights file"):
        load_pretrained(create_model("ViT-Ti/16", image_size=32, depth=1), tmp_path)


# --- project checkpoints -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("ViT-Ti/16", dict(image_size=32, depth=2, num_classes=4, pos_embed="learned_2d", representation_size=8)),
        ("ViT-S/8", dict(image_size=16, depth=1, num_classes=0, pool="gap", pos_embed="sincos")),
        ("R50+ViT-B/16", dict(image_size=32, embed_dim=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3,
                              hybrid={"layers": (1, 1, 1), "width": 8})),
        ("ResNet-50", dict(num_classes=3, layers=(1, 1, 1, 1), width=8)),
    ],
)
def test_checkpoints_round_trip_config_and_outputs(name, overrides, tmp_path):
    torch.manual_seed(0)
    model = create_model(name, **overrides).eval()
    save_checkpoint(model, tmp_path / "ckpt")
    restored = load_checkpoint(tmp_path / "ckpt").eval()
    assert type(restored) is type(model) and restored.config == model.config
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(restored(x), model(x), rtol=0, atol=0)


def test_checkpoints_are_safetensors_plus_json_config_with_an_arch(tmp_path):
    model = create_model("ViT-Ti/16", image_size=32, depth=1, num_classes=2)
    save_checkpoint(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["arch"] == "vit" and meta["config"]["embed_dim"] == 192
    assert set(load_file(tmp_path / "model.safetensors")) == set(model.state_dict())


def test_load_checkpoint_refuses_an_unknown_arch(tmp_path):
    save_checkpoint(create_model("ViT-Ti/16", image_size=32, depth=1), tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "arch": "nope"}))
    with pytest.raises(ValueError, match="arch 'nope'"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name, overrides", [("ViT-Ti/16", {}), ("ViT-S/8", dict(pos_embed="sincos", pool="gap"))])
def test_load_checkpoint_returns_the_model_on_map_location(name, overrides, tmp_path):
    save_checkpoint(create_model(name, image_size=32, depth=1, num_classes=2, **overrides), tmp_path)
    model = load_checkpoint(tmp_path, map_location="meta")  # a device other than the CPU, on any machine
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}


def test_load_checkpoint_refuses_a_map_location_that_is_not_a_device(tmp_path):
    save_checkpoint(create_model("ViT-Ti/16", image_size=32, depth=1), tmp_path)
    with pytest.raises(ValueError, match="map_location must name a device.*'gpu0'"):
        load_checkpoint(tmp_path, map_location="gpu0")


@dataclass
class _PairConfig:
    width: int = 3

    def to_dict(self) -> dict:
        return {"width": self.width}


class _Pair(nn.Module):
    def __init__(self, config: _PairConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.width, 2)


def test_other_families_can_register_for_checkpoints(tmp_path):
    register_arch("pair", _PairConfig, _Pair)
    try:
        model = _Pair(_PairConfig(width=5))
        save_checkpoint(model, tmp_path)
        restored = load_checkpoint(tmp_path)
        assert isinstance(restored, _Pair) and torch.equal(restored.fc.weight, model.fc.weight)
    finally:
        ARCHS.pop("pair")


def test_load_checkpoint_names_a_corrupt_weights_file_in_one_value_error(tmp_path):
    save_checkpoint(create_model("ViT-Ti/16", image_size=32, depth=1), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"model\.safetensors.*cannot be read") as err:
        load_checkpoint(tmp_path)
    assert "\n" not in str(err.value)


def test_load_checkpoint_names_weights_that_do_not_fit_the_config_in_one_value_error(tmp_path):
    save_checkpoint(create_model("ViT-Ti/16", image_size=32, depth=1), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["extra"] = torch.zeros(1)
    del state["norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"do not fit.*norm\.weight.*extra") as err:
        load_checkpoint(tmp_path)
    assert "\n" not in str(err.value)



def test_load_checkpoint_refuses_an_arch_that_is_not_a_string(tmp_path):
    save_checkpoint(create_model("ViT-Ti/16", image_size=32, depth=1), tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "arch": ["vit"]}))
    with pytest.raises(ValueError, match=r"arch \['vit'\]"):
        load_checkpoint(tmp_path)


def test_a_torch_compile_wrapped_model_saves_the_checkpoint_of_the_model_it_wraps(tmp_path):
    model = create_model("ViT-Ti/16", image_size=32, depth=1, num_classes=2).eval()
    save_checkpoint(torch.compile(model), tmp_path)  # saving runs no forward, so nothing is compiled
    restored = load_checkpoint(tmp_path).eval()
    assert set(load_file(tmp_path / "model.safetensors")) == set(model.state_dict())
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(restored(x), model(x), rtol=0, atol=0)
