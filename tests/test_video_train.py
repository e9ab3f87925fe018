"""The video training stage: a VTN on video shards, on Ray Train, evaluated in both of the paper's modes.

The data are generated video shards in the ingest's format (`tests/video_fixtures.py`):
a square crossing 32×32 frames left to right or right to left, so only frame order
tells the classes apart. The backbone stands in for an image-pipeline pretrain run:
a tiny ViT (2 layers, width 32, patch 8) trained in-process to locate the square,
logged as `checkpoints/final` of an MLflow run in a local SQLite store. One stage
execution on two Ray Train workers is shared by the tests that read its run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

import vit
from pipelines.cli import app
from pipelines.core import registry
from pipelines.video.data import ClipSpec, clip_dataset, read_video_manifest, sample_clip_indices
from pipelines.video.eval import ATTENTION_FIGURE, ATTENTION_VALUES, EVAL_TABLE
from pipelines.video.model import build_initial_model
from pipelines.video.train import load_config, run_video_train
from tests.video_fixtures import (
    FRAMES,
    TEMPORAL,
    logged_backbone_run,
    order_matters_videos,
    vtn_train_fields,
    write_video_shards,
)


@pytest.fixture(scope="module")
def video_data(tmp_path_factory) -> str:
    """48 videos of 8 stored 32×32 frames, two classes that differ only in frame order; 60/20/20 split."""
    return order_matters_videos(tmp_path_factory.mktemp("video-data") / "out")


@pytest.fixture(scope="module")
def backbone_run(tmp_path_factory) -> dict[str, str]:
    """A pretrained tiny ViT as an image pretrain run leaves it: `runs:/<id>/checkpoints/final`."""
    return logged_backbone_run(tmp_path_factory.mktemp("video-backbone"), "video-tests")


def stage_config(data: str, backbone_run: dict[str, str], **overrides):
    fields = dict(
        vtn_train_fields(data, backbone_run, "video-tests"), freeze_backbone=True, eval_shuffled=True,
        attention_videos=3, registry_model="video-tests-vtn",
    )
    fields.update(overrides)
    return load_config(fields)


@pytest.fixture(scope="module")
def trained(ray_cluster, video_data, backbone_run):
    """One stage execution: 100 steps on 2 workers, then both eval modes, in order and shuffled."""
    config = stage_config(video_data, backbone_run)
    return config, run_video_train(config)


def client_of(config) -> MlflowClient:
    return MlflowClient(config.tracking_uri)


def artifact_json(client: MlflowClient, run_id: str, path: str, tmp_path: Path) -> dict:
    return json.loads(Path(client.download_artifacts(run_id, path, str(tmp_path))).read_text())


# ---------------------------------------------------------------- the trained run


def test_loss_falls_on_an_order_matters_dataset(trained):
    config, result = trained
    history = sorted(client_of(config).get_metric_history(result.run_id, "train_loss"), key=lambda m: m.step)
    losses = [m.value for m in history]
    assert len(losses) == config.steps  # every step's loss, logged every log_interval steps
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert first > 0.6  # two classes: chance is ln 2 ≈ 0.69
    assert last < first - 0.3, losses


def test_the_same_seeded_config_trains_the_same_run_twice(trained, backbone_run):
    config, result = trained
    again = run_video_train(config.model_copy(update={"run_name": "video-train-again", "registry_model": None}))
    assert again.run_id != result.run_id and not again.reused
    client = client_of(config)
    curves = [[m.value for m in sorted(client.get_metric_history(run, "train_loss"), key=lambda m: m.step)]
              for run in (result.run_id, again.run_id)]
    assert curves[0] == curves[1]
    assert [(r["mode"], r["frame_order"], r["top1"]) for r in again.evaluation] == \
        [(r["mode"], r["frame_order"], r["top1"]) for r in result.evaluation]


def test_full_video_and_multiview_accuracy_are_logged_side_by_side_with_wall_times(trained, tmp_path):
    config, result = trained
    metrics = client_of(config).get_run(result.run_id).data.metrics
    for mode in ("full_video", "multiview"):
        assert 0.0 <= metrics[f"{mode}_top1"] <= 1.0
        assert metrics[f"{mode}_wall_s"] > 0
        assert metrics[f"{mode}_videos_per_s"] > 0
    assert metrics["full_vs_multiview_speedup"] == pytest.approx(metrics["multiview_wall_s"] / metrics["full_video_wall_s"])
    table = artifact_json(client_of(config), result.run_id, EVAL_TABLE, tmp_path)["modes"]
    original = {row["mode"]: row for row in table if row["frame_order"] == "original"}
    assert original["full_video"]["views_per_video"] == 1
    assert original["multiview"]["views_per_video"] == 30  # 10 clips × 3 crops
    test_videos = read_video_manifest(config.data)["counts"]["test"]
    assert original["full_video"]["videos"] == original["multiview"]["videos"] == test_videos


def test_shuffled_frame_evaluation_is_logged_beside_the_ordered_one(trained):
    config, result = trained
    metrics = client_of(config).get_run(result.run_id).data.metrics
    for mode in ("full_video", "multiview"):
        assert 0.0 <= metrics[f"shuffled_{mode}_top1"] <= 1.0
        assert metrics[f"shuffled_{mode}_wall_s"] > 0
    rows = [(row["mode"], row["frame_order"]) for row in result.evaluation]
    assert rows == [("full_video", "original"), ("multiview", "original"),
                    ("full_video", "shuffled"), ("multiview", "shuffled")]


def test_cls_attention_over_frames_is_logged_as_a_picture(trained, tmp_path):
    config, result = trained
    client = client_of(config)
    logged = {a.path for a in client.list_artifacts(result.run_id, "attention")}
    assert ATTENTION_FIGURE in logged
    picture = Path(client.download_artifacts(result.run_id, ATTENTION_FIGURE, str(tmp_path)))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    videos = artifact_json(client, result.run_id, ATTENTION_VALUES, tmp_path)["videos"]
    assert len(videos) == 3
    for video in videos:
        assert video["frames"] == list(range(FRAMES))
        assert all(w >= 0 for w in video["attention"]) and 0 < sum(video["attention"]) <= 1 + 1e-6


def test_video_training_logs_its_learning_curve_as_a_picture(trained, tmp_path):
    config, result = trained
    client = client_of(config)
    picture = Path(client.download_artifacts(result.run_id, "learning_curve.png", str(tmp_path)))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frozen_backbone_from_a_pretrain_run_keeps_the_pretrained_weights(trained, backbone_run):
    config, result = trained
    final = registry.load_model_from_run(result.final_checkpoint, config.tracking_uri)
    pretrained = vit.load_checkpoint(backbone_run["checkpoint"]).state_dict()
    backbone = final.backbone.state_dict()
    assert set(backbone) == {k for k in pretrained if not k.startswith("head.")}
    for name, tensor in backbone.items():
        assert torch.equal(tensor, pretrained[name]), name
    run = client_of(config).get_run(result.run_id)
    assert run.data.tags["vitpipe.backbone_run_id"] == backbone_run["run_id"]


def test_final_model_is_logged_and_registered(trained):
    import mlflow

    config, result = trained
    assert result.model_uri and result.registered_version == "1"
    mlflow.set_tracking_uri(config.tracking_uri)
    model = mlflow.pyfunc.load_model("models:/video-tests-vtn/1")  # safetensors + vit code, no pickle
    video = np.zeros((1, FRAMES, 3, 32, 32), dtype=np.float32)
    assert model.predict(video).shape == (1, 2)


def test_a_finished_run_asked_for_under_another_name_is_registered_there_without_training(trained):
    config, result = trained
    renamed = config.model_copy(update={"registry_model": "video-tests-vtn-renamed"})
    for _ in range(2):  # the second time finds the version the first registered
        again = run_video_train(renamed)
        assert again.reused and again.run_id == result.run_id
    versions = client_of(config).search_model_versions("name = 'video-tests-vtn-renamed'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", result.run_id)]
    assert versions[0].tags["vitpipe.video_train_run_id"] == result.run_id
    assert again.registered_version == "1"


def test_rerunning_a_finished_config_returns_its_run_without_training(trained):
    config, result = trained
    again = run_video_train(config)
    assert again.reused and again.run_id == result.run_id
    assert again.evaluation == result.evaluation


def test_a_finished_run_is_handed_back_without_loading_its_backbone(trained, monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("the starting VTN, and so its backbone's weights, was loaded for a finished run")

    monkeypatch.setattr("pipelines.video.train.build_initial_model", tripwire)
    config, result = trained
    again = run_video_train(config)
    assert again.reused and again.run_id == result.run_id


# ---------------------------------------------------------------- the model the stage builds (no training)


def test_backbone_loaded_from_a_checkpoint_dir_has_its_weights_and_trains_unless_frozen(backbone_run, video_data):
    config = stage_config(video_data, backbone_run, init=backbone_run["checkpoint"], freeze_backbone=False)
    model = build_initial_model(config, 2, backbone_run["tracking_uri"]).model
    pretrained = vit.load_checkpoint(backbone_run["checkpoint"]).state_dict()
    for name, tensor in model.backbone.state_dict().items():
        assert torch.equal(tensor, pretrained[name]), name
    assert all(p.requires_grad for p in model.backbone.parameters())


@pytest.mark.parametrize("choice, kind", [("learned", "learned"), ("fixed", "sincos"), ("none", "none")])
def test_temporal_position_embedding_ablation_switches_the_model(backbone_run, video_data, choice, kind):
    # A window over every frame, so that only the position embedding can tell frames apart by place.
    config = stage_config(video_data, backbone_run, temporal_pos_embed=choice, vtn={**TEMPORAL, "window": 2 * FRAMES + 2})
    model = build_initial_model(config, 2, backbone_run["tracking_uri"]).model.eval()
    assert model.config.temporal_pos_embed == kind
    assert (model.pos_embed is not None) == (kind == "learned")
    video = torch.randn(1, FRAMES, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ordered, shuffled = model(video), model(video[:, torch.randperm(FRAMES, generator=torch.Generator().manual_seed(1))])
    # Without a position embedding (and with a window over all frames) the encoder cannot see frame order.
    # Relative: the tiny head's logits are ~5e-3, and a learned table at init moves them by ~1e-3 of that
    # (an absolute 1e-6 was within 3x of it, and failed once); float noise of the "none" case is ~1e-7 of it.
    assert torch.allclose(ordered, shuffled, rtol=1e-5, atol=0) == (kind == "none")


# ---------------------------------------------------------------- clips and data


def test_training_clips_take_frames_in_order_from_the_stored_frames():
    rng = np.random.default_rng(0)
    segments = sample_clip_indices(250, 16, "segments", rng)
    assert len(segments) == 16 and np.all(np.diff(segments) > 0) and segments[0] < 250 // 16 and segments[-1] < 250
    clip = sample_clip_indices(250, 16, "clip", rng, stride=2)
    assert np.all(np.diff(clip) == 2)
    short = sample_clip_indices(5, 16, "segments", None)  # fewer stored frames than the clip: frames repeat
    assert len(short) == 16 and sorted(set(short.tolist())) == [0, 1, 2, 3, 4]


def seeded_clips(data: str, **kw) -> list[tuple[int, tuple[int, ...], bytes]]:
    spec = ClipSpec(frames=6, size=24, train=True, clips_per_video=2)
    rows = clip_dataset(data, "train", spec, **kw).take_all()
    return sorted((int(r["label"]), tuple(r["frame_positions"].tolist()), r["frames"].tobytes()) for r in rows)


def test_seeded_training_clips_repeat_exactly_and_differ_by_pass_and_seed(ray_cluster, tmp_path):
    # Videos of 12-24 stored 32×32 frames: random frames per segment and random crops to 24 px.
    data = write_video_shards(tmp_path / "out", videos=12, frames=(12, 24), per_shard=4)
    first, both = seeded_clips(data, seed=3), seeded_clips(data, seed=3, epochs=2)
    assert both == seeded_clips(data, seed=3, epochs=2)
    second = sorted(set(both) - set(first))
    assert len(both) == 2 * len(first) and len(second) == len(first)  # a second pass draws clips of its own
    assert seeded_clips(data, seed=4) != first
    assert seeded_clips(data, seed=3, manifest=read_video_manifest(data)) == first  # the caller's manifest, not re-read


def test_data_that_is_not_a_video_ingest_output_is_refused(tmp_path):
    from pipelines.core.errors import VitpipeError

    (tmp_path / "manifest.json").write_text(json.dumps({"format": "vitpipe-patches/1", "classes": ["a"]}))
    (tmp_path / "_SUCCESS").write_text("{}")
    with pytest.raises(VitpipeError, match="not a video dataset"):
        read_video_manifest(str(tmp_path))


# ---------------------------------------------------------------- bad configs


@pytest.mark.parametrize(
    "change, words",
    [
        ({"temporal_pos_embed": "rotary"}, "temporal_pos_embed"),
        ({"train_frames": 0}, "train_frames"),
        ({"init": None, "backbone": None}, "backbone: required when training from scratch"),
        ({"vtn": {"depht": 2}}, "unknown VTN field"),
        ({"vtn": {"num_frames": 8}}, "num_frames is set by the stage"),
        ({"vtn": {"window": 0}}, "window"),
        ({"eval_modes": ["full_video", "two_stream"]}, "eval_modes"),
        ({"warmup_steps": 10, "steps": 10}, "warmup_steps (10) must be smaller than steps (10)"),
        ({"backbone": "ViT-Q/16", "init": None}, "backbone 'ViT-Q/16'"),
        ({"learning_rate": 0.1}, "learning_rate"),
        ({"registry_model": "team/vtn"}, "registry_model 'team/vtn': a registered model's name cannot contain '/'"),
    ],
)
def test_bad_config_is_a_one_line_error(tmp_path, change, words):
    fields = {"data": str(tmp_path), "init": str(tmp_path), "steps": 10, **change}
    with pytest.raises(ValueError) as err:
        load_config(fields)
    message = str(err.value)
    assert message.startswith("video_train config: ") and "\n" not in message
    assert words in message


def test_a_learned_temporal_table_shorter_than_the_stored_videos_is_refused_before_ray_starts(
        video_data, backbone_run, monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("Ray was started for a config that cannot train")

    monkeypatch.setattr("pipelines.video.train.connect", tripwire)
    with pytest.raises(ValueError, match=r"^vtn\.max_frames: the learned temporal table has 4 positions, but .* "
                                         r"stores up to 8 frames a video"):
        base = stage_config(video_data, backbone_run)
        learned = {"vtn": {**base.vtn, "max_frames": 4}, "temporal_pos_embed": "learned"}
        run_video_train(base.model_copy(update=learned))


def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    path = tmp_path / "video.yaml"
    path.write_text(f"data: {tmp_path}\nbackbone: ViT-Ti/16\nsteps: 10\nfreeze_backbone: maybe\n")
    result = CliRunner().invoke(app, ["video-train", str(path)])
    assert result.exit_code == 1
    err = result.stderr.strip()
    assert err.startswith("error: video_train config: freeze_backbone") and "\n" not in err
