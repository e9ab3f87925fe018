"""The video ingest stage on real video files: a local folder and the loopback S3 server.

Good videos come from the generated corpus (MP4/H.264) plus one each in WebM
(VP9), AVI (MPEG-4 part 2) and MKV (H.264), made in `tests/video_ingest_files.py`;
bad input is in `tests/test_video_ingest_rejects.py`.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipelines.core import shards
from pipelines.core.errors import VitpipeError
from pipelines.corpora.videos import class_specs
from pipelines.video import shards as video_shards
from pipelines.video.data import read_video_manifest
from pipelines.video.ingest import run_video_ingest
from pipelines.video.configs import VideoIngestConfig
from pipelines.video.decode import clip_indices, full_indices
from tests.process_output import result_json
from tests.shard_output import assert_completing_writes_only_the_missing_shard, mtimes
from tests.video_ingest_files import (  # noqa: F401
    CLASSES, FRAME_SIZE, MAX_FRAMES, OTHER_CONTAINERS, VIDEOS, config, corpus, read_rows,
)


def resized(frames: np.ndarray, size: int) -> np.ndarray:
    return np.stack([np.asarray(Image.fromarray(f).resize((size, size), Image.Resampling.BOX)) for f in frames])


@pytest.fixture(scope="module")
def ingested(ray_cluster, corpus, tmp_path_factory):
    return run_video_ingest(config(corpus[0], tmp_path_factory.mktemp("video-ingest") / "out"))


# ---------------------------------------------------------------- contents


def test_every_good_video_appears_exactly_once_with_its_class_label(corpus, ingested):
    _, expected = corpus
    rows = read_rows(ingested.output)
    assert sorted(rows) == sorted(expected)
    classes = ingested.manifest["classes"]
    assert classes == {s.name: s.label for s in class_specs(CLASSES)}
    assert all(row["label"] == classes[key.split("/")[0]] for key, row in rows.items())


def test_shards_have_the_video_shard_schema(ingested):
    for entry in ingested.manifest["shards"]:
        table = pq.read_table(Path(ingested.output, entry["path"]))
        assert table.schema.remove_metadata() == video_shards.SCHEMA
        assert table.column_names == list(video_shards.COLUMNS)


def test_decoded_rows_are_frame_arrays_of_the_recorded_shape(ingested):
    for row in read_rows(ingested.output).values():
        frames = row["frames"]
        assert frames.dtype == np.uint8 and frames.flags["C_CONTIGUOUS"]
        assert frames.shape == (row["num_frames"], FRAME_SIZE, FRAME_SIZE, 3) == (len(row["frame_indices"]), row["height"], row["width"], 3)


def test_full_sampling_spreads_the_frames_over_the_whole_video(corpus, ingested):
    _, expected = corpus
    for key, row in read_rows(ingested.output).items():
        total = len(expected[key][0])
        assert np.array_equal(row["frame_indices"], full_indices(total, MAX_FRAMES)), key


def test_variable_lengths_keep_short_videos_whole_and_thin_out_long_ones(corpus, ingested):
    _, expected = corpus
    rows = read_rows(ingested.output)
    totals = {key: len(frames) for key, (frames, _) in expected.items()}
    assert min(totals.values()) < MAX_FRAMES < max(totals.values())  # the corpus has both kinds
    for key, row in rows.items():
        assert row["num_frames"] == min(totals[key], MAX_FRAMES)


def test_stored_frames_are_the_source_frames_resized(corpus, ingested):
    _, expected = corpus
    for key, row in read_rows(ingested.output).items():
        source = resized(expected[key][0][row["frame_indices"]], FRAME_SIZE)
        error = np.abs(row["frames"].astype(int) - source).mean()
        assert error < 6, (key, error)
        shuffled = np.abs(row["frames"][::-1].astype(int) - source).mean()
        assert shuffled > error, key  # the frames are in the recorded order


def test_each_video_keeps_its_own_frame_rate(corpus, ingested):
    _, expected = corpus
    rows = read_rows(ingested.output)
    assert all(row["fps"] == pytest.approx(expected[key][1], rel=0.02) for key, row in rows.items())
    assert len({row["fps"] for row in rows.values()}) > 1


def test_webm_avi_and_mkv_are_ingested_like_mp4(ingested):
    rows = read_rows(ingested.output)
    for ext in OTHER_CONTAINERS:
        (key,) = [k for k in rows if k.endswith(f".{ext}")]
        assert rows[key]["num_frames"] > 0


def test_manifest_describes_format_sampling_classes_and_counts(ingested):
    m = json.loads(Path(ingested.output, shards.MANIFEST).read_text())
    assert m["format"] == video_shards.FORMAT == "vitpipe-video/1"
    assert (m["frame_size"], m["height"], m["width"], m["channels"]) == (FRAME_SIZE, FRAME_SIZE, FRAME_SIZE, 3)
    assert m["sampling"] == {"mode": "full", "max_frames": MAX_FRAMES}
    counts = m["counts"]
    total = VIDEOS + len(OTHER_CONTAINERS)
    assert counts["videos"] == total and counts["rejected"] == 0 and m["rejected"] == []
    assert counts["train"] + counts["val"] + counts["test"] == total
    assert sum(counts["classes"].values()) == total
    rows = read_rows(ingested.output)
    assert counts["frames"] == sum(r["num_frames"] for r in rows.values())
    assert m["stats"]["fps"][0] < m["stats"]["fps"][1]
    for split in shards.SPLITS:
        for name, n in counts["split_classes"][split].items():
            assert n == sum(r["split"] == split and r["key"].startswith(name + "/") for r in rows.values())


def test_content_hash_is_recomputable_from_the_shards(ingested):
    m = ingested.manifest
    hashes = [video_shards.table_hash(pq.read_table(Path(ingested.output, s["path"]))) for s in m["shards"]]
    assert m["content_hash"] == video_shards.content_hash(m["frame_size"], m["sampling"], m["classes"], hashes)


def test_split_column_is_the_stable_hash_of_the_key(ingested):
    rows = read_rows(ingested.output)
    assert all(row["split"] == shards.split_of(key, 0.2, 0.1) for key, row in rows.items())


def test_read_manifest_accepts_a_finished_video_output_only(ingested, tmp_path):
    assert read_video_manifest(ingested.output) == ingested.manifest
    with pytest.raises(VitpipeError, match="not a finished ingest output"):
        read_video_manifest(str(tmp_path))


def test_clips_sampling_stores_the_clips_of_a_video_back_to_back(ray_cluster, corpus, tmp_path):
    _, expected = corpus
    clips = dict(clip_length=4, frame_stride=2, clip_stride=3, max_clips=2)
    result = run_video_ingest(config(corpus[0], tmp_path / "clips", sampling="clips", **clips))
    assert result.manifest["sampling"] == {"mode": "clips", **clips}
    rows = read_rows(result.output)
    assert sorted(rows) == sorted(expected)
    for key, row in rows.items():
        indices = clip_indices(len(expected[key][0]), 4, 2, 3, 2)
        assert np.array_equal(row["frame_indices"], indices), key
        split = video_shards.split_clips(row["frames"], 4)
        assert split.shape == (2, 4, FRAME_SIZE, FRAME_SIZE, 3)
        assert np.array_equal(split[1], row["frames"][4:8])


# ---------------------------------------------------------------- reruns


def test_rerun_with_the_same_config_does_nothing(ray_cluster, corpus, ingested):
    before = mtimes(ingested.output)
    again = run_video_ingest(config(corpus[0], ingested.output))
    assert again.skipped and again.shards_written == 0
    assert mtimes(ingested.output) == before
    assert again.manifest["content_hash"] == ingested.manifest["content_hash"]


def test_an_output_missing_a_shard_and_its_marker_is_completed_by_writing_only_that_shard(
    ray_cluster, corpus, ingested, tmp_path
):
    # Damaged by hand, not interrupted: a SIGKILL mid-write is tests/test_ingest_kill.py's.
    assert_completing_writes_only_the_missing_shard(ingested, tmp_path / "completed",
                                                    lambda out: run_video_ingest(config(corpus[0], out)))


def test_changed_sampling_replaces_the_output(ray_cluster, corpus, ingested, tmp_path):
    out = tmp_path / "changed"
    shutil.copytree(ingested.output, out)
    result = run_video_ingest(config(corpus[0], out, max_frames=4))
    assert not result.skipped and result.shards_reused == 0
    assert {r["num_frames"] for r in read_rows(str(out)).values()} == {4}


# ---------------------------------------------------------------- CLI, config, S3


def test_cli_video_ingest_runs_the_stage_and_reports_json(ray_cluster, corpus, tmp_path):
    from typer.testing import CliRunner

    from pipelines.cli import app

    args = ["video-ingest", str(corpus[0]), str(tmp_path / "cli"), "--frame-size", "16", "--max-frames", "8", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = result_json(result.stdout)
    assert report["counts"]["videos"] == len(corpus[1]) and not report["skipped"]
    assert Path(tmp_path, "cli", shards.SUCCESS).exists()


@pytest.mark.parametrize(("fields", "message"), [
    ({"image_size": 16}, "Extra inputs are not permitted"), ({"sampling": "random"}, "sampling"),
    ({"val_fraction": 0.7, "test_fraction": 0.5}, "exceeds 1"),
    ({"frame_size": 1024, "shard_size": 64}, "exceed 2 GiB per shard")])
def test_config_refuses_an_unknown_field_or_a_bad_value(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        VideoIngestConfig(source=str(tmp_path / "a"), output=str(tmp_path / "b"), **fields)


@pytest.fixture(scope="module")
def s3_ingested(ray_cluster, s3_server, corpus):
    """The corpus uploaded to the S3 server and ingested there twice: (client, bucket, first run, rerun)."""
    client, bucket = s3_server.client(), f"videos-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    for path in (p for p in corpus[0].rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"corpus/{path.relative_to(corpus[0]).as_posix()}", Body=path.read_bytes())
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env.items():
            mp.setenv(name, value)
        runs = [run_video_ingest(config(f"s3://{bucket}/corpus", f"s3://{bucket}/out")) for _ in range(2)]
    return client, bucket, *runs


def test_s3_and_local_video_ingest_of_the_same_files_are_identical(s3_ingested, corpus, ingested):
    client, bucket, result, _ = s3_ingested
    assert result.counts["videos"] == len(corpus[1])
    assert result.manifest["content_hash"] == ingested.manifest["content_hash"]
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="out/")
    written = sorted(o["Key"][len("out/"):] for page in pages for o in page.get("Contents", []))
    assert written == sorted([s["path"] for s in result.manifest["shards"]] + [shards.MANIFEST, shards.SUCCESS])


def test_rerunning_a_finished_s3_video_ingest_writes_nothing(s3_ingested):
    assert s3_ingested[3].skipped
