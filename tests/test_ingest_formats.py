"""The image ingest's input formats on the S3 server: unlabeled objects, WebDataset tar shards and
Parquet tables of image bytes; their bad input, and reruns that reuse per input shard."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipelines.core import shards
from pipelines.core.shards import read_manifest
from pipelines.image.ingest import IngestConfig, run_ingest


def _jpeg(seed: int, side: int = 20) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _ingest(s3_server, source: str, output: str, **fields):
    """Run the ingest with the server's credentials in the AWS environment for this call only."""
    config = IngestConfig(source=source, output=output, image_size=16, patch_size=4, shard_size=8, **fields)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env.items():
            mp.setenv(name, value)
        return run_ingest(config)


def _shard_rows(s3_server, bucket: str, prefix: str) -> list[dict]:
    client = s3_server.client()
    rows = []
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{shards.SHARD_DIR}/").get("Contents", []):
        body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        rows += pq.read_table(io.BytesIO(body), columns=["key", "label"]).to_pylist()
    return sorted(rows, key=lambda r: r["key"])


def _manifest(s3_server, bucket: str, prefix: str) -> dict:
    return json.loads(s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/{shards.MANIFEST}")["Body"].read())


# ---------------------------------------------------------------- unlabeled objects


@pytest.fixture(scope="module")
def loose_images(ray_cluster, s3_server):
    """Images under a prefix with no class folders, some at its root and some in folders."""
    client = s3_server.client()
    bucket = "formats-loose"
    client.create_bucket(Bucket=bucket)
    keys = [f"{i:02d}.jpg" for i in range(6)] + [f"day{d}/{i:02d}.jpg" for d in range(2) for i in range(5)]
    for i, key in enumerate(keys):
        client.put_object(Bucket=bucket, Key=f"loose/{key}", Body=_jpeg(i))
    return bucket, keys


def test_unlabeled_ingest_keeps_every_object_with_a_null_label(s3_server, loose_images):
    bucket, keys = loose_images
    _ingest(s3_server, f"s3://{bucket}/loose", f"s3://{bucket}/unlabeled", labeled=False)
    rows = _shard_rows(s3_server, bucket, "unlabeled")
    assert [r["key"] for r in rows] == sorted(keys)
    assert {r["label"] for r in rows} == {None}


def test_unlabeled_manifest_says_so_and_has_no_classes(s3_server, loose_images):
    bucket, keys = loose_images
    result = _ingest(s3_server, f"s3://{bucket}/loose", f"s3://{bucket}/unlabeled", labeled=False)
    manifest = _manifest(s3_server, bucket, "unlabeled")
    assert manifest["labeled"] is False and manifest["classes"] == {} and manifest["num_classes"] == 0
    assert result.counts["images"] == len(keys) and result.counts["rejected"] == 0


def test_labeled_manifest_says_labeled(tiny_dataset):
    assert read_manifest(tiny_dataset)["labeled"] is True


def test_an_unlabeled_ingest_takes_no_label_manifest():
    with pytest.raises(ValueError, match="unlabeled"):
        IngestConfig(source="/src", output="/out", manifest="/labels.csv", labeled=False)
