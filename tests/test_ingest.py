"""The ingest stage on a local corpus: output contents, manifest, splits, resume and idempotency."""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import vit.patches
from pipelines.core import shards
from pipelines.image.patches import decode_image
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig
from tests.process_output import result_json
from tests.shard_output import assert_completing_writes_only_the_missing_shard, mtimes

CLASSES = ["ant", "bee", "cow"]
PER_CLASS = 30
SIZE, PATCH = 16, 4


def _image_bytes(rng: np.random.Generator, fmt: str = "JPEG") -> bytes:
    w, h = (int(v) for v in rng.integers(18, 48, size=2))
    low = rng.integers(0, 256, size=(h // 6 + 1, w // 6 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(low).resize((w, h), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def write_corpus(root: Path, seed: int = 0) -> list[str]:
    """JPEG and PNG objects in class folders; returns their keys."""
    rng = np.random.default_rng(seed)
    keys = []
    for name in CLASSES:
        for i in range(PER_CLASS):
            fmt = "PNG" if i % 5 == 0 else "JPEG"
            key = f"{name}/{i:03d}.{fmt.lower()}"
            path = root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_image_bytes(rng, fmt))
            keys.append(key)
    return keys


def config(source: Path, output: Path, **overrides) -> IngestConfig:
    fields = dict(
        source=str(source), output=str(output), image_size=SIZE, patch_size=PATCH,
        val_fraction=0.2, test_fraction=0.1, shard_size=16, mix_window=4,
    )
    fields.update(overrides)
    return IngestConfig(**fields)


def read_rows(output: str) -> dict[str, dict]:
    rows = {}
    for path in sorted(Path(output, shards.SHARD_DIR).glob("*.parquet")):
        table = pq.read_table(path)
        for row in table.to_pylist():
            assert row["key"] not in rows, f"{row['key']} appears twice"
            rows[row["key"]] = row
    return rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def ingested(ray_cluster, corpus, tmp_path_factory):
    source, _ = corpus
    return run_ingest(config(source, tmp_path_factory.mktemp("ingest") / "out"))


def test_every_image_appears_exactly_once_with_its_class_label(corpus, ingested):
    _, keys = corpus
    rows = read_rows(ingested.output)
    assert sorted(rows) == sorted(keys)
    classes = ingested.manifest["classes"]
    assert all(row["label"] == classes[key.split("/")[0]] for key, row in rows.items())


def test_stored_patches_are_vit_patchify_of_the_decoded_image(corpus, ingested):
    source, keys = corpus
    rows = read_rows(ingested.output)
    for key in keys[::17]:
        image = decode_image((source / key).read_bytes(), SIZE, max_pixels=10**8)
        expected = vit.patches.patchify(torch.from_numpy(image[None].copy()), PATCH, channels_last=True)[0]
        stored = np.frombuffer(rows[key]["patches"], dtype=np.uint8).reshape(expected.shape)
        assert np.array_equal(stored, expected.numpy())


def test_manifest_describes_sizes_classes_and_counts(ingested):
    m = json.loads(Path(ingested.output, "manifest.json").read_text())
    assert (m["image_size"], m["patch_size"], m["num_patches"], m["patch_dim"]) == (16, 4, 16, 48)
    assert m["classes"] == {"ant": 0, "bee": 1, "cow": 2}
    counts = m["counts"]
    assert counts["images"] == 90 and counts["rejected"] == 0 and m["rejected"] == []
    assert counts["train"] + counts["val"] + counts["test"] == 90
    assert counts["classes"] == {name: PER_CLASS for name in CLASSES}
    rows = read_rows(ingested.output)
    for split in shards.SPLITS:
        for name, n in counts["split_classes"][split].items():
            assert n == sum(r["split"] == split and r["key"].startswith(name + "/") for r in rows.values())


def test_manifest_lists_every_shard_and_its_rows(ingested):
    m = ingested.manifest
    on_disk = sorted(p.relative_to(ingested.output).as_posix() for p in Path(ingested.output, "shards").iterdir())
    assert on_disk == [s["path"] for s in m["shards"]]
    for entry in m["shards"]:
        assert pq.read_metadata(Path(ingested.output, entry["path"])).num_rows == entry["rows"]


def test_content_hash_is_recomputable_from_the_shards(ingested):
    m = ingested.manifest
    hashes = [shards.table_hash(pq.read_table(Path(ingested.output, s["path"]))) for s in m["shards"]]
    assert m["content_hash"] == shards.content_hash(m["image_size"], m["patch_size"], m["classes"], hashes)


def test_config_in_manifest_is_the_validated_config(corpus, ingested):
    expected = config(corpus[0], Path(ingested.output)).model_dump(mode="json")
    assert ingested.manifest["config"] == expected


def test_split_column_is_the_stable_hash_of_the_key(ingested):
    rows = read_rows(ingested.output)
    assert all(row["split"] == shards.split_of(key, 0.2, 0.1) for key, row in rows.items())


def test_split_fractions_follow_the_config():
    splits = [shards.split_of(f"class/{i}.jpg", 0.2, 0.1) for i in range(20000)]
    assert abs(splits.count("val") / 20000 - 0.2) < 0.015
    assert abs(splits.count("test") / 20000 - 0.1) < 0.015


def test_shards_mix_classes(ingested):
    mixed = 0
    for entry in ingested.manifest["shards"]:
        labels = set(pq.read_table(Path(ingested.output, entry["path"]), columns=["label"]).column("label").to_pylist())
        mixed += len(labels) > 1
    assert mixed >= len(ingested.manifest["shards"]) // 2


def test_rerun_with_the_same_config_does_nothing(ray_cluster, corpus, ingested):
    before = mtimes(ingested.output)
    again = run_ingest(config(corpus[0], Path(ingested.output)))
    assert again.skipped and again.shards_written == 0
    assert mtimes(ingested.output) == before
    assert again.manifest["content_hash"] == ingested.manifest["content_hash"]


def test_an_ingest_shows_no_deprecation_warning_raised_at_vitpipes_own_calls(ray_cluster, corpus, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_ingest(config(corpus[0], tmp_path / "out"))
    ours = [f"{w.filename}: {w.message}" for w in caught
            if issubclass(w.category, DeprecationWarning) and f"{os.sep}pipelines{os.sep}" in w.filename]
    assert ours == []


def test_force_rewrites_every_shard_of_a_finished_output(ray_cluster, corpus, ingested, tmp_path):
    out = tmp_path / "forced"
    shutil.copytree(ingested.output, out)
    again = run_ingest(config(corpus[0], out), force=True)
    assert not again.skipped
    assert (again.shards_written, again.shards_reused) == (len(ingested.manifest["shards"]), 0)
    assert again.manifest["content_hash"] == ingested.manifest["content_hash"]


def test_an_output_missing_a_shard_and_its_marker_is_completed_by_writing_only_that_shard(
    ray_cluster, corpus, ingested, tmp_path
):
    # Damaged by hand, not interrupted: a SIGKILL mid-write is tests/test_ingest_kill.py's.
    assert_completing_writes_only_the_missing_shard(ingested, tmp_path / "completed",
                                                    lambda out: run_ingest(config(corpus[0], out)))


def test_changed_config_replaces_the_output(ray_cluster, corpus, ingested, tmp_path):
    out = tmp_path / "changed"
    shutil.copytree(ingested.output, out)
    result = run_ingest(config(corpus[0], out, shard_size=64))
    assert not result.skipped and result.shards_reused == 0
    assert sorted(os.listdir(out / "shards")) == [Path(s["path"]).name for s in result.manifest["shards"]]
    assert sorted(read_rows(str(out))) == sorted(read_rows(ingested.output))


def test_cli_ingest_runs_the_stage_and_reports_json(ray_cluster, corpus, tmp_path):
    from typer.testing import CliRunner

    from pipelines.cli import app

    args = ["ingest", str(corpus[0]), str(tmp_path / "cli"), "--image-size", "16", "--patch-size", "4", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = result_json(result.stdout)
    assert report["counts"]["images"] == len(corpus[1]) and not report["skipped"]
    assert Path(tmp_path, "cli", shards.SUCCESS).exists()


@pytest.mark.parametrize(("fields", "message"), [
    ({"image_size": 30, "patch_size": 4}, "not divisible by patch_size"),
    ({"val_fraction": 0.7, "test_fraction": 0.5}, "exceeds 1"),
    ({"source": "gs://bucket/x"}, "unsupported scheme")])
def test_config_refuses_inconsistent_sizes_fractions_or_a_scheme_it_cannot_read(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        IngestConfig(**{"source": str(tmp_path / "a"), "output": str(tmp_path / "b"), **fields})
