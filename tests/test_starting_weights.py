"""What a stage knows of its starting weights before it loads them: their origin and their config.

`starting_origin` names weights that no MLflow run names by their files' content, unread by torch. A stage's
identity holds that digest, so a checkpoint folder or a weights file replaced in place is never taken for the
one a finished run started from, and the same bytes elsewhere still count as the same start.
`starting_config` reads a checkpoint's config.json alone, so a finished run is found without the weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import vit
from pipelines.core.storage import S3Settings, open_store
from pipelines.training.starting_weights import fetch_starting_weights, starting_config, starting_origin

TINY = dict(depth=1, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=4, image_size=16, num_classes=3)
NO_TRACKING = "file:///nonexistent"  # never asked: these inits name no run


def tiny(seed: int) -> vit.VisionTransformer:
    torch.manual_seed(seed)
    return vit.create_model("ViT-Ti/16", **TINY)


def checkpoint(directory: Path, seed: int) -> str:
    return str(vit.save_checkpoint(tiny(seed), directory))


def test_a_local_checkpoint_replaced_in_place_gets_another_digest(tmp_path):
    path = checkpoint(tmp_path / "ckpt", seed=0)
    before = starting_origin(path, NO_TRACKING)
    checkpoint(tmp_path / "ckpt", seed=1)
    after = starting_origin(path, NO_TRACKING)
    assert before.kind == after.kind == "checkpoint" and before.run_id is None
    assert before.content and after.content and before.content != after.content


def test_the_same_checkpoint_bytes_in_another_folder_get_the_same_digest(tmp_path):
    path = checkpoint(tmp_path / "a", seed=0)
    copy = shutil.copytree(path, tmp_path / "b")
    assert starting_origin(path, NO_TRACKING).content == starting_origin(str(copy), NO_TRACKING).content


def test_a_published_weights_file_is_named_by_its_bytes(tmp_path):
    weights = tmp_path / "vit.pth"
    torch.save(tiny(0).state_dict(), weights)
    before = starting_origin(str(weights), NO_TRACKING)
    torch.save(tiny(1).state_dict(), weights)
    after = starting_origin(str(weights), NO_TRACKING)
    assert before.kind == "foreign" and before.content != after.content


def test_a_config_beside_published_weights_is_part_of_their_digest(tmp_path):
    """The `config.json` beside the weights decides their token grid when they are loaded."""
    torch.save(tiny(0).state_dict(), tmp_path / "vit.pth")
    before = starting_origin(str(tmp_path / "vit.pth"), NO_TRACKING).content
    (tmp_path / "config.json").write_text('{"image_size": 32, "patch_size": 8}')
    assert starting_origin(str(tmp_path / "vit.pth"), NO_TRACKING).content != before


def test_a_missing_weights_path_is_one_line_before_anything_is_loaded(tmp_path):
    with pytest.raises(ValueError, match=r"^init .*nowhere\.pth: no such file or directory") as err:
        starting_origin(str(tmp_path / "nowhere.pth"), NO_TRACKING)
    assert "\n" not in str(err.value)


def test_the_fetched_weights_carry_the_digest_their_origin_gave(tmp_path):
    path = checkpoint(tmp_path / "ckpt", seed=0)
    start = fetch_starting_weights(path, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING)
    assert start.origin == starting_origin(path, NO_TRACKING) and start.source_run_id is None


def _upload(store, directory: str) -> None:
    for name in ("config.json", "model.safetensors"):
        store.write(name, Path(directory, name).read_bytes())


def test_an_s3_checkpoint_overwritten_in_place_gets_another_digest(tmp_path, s3_env, s3_bucket):
    uri, endpoint = f"s3://{s3_bucket}/ckpt", s3_env.endpoint_url
    store = open_store(uri, S3Settings(endpoint))
    _upload(store, checkpoint(tmp_path / "a", seed=0))
    before = starting_origin(uri, NO_TRACKING, endpoint)
    assert starting_origin(uri, NO_TRACKING, endpoint) == before  # read from a listing: stable
    _upload(store, checkpoint(tmp_path / "b", seed=1))
    after = starting_origin(uri, NO_TRACKING, endpoint)
    assert before.kind == "checkpoint" and before.content != after.content


def test_an_s3_folder_without_weights_is_refused_before_they_are_fetched(tmp_path, s3_env, s3_bucket):
    uri = f"s3://{s3_bucket}/half"
    open_store(uri, S3Settings(s3_env.endpoint_url)).write("config.json", b"{}")
    with pytest.raises(ValueError, match=r"^init s3://.*/half: not a vit checkpoint \(no model.safetensors\)$"):
        starting_origin(uri, NO_TRACKING, s3_env.endpoint_url)


def test_a_known_origin_is_used_as_given_and_not_worked_out_again(tmp_path):
    """A stage that looked for a finished run already has the origin: the weights' files are digested once."""
    path = checkpoint(tmp_path / "ckpt", seed=0)
    origin = starting_origin(path, NO_TRACKING)
    start = fetch_starting_weights(path, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING, origin=origin)
    assert start.origin is origin



def test_a_checkpoints_config_is_read_without_its_weights(tmp_path):
    path = checkpoint(tmp_path / "ckpt", seed=0)
    Path(path, "model.safetensors").write_bytes(b"not weights")  # any read of the weights would fail
    config = starting_config(path, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING)
    assert config == tiny(0).config


def test_a_fresh_models_config_is_that_of_the_named_architecture():
    config = starting_config(None, model_name="ViT-Ti/16", model_overrides=TINY, tracking_uri=NO_TRACKING)
    assert config == vit.create_model("ViT-Ti/16", **TINY).config


def test_a_checkpoint_of_another_architecture_is_refused_from_its_config(tmp_path):
    path = str(vit.save_checkpoint(vit.create_model("ResNet-50", num_classes=3), tmp_path / "resnet"))
    with pytest.raises(ValueError, match=r"^init .*resnet: holds a ResNet, not a ViT$"):
        starting_config(path, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING)


def test_a_checkpoint_replaced_after_its_origin_was_taken_is_refused_when_fetched(tmp_path):
    """Its run's identity would name the old bytes while it trained from the new ones."""
    path = checkpoint(tmp_path / "ckpt", seed=0)
    origin = starting_origin(path, NO_TRACKING)
    checkpoint(tmp_path / "ckpt", seed=1)
    with pytest.raises(ValueError, match=r"^init .*ckpt: its files changed while they were read; run again$"):
        fetch_starting_weights(path, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING, origin=origin)


def test_published_weights_replaced_after_their_origin_was_taken_are_refused_when_fetched(tmp_path):
    weights = tmp_path / "vit.pth"
    torch.save(tiny(0).state_dict(), weights)
    origin = starting_origin(str(weights), NO_TRACKING)
    torch.save(tiny(1).state_dict(), weights)
    with pytest.raises(ValueError, match=r"changed while they were read"):
        fetch_starting_weights(str(weights), model_name="ViT-Ti/16", model_overrides=TINY, tracking_uri=NO_TRACKING,
                               origin=origin)


def test_an_s3_checkpoint_overwritten_after_its_origin_was_taken_is_refused_when_fetched(tmp_path, s3_env, s3_bucket):
    uri, endpoint = f"s3://{s3_bucket}/ckpt", s3_env.endpoint_url
    store = open_store(uri, S3Settings(endpoint))
    _upload(store, checkpoint(tmp_path / "a", seed=0))
    origin = starting_origin(uri, NO_TRACKING, endpoint)
    _upload(store, checkpoint(tmp_path / "b", seed=1))
    with pytest.raises(ValueError, match=r"changed while they were read"):
        fetch_starting_weights(uri, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING,
                               endpoint_url=endpoint, origin=origin)


@pytest.mark.parametrize("init", ["runs:/", "runs://checkpoints/final"])
def test_a_runs_uri_without_a_run_id_is_one_line_before_mlflow_is_asked(init):
    with pytest.raises(ValueError) as err:
        starting_origin(init, NO_TRACKING)
    assert str(err.value) == f"init {init}: expected runs:/<run id>/<artifact path>"


def _unfit(path: Path, state: dict) -> str:
    """The one line fetching `state`, saved at `path` as published weights for a 1-block ViT-Ti, is refused with."""
    torch.save(state, path)
    with pytest.raises(ValueError) as err:
        fetch_starting_weights(str(path), model_name="ViT-Ti/16", model_overrides=TINY, tracking_uri=NO_TRACKING)
    return str(err.value)


def test_a_video_models_weights_given_as_published_weights_are_counted_not_dumped(tmp_path):
    """A VTN's state dict shares two names with a ViT's; the rest are counted and the first few named."""
    from vit.vtn import VTN, VTNConfig

    vtn = VTN(VTNConfig(backbone="ViT-Ti/16", backbone_overrides={**TINY, "num_classes": 0}, num_classes=3,
                        num_frames=4, depth=1, num_heads=2))
    path = tmp_path / "vtn.pth"
    assert _unfit(path, vtn.state_dict()) == (
        f"init {path}: does not fit model 'ViT-Ti/16': cannot load {path} into VisionTransformer: 17 of its 18 "
        "tensors missing, 43 of the file's 44 unexpected: missing keys ['blocks.0.attn.proj.bias', "
        "'blocks.0.attn.proj.weight', 'blocks.0.attn.qkv.bias'] and 14 more, unexpected keys "
        "['backbone.blocks.0.attn.proj.bias', 'backbone.blocks.0.attn.proj.weight', 'backbone.blocks.0.attn.qkv.bias'] "
        "and 40 more")


def test_published_weights_of_another_width_name_three_shapes_and_count_the_rest(tmp_path):
    path = tmp_path / "wide.pth"
    wide = vit.create_model("ViT-Ti/16", **{**TINY, "embed_dim": 64, "mlp_dim": 128})
    assert _unfit(path, wide.state_dict()) == (
        f"init {path}: does not fit model 'ViT-Ti/16': shape mismatch loading {path}: cls_token: file (1, 1, 64) vs "
        "model (1, 1, 32); pos_embed: file (1, 17, 64) vs model (1, 17, 32); patch_embed.proj.weight: file (64, 48) "
        "vs model (32, 48); and 15 more")


def test_a_weights_file_that_holds_no_tensors_says_so(tmp_path):
    path = tmp_path / "optimizer.pt"
    assert _unfit(path, {"optimizer": {"state": {}, "param_groups": []}, "step": 3}) == (
        f"init {path}: does not fit model 'ViT-Ti/16': {path} holds no tensors")


def test_a_checkpoint_folder_whose_config_is_not_a_vits_names_the_file_not_a_temporary_folder(tmp_path):
    path = checkpoint(tmp_path / "ckpt", seed=0)
    Path(path, "config.json").write_text('{"arch": "vit", "config": {"width": 3}}')
    with pytest.raises(ValueError) as err:
        fetch_starting_weights(path, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING)
    assert str(err.value) == (f"init {path}: not a loadable vit checkpoint (config.json + model.safetensors): "
                              "config.json does not fit ViTConfig: ViTConfig.__init__() got an unexpected keyword "
                              "argument 'width'")


def test_a_checkpoint_folder_whose_weights_are_not_safetensors_names_the_file(tmp_path):
    path = checkpoint(tmp_path / "ckpt", seed=0)
    Path(path, "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError) as err:
        fetch_starting_weights(path, model_name=None, model_overrides={}, tracking_uri=NO_TRACKING)
    assert str(err.value) == (f"init {path}: not a loadable vit checkpoint (config.json + model.safetensors): "
                              "model.safetensors cannot be read as safetensors: Error while deserializing header: "
                              "header too large")
