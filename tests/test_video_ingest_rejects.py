"""The video ingest stage's bad input: one object of each kind it must refuse, each rejected with its
reason while every good video is kept; too many rejections fail the stage in one line; an output of
another kind is refused and left whole."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from pipelines.core import shards
from pipelines.core.errors import IngestError, VitpipeError
from pipelines.corpora.videos import class_specs, make_video
from pipelines.video.ingest import run_video_ingest
from tests.video_ingest_files import CLASSES, SEED, SIZE, config, corpus, encode, read_rows  # noqa: F401


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
