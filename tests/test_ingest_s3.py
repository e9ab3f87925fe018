"""The ingest stage against a real S3-compatible server (moto over HTTP, authentication enforced)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from pipelines.core import shards
from pipelines.core.shards import read_manifest
from pipelines.core.errors import StorageError
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig
from tests.corpus_files import jpeg


def _corpus(root: Path, classes: int = 3, per_class: int = 20, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    keys = []
    for c in range(classes):
        for i in range(per_class):
            key = f"class{c}/{i:03d}.jpg"
            (root / f"class{c}").mkdir(parents=True, exist_ok=True)
            side = int(rng.integers(20, 40))
            (root / key).write_bytes(jpeg(rng, (side, side + 4)))
            keys.append(key)
    return keys


def _upload(client, root: Path, keys: list[str], bucket: str, prefix: str) -> None:
    for key in keys:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=(root / key).read_bytes())


def _config(source: str, output: str, endpoint: str | None = None, **overrides) -> IngestConfig:
    fields = dict(source=source, output=output, endpoint_url=endpoint, image_size=16, patch_size=4, shard_size=16)
    fields.update(overrides)
    return IngestConfig(**fields)


def _objects(client, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for page in pages for o in page.get("Contents", []))


def _versions(client, bucket: str, prefix: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
        for v in page.get("Versions", []):
            counts[v["Key"][len(prefix):]] = counts.get(v["Key"][len(prefix):], 0) + 1
    return counts


@pytest.fixture(scope="module")
def bucket(s3_server):
    """A versioned bucket for this module (versions show which objects a rerun rewrote)."""
    client = s3_server.client()
    name = f"ingest-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


@pytest.fixture(scope="module")
def corpus(s3_server, bucket, tmp_path_factory):
    root = tmp_path_factory.mktemp("s3-corpus")
    keys = _corpus(root)
    _upload(s3_server.client(), root, keys, bucket, "corpus")
    return root, keys


def _run_with_env(s3_server, config: IngestConfig):
    """Run with the server's credentials in the AWS environment for the duration of the call only."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env.items():
            mp.setenv(name, value)
        return run_ingest(config)


@pytest.fixture(scope="module")
def ingested(ray_cluster, s3_server, bucket, corpus):
    return _run_with_env(s3_server, _config(f"s3://{bucket}/corpus", f"s3://{bucket}/out"))


def test_shards_manifest_and_marker_land_in_the_bucket(s3_server, bucket, ingested):
    objects = _objects(s3_server.client(), bucket, "out/")
    expected = sorted([s["path"] for s in ingested.manifest["shards"]] + [shards.MANIFEST, shards.SUCCESS])
    assert objects == expected


def test_s3_and_local_ingest_of_the_same_files_are_identical(ray_cluster, corpus, ingested, tmp_path):
    root, keys = corpus
    local = run_ingest(_config(str(root), str(tmp_path / "out")))
    assert local.manifest["content_hash"] == ingested.manifest["content_hash"]
    assert ingested.counts["images"] == len(keys)


def test_the_s3_output_reads_back_as_a_finished_manifest(s3_env, bucket, ingested):
    assert read_manifest(f"s3://{bucket}/out") == ingested.manifest


def test_training_reads_the_s3_output_through_ray_data(s3_env, bucket, ingested):
    from pipelines.image.data import load_split, patch_dataset

    ds = patch_dataset(f"s3://{bucket}/out", "train", augment=False)
    rows = sum(len(batch["label"]) for batch in ds.iter_torch_batches(batch_size=16))
    assert rows == ingested.counts["train"]
    x, y = load_split(f"s3://{bucket}/out", "val")
    assert x.shape == (ingested.counts["val"], 16, 48) and len(y) == ingested.counts["val"]


def test_rerun_on_s3_rewrites_nothing(s3_server, bucket, ingested):
    client = s3_server.client()
    before = _versions(client, bucket, "out/")
    again = _run_with_env(s3_server, _config(f"s3://{bucket}/corpus", f"s3://{bucket}/out"))
    assert again.skipped
    assert _versions(client, bucket, "out/") == before


def test_an_s3_output_missing_a_shard_and_its_marker_is_completed_by_writing_only_that_shard(s3_server, bucket,
                                                                                             ingested):
    # A copy of the finished output with one shard and `_SUCCESS` deleted by hand (not an interruption).
    client = s3_server.client()
    for key in _objects(client, bucket, "out/"):
        client.copy_object(Bucket=bucket, Key=f"completed/{key}", CopySource={"Bucket": bucket, "Key": f"out/{key}"})
    lost = ingested.manifest["shards"][1]["path"]
    client.delete_object(Bucket=bucket, Key=f"completed/{shards.SUCCESS}")
    client.delete_object(Bucket=bucket, Key=f"completed/{lost}")
    result = _run_with_env(s3_server, _config(f"s3://{bucket}/corpus", f"s3://{bucket}/completed"))
    assert result.shards_written == 1
    versions = _versions(client, bucket, "completed/")
    assert versions[lost] == 2  # the original copy and the rewrite
    assert all(versions[s["path"]] == 1 for s in ingested.manifest["shards"] if s["path"] != lost)
    assert result.manifest["content_hash"] == ingested.manifest["content_hash"]


def _one_line_error(s3_env, config: IngestConfig) -> str:
    with pytest.raises(StorageError) as info:
        run_ingest(config)
    message = str(info.value)
    assert "\n" not in message and s3_env.secret_key not in message
    return message


def test_missing_source_bucket_is_named(s3_env, s3_bucket):
    message = _one_line_error(s3_env, _config("s3://no-such-source/images", f"s3://{s3_bucket}/out"))
    assert message == "s3://no-such-source/images: bucket does not exist"


def test_missing_output_bucket_is_named(s3_env, s3_bucket):
    message = _one_line_error(s3_env, _config(f"s3://{s3_bucket}/images", "s3://no-such-output/out"))
    assert message == "s3://no-such-output/out: bucket does not exist"


def test_empty_prefix_is_named(s3_env, s3_bucket):
    message = _one_line_error(s3_env, _config(f"s3://{s3_bucket}/nothing-here", f"s3://{s3_bucket}/out"))
    assert message == f"s3://{s3_bucket}/nothing-here: no objects under this prefix"


def test_wrong_endpoint_is_named(s3_env, s3_bucket):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    message = _one_line_error(s3_env, _config(f"s3://{s3_bucket}/images", f"s3://{s3_bucket}/out", endpoint=closed))
    assert message == f"s3://{s3_bucket}/out: cannot connect to {closed}"


def test_unknown_access_key_is_named(s3_env, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAAAAAAAAAAAAAAAAA")
    message = _one_line_error(s3_env, _config(f"s3://{s3_bucket}/images", f"s3://{s3_bucket}/out"))
    assert message.startswith(f"s3://{s3_bucket}/out: the access key is not known")


def test_wrong_secret_is_named_without_showing_it(s3_env, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-" + "z" * 25)
    message = _one_line_error(s3_env, _config(f"s3://{s3_bucket}/images", f"s3://{s3_bucket}/out"))
    assert message.startswith(f"s3://{s3_bucket}/out: the request signature does not match")
    assert "not-the-secret" not in message


def test_cli_prints_one_line_and_exits_non_zero(s3_env, tmp_path):
    env = {**os.environ, **s3_env.env, "VITPIPE_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "ingest", "s3://no-such-bucket/images", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 1
    [log_file] = (tmp_path / "logs").iterdir()
    assert proc.stderr.strip() == f"error: s3://no-such-bucket/images: bucket does not exist (log: {log_file})"
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Traceback" in log_file.read_text() and s3_env.secret_key not in log_file.read_text()


def test_credentials_never_reach_outputs_or_logs(ray_cluster, s3_env, s3_bucket, tmp_path, caplog, capfd):
    import ray

    root = tmp_path / "corpus"
    keys = _corpus(root, classes=2, per_class=5, seed=7)
    _upload(s3_env.client(), root, keys, s3_bucket, "in")
    with caplog.at_level(logging.DEBUG):
        result = run_ingest(_config(f"s3://{s3_bucket}/in", f"s3://{s3_bucket}/out", endpoint=s3_env.endpoint_url))
    assert result.counts["images"] == len(keys)
    secret = s3_env.secret_key
    client = s3_env.client()
    for key in _objects(client, s3_bucket, "out/"):
        assert secret.encode() not in client.get_object(Bucket=s3_bucket, Key=f"out/{key}")["Body"].read(), key
    out, err = capfd.readouterr()
    assert secret not in caplog.text and secret not in out and secret not in err
    assert result.manifest["config"]["endpoint_url"] == s3_env.endpoint_url
    logs = Path(ray._private.worker._global_node.get_session_dir_path(), "logs")  # this session's logs
    leaks = [p for p in logs.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaks == []
