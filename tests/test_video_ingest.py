"""The video ingest stage on real video files: a local folder and the loopback S3 server.

Good videos come from the generated corpus (MP4/H.264) plus one each in WebM
(VP9), AVI (MPEG-4 part 2) and MKV (H.264); bad ones are made here, one of each
kind the stage must refuse.
"""

from __future__ import annotations

import io
import json
import shutil
import uuid
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipelines.core import shards
from pipelines.video import shards as video_shards
from pipelines.core.errors import IngestError, VitpipeError
from pipelines.corpora.videos import class_specs, make_video, synth_video_corpus
from pipelines.video.data import read_video_manifest
from pipelines.video.ingest import run_video_ingest
from pipelines.video.configs import VideoIngestConfig
from pipelines.video.decode import clip_indices, full_indices
from tests.process_output import result_json
from tests.shard_output import assert_completing_writes_only_the_missing_shard, mtimes

SEED, SIZE, FRAMES, CLASSES, VIDEOS = 0, 32, 16, 4, 24
FRAME_SIZE, MAX_FRAMES = 16, 16
# Extra good videos in the other containers: key -> (class, video index, FFmpeg format, codec).
OTHER_CONTAINERS = {"webm": ("webm", "libvpx-vp9"), "avi": ("avi", "mpeg4"), "mkv": ("matroska", "libx264")}


def encode(frames: np.ndarray, fps: int, fmt: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 4_000_000  # high quality, so decoded frames stay close to the rendered ones
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def zero_frame_avi() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width = stream.height = 32
        container.start_encoding()  # header and an empty index: a video stream with no frames
    return buf.getvalue()


def audio_only_mp4() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        for _ in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 8000
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# One of each kind of bad object: name -> (key, bytes, expected reason).
def bad_objects(rng: np.random.Generator) -> dict[str, tuple[str, bytes, str]]:
    specs = class_specs(CLASSES)
    frames, fps = make_video(specs[0], 99, seed=SEED, size=SIZE, frames=30)
    mp4 = encode(frames, fps, "mp4", "libx264")
    mkv = encode(frames, fps, "matroska", "libx264")
    avi = encode(frames, fps, "avi", "mpeg4")
    a, b = specs[0].name, specs[1].name
    return {
        "empty": (f"{a}/empty.mp4", b"", "empty file"),
        "garbage": (f"{a}/garbage.mp4", rng.integers(0, 256, 4000, dtype=np.uint8).tobytes(), "not a video"),
        "truncated-mp4": (f"{a}/truncated.mp4", mp4[: len(mp4) // 2], "corrupt or truncated"),
        "truncated-mkv": (f"{b}/truncated.mkv", mkv[: len(mkv) // 2], "corrupt or truncated"),
        "corrupt": (f"{b}/corrupt.mkv", mkv[:64] + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes(),
                    "corrupt or truncated"),
        "zero-frames": (f"{a}/zero.avi", zero_frame_avi(), "no video frames"),
        "audio-only": (f"{b}/audio.mp4", audio_only_mp4(), "no video stream (audio only)"),
        # An AVI whose codec tag no decoder knows.
        "unsupported-codec": (f"{b}/unknown.avi", avi.replace(b"FMP4", b"QQQQ"), "unsupported codec"),
        "still-image": (f"{a}/picture.png", png(), "unsupported container"),
        "loose": ("loose.mp4", mp4, "not inside a class folder"),
    }


def config(source, output, **overrides) -> VideoIngestConfig:
    fields = dict(source=str(source), output=str(output), frame_size=FRAME_SIZE, max_frames=MAX_FRAMES,
                  val_fraction=0.2, test_fraction=0.1, shard_size=8, mix_window=4)
    fields.update(overrides)
    return VideoIngestConfig(**fields)


def read_rows(output: str) -> dict[str, dict]:
    rows = {}
    for path in sorted(Path(output, shards.SHARD_DIR).glob("*.parquet")):
        for row in video_shards.read_video_rows(pq.read_table(path)):
            assert row["key"] not in rows, f"{row['key']} appears twice"
            rows[row["key"]] = row
    return rows


def resized(frames: np.ndarray, size: int) -> np.ndarray:
    return np.stack([np.asarray(Image.fromarray(f).resize((size, size), Image.Resampling.BOX)) for f in frames])


@pytest.fixture(scope="module")
def corpus(ray_cluster, tmp_path_factory):
    """The generated corpus plus one good video per other container; returns (root, {key: (frames, fps)})."""
    root = tmp_path_factory.mktemp("video-corpus")
    synth_video_corpus(str(root), videos=VIDEOS, classes=CLASSES, size=SIZE, frames=FRAMES, seed=SEED)
    specs = class_specs(CLASSES)
    expected = {}
    for spec in specs:
        for i in range(VIDEOS // CLASSES):
            expected[f"{spec.name}/{i:06d}.mp4"] = make_video(spec, i, seed=SEED, size=SIZE, frames=FRAMES)
    for n, (ext, (fmt, codec)) in enumerate(OTHER_CONTAINERS.items()):
        spec = specs[2 + n % 2]
        video = make_video(spec, 100 + n, seed=SEED, size=SIZE, frames=FRAMES)
        key = f"{spec.name}/other-{n}.{ext}"
        (root / key).write_bytes(encode(*video, fmt, codec))
        expected[key] = video
    return root, expected


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


# ---------------------------------------------------------------- bad input


def _files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_an_output_holding_an_image_ingest_output_is_refused_and_left_whole(corpus, tiny_dataset, tmp_path):
    # A mistyped output: writing there would delete the images' marker and replace their shards.
    images = tmp_path / "images"
    shutil.copytree(tiny_dataset, images)
    before = _files(images)
    with pytest.raises(VitpipeError) as err:
        run_video_ingest(config(corpus[0], images))
    assert str(err.value) == (f"{images}: holds a finished output of another kind (format 'vitpipe-patches/1', "
                              "not 'vitpipe-video/1'); write to a new folder or to an earlier output of this kind")
    assert _files(images) == before


@pytest.fixture(scope="module")
def dirty(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("dirty-videos")
    shutil.copytree(corpus[0], root, dirs_exist_ok=True)
    bad = bad_objects(np.random.default_rng(0))
    for key, data, _ in bad.values():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root, bad


@pytest.fixture(scope="module")
def tolerant(ray_cluster, dirty, tmp_path_factory):
    return run_video_ingest(config(dirty[0], tmp_path_factory.mktemp("tolerant") / "out", max_reject_fraction=0.5))


@pytest.mark.parametrize("kind", list(bad_objects(np.random.default_rng(0))))
def test_bad_video_is_rejected_with_its_reason(dirty, tolerant, kind):
    key, _, reason = dirty[1][kind]
    rejected = {r["key"]: r["reason"] for r in tolerant.manifest["rejected"]}
    assert key in rejected
    assert rejected[key].startswith(reason), rejected[key]


def test_rejections_are_counted_and_every_good_video_kept(corpus, dirty, tolerant):
    assert tolerant.counts["rejected"] == len(dirty[1]) == len(tolerant.manifest["rejected"])
    assert tolerant.counts["videos"] == len(corpus[1])
    assert sorted(read_rows(tolerant.output)) == sorted(corpus[1])


def test_too_many_rejections_fail_the_stage_with_one_line(ray_cluster, corpus, dirty, tmp_path):
    root, bad = dirty
    with pytest.raises(IngestError) as info:
        run_video_ingest(config(root, tmp_path / "strict"))  # default threshold: 1%
    message = str(info.value)
    total = len(corpus[1]) + len(bad)
    assert "\n" not in message
    assert f"{len(bad)} of {total} objects rejected ({100 * len(bad) / total:.1f}% > 1.0%)" in message
    assert str(tmp_path / "strict" / shards.MANIFEST) in message
    assert not (tmp_path / "strict" / shards.SUCCESS).exists()


def test_cli_video_ingest_prints_one_line_and_exits_non_zero_past_the_threshold(ray_cluster, dirty, tmp_path):
    from typer.testing import CliRunner

    from pipelines.cli import app

    result = CliRunner().invoke(app, ["video-ingest", str(dirty[0]), str(tmp_path / "cli"), "--frame-size", "16"])
    assert result.exit_code == 1
    # Ray Data's progress lines may come first on stderr (for people); the error is the last line, and one line.
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "objects rejected" in last
    assert "Traceback" not in result.stderr


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
