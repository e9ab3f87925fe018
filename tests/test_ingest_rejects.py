"""Bad objects are rejected with a reason and counted; too many fail the stage with one line."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.core import shards
from pipelines.core.shards import read_manifest
from pipelines.core.errors import IngestError, StorageError, VitpipeError
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig
from tests.corpus_files import jpeg

GOOD_PER_CLASS = 50


def _png_bomb(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


# key -> (bytes, expected reason). One of each kind of bad object.
def bad_objects(rng: np.random.Generator) -> dict[str, tuple[bytes, str]]:
    whole = jpeg(rng, 64)
    return {
        "a/empty.jpg": (b"", "empty file"),
        "a/truncated.jpg": (whole[: len(whole) // 2], "corrupt or truncated"),
        "b/garbage.jpg": (rng.integers(0, 256, 3000, dtype=np.uint8).tobytes(), "not an image"),
        "b/notes.png": (b"shopping list: eggs, milk", "not an image"),
        "b/bomb.png": (_png_bomb(40000, 40000), "too many pixels"),
        "a/huge.jpg": (jpeg(rng, 120), "too many pixels"),  # 14,400 px > max_pixels below
        "loose.jpg": (jpeg(rng, 24), "not inside a class folder"),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("dirty")
    good = []
    for name in ("a", "b"):
        for i in range(GOOD_PER_CLASS):
            key = f"{name}/{i:03d}.jpg"
            good.append(key)
            (root / name).mkdir(exist_ok=True)
            (root / key).write_bytes(jpeg(rng, 24))
    bad = bad_objects(rng)
    for key, (data, _) in bad.items():
        (root / key).write_bytes(data)
    return root, good, bad


def _config(source: Path, output: Path, **overrides) -> IngestConfig:
    fields = dict(source=str(source), output=str(output), image_size=16, patch_size=4, shard_size=16, max_pixels=10_000)
    fields.update(overrides)
    return IngestConfig(**fields)


@pytest.fixture(scope="module")
def tolerant(ray_cluster, corpus, tmp_path_factory):
    root, _, _ = corpus
    return run_ingest(_config(root, tmp_path_factory.mktemp("tolerant"), max_reject_fraction=0.1))


def test_each_bad_object_is_rejected_with_its_reason(corpus, tolerant):
    _, _, bad = corpus
    rejected = {r["key"]: r["reason"] for r in tolerant.manifest["rejected"]}
    assert sorted(rejected) == sorted(bad)
    for key, (_, reason) in bad.items():
        assert reason in rejected[key], key


def test_rejections_are_counted(corpus, tolerant):
    _, good, bad = corpus
    assert tolerant.counts["rejected"] == len(bad)
    assert tolerant.counts["images"] == len(good)


def test_no_good_image_is_lost_or_duplicated(corpus, tolerant):
    _, good, _ = corpus
    keys = []
    for entry in tolerant.manifest["shards"]:
        keys += pq.read_table(Path(tolerant.output, entry["path"]), columns=["key"]).column("key").to_pylist()
    assert sorted(keys) == sorted(good)


def test_too_many_rejections_fail_the_stage_with_one_line(ray_cluster, corpus, tmp_path):
    root, good, bad = corpus
    with pytest.raises(IngestError) as info:
        run_ingest(_config(root, tmp_path / "strict"))  # default threshold: 1%
    message = str(info.value)
    total = len(good) + len(bad)
    assert "\n" not in message
    assert f"{len(bad)} of {total} objects rejected ({100 * len(bad) / total:.1f}% > 1.0%)" in message
    assert str(tmp_path / "strict" / "manifest.json") in message


def test_a_failed_run_keeps_the_reasons_but_is_not_marked_finished(ray_cluster, corpus, tmp_path):
    root, _, bad = corpus
    with pytest.raises(IngestError):
        run_ingest(_config(root, tmp_path / "strict"))
    manifest = json.loads((tmp_path / "strict" / "manifest.json").read_text())
    assert len(manifest["rejected"]) == len(bad)
    assert not (tmp_path / "strict" / shards.SUCCESS).exists()
    with pytest.raises(VitpipeError, match="not a finished ingest output"):
        read_manifest(str(tmp_path / "strict"))


def test_missing_source_directory_is_one_line(tmp_path):
    with pytest.raises(StorageError, match=f"^{tmp_path / 'nowhere'}: does not exist$"):
        run_ingest(_config(tmp_path / "nowhere", tmp_path / "out"))


def test_empty_source_directory_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match=f"^{tmp_path / 'empty'}: no objects under this prefix$"):
        run_ingest(_config(tmp_path / "empty", tmp_path / "out"))


def test_a_storage_failure_inside_a_worker_surfaces_as_one_line(ray_cluster, corpus, tmp_path):
    root, _, _ = corpus
    out = tmp_path / "out"
    out.mkdir()
    (out / "shards").write_text("a file where the shard folder should be")
    with pytest.raises(StorageError) as info:
        run_ingest(_config(root, out, max_reject_fraction=0.2))
    message = str(info.value)
    assert message.startswith(f"{out}/shards/shard-") and "\n" not in message


def test_errors_raised_inside_ray_data_are_recovered_as_one_line(ray_cluster):
    import ray.data

    from pipelines.core.errors import find_vitpipe_error

    def _fail_in_worker(batch):  # defined here so that it travels by value (workers cannot import tests)
        raise StorageError("s3://bucket/x: bucket does not exist")

    with pytest.raises(Exception) as info:
        ray.data.from_items([{"x": 1}]).map_batches(_fail_in_worker).take_all()
    found = find_vitpipe_error(info.value)
    assert type(found) is StorageError and str(found) == "s3://bucket/x: bucket does not exist"
