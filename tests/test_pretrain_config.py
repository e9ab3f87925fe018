"""Pretrain stage config: validation, defaults, and the model checked against the data (no Ray)."""

from __future__ import annotations

import json
import pickle

import pytest

from pipelines.core import shards
from pipelines.core.stage_config import load_stage_config
from pipelines.image.pretrain import load_config, loop_settings, model_overrides, run_identity, run_pretrain
from pipelines.image.configs import PretrainConfig
from pipelines.training.trainer import build_trainer

TINY = dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64)
MANIFEST = {
    "image_size": 16, "patch_size": 4, "num_patches": 16, "patch_dim": 48,
    "classes": {"a": 0, "b": 1, "c": 2}, "num_classes": 3, "counts": {"train": 10, "val": 2}, "content_hash": "sha256:abc",
}


def config(**kw) -> PretrainConfig:
    return load_config({"data": "/data", "steps": 10, "warmup_steps": 1, "model": "ViT-Ti/16", "model_overrides": TINY, **kw})


def test_global_batch_must_be_a_multiple_of_the_per_step_batch():
    with pytest.raises(ValueError, match="global_batch_size 100 is not a multiple of num_workers × batch_size_per_worker = 32"):
        config(num_workers=2, batch_size_per_worker=16, global_batch_size=100)


def test_global_batch_beyond_one_step_is_reached_by_accumulation():
    assert config(num_workers=2, batch_size_per_worker=16, global_batch_size=128).grad_accum_steps == 4
    assert config(num_workers=2, batch_size_per_worker=16).grad_accum_steps == 1


def test_data_passes_cover_every_step_of_the_run():
    c = config(num_workers=2, batch_size_per_worker=16, global_batch_size=64, steps=10)  # 640 rows in all
    assert c.global_batch == 64
    assert [c.passes_over(rows) for rows in (640, 639, 100, 10_000, None)] == [1, 2, 7, 1, 1]


def test_defaults_follow_the_papers_pretraining_recipe():
    c = load_config({"data": "/data", "steps": 20_000})
    assert (c.model, c.betas, c.weight_decay, c.clip_grad_norm) == ("ViT-B/16", (0.9, 0.999), 0.1, 1.0)
    assert (c.warmup_steps, c.schedule, c.precision, c.label_smoothing) == (10_000, "linear", "auto", 0.0)


def test_bad_config_is_one_line_naming_the_field():
    with pytest.raises(ValueError) as err:
        config(warmup_steps=10)
    assert "\n" not in str(err.value)
    assert str(err.value) == "pretrain config: warmup_steps (10) must be smaller than steps (10)"
    with pytest.raises(ValueError, match=r"^pretrain config: precision: "):
        config(precision="fp8")
    with pytest.raises(ValueError, match=r"^pretrain config: num_workrs: "):
        config(num_workrs=2)


def test_a_value_outside_a_fixed_set_is_named_with_the_closest_choice():
    with pytest.raises(ValueError) as err:
        config(objective="mea")
    assert str(err.value) == ("pretrain config: objective: Input should be 'supervised' or 'mae'; "
                              "got 'mea' (did you mean 'mae'?)")
    with pytest.raises(ValueError, match=r"^pretrain config: precision: .*; got 'fp8'$"):
        config(precision="fp8")  # nothing close: no guess


def test_config_file_and_overrides_load(tmp_path):
    path = tmp_path / "pretrain.yaml"
    path.write_text("data: s3://bucket/ingested\nsteps: 50\nwarmup_steps: 5\nlr: 0.0005\n")
    c = load_config(path, steps=60)
    assert (c.data, c.steps, c.lr) == ("s3://bucket/ingested", 60, 0.0005)


def test_a_dotted_override_sets_one_key_of_a_mapping_field_and_keeps_the_others(tmp_path):
    path = tmp_path / "pretrain.yaml"
    path.write_text("data: /d\nsteps: 50\nwarmup_steps: 5\nmodel_overrides: {depth: 2, hidden_size: 64}\n")
    c = load_stage_config(PretrainConfig, "pretrain", path, {"model_overrides.depth": 3})
    assert c.model_overrides == {"depth": 3, "hidden_size": 64}


def test_a_dotted_override_through_a_plain_field_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^pretrain config: --set steps.x: 'steps' is not a mapping$"):
        load_stage_config(PretrainConfig, "pretrain", {"data": "/d", "steps": 50, "warmup_steps": 5}, {"steps.x": 1})


def test_a_field_written_twice_in_a_config_file_is_refused_naming_its_line(tmp_path):
    # YAML keeps the last of two equal keys: the first `steps` would be dropped without a word.
    path = tmp_path / "pretrain.yaml"
    path.write_text("data: /d\nsteps: 5000\nwarmup_steps: 5\nsteps: 50\n")
    with pytest.raises(ValueError, match=r"^pretrain config .*pretrain.yaml: YAML syntax error at line 4, column 1: "
                                         r"key 'steps' appears twice in one mapping$"):
        load_config(path)


def test_missing_config_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_plain_vit_takes_image_size_patch_size_and_classes_from_the_data():
    out = model_overrides(config(), MANIFEST)
    assert (out["image_size"], out["patch_size"], out["num_classes"]) == (16, 4, 3)


def test_user_class_count_wins_over_the_data():
    assert model_overrides(config(model_overrides={**TINY, "num_classes": 7}), MANIFEST)["num_classes"] == 7


def test_the_class_count_reaches_the_largest_label_when_labels_skip_ids():
    # Integer labels keep their ids; a manifest written before that counted the names (2 here).
    manifest = {**MANIFEST, "classes": {"3": 3, "4": 4}, "num_classes": 2}
    assert model_overrides(config(), manifest)["num_classes"] == 5


def test_patch_size_that_contradicts_the_data_is_refused():
    with pytest.raises(ValueError, match=r"model_overrides.patch_size=8 does not match the ingest manifest \(4\)"):
        model_overrides(config(model_overrides={**TINY, "patch_size": 8}), MANIFEST)


def test_hybrid_keeps_its_stem_patch_size_and_must_read_the_stored_patches():
    hybrid = {"hybrid": {"layers": [1], "width": 8}, "patch_size": 1, **TINY}  # stem stride 4: 4-pixel patches
    out = model_overrides(config(model="R50+ViT-B/16", model_overrides=hybrid), MANIFEST)
    assert out["patch_size"] == 1 and out["image_size"] == 16
    wrong = {**hybrid, "hybrid": {"layers": [1, 1], "width": 8}}  # stride 8: 8-pixel patches, a 2×2 grid
    with pytest.raises(ValueError, match="reads 4 patches of length 192, but the data holds 16 patches of length 48"):
        model_overrides(config(model="R50+ViT-B/16", model_overrides=wrong), MANIFEST)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model"):
        model_overrides(config(model="NotAModel"), MANIFEST)


def test_run_identity_ignores_where_it_is_recorded_but_sees_data_and_recipe():
    base = run_identity(config(), MANIFEST)
    assert run_identity(config(tracking_uri="http://x", experiment="e", parent_run_id="p", max_failures=5), MANIFEST) == base
    assert run_identity(config(lr=0.5), MANIFEST) != base
    assert run_identity(config(), {**MANIFEST, "content_hash": "sha256:other"}) != base


def test_run_identity_ignores_how_fast_it_runs_and_how_many_checkpoints_it_keeps():
    # A run interrupted and restarted with other threads resumes: it is the same run.
    assert run_identity(config(torch_threads=3, keep_last=9), MANIFEST) == run_identity(config(), MANIFEST)


def test_fields_left_out_of_the_identity_later_stay_in_it_at_their_old_defaults():
    # Runs recorded while torch_threads and keep_last counted keep their identity, so they are still reused.
    identity = run_identity(config(torch_threads=3, keep_last=9), MANIFEST)
    assert (identity["torch_threads"], identity["keep_last"]) == (None, 2)


def test_worker_settings_carry_no_endpoint_or_credentials():
    c = config(storage="s3://bucket/runs", endpoint_url="http://127.0.0.1:9000")
    settings = loop_settings(c, model_overrides(c, MANIFEST), has_val=True, run_id="r", tracking_uri="sqlite:///m.db")
    dumped = json.dumps(settings.model_dump(mode="json"))
    assert "127.0.0.1:9000" not in dumped and "s3://" not in dumped
    assert settings.torch_threads == 1  # one CPU per worker by default


def test_a_tracking_password_reaches_the_workers_but_not_rays_exported_run_settings(tmp_path):
    from ray.train.v2._internal.state.schema import RunSettings

    c = config()
    uri = "http://bob:hunter2@mlflow.example:5000"
    settings = loop_settings(c, model_overrides(c, MANIFEST), has_val=True, run_id="r", tracking_uri=uri)
    trainer = build_trainer(settings.model_dump(mode="json"), run_name="r", location=(str(tmp_path), None),
                            workers=c, max_failures=0, keep=1, datasets={})
    loop_config = trainer.train_loop_config
    # What Ray's state API shows of a run's loop config (RunSettings' own validator), and what a worker unpickles.
    shown = RunSettings._sanitize_train_loop_config(loop_config)
    assert "hunter2" not in json.dumps(shown)
    assert pickle.loads(pickle.dumps(loop_config))["tracking_uri"].value == uri


def test_worker_settings_take_every_shared_recipe_field_and_the_stages_own():
    c = config(warmup_steps=3, schedule="cosine", lr=0.5, min_lr=0.1, weight_decay=0.2, betas=(0.8, 0.9),
               clip_grad_norm=2.0, label_smoothing=0.1, precision="fp32", num_workers=2, batch_size_per_worker=4,
               global_batch_size=16, eval_interval=7, checkpoint_interval=9, log_interval=3, shuffle_buffer=5,
               torch_threads=2, seed=11, eval_batch_size=6)
    settings = loop_settings(c, model_overrides(c, MANIFEST), has_val=False, run_id=None, tracking_uri=None,
                             train_rows=40)
    shared = ("steps", "warmup_steps", "schedule", "lr", "min_lr", "weight_decay", "betas", "clip_grad_norm",
              "label_smoothing", "precision", "batch_size_per_worker", "grad_accum_steps", "eval_interval",
              "checkpoint_interval", "log_interval", "shuffle_buffer", "torch_threads", "seed", "eval_batch_size")
    assert {name: getattr(settings, name) for name in shared} == {name: getattr(c, name) for name in shared}
    assert settings.grad_accum_steps == 2
    assert (settings.model_name, settings.train_rows, settings.val_dataset) == ("ViT-Ti/16", 40, None)


def test_stage_refuses_a_model_that_cannot_read_the_data_before_starting_anything(tmp_path):
    data = tmp_path / "ingested"
    data.mkdir()
    (data / shards.MANIFEST).write_text(json.dumps(MANIFEST))
    (data / shards.SUCCESS).write_text("{}")
    bad = config(data=str(data), model_overrides={**TINY, "image_size": 32}, tracking_uri=f"sqlite:///{tmp_path}/m.db")
    with pytest.raises(ValueError, match=r"model_overrides.image_size=32 does not match the ingest manifest \(16\)"):
        run_pretrain(bad)
    assert not (tmp_path / "m.db").exists()  # no MLflow run was opened


def test_stage_refuses_data_that_is_not_a_finished_ingest_output(tmp_path):
    from pipelines.core.errors import VitpipeError

    with pytest.raises(VitpipeError, match="not a finished ingest output"):
        run_pretrain(config(data=str(tmp_path)))
