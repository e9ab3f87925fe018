"""The generated video corpus: real MP4s in class folders, deterministic, and some classes only frame order tells apart."""

from __future__ import annotations

import io
import json
from pathlib import Path

import av
import numpy as np
import pytest
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.corpora.videos import (
    META_KEY,
    class_specs,
    make_video,
    render_video,
    synth_video_corpus,
    video_length,
    video_rng,
)

SEED, SIZE, FRAMES, CLASSES, VIDEOS = 0, 32, 16, 4, 12


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def decode(data: bytes) -> tuple[np.ndarray, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate)


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    results = {}
    for name, seed in (("a", SEED), ("b", SEED), ("c", SEED + 1)):
        results[name] = synth_video_corpus(str(root / name), videos=VIDEOS, classes=CLASSES, size=SIZE, frames=FRAMES,
                                           seed=seed)
    return root, results


def test_classes_are_forward_reversed_pairs_then_appearance_classes():
    specs = class_specs(6)
    assert [s.kind for s in specs] == ["forward", "reversed", "forward", "reversed", "appearance", "appearance"]
    for forward, backward in ((specs[0], specs[1]), (specs[2], specs[3])):
        assert backward.reverse_of == forward.label and backward.digit == forward.digit
        assert backward.direction == forward.direction
    assert [s.order_matters for s in specs] == [True] * 4 + [False] * 2


def test_each_pair_and_each_appearance_class_has_a_digit_of_its_own():
    for classes in (2, 3, 4, 6, 10, 15):
        specs = class_specs(classes)
        own = {s.digit for s in specs if s.kind != "reversed"}
        assert len(own) == len([s for s in specs if s.kind != "reversed"]), classes


def test_order_matters_classes_are_the_forward_frames_reversed():
    specs = class_specs(6)
    for forward, backward in ((specs[0], specs[1]), (specs[2], specs[3])):
        for i in range(3):
            ahead = render_video(forward, 20, SIZE, np.random.default_rng(i))
            behind = render_video(backward, 20, SIZE, np.random.default_rng(i))
            assert np.array_equal(behind, ahead[::-1])
            assert not np.array_equal(behind, ahead)  # the digit really moves


def test_appearance_classes_are_told_apart_by_any_single_frame():
    specs = class_specs(6)
    a = render_video(specs[4], 12, SIZE, np.random.default_rng(0))
    b = render_video(specs[5], 12, SIZE, np.random.default_rng(0))
    # Same generator state, different digit: every frame differs, not just their order.
    assert all(not np.array_equal(a[t], b[t]) for t in range(12))


def test_videos_vary_in_length_and_frame_rate():
    lengths = {video_length(FRAMES, np.random.default_rng(i)) for i in range(40)}
    counts, rates = {c for c, _ in lengths}, {f for _, f in lengths}
    assert len(counts) > 3 and len(rates) > 2
    assert min(counts) >= FRAMES * 3 // 4 and max(counts) <= FRAMES * 5 // 4


def test_synth_video_writes_mp4s_in_class_folders(runs):
    root, results = runs
    files = tree(root / "a")
    names = [s.name for s in class_specs(CLASSES)]
    assert results["a"].images == VIDEOS and results["a"].classes == names
    videos = [k for k in files if not k.startswith(".")]
    assert len(videos) == VIDEOS and all(k.endswith(".mp4") and k.split("/")[0] in names for k in videos)
    assert {k.split("/")[0] for k in videos} == set(names)
    meta = json.loads(files[META_KEY])
    assert [c["order_matters"] for c in meta["classes"]] == [True, True, False, False]


def test_synth_video_is_deterministic_by_seed(runs):
    root, _ = runs
    a, b, c = tree(root / "a"), tree(root / "b"), tree(root / "c")
    assert a == b
    assert a.keys() == c.keys() and any(a[k] != c[k] for k in a if k != META_KEY)


def test_files_decode_to_the_rendered_frames_at_their_frame_rate(runs):
    root, _ = runs
    for spec in class_specs(CLASSES):
        expected, fps = make_video(spec, 0, seed=SEED, size=SIZE, frames=FRAMES)
        frames, rate = decode((root / "a" / spec.name / "000000.mp4").read_bytes())
        assert frames.shape == expected.shape and rate == fps
        assert np.abs(frames.astype(int) - expected).mean() < 4  # H.264 at CRF 12 is nearly lossless


def test_reversed_class_files_play_the_forward_motion_backwards(runs):
    root, _ = runs
    forward, backward = class_specs(CLASSES)[:2]
    rng = video_rng(SEED, backward.label, 0)
    count, _ = video_length(FRAMES, rng)
    ahead = render_video(forward, count, SIZE, rng)
    frames, _ = decode((root / "a" / backward.name / "000000.mp4").read_bytes())
    assert np.abs(frames[::-1].astype(int) - ahead).mean() < 4
    assert np.abs(frames.astype(int) - ahead).mean() > 2 * np.abs(frames[::-1].astype(int) - ahead).mean()


def test_cli_synth_video_writes_the_corpus(ray_cluster, tmp_path):
    args = ["corpus", "synth-video", str(tmp_path / "cli"), "--videos", "4", "--classes", "2", "--size", "16",
            "--frames", "8", "--seed", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "wrote 4 videos in 2 classes" in result.stdout
    assert len(list((tmp_path / "cli").rglob("*.mp4"))) == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"size": 33}, "size must be even"), ({"classes": 16, "videos": 32}, "classes must be within 2..15"),
     ({"videos": 2, "classes": 3}, "need videos >= classes")],
)
def test_bad_corpus_settings_are_refused_before_any_work(tmp_path, fields, message):
    kwargs = {"videos": 8, "classes": 4, "size": 16, "frames": 8, **fields}
    with pytest.raises(ValueError, match=message):
        synth_video_corpus(str(tmp_path / "x"), **kwargs)
    assert not (tmp_path / "x").exists()
