"""The video features stage (per-frame backbone features stored as shards) and video training on features alone.

The data are the order-matters video shards of `tests/video_fixtures.py` (a square
crossing 32×32 frames left to right or right to left); the backbone is the tiny ViT
pretrained there to locate the square, logged as an MLflow run's `checkpoints/final`.
One feature extraction and one training run on its output (2 Ray Train
workers) are shared by the tests that read them.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

import vit
from pipelines.cli import app
from pipelines.core import registry, shards
from pipelines.video import shards as video_shards
from pipelines.core.errors import VitpipeError
from pipelines.video.feature_data import (
    FORMAT,
    MULTIVIEW_NOTE,
    FeaturePredictor,
    _feature_clip_batch,
    decode_features,
    read_training_manifest,
)
from pipelines.video.data import ClipSpec, _clip_batch, iter_videos, read_video_manifest
from pipelines.video.features import FrameFeatures, frozen_backbone, load_config, run_video_features
from pipelines.video.eval import frame_views
from pipelines.video.model import build_initial_model
from pipelines.video.train import load_config as load_train_config
from pipelines.video.train import run_video_train
from tests.video_fixtures import (
    CLASSES,
    FRAMES,
    logged_backbone_run,
    order_matters_videos,
    pretrain_position_backbone,
    vtn_train_fields,
)


@pytest.fixture(scope="module")
def video_data(tmp_path_factory) -> str:
    """48 videos of 8 stored 32×32 frames in 3 shards, two classes that differ only in frame order."""
    return order_matters_videos(tmp_path_factory.mktemp("features-data") / "videos")


@pytest.fixture(scope="module")
def backbone_run(tmp_path_factory) -> dict[str, str]:
    """The pretrained tiny ViT as an image pretrain run leaves it: `runs:/<id>/checkpoints/final`."""
    tmp = tmp_path_factory.mktemp("features-backbone")
    return logged_backbone_run(tmp, "features-tests", steps=100)  # enough to locate the square


def features_config(data: str, output: str, backbone_run: dict[str, str], **overrides):
    fields = dict(data=data, output=output, init=backbone_run["init"], tracking_uri=backbone_run["tracking_uri"],
                  precision="fp32", batch_size=16, videos_per_batch=4, num_workers=1)
    return load_config({**fields, **overrides})


@pytest.fixture(scope="module")
def extracted(ray_cluster, video_data, backbone_run):
    """One feature extraction of every stored frame, float32, on the actor pool."""
    output = str(Path(backbone_run["tmp"]) / "features")
    config = features_config(video_data, output, backbone_run)
    return config, run_video_features(config)


def train_config(data: str, backbone_run: dict[str, str], **overrides):
    return load_train_config({**vtn_train_fields(data, backbone_run, "features-tests"), **overrides})


@pytest.fixture(scope="module")
def trained(extracted, backbone_run):
    """One video_train execution on the features output: 100 steps on 2 workers, then both eval modes."""
    config = train_config(extracted[1].output, backbone_run)
    return config, run_video_train(config)


def stored_rows(output: str) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for path in sorted(Path(output, "shards").glob("*.parquet")):
        rows += pq.read_table(path).to_pylist()
    return rows


# ---------------------------------------------------------------- the stored features


def test_stored_features_equal_vtn_frame_features_of_the_prepared_frames(extracted, video_data, backbone_run):
    config, result = extracted
    manifest = result.manifest
    model = build_initial_model(frozen_backbone(config), len(CLASSES), backbone_run["tracking_uri"]).model.eval()
    stored = {row["key"]: decode_features(row) for row in stored_rows(result.output)}
    checked = 0
    for split in shards.SPLITS:
        for video in iter_videos(video_data, split):
            _, square = frame_views(video.frames, manifest["frame_size"])  # what full-video evaluation sees
            with torch.no_grad():
                expected = model.frame_features(square[None])[0].numpy()
            assert stored[video.key].shape == (FRAMES, manifest["feature_dim"])
            np.testing.assert_allclose(stored[video.key], expected, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == len(stored) == 48


def test_every_source_video_appears_exactly_once_with_its_label_key_split_and_frame_indices(extracted, video_data):
    _, result = extracted
    rows = stored_rows(result.output)
    keys = [row["key"] for row in rows]
    assert len(keys) == len(set(keys)) == 48
    by_key = {row["key"]: row for row in rows}
    for split in shards.SPLITS:
        for video in iter_videos(video_data, split):
            row = by_key.pop(video.key)
            assert (row["label"], row["split"], row["num_frames"]) == (video.label, split, len(video.frames))
            assert row["frame_indices"] == video.frame_indices.tolist() and row["fps"] == pytest.approx(video.fps)
    assert not by_key


def test_manifest_names_its_format_backbone_dim_frame_size_and_the_sources_classes_and_counts(extracted, video_data,
                                                                                          backbone_run):
    _, result = extracted
    manifest = json.loads(Path(result.output, "manifest.json").read_text())
    source = read_video_manifest(video_data)
    assert manifest["format"] == FORMAT == "vitpipe-video-features/1"
    assert manifest["backbone"]["init"] == backbone_run["init"]
    assert manifest["backbone"]["run_id"] == backbone_run["run_id"]
    assert manifest["feature_dim"] == 32 and manifest["frame_size"] == 32  # the tiny ViT's width and image size
    assert manifest["classes"] == source["classes"]
    assert {s: manifest["counts"][s] for s in shards.SPLITS} == {s: source["counts"][s] for s in shards.SPLITS}
    assert [s["path"] for s in manifest["shards"]] == [s["path"] for s in source["shards"]]
    assert json.loads(Path(result.output, "_SUCCESS").read_text())["fingerprint"] == manifest["fingerprint"]


def test_rerun_with_the_same_inputs_and_config_does_nothing(extracted):
    config, result = extracted
    files = {p: p.stat().st_mtime_ns for p in Path(result.output).rglob("*") if p.is_file()}
    again = run_video_features(config)
    assert again.skipped and again.shards_written == 0
    assert {p: p.stat().st_mtime_ns for p in Path(result.output).rglob("*") if p.is_file()} == files


def test_an_output_missing_only_its_marker_is_completed_from_the_feature_shards_it_holds(extracted):
    # Every shard there, `_SUCCESS` deleted by hand: the rerun writes the manifest and marker, no shard.
    # A SIGKILL mid-run is tests/test_video_features_kill.py's.
    config, result = extracted
    os.unlink(Path(result.output, "_SUCCESS"))
    resumed = run_video_features(config)
    assert (resumed.skipped, resumed.shards_written, resumed.shards_reused) == (False, 0, 3)
    assert resumed.manifest["content_hash"] == result.manifest["content_hash"]


def source_and_feature_tables(video_data: str, output: str):
    import pyarrow.parquet as pq

    key = shards.shard_key(0)
    return pq.read_table(Path(video_data, key)), pq.read_table(Path(output, key))


def test_the_output_manifest_holds_no_password_of_the_tracking_uri(ray_cluster, video_data, backbone_run, tmp_path):
    # A checkpoint path as init: the tracking URI is only carried, never reached.
    config = features_config(video_data, str(tmp_path / "features"), backbone_run, init=str(backbone_run["checkpoint"]),
                             tracking_uri="http://bob:hunter2@127.0.0.1:9")
    run_video_features(config)
    written = (tmp_path / "features" / shards.MANIFEST).read_text()
    assert "hunter2" not in written and "http://127.0.0.1:9" in written


def test_an_output_holding_a_video_ingest_output_is_refused_and_left_whole(ray_cluster, video_data, backbone_run,
                                                                           tmp_path):
    # A mistyped output (the data's sibling ingest, say): writing there would replace its shards.
    videos = tmp_path / "videos"
    shutil.copytree(video_data, videos)
    before = {p.relative_to(videos): p.read_bytes() for p in videos.rglob("*") if p.is_file()}
    config = features_config(video_data, str(videos), backbone_run, init=str(backbone_run["checkpoint"]))
    with pytest.raises(VitpipeError) as err:
        run_video_features(config)
    assert str(err.value) == (f"{videos}: holds a finished output of another kind (format 'vitpipe-video/1', "
                              "not 'vitpipe-video-features/1'); write to a new folder or to an earlier output of "
                              "this kind")
    assert {p.relative_to(videos): p.read_bytes() for p in videos.rglob("*") if p.is_file()} == before


def test_float16_features_match_float32_within_half_precision(extracted, video_data):
    config, result = extracted
    model = build_initial_model(frozen_backbone(config), len(CLASSES), config.tracking_uri).model
    source, _ = source_and_feature_tables(video_data, result.output)
    half = FrameFeatures([model], 32, 16, False, "float16", 1)(source)  # the actors' UDF, called here
    full = {row["key"]: decode_features(row) for row in stored_rows(result.output)}
    for row in half.to_pylist():
        np.testing.assert_allclose(decode_features(row, "float16"), full[row["key"]], rtol=1e-2, atol=1e-2)


def test_feature_clips_take_the_frames_seeded_frame_clips_take(extracted, video_data):
    _, result = extracted
    source, features = source_and_feature_tables(video_data, result.output)
    spec = ClipSpec(frames=4, size=32, train=True, clips_per_video=2)
    frames = _clip_batch(source.sort_by("key"), spec=spec, seed=5, epoch=1)
    clips = _feature_clip_batch(features, spec=spec, dtype="float32", dim=32, seed=5, epoch=1)
    assert sorted(zip(frames["label"].tolist(), map(tuple, frames["frame_positions"].tolist()))) == \
        sorted(zip(clips["label"].tolist(), map(tuple, clips["frame_positions"].tolist())))
    assert clips["features"].shape == (len(frames["label"]), 4, 32) and clips["features"].dtype == np.float32


def test_both_evaluation_modes_on_features_give_what_the_vtn_gives_on_the_frames(extracted, video_data, backbone_run):
    _, result = extracted
    config = train_config(result.output, backbone_run, train_frames=3, multiview_clips=4, full_video_frames=6)
    model = build_initial_model(config, len(CLASSES), backbone_run["tracking_uri"]).model.eval()
    stored = {row["key"]: decode_features(row) for row in stored_rows(result.output)}
    predict = FeaturePredictor(model, config)
    for video in list(iter_videos(video_data, "test"))[:3]:
        _, square = frame_views(video.frames, 32)
        features = torch.from_numpy(stored[video.key])
        with torch.no_grad():
            torch.testing.assert_close(predict("full_video", features), model.predict_full_video(square, num_frames=6),
                                       rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(predict("multiview", features),
                                       model.predict_multiview(square, clips=4, crops=1, clip_frames=3),
                                       rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- training on features alone


def test_video_train_on_features_trains_the_temporal_encoder(trained):
    config, result = trained
    client = MlflowClient(config.tracking_uri)
    losses = [m.value for m in sorted(client.get_metric_history(result.run_id, "train_loss"), key=lambda m: m.step)]
    assert len(losses) == config.steps
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert first > 0.6  # two classes: chance is ln 2 ≈ 0.69
    assert last < first - 0.3, losses


def test_video_train_on_features_keeps_the_pretrained_backbone_in_a_normal_vtn_checkpoint(trained, backbone_run):
    config, result = trained
    final = registry.load_model_from_run(result.final_checkpoint, config.tracking_uri)
    pretrained = vit.load_checkpoint(backbone_run["checkpoint"]).state_dict()
    for name, tensor in final.backbone.state_dict().items():
        assert torch.equal(tensor, pretrained[name]), name
    assert final.config.freeze_backbone
    with torch.no_grad():  # the model runs on raw video too
        assert final.eval()(torch.zeros(1, FRAMES, 3, 32, 32)).shape == (1, 2)


def test_multiview_on_features_logs_its_clips_times_one_crop(trained):
    _, result = trained
    rows = {row["mode"]: row for row in result.evaluation}
    assert rows["full_video"]["views_per_video"] == 1
    assert rows["multiview"]["views_per_video"] == 10 and rows["multiview"]["note"] == MULTIVIEW_NOTE
    assert rows["full_video"]["videos"] == rows["multiview"]["videos"] > 0


# ---------------------------------------------------------------- bad configs and data


@pytest.mark.parametrize("change, words", [
    ({"batch_size": 0}, "batch_size"),
    ({"precision": "fp8"}, "precision"),
    ({"feature_dtype": "int8"}, "feature_dtype"),
    ({"init": None}, "backbone: required when training from scratch"),
    ({"output": "DATA"}, "output: "),
    ({"output": "ABOVE"}, "holds the data"),  # its stale-shard sweep would delete the data's files
    ({"output": "ftp://host/x"}, "ftp://host/x"),
])
def test_bad_config_is_a_one_line_error_naming_the_field(tmp_path, change, words):
    fields = {"data": str(tmp_path / "data"), "output": str(tmp_path / "out"), "init": str(tmp_path), **change}
    fields["output"] = {"DATA": fields["data"], "ABOVE": str(tmp_path)}.get(fields["output"], fields["output"])
    with pytest.raises(ValueError) as err:
        load_config(fields)
    message = str(err.value)
    assert message.startswith("video_features config: ") and "\n" not in message and words in message


def test_data_that_is_not_a_video_ingest_output_is_a_one_line_error_naming_its_uri(tmp_path, backbone_run):
    (tmp_path / "data").mkdir()
    config = features_config(str(tmp_path / "data"), str(tmp_path / "out"), backbone_run)
    with pytest.raises(VitpipeError) as err:
        run_video_features(config)
    assert str(tmp_path / "data") in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("manifest, words", [
    ({"format": "vitpipe-patches/1", "classes": ["a"]}, "not a video dataset"),
    ({"format": FORMAT, "classes": {}}, "the manifest lists no classes"),
    ({"format": video_shards.FORMAT}, "the manifest lists no classes"),
])
def test_training_data_that_is_neither_videos_nor_features_with_classes_is_a_one_line_error(tmp_path, manifest,
                                                                                         words):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "_SUCCESS").write_text("{}")
    with pytest.raises(VitpipeError) as err:
        read_training_manifest(str(tmp_path))
    assert str(err.value).startswith(f"{tmp_path}: {words}") and "\n" not in str(err.value)


def test_training_on_features_with_a_different_backbone_or_flips_is_refused_in_one_line(extracted, backbone_run,
                                                                                       tmp_path):
    _, result = extracted
    other = pretrain_position_backbone(tmp_path / "other", steps=1, seed=1)
    cases = [({"init": other}, "init: the backbone"), ({"hflip": True}, "hflip:"),
             ({"freeze_backbone": False}, "freeze_backbone:")]
    for change, words in cases:
        with pytest.raises(ValueError) as err:
            run_video_train(train_config(result.output, backbone_run, **change))
        assert str(err.value).startswith(words) and "\n" not in str(err.value)
    assert read_training_manifest(result.output)["format"] == FORMAT


# ---------------------------------------------------------------- the pipeline spec


def test_spec_accepts_a_video_features_stage_and_wires_it_into_video_train(tmp_path):
    from pipelines.spec_file import load_spec

    run = "runs:/" + "a" * 32 + "/checkpoints/final"
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: t
        storage: {{root: {tmp_path}/store}}
        tracking_uri: sqlite:///{tmp_path}/t.db
        stages:
          videos: {{kind: video_ingest, source: corpus, frame_size: 32}}
          feats: {{kind: video_features, inputs: [videos, "{run}"], precision: fp32}}
          vtn: {{kind: video_train, inputs: [feats, "{run}"], steps: 20, freeze_backbone: true}}
        """))
    spec = load_spec(path)
    assert spec.order() == ["videos", "feats", "vtn"]
    feats = spec.config_for("feats", {"videos": {"output": "/data/videos"}})
    assert (feats.data, feats.init, feats.output) == ("/data/videos", run, f"{tmp_path}/store/data/feats")
    vtn = spec.config_for("vtn", {"feats": {"output": feats.output}})
    assert (vtn.data, vtn.init) == (feats.output, run)


def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    path = tmp_path / "features.yaml"
    path.write_text(f"data: {tmp_path}/videos\noutput: {tmp_path}/features\ninit: {tmp_path}\nnum_workers: 0\n")
    result = CliRunner().invoke(app, ["video-features", str(path)])
    assert result.exit_code == 1
    err = result.stderr.strip()
    assert err.startswith("error: video_features config: num_workers") and "\n" not in err
