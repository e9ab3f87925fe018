"""Bounded, and no crash on odd input: the fetch window, the per-object byte cap, EXIF orientation,
non-UTF-8 file names, duplicate manifest keys, an output inside its source, a shard of an earlier
version that recorded read errors."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from pydantic import ValidationError

from pipelines.core import shards
from pipelines.core.errors import IngestError, ObjectTooLarge
from pipelines.core.fetch import fetch_planned
from pipelines.core.storage import LocalStore, S3Settings, open_store
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig
from pipelines.image.patches import decode_image
from tests.corpus_files import jpeg


def _corpus(root: Path, n: int = 12, classes: int = 2) -> list[str]:
    keys = []
    for i in range(n):
        key = f"c{i % classes}/{i:03d}.jpg"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(jpeg(i, (20, 24)))
        keys.append(key)
    return keys


def _config(source: Path, output: Path, **overrides) -> IngestConfig:
    fields = dict(source=str(source), output=str(output), image_size=16, patch_size=4, shard_size=4)
    return IngestConfig(**{**fields, **overrides})


class _CountingStore(LocalStore):
    """A local store that counts the objects read and not yet released by the consumer."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.lock = threading.Lock()
        self.held = 0
        self.peak = 0

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        data = super().read(key, max_bytes)
        with self.lock:
            self.held += 1
            self.peak = max(self.peak, self.held)
        return data


def test_a_shard_task_holds_at_most_io_threads_objects(tmp_path):
    keys = _corpus(tmp_path, n=20)
    store = _CountingStore(str(tmp_path))
    plan = {"keys": keys, "reasons": [""] * len(keys)}
    seen = []
    for i, data in fetch_planned(plan, store, [], io_threads=2, max_bytes=None):
        time.sleep(0.02)  # a slow decoder: unbounded reads would all finish meanwhile
        seen.append(i)
        del data
        with store.lock:
            store.held -= 1
    assert seen == list(range(len(keys)))
    assert store.peak <= 2


def test_an_object_over_the_byte_cap_is_rejected_with_a_reason(ray_cluster, tmp_path):
    keys = _corpus(tmp_path / "src", n=8)
    big = "c0/big.jpg"
    (tmp_path / "src" / big).write_bytes(jpeg(99, 300))
    cap = max(len((tmp_path / "src" / k).read_bytes()) for k in keys)
    result = run_ingest(_config(tmp_path / "src", tmp_path / "out", max_object_bytes=cap, max_reject_fraction=0.5))
    assert result.counts["images"] == len(keys)
    [rejected] = result.manifest["rejected"]
    assert rejected["key"] == big and rejected["reason"].startswith("too large (") and str(cap) in rejected["reason"]


def test_the_s3_byte_cap_is_checked_before_the_body_is_read(s3_env, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/p", S3Settings(s3_env.endpoint_url))
    store.write("big.bin", b"x" * 5000)
    with pytest.raises(ObjectTooLarge, match=r"big.bin: too large \(5000 bytes > max_object_bytes 4096\)"):
        store.read("big.bin", max_bytes=4096)
    assert store.read("big.bin", max_bytes=5000) == b"x" * 5000


def test_the_byte_cap_has_a_default_and_is_larger_for_video():
    from pipelines.video.configs import VideoIngestConfig

    image = IngestConfig(source="/a", output="/b")
    video = VideoIngestConfig(source="/a", output="/b")
    assert 0 < image.max_object_bytes < video.max_object_bytes


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_photo_taken_rotated_is_stored_upright(fmt):
    pixels = np.zeros((64, 64, 3), np.uint8)
    pixels[:32] = (255, 0, 0)  # stored: red on top, blue below
    pixels[32:] = (0, 0, 255)
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # "turn 90° clockwise to view"
    buf = io.BytesIO()
    image.save(buf, fmt, exif=exif.tobytes())
    out = decode_image(buf.getvalue(), 16, max_pixels=10**6).astype(int)
    assert out[8, 1, 2] > 200 and out[8, 1, 0] < 50  # blue on the left
    assert out[8, 14, 0] > 200 and out[8, 14, 2] < 50  # red on the right


def test_a_non_utf8_file_name_is_a_rejection_not_a_crash(ray_cluster, tmp_path):
    keys = _corpus(tmp_path / "src", n=8)
    with open(os.path.join(os.fsencode(tmp_path / "src" / "c1"), b"caf\xe9.jpg"), "wb") as f:
        f.write(jpeg(7, (20, 24)))
    result = run_ingest(_config(tmp_path / "src", tmp_path / "out", max_reject_fraction=0.5))
    assert result.counts["images"] == len(keys)
    assert result.manifest["rejected"] == [{"key": "c1/caf\\xe9.jpg", "reason": "file name is not valid UTF-8"}]


def test_duplicate_manifest_keys_are_one_line_naming_the_first(ray_cluster, tmp_path):
    keys = _corpus(tmp_path / "src", n=6)
    rows = ["key,label"] + [f"{k},{k[:2]}" for k in keys] + [f"{keys[3]},c9", f"{keys[1]},c9"]
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(IngestError) as failed:
        run_ingest(_config(tmp_path / "src", tmp_path / "out", manifest=str(tmp_path / "labels.csv")))
    assert str(failed.value) == f"{tmp_path / 'labels.csv'}: key {keys[3]} appears more than once"


@pytest.mark.parametrize(("source", "output"), [("{tmp}/src", "{tmp}/src/out"), ("s3://bkt/corpus", "s3://bkt/corpus/out"),
                                                ("s3://bkt", "s3://bkt/out")])
def test_an_output_inside_its_source_is_refused(tmp_path, source, output):
    with pytest.raises(ValidationError, match="is inside source"):
        IngestConfig(source=source.format(tmp=tmp_path), output=output.format(tmp=tmp_path))


@pytest.mark.parametrize("field", ["output", "manifest"])
def test_an_s3_output_or_manifest_with_an_empty_folder_name_is_refused_in_one_line(tmp_path, field):
    with pytest.raises(ValidationError, match=r"s3://bkt/a//b: an empty folder name \('//'\) is refused here"):
        IngestConfig(**{"source": "s3://bkt/corpus", "output": "s3://bkt/out", field: "s3://bkt/a//b"})


def test_a_source_with_an_empty_folder_name_is_accepted_as_written(tmp_path):
    # S3 keys are literal: `corpus//2024` is another prefix than `corpus/2024`.
    assert IngestConfig(source="s3://bkt/corpus//2024", output="s3://bkt/out").source == "s3://bkt/corpus//2024"


@pytest.mark.parametrize("source", ["{tmp}/src", "s3://bkt/corpus"])
def test_an_output_beside_its_source_is_accepted(tmp_path, source):
    source = source.format(tmp=tmp_path)
    config = IngestConfig(source=source, output=f"{source}-out")
    assert (config.source, config.output) == (source, f"{source}-out")


def test_a_shard_holding_a_read_error_of_an_earlier_version_is_never_reused(ray_cluster, tmp_path):
    _corpus(tmp_path / "src", n=12)
    out = tmp_path / "out"
    first = run_ingest(_config(tmp_path / "src", out))
    assert first.shards_written >= 2
    # An earlier version's interrupted run: one shard recorded a throttled read as "unreadable".
    store = LocalStore(str(out))
    key = first.manifest["shards"][0]["path"]
    table = pq.read_table(out / key)
    summary = shards.read_summary(*store.arrow(key))
    summary["rejected"] = [{"key": "c0/000.jpg", "reason": "unreadable (S3 error SlowDown: Please reduce)"}]
    shards.write_shard(store, key, table, summary, "lz4")
    store.delete(shards.SUCCESS)
    rerun = run_ingest(_config(tmp_path / "src", out))
    assert (rerun.shards_written, rerun.shards_reused) == (1, first.shards_written - 1)
    assert rerun.counts["rejected"] == 0 and rerun.counts["images"] == 12
