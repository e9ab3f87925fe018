"""Transient S3 faults: a real fault-injecting proxy (tests/fault_proxy.py) between the ingest and
moto's server, on the session's real Ray cluster. Throttling, resets and cut-off bodies are retried
and lose nothing; a fault that persists fails the stage in one line naming the object; nothing
secret travels to Ray tasks."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from botocore.exceptions import ClientError

from pipelines.core import shards
from pipelines.core.errors import StorageError, StoreAccessError, TransientStorageError
from pipelines.core.ingest import IngestKind, run_sharded_ingest
from pipelines.core.s3 import storage_error
from pipelines.core.samples import parquet_samples, tar_samples
from pipelines.core.storage import S3Settings, Store, open_store
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig
from tests.corpus_files import jpeg, webdataset_tar
from tests.fault_proxy import FaultProxy

KEYS = [f"class{c}/{i:02d}.jpg" for c in range(3) for i in range(8)]


@pytest.fixture
def corpus(s3_env, s3_bucket) -> str:
    """24 small JPEGs under s3://bucket/corpus (the test process has the server's keys in its chain)."""
    rng = np.random.default_rng(0)
    client = s3_env.client()
    for key in KEYS:
        client.put_object(Bucket=s3_bucket, Key=f"corpus/{key}", Body=jpeg(rng, (20, 24)))
    return f"s3://{s3_bucket}/corpus"


@pytest.fixture
def proxy(s3_env):
    with FaultProxy(s3_env.endpoint_url) as running:
        yield running


def _config(source: str, output: Path, proxy: FaultProxy, max_reject_fraction: float = 0.0, **fields) -> IngestConfig:
    return IngestConfig(source=source, output=str(output), endpoint_url=proxy.url, image_size=16, patch_size=4,
                        shard_size=8, max_reject_fraction=max_reject_fraction, **fields)


def _stored_keys(output: Path) -> list[str]:
    return sorted(k for path in (output / shards.SHARD_DIR).glob("*.parquet")
                  for k in pq.read_table(path, columns=["key"]).column("key").to_pylist())


def test_throttling_resets_and_cut_bodies_are_retried_and_every_object_is_stored_once(
    ray_cluster, corpus, proxy, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    faults = {"class0/01.jpg": ("slowdown", 2), "class1/03.jpg": ("reset", 2), "class2/05.jpg": ("truncate", 2),
              # more than one task's attempts: the shard task fails once and Ray runs it again
              "class2/07.jpg": ("slowdown", 5)}
    for key, (fault, times) in faults.items():
        proxy.fail(f"corpus/{key}", fault, times)
    result = run_ingest(_config(corpus, tmp_path / "out", proxy))
    assert result.counts["images"] == len(KEYS) and result.counts["rejected"] == 0
    assert _stored_keys(tmp_path / "out") == sorted(KEYS)  # every object exactly once
    assert {key: n for (key, _), n in proxy.injected.items()} == {f"corpus/{k}": t for k, (_, t) in faults.items()}


def test_a_fault_that_persists_fails_the_stage_in_one_line_naming_the_key_and_a_rerun_completes(
    ray_cluster, corpus, proxy, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    proxy.fail("corpus/class1/04.jpg", "slowdown", times=None)
    with pytest.raises(TransientStorageError) as failed:
        run_ingest(_config(corpus, tmp_path / "out", proxy))
    message = str(failed.value)
    assert message.startswith(f"{corpus}/class1/04.jpg: ") and "SlowDown" in message and "\n" not in message
    assert not (tmp_path / "out" / shards.SUCCESS).exists()

    proxy.clear()
    rerun = run_ingest(_config(corpus, tmp_path / "out", proxy))
    assert rerun.counts["images"] == len(KEYS) and rerun.counts["rejected"] == 0
    assert _stored_keys(tmp_path / "out") == sorted(KEYS)


def test_a_read_refused_for_the_workers_credentials_fails_the_stage_and_rejects_no_object(
    ray_cluster, corpus, proxy, tmp_path
):
    # Rejections are tolerated here, so only failing the stage keeps the object from being lost.
    proxy.fail("corpus/class0/02.jpg", "badkey", times=None)
    with pytest.raises(StoreAccessError, match=rf"^{corpus}/class0/02.jpg: the access key is not known"):
        run_ingest(_config(corpus, tmp_path / "out", proxy, max_reject_fraction=0.5))
    assert not (tmp_path / "out" / shards.SUCCESS).exists()


def test_an_object_refused_access_is_read_again_by_a_rerun_once_allowed(ray_cluster, corpus, proxy, tmp_path):
    proxy.fail("corpus/class2/06.jpg", "denied", times=None)
    first = run_ingest(_config(corpus, tmp_path / "out", proxy, max_reject_fraction=0.5))
    assert [(r["key"], r["reason"]) for r in first.manifest["rejected"]] == [("class2/06.jpg", "access denied")]

    proxy.clear()  # the permission is granted; the object's version, and so its shard's plan, is the same
    rerun = run_ingest(_config(corpus, tmp_path / "out", proxy, max_reject_fraction=0.5))
    assert rerun.counts["rejected"] == 0
    assert _stored_keys(tmp_path / "out") == sorted(KEYS)


def test_a_throttled_open_of_a_tar_shard_is_retried_and_loses_no_sample(ray_cluster, s3_env, s3_bucket, proxy,
                                                                       tmp_path, monkeypatch):
    # pyarrow opens each file with a HEAD, and S3 answers a HEAD's 503 with no body: no code, only its status.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    tar = webdataset_tar([{f"s{i}.jpg": jpeg(i), f"s{i}.cls": str(i % 2).encode()} for i in range(4)])
    s3_env.client().put_object(Bucket=s3_bucket, Key="tars/000000.tar", Body=tar)
    proxy.fail("tars/000000.tar", "slowdown", 4, method="HEAD")  # past pyarrow's own attempts: Ray runs it again
    result = run_ingest(_config(f"s3://{s3_bucket}/tars", tmp_path / "out", proxy, input_format="webdataset"))
    assert result.counts["images"] == 4 and result.counts["rejected"] == 0
    assert proxy.injected["tars/000000.tar", "slowdown"] == 4


def _samples_file(fmt: str) -> tuple[str, bytes]:
    """A WebDataset tar or a Parquet table of two images: (its key, its bytes)."""
    if fmt == "webdataset":
        return "in/000.tar", webdataset_tar([{f"s{i}.jpg": jpeg(i)} for i in range(2)])
    buf = io.BytesIO()
    pq.write_table(pa.table({"image": [jpeg(i) for i in range(2)]}), buf)
    return "in/000.parquet", buf.getvalue()


def _read_samples(store: Store, fmt: str, key: str, rejected: list) -> list:
    if fmt == "webdataset":
        return list(tar_samples(store, key, rejected, labeled=False, label_field=None, max_bytes=None))
    return list(parquet_samples(store, key, rejected, image_column="image", label_column=None, max_bytes=None))


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
@pytest.mark.parametrize(("keys", "cause"), [(("AKIAUNKNOWNUNKNOWN00", "x" * 40), "access key is not known"),
                                             ((None, "wrong-secret-" + "y" * 27), "signature does not match")])
def test_a_file_of_samples_refused_for_the_workers_credentials_fails_the_read_and_rejects_nothing(
    s3_env, s3_bucket, monkeypatch, fmt, keys, cause
):
    # pyarrow opens the file with a HEAD, whose 403 names no cause: it must not read as this file's "access denied".
    key, body = _samples_file(fmt)
    s3_env.client().put_object(Bucket=s3_bucket, Key=key, Body=body)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys[0] or s3_env.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys[1])
    rejected: list = []
    with pytest.raises(StoreAccessError, match=rf"^s3://{s3_bucket}/{key}: .*{cause}"):
        _read_samples(open_store(f"s3://{s3_bucket}"), fmt, key, rejected)
    assert rejected == []


def test_a_file_of_samples_a_policy_forbids_is_still_one_rejection(s3_env, s3_bucket, proxy):
    key, body = _samples_file("webdataset")
    s3_env.client().put_object(Bucket=s3_bucket, Key=key, Body=body)
    for method in ("HEAD", "GET"):
        proxy.fail(key, "denied", times=None, method=method)
    rejected: list = []
    assert _read_samples(open_store(f"s3://{s3_bucket}", S3Settings(proxy.url)), "webdataset", key, rejected) == []
    assert rejected == [{"key": key, "reason": "access denied"}]  # S3's own code, read from a GET


def _error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


@pytest.mark.parametrize(
    ("code", "status", "transient"),
    [("SlowDown", 503, True), ("InternalError", 500, True), ("ServiceUnavailable", 503, True),
     ("ExpiredToken", 400, True), ("RequestTimeout", 400, True),
     ("NoSuchKey", 404, False), ("AccessDenied", 403, False)],
)
def test_only_causes_that_may_pass_are_transient(code, status, transient):
    err = storage_error("s3://b/k.jpg", _error(code, status))
    assert isinstance(err, TransientStorageError) == transient and isinstance(err, StorageError)
    assert err.message.startswith("s3://b/k.jpg: ")


@pytest.mark.parametrize(
    ("text", "transient"),
    [("AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body.", True),
     ("AWS Error UNKNOWN (HTTP status 429) during HeadObject operation: No response body.", True),
     ("AWS Error UNKNOWN (HTTP status 400) during GetObject operation: ExceptionName: ExpiredToken", True),
     ("AWS Error UNKNOWN (HTTP status 404) during HeadObject operation: No response body.", False),
     ("AWS Error ACCESS_DENIED during HeadObject operation: No response body.", False)],
)
def test_a_pyarrow_error_without_an_s3_code_is_transient_by_its_status(text, transient):
    err = storage_error("s3://b/k.tar", OSError(f"When reading information for key 'k.tar' in bucket 'b': {text}"))
    assert isinstance(err, TransientStorageError) == transient


# ---------------------------------------------------------------- what Ray tasks receive


def _record_arguments(plan, config, source, out):
    """A shard step that writes nothing and returns the pickled arguments its Ray task received."""
    return {"key": plan["key"], "rejected": [], "received": pickle.dumps((plan, config, source, out)).hex()}


_RECEIVED: list[bytes] = []


def _assemble(config, settings, fingerprint, summaries):
    _RECEIVED.extend(bytes.fromhex(s["received"]) for s in summaries)
    return {"counts": {"objects": 0, "rejected": 0}, "rejected": [], "content_hash": "-"}


def test_no_secret_reaches_a_ray_task_argument(ray_cluster, corpus, s3_env, tmp_path):
    _RECEIVED.clear()
    kind = IngestKind("probe", "probe/1", "objects", _record_arguments, _assemble)
    config = IngestConfig(source=corpus, output=str(tmp_path / "out"), endpoint_url=s3_env.endpoint_url, shard_size=8)
    run_sharded_ingest(config, kind)
    assert len(_RECEIVED) >= len(KEYS) // 8  # every shard task (shards hold at most 8 keys) was probed
    for blob in _RECEIVED:
        assert s3_env.secret_key.encode() not in blob and s3_env.access_key.encode() not in blob
        assert corpus.split("//")[1].split("/")[0].encode() in blob  # the probe did see the task's arguments
