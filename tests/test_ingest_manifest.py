"""Ingest driven by a manifest (CSV or Parquet of key,label[,split]) instead of class folders."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipelines.core.errors import IngestError
from pipelines.core.plan import ListingIndex, seal, tagged
from pipelines.core.shards import class_names
from pipelines.core.sources import object_plans
from pipelines.core.storage import open_store
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig


def _write_flat_corpus(root: Path, n: int) -> list[str]:
    """Images in a flat layout, where folders say nothing about labels."""
    rng = np.random.default_rng(5)
    keys = []
    for i in range(n):
        key = f"pool/img-{i:04d}.png"
        (root / "pool").mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(20, 20, 3), dtype=np.uint8)).save(buf, "PNG")
        (root / key).write_bytes(buf.getvalue())
        keys.append(key)
    return keys


def _config(root: Path, manifest: Path, out: Path, **overrides) -> IngestConfig:
    fields = dict(source=str(root), output=str(out), manifest=str(manifest), image_size=16, patch_size=4,
                  shard_size=16, max_reject_fraction=0.1)
    fields.update(overrides)
    return IngestConfig(**fields)


def _rows(result) -> dict[str, dict]:
    rows = {}
    for entry in result.manifest["shards"]:
        for row in pq.read_table(Path(result.output, entry["path"]), columns=["key", "label", "split"]).to_pylist():
            rows[row["key"]] = row
    return rows


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    root = tmp_path_factory.mktemp("flat")
    return root, _write_flat_corpus(root, 40)


@pytest.fixture(scope="module")
def parquet_run(ray_cluster, flat, tmp_path_factory):
    """Named labels, a fixed split for every row, and one key that does not exist."""
    root, keys = flat
    names = ["zebra", "apple", "mango"]
    labels = [names[i % 3] for i in range(len(keys))] + ["apple"]
    splits = ["test" if i % 4 == 0 else "train" for i in range(len(keys))] + ["train"]
    table = pa.table({"key": keys + ["pool/missing.png"], "label": labels, "split": splits})
    manifest = tmp_path_factory.mktemp("m") / "labels.parquet"
    pq.write_table(table, manifest)
    return run_ingest(_config(root, manifest, tmp_path_factory.mktemp("out") / "o")), dict(zip(table["key"].to_pylist(), zip(labels, splits)))


def test_named_labels_are_numbered_in_sorted_order(parquet_run):
    result, _ = parquet_run
    assert result.manifest["classes"] == {"apple": 0, "mango": 1, "zebra": 2}


def test_rows_carry_the_manifest_label_and_split(parquet_run):
    result, truth = parquet_run
    classes = result.manifest["classes"]
    for key, row in _rows(result).items():
        label, split = truth[key]
        assert (row["label"], row["split"]) == (classes[label], split)
    assert result.manifest["split_source"] == "manifest"


def test_a_listed_object_that_does_not_exist_is_rejected_as_missing(parquet_run):
    result, _ = parquet_run
    assert [r["key"] for r in result.manifest["rejected"]] == ["pool/missing.png"]
    # refused at planning: with no version to track, a file added later would never rewrite its shard
    assert result.manifest["rejected"][0]["reason"] == "not in the source listing"


def _plans(source: Path, rows: str) -> list[dict]:
    """The sealed shard plans of a local source under a CSV label manifest of `rows`."""
    (source.parent / "labels.csv").write_text("key,label\n" + rows)
    config = SimpleNamespace(list_concurrency=1, shard_size=8, mix_window=1, seed=0)
    manifest = open_store(str(source.parent / "labels.csv"))
    return [seal(p, "config") for p in object_plans(config, open_store(str(source)), manifest)]


@pytest.mark.parametrize("spelling", ["./cat/a.jpg", "cat//a.jpg", "cat/./a.jpg"])
def test_a_local_object_whose_manifest_key_is_spelled_otherwise_rewrites_its_shard_when_replaced(tmp_path, spelling):
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.jpg").write_bytes(b"first")
    before = _plans(tmp_path / "src", f"{spelling},cat\n")
    assert before[0]["keys"] == [spelling] and before[0]["reasons"] == [""]  # read as written, like any row
    (tmp_path / "src" / "cat" / "a.jpg").write_bytes(b"replaced")
    assert _plans(tmp_path / "src", f"{spelling},cat\n")[0]["fingerprint"] != before[0]["fingerprint"]


def test_an_s3_manifest_key_spelled_otherwise_names_another_object_and_is_rejected_unless_listed(s3_env, s3_bucket):
    client = s3_env.client()
    for key in ("data/cat/a.jpg", "data/cat//b.jpg"):  # on S3 `cat//b.jpg` is a key of its own
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"img")
    source = open_store(f"s3://{s3_bucket}/data")
    rows = [(key, 0, "", "cat", "") for key in ("cat/a.jpg", "./cat/a.jpg", "cat//a.jpg", "cat//b.jpg", "cat/b.jpg")]
    items = list(tagged(iter(rows), ListingIndex(source.list_entries()), source))
    assert [(key, reason, bool(tag)) for key, _, _, _, reason, tag in items] == [
        ("cat/a.jpg", "", True), ("./cat/a.jpg", "not in the source listing", False),
        ("cat//a.jpg", "not in the source listing", False), ("cat//b.jpg", "", True),
        ("cat/b.jpg", "not in the source listing", False)]


@pytest.fixture(scope="module")
def integer_run(ray_cluster, flat, tmp_path_factory):
    """A CSV manifest of integer labels 3 and 4, no split column."""
    root, keys = flat
    csv = tmp_path_factory.mktemp("m") / "labels.csv"
    csv.write_text("key,label\n" + "".join(f"{k},{i % 2 + 3}\n" for i, k in enumerate(keys)))
    return run_ingest(_config(root, csv, tmp_path_factory.mktemp("out") / "o", val_fraction=0.25))


def test_csv_manifest_with_integer_labels_and_no_split(integer_run, flat):
    _, keys = flat
    assert integer_run.manifest["classes"] == {"3": 3, "4": 4}
    rows = _rows(integer_run)
    assert sorted(rows) == sorted(keys)
    assert {row["label"] for row in rows.values()} == {3, 4}
    assert integer_run.manifest["split_source"] == "hash"


def test_integer_labels_keep_their_ids_so_the_class_count_reaches_the_largest(integer_run):
    # A head of len(classes) = 2 outputs could not take label 4; ids 0-2 are outputs no image uses.
    assert integer_run.manifest["num_classes"] == 5
    assert class_names(integer_run.manifest) == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("name,label\na.png,1\n", "missing column 'key'"),
        ("key,label,split\npool/img-0000.png,1,holdout\n", "split 'holdout'"),
    ],
)
def test_malformed_manifests_fail_with_one_line(ray_cluster, flat, tmp_path, text, words):
    root, _ = flat
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    with pytest.raises(IngestError, match=words) as info:
        run_ingest(_config(root, bad, tmp_path / "out"))
    assert "\n" not in str(info.value) and str(bad) in str(info.value)
