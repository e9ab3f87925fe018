"""The transfer stage's parts that need no cluster: model surgery, optimizer, data decoding, config checks."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch

import vit
from pipelines.image.finetune import default_batch_size, load_config
from pipelines.image.configs import FinetuneConfig
from pipelines.image.labeled_rows import MemoryRows, augment_config, decode_batch, in_holdout, memory_batches
from pipelines.image.finetune_trial import TrialSettings, build_finetune_optimizer
from pipelines.training.starting_weights import fetch_starting_weights, init_kind
from pipelines.training.step import TrainStep, build_scheduler

TINY = dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=4, image_size=16, num_classes=4)


def tiny(**overrides) -> vit.VisionTransformer:
    torch.manual_seed(0)
    return vit.create_model("ViT-Ti/16", **{**TINY, **overrides})


def settings(**overrides) -> TrialSettings:
    fields = dict(model_name="ViT-Ti/16", steps=10, lr=0.1, weight_decay=0.0, batch_size_per_worker=8, image_size=32, num_classes=10)
    fields.update(overrides)
    return TrialSettings(**fields)


# ---------------------------------------------------------------- the model


def test_a_frozen_backbone_trains_only_the_head():
    model = vit.at_resolution(tiny(), 16, 4)
    vit.freeze_backbone(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = settings(image_size=16, num_classes=4, freeze_backbone=True)
    optimizer = build_finetune_optimizer(model, s)
    step = TrainStep(model, optimizer, build_scheduler(optimizer, s), device=torch.device("cpu"), amp_dtype=None)
    step([(torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,)))])
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"head.weight", "head.bias"}


def test_the_default_optimizer_is_sgd_with_momentum_and_decays_matrices_only():
    model = tiny()
    optimizer = build_finetune_optimizer(model, settings(weight_decay=1e-4))
    assert isinstance(optimizer, torch.optim.SGD)
    decayed, plain = optimizer.param_groups
    assert (decayed["momentum"], decayed["weight_decay"], plain["weight_decay"]) == (0.9, 1e-4, 0.0)
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim < 2 for p in plain["params"])
    assert isinstance(build_finetune_optimizer(model, settings(optimizer="adamw")), torch.optim.AdamW)


# ---------------------------------------------------------------- data


def _table(n: int, size: int = 16, patch: int = 4) -> tuple[pa.Table, dict]:
    grid = size // patch
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    from pipelines.image.patches import patchify_batch

    patches = patchify_batch(images, patch)
    table = pa.table({
        "patches": pa.array([p.tobytes() for p in patches], pa.binary()),
        "label": pa.array(np.arange(n) % 3, pa.int64()),
        "key": pa.array([f"img-{i:04d}.png" for i in range(n)]),
    })
    manifest = {"patch_size": patch, "grid": [grid, grid], "num_patches": grid * grid, "patch_dim": patch * patch * 3, "image_size": size}
    return table, manifest


def _kept_keys(table: pa.Table, manifest: dict, keep: str) -> set[str]:
    """Keys of the rows `decode_batch` keeps; the table's labels are row numbers, so they name the rows."""
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(np.arange(len(table)), pa.int64()))
    out = decode_batch(table, manifest=manifest, keep=keep, holdout=0.2, size=16, aug=None)
    keys = table.column("key").to_pylist()
    return {keys[i] for i in out["label"].tolist()}


def test_the_minival_holdout_and_the_train_rows_are_disjoint_and_cover_every_key():
    table, manifest = _table(200)
    train, held = _kept_keys(table, manifest, "train"), _kept_keys(table, manifest, "holdout")
    assert not train & held
    assert train | held == set(table.column("key").to_pylist())
    assert 20 <= len(held) <= 60  # about a fifth


def test_the_minival_holdout_decides_each_key_whatever_the_row_order():
    keys = [f"img-{i:04d}.png" for i in range(200)]
    shuffled = [keys[i] for i in np.random.default_rng(0).permutation(len(keys))]
    in_order = dict(zip(keys, in_holdout(keys, 0.2).tolist()))
    assert dict(zip(shuffled, in_holdout(shuffled, 0.2).tolist())) == in_order
    assert 0 < sum(in_order.values()) < len(keys)  # both sides non-empty, or the comparison says little


def test_rows_are_resized_to_the_trial_resolution_in_the_shared_patch_order():
    table, manifest = _table(4)
    out = decode_batch(table, manifest=manifest, keep="all", holdout=0.0, size=32, aug=None)
    assert out["patches"].shape == (4, 64, 48)
    # A 2x upsampling of a smooth ramp keeps its shape: compare with torch's own bicubic resize of the pixels.
    original = vit.unpatchify(torch.from_numpy(decode_batch(table, manifest=manifest, keep="all", holdout=0.0, size=16, aug=None)["patches"]), 4, (4, 4))
    resized = vit.unpatchify(torch.from_numpy(out["patches"]), 4, (8, 8))
    down = torch.nn.functional.avg_pool2d(resized, 2)
    assert torch.corrcoef(torch.stack([down.flatten(), original.flatten()]))[0, 1] > 0.9


def _memory_rows(n: int) -> MemoryRows:
    table, manifest = _table(n)
    from pipelines.image.data import patches_array

    patches = np.array(patches_array(table.column("patches"), manifest["num_patches"], manifest["patch_dim"]))
    return MemoryRows(patches, np.arange(n), table.column("key").to_pylist(), manifest, 16, None)


def test_in_memory_batches_deal_each_epoch_out_to_the_ranks_without_overlap():
    rows = _memory_rows(40)
    seen = []
    for rank in range(2):
        batches = memory_batches(rows, batch_size=5, rank=rank, world=2, seed=0, epoch=0, skip=0)
        seen.append([int(y) for _ in range(4) for y in next(batches)[2]["label"]])
    assert len(set(seen[0]) | set(seen[1])) == 40  # one epoch: every row once, on one rank
    nxt = memory_batches(rows, batch_size=5, rank=0, world=2, seed=0, epoch=1, skip=0)
    assert [int(y) for _ in range(4) for y in next(nxt)[2]["label"]] != seen[0]  # a new order every epoch


def test_in_memory_batches_resume_from_their_data_position():
    rows = _memory_rows(40)
    full = memory_batches(rows, batch_size=5, rank=0, world=1, seed=3, epoch=2, skip=0)
    expected = [next(full) for _ in range(8)][3:]
    resumed = memory_batches(rows, batch_size=5, rank=0, world=1, seed=3, epoch=2, skip=3)
    for (epoch, position, batch), (e, p, b) in zip(expected, [next(resumed) for _ in range(5)]):
        assert (epoch, position) == (e, p)
        assert torch.equal(batch["label"], b["label"])


def test_in_memory_augmented_crops_are_a_function_of_seed_epoch_and_key():
    rows = _memory_rows(40)
    rows.aug = augment_config(1.0, hflip=True)

    def crops(epoch: int) -> dict[int, torch.Tensor]:
        """Each image's crop in one epoch, by label (the row number): epochs deal the rows in different orders."""
        batches = memory_batches(rows, batch_size=5, rank=0, world=1, seed=7, epoch=epoch, skip=0)
        return {int(y): p for _ in range(8) for _, _, b in [next(batches)] for y, p in zip(b["label"], b["patches"])}

    first, again, later = crops(3), crops(3), crops(4)
    assert all(torch.equal(first[y], again[y]) for y in first)  # a resumed trial sees the same crops
    assert sum(not torch.equal(first[y], later[y]) for y in first) > len(first) // 2  # a new epoch, new crops


def test_augmentation_strength_scales_the_crop_and_zero_turns_it_off():
    assert augment_config(0.0, hflip=True) is None
    full, mild = augment_config(1.0, hflip=False), augment_config(0.2, hflip=True)
    assert full.scale == (0.25, 1.0) and full.flip is False
    assert mild.scale[0] > full.scale[0] and mild.ratio[1] < full.ratio[1]


# ---------------------------------------------------------------- config and starting weights


def test_the_defaults_are_the_papers_fine_tuning_recipe():
    config = load_config({"data": "x", "init": "0" * 32})
    assert (config.optimizer, config.momentum, config.schedule, config.clip_grad_norm) == ("sgd", 0.9, "cosine", 1.0)
    assert config.space.to_tune("grid", {"resolution": 32})["weight_decay"] == 0.0
    assert config.scheduler == "asha" and (config.metric, config.sweep_mode) == ("val_top1", "max")
    assert default_batch_size(100_000) == 512
    assert default_batch_size(1_000) == 128  # a quarter of the data, rounded down to a power of two


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"search_space": {"lr": 0.1, "momentum": 0.9}}, r"finetune config: search_space: unknown parameter 'momentum'"),
        ({"search_space": {"lr": {"uniform": [0.1, 0.01]}}}, r"finetune config: search_space\.lr: empty range"),
        ({"metric": "accuracy"}, r"finetune config: metric: unknown metric 'accuracy'; trials report val_top1"),
        ({"scheduler": "pbt", "search_space": {"lr": 0.1}}, r"scheduler 'pbt' needs at least one of lr"),
        ({"search_space": {"lr": {"loguniform": [1e-3, 1e-1]}}}, r"searcher 'grid' takes constants and grid values only"),
        ({"warmup_steps": 50, "search_space": {"steps": {"grid": [40, 80]}}}, r"warmup_steps \(50\) must be smaller than the fewest steps searched \(40\)"),
        ({"init": None}, r"model: required when training from scratch"),
        ({"batch_size": 30, "num_workers": 4}, r"batch_size 30 is not a multiple of num_workers 4"),
        ({"reduction_factor": 1}, r"finetune config: reduction_factor: Input should be greater than 1"),
        ({"registry_model": "team/vit"}, r"registry_model 'team/vit': a registered model's name cannot contain '/'"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        load_config({"data": "x", "init": "0" * 32, **fields})
    assert "\n" not in str(info.value)


def test_a_drawn_resolution_is_refused_since_only_listed_sizes_can_be_checked_against_the_patch_size():
    with pytest.raises(ValueError, match=r"search_space\.resolution: randint draws sizes that need not be multiples "
                                         r"of the patch size; list the sizes with grid or choice") as info:
        load_config({"data": "x", "init": "0" * 32, "searcher": "random", "search_space": {"resolution": {"randint": [224, 384]}}})
    assert "\n" not in str(info.value)
    for listed in ({"choice": [224, 384]}, {"grid": [224, 384]}, 224):
        load_config({"data": "x", "init": "0" * 32, "searcher": "random", "search_space": {"resolution": listed}})


def test_init_strings_are_classified_without_touching_anything(tmp_path):
    vit.save_checkpoint(tiny(), tmp_path / "ckpt")
    assert init_kind(None) == init_kind("none") == "scratch"
    assert init_kind("runs:/abc/checkpoints/final") == init_kind("a" * 32) == "run"
    assert init_kind("models:/digits/3") == "registry"
    assert init_kind("s3://bucket/ckpt") == init_kind(str(tmp_path / "ckpt")) == "checkpoint"
    assert init_kind("s3a://bucket/ckpt") == init_kind("S3://bucket/ckpt") == "checkpoint"  # as parse_uri reads them
    assert init_kind(str(tmp_path / "vit_base.safetensors")) == "foreign"


def test_a_local_checkpoint_of_another_architecture_is_refused(tmp_path):
    vit.save_checkpoint(tiny(), tmp_path / "ckpt")
    overrides = {k: v for k, v in TINY.items() if k not in ("image_size", "num_classes")}
    with pytest.raises(ValueError, match=r"checkpoint architecture does not match model 'ViT-Ti/16': embed_dim 32 \(checkpoint\) vs 64 \(requested\)"):
        fetch_starting_weights(str(tmp_path / "ckpt"), model_name="ViT-Ti/16", model_overrides={**overrides, "embed_dim": 64},
                               tracking_uri="unused")
    fetched = fetch_starting_weights(str(tmp_path / "ckpt"), model_name="ViT-Ti/16", model_overrides=overrides, tracking_uri="unused")
    assert fetched.kind == "checkpoint" and fetched.source_run_id is None


def test_published_weights_load_into_the_named_architecture_and_need_one(tmp_path):
    from safetensors.torch import save_file

    source = tiny()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "timm.safetensors")
    overrides = {k: v for k, v in TINY.items() if k != "num_classes"}
    with pytest.raises(ValueError, match=r"needs `model` to name its architecture"):
        fetch_starting_weights(str(tmp_path / "timm.safetensors"), model_name=None, model_overrides={}, tracking_uri="unused")
    fetched = fetch_starting_weights(str(tmp_path / "timm.safetensors"), model_name="ViT-Ti/16", model_overrides=overrides, tracking_uri="unused")
    torch.testing.assert_close(fetched.model.pos_embed, source.pos_embed)
    with pytest.raises(ValueError, match=r"does not fit model 'ViT-Ti/16'"):
        fetch_starting_weights(str(tmp_path / "timm.safetensors"), model_name="ViT-Ti/16", model_overrides={**overrides, "depth": 3}, tracking_uri="unused")


def test_from_scratch_needs_an_architecture():
    with pytest.raises(ValueError, match=r"model: required when training from scratch"):
        fetch_starting_weights(None, model_name=None, model_overrides={}, tracking_uri="unused")


def test_config_round_trips_through_yaml(tmp_path):
    import yaml

    config = FinetuneConfig(data="x", init="0" * 32, search_space={"lr": {"grid": [0.1, 0.01]}, "steps": 100})
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert load_config(path) == config


def test_a_from_scratch_start_is_drawn_from_the_seed() -> None:
    tiny = {"depth": 1, "embed_dim": 16, "num_heads": 2, "mlp_dim": 32, "image_size": 16, "patch_size": 4}

    def weights(seed: int) -> dict:
        start = fetch_starting_weights(None, model_name="ViT-Ti/16", model_overrides=tiny, tracking_uri="unused", seed=seed)
        return start.model.state_dict()

    first, again, other = weights(0), weights(0), weights(1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["patch_embed.proj.weight"], other["patch_embed.proj.weight"])


def test_trial_hooks_stop_a_pbt_segment_and_report_the_last_loss():
    from pipelines.image.finetune_trial import TrialHooks
    from pipelines.training.hooks import Window
    from pipelines.training.step import StepStats

    hooks = pickle.loads(pickle.dumps(TrialHooks()))  # Ray Train ships them to every worker
    assert hooks.end_step(settings(steps=10)) == 10 and hooks.end_step(settings(steps=10, stop_at_step=4)) == 4
    stats = StepStats(loss=torch.tensor(0.5), grad_norm=torch.tensor(1.0), lr=0.1)
    report = hooks.report(4, 0, stats, Window(losses=[0.9, 0.7], seconds=1.0), 16, None)
    assert report == {"step": 4, "epoch": 0, "lr": 0.1, "train_loss": 0.7}  # what Tune ranks by, besides val_*
    assert not hooks.keep_best and hooks.checkpoint_at_evaluations_only


@pytest.mark.parametrize("factor, start, clipped", [(1.2, {"aug_strength": 0.9, "lr": 0.09}, {"aug_strength": 1.0, "lr": 0.1}),
                                                    (0.8, {"aug_strength": 0.55, "lr": 1.1e-3}, {"aug_strength": 0.5, "lr": 1e-3})])
def test_pbt_keeps_a_perturbed_value_within_its_searched_range(factor, start, clipped):
    # Tune multiplies by 0.8 or 1.2 whatever the range: aug_strength past 1 makes a crop area below zero.
    from ray.tune.schedulers.pbt import _explore

    from pipelines.image.finetune import build_scheduler as build_tune_scheduler

    config = FinetuneConfig(data="x", init="0" * 32, scheduler="pbt", searcher="random",
                            search_space={"aug_strength": {"uniform": [0.5, 1.0]}, "lr": {"loguniform": [1e-3, 1e-1]}})
    pbt = build_tune_scheduler(config)
    explored, _ = _explore(dict(start), pbt._hyperparam_mutations, resample_probability=0.0,
                           perturbation_factors=(factor,), custom_explore_fn=pbt._custom_explore_fn)
    assert explored == pytest.approx(clipped)
    assert pickle.loads(pickle.dumps(pbt._custom_explore_fn))(dict(start)) == pytest.approx(start)  # Tune saves it
