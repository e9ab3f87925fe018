"""Reuse decided by the input: a rerun picks up a changed label, an added or replaced object,
and rewrites only the shards whose inputs changed (moto's S3 server over HTTP, real Ray)."""

from __future__ import annotations

import io
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.core import plan as ingest_plan
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig
from tests.corpus_files import jpeg

SHARD_SIZE, WINDOW = 8, 2


def _upload_corpus(client, bucket: str, keys: list[str], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for key in keys:
        client.put_object(Bucket=bucket, Key=f"corpus/{key}", Body=jpeg(rng, (20, 24)))


def _config(bucket: str, out: str = "out", **overrides) -> IngestConfig:
    fields = dict(source=f"s3://{bucket}/corpus", output=f"s3://{bucket}/{out}", image_size=16, patch_size=4,
                  shard_size=SHARD_SIZE, mix_window=WINDOW, val_fraction=0.2)
    fields.update(overrides)
    return IngestConfig(**fields)


def _shard_rows(client, bucket: str, result) -> dict[str, list[tuple[str, int]]]:
    """Each shard of the result's manifest: its (key, label) rows, read back from the bucket."""
    rows = {}
    for entry in result.manifest["shards"]:
        body = client.get_object(Bucket=bucket, Key=f"out/{entry['path']}")["Body"].read()
        table = pq.read_table(io.BytesIO(body), columns=["key", "label"])
        rows[entry["path"]] = list(zip(table.column("key").to_pylist(), table.column("label").to_pylist()))
    return rows


def _versions(client, bucket: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix="out/shards/"):
        for v in page.get("Versions", []):
            counts[v["Key"]] = counts.get(v["Key"], 0) + 1
    return counts


@pytest.fixture
def versioned(s3_server):
    """A fresh versioned bucket (object versions show which shards a rerun rewrote); removed after."""
    client = s3_server.client()
    bucket = f"reuse-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    yield client, bucket
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
        for v in page.get("Versions", []) + page.get("DeleteMarkers", []):
            client.delete_object(Bucket=bucket, Key=v["Key"], VersionId=v["VersionId"])
    client.delete_bucket(Bucket=bucket)


FOLDER_KEYS = [f"class{c}/{i:03d}.jpg" for c in range(3) for i in range(40)]


def test_a_corrected_label_in_the_manifest_rewrites_only_its_shard(ray_cluster, s3_env, versioned):
    client, bucket = versioned
    keys = [f"pool/img-{i:04d}.jpg" for i in range(96)]
    _upload_corpus(client, bucket, keys)
    labels = {key: "abc"[i % 3] for i, key in enumerate(keys)}

    def put_manifest() -> None:
        body = "key,label\n" + "".join(f"{k},{labels[k]}\n" for k in keys)
        client.put_object(Bucket=bucket, Key="labels.csv", Body=body.encode())

    put_manifest()
    config = _config(bucket, manifest=f"s3://{bucket}/labels.csv")
    first = run_ingest(config)
    labels[keys[17]] = "c" if labels[keys[17]] != "c" else "a"  # the set of class names stays the same
    put_manifest()

    again = run_ingest(config)

    assert not again.skipped
    assert (again.shards_written, again.shards_reused) == (1, len(first.manifest["shards"]) - 1)
    rows = dict(row for shard in _shard_rows(client, bucket, again).values() for row in shard)
    assert rows[keys[17]] == again.manifest["classes"][labels[keys[17]]]
    assert again.manifest["content_hash"] != first.manifest["content_hash"]
    assert sorted(n for n in _versions(client, bucket).values()) == [1] * (len(first.manifest["shards"]) - 1) + [2]


def test_an_object_added_under_the_prefix_rewrites_only_the_shards_of_its_window(ray_cluster, s3_env, versioned):
    client, bucket = versioned
    _upload_corpus(client, bucket, FOLDER_KEYS)
    first = run_ingest(_config(bucket))
    before = _shard_rows(client, bucket, first)
    _upload_corpus(client, bucket, ["class1/020a.jpg"], seed=1)

    again = run_ingest(_config(bucket))

    after = _shard_rows(client, bucket, again)
    changed = [path for path, rows in after.items() if before.get(path) != rows]
    assert not again.skipped and again.counts["images"] == len(FOLDER_KEYS) + 1
    assert again.shards_written == len(changed) and again.shards_reused == len(after) - len(changed)
    assert 0 < len(changed) < len(after) // 3  # the shards of the key's window, not everything after it
    assert len({_window(path) for path in changed}) <= 2  # its window, split in two if the key ends a window
    assert any(key == "class1/020a.jpg" for path in changed for key, _ in after[path])
    assert again.manifest["content_hash"] != first.manifest["content_hash"]


def test_a_replaced_object_rewrites_only_its_shard(ray_cluster, s3_env, versioned):
    client, bucket = versioned
    _upload_corpus(client, bucket, FOLDER_KEYS)
    first = run_ingest(_config(bucket))
    _upload_corpus(client, bucket, ["class2/007.jpg"], seed=2)  # same key, new pixels

    again = run_ingest(_config(bucket))

    assert (again.shards_written, again.shards_reused) == (1, len(first.manifest["shards"]) - 1)
    assert again.manifest["content_hash"] != first.manifest["content_hash"]


def test_an_unchanged_input_is_skipped_and_nothing_is_written(ray_cluster, s3_env, versioned):
    client, bucket = versioned
    _upload_corpus(client, bucket, FOLDER_KEYS)
    first = run_ingest(_config(bucket))
    before = _versions(client, bucket)

    again = run_ingest(_config(bucket))

    assert again.skipped and again.shards_written == 0
    assert again.manifest["input_digest"] == first.manifest["input_digest"]
    assert _versions(client, bucket) == before


def _window(shard: str) -> str:
    """The window part of a shard's name (`<window>-<part>`, or its path `shards/shard-<window>-<part>.parquet`)."""
    return shard.rsplit("/", 1)[-1].removeprefix("shard-").split("-")[0]


def _items(keys: list[str]) -> list[ingest_plan.Item]:
    return [(k, 0, "", "c", "", "tag") for k in keys]


def test_an_added_key_changes_only_the_plans_of_its_window():
    keys = [f"c/{i:05d}.jpg" for i in range(5000)]
    before = {p["shard"]: p["keys"] for p in ingest_plan.cut_shards(iter(_items(keys)), 16, 4, seed=0)}
    keys.insert(2500, "c/02499a.jpg")
    after = {p["shard"]: p["keys"] for p in ingest_plan.cut_shards(iter(_items(keys)), 16, 4, seed=0)}

    changed = {name for name, k in after.items() if before.get(name) != k}
    assert 0 < len(changed) < len(after) // 10  # one window's shards; not the ~150 shards after the key
    assert len({_window(name) for name in changed}) <= 2  # its window, split in two if the key ends a window
    assert all(len(k) <= 16 for k in after.values())
    assert sorted(k for ks in after.values() for k in ks) == sorted(keys)
