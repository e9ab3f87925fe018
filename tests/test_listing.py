"""A source is listed by class folder in parallel on Ray, and gives exactly the sequential listing."""

from __future__ import annotations

import pytest

from pipelines.core.errors import StorageError
from pipelines.core.listing import source_entries
from pipelines.core.storage import S3Settings, open_store

# Keys whose order tricks a naive merge: "-" and "." sort before "/", so "a-b/x" and "a.txt" come
# before the folder "a/"; hidden names and folder markers are skipped; "d/" holds only a marker.
KEYS = [
    "a-b/x.jpg", "a.txt", "a/y.jpg", "a/z/deep.jpg", "a/.DS_Store", "a0.txt", "b/1.jpg", "b/2.jpg", "b/3.jpg",
    "b/4.jpg", ".cache/x.jpg", "c/", "c/k.jpg", "d/", "e/e1.jpg", "e/e2.jpg", "f.txt",
]


def _flat(pages) -> list[tuple[str, int, str]]:
    return [entry for page in pages for entry in page]


@pytest.fixture
def source(s3_env, s3_bucket):
    client = s3_env.client()
    for key in KEYS:
        client.put_object(Bucket=s3_bucket, Key=f"corpus/{key}", Body=b"" if key.endswith("/") else key.encode())
    return open_store(f"s3://{s3_bucket}/corpus", S3Settings.resolve())


def test_parallel_listing_gives_the_sequential_listing_in_key_order(ray_cluster, source):
    sequential = _flat(source.list_entries())
    # Pages of two keys and two folders in flight: pagination and the in-flight bound both at work.
    parallel = _flat(source_entries(source, width=2, page_size=2))
    assert parallel == sequential
    assert [key for key, _, _ in parallel][:4] == ["a-b/x.jpg", "a.txt", "a/y.jpg", "a/z/deep.jpg"]


def test_a_flat_source_is_its_first_level(ray_cluster, s3_env, s3_bucket):
    client = s3_env.client()
    for key in ("img2.jpg", "img1.jpg", ".tmp"):
        client.put_object(Bucket=s3_bucket, Key=f"flat/{key}", Body=b"x")
    source = open_store(f"s3://{s3_bucket}/flat", S3Settings.resolve())
    assert [key for key, _, _ in _flat(source_entries(source, width=4))] == ["img1.jpg", "img2.jpg"]


def test_a_bucket_root_is_listed_by_folder_too(ray_cluster, s3_env, s3_bucket):
    client = s3_env.client()
    for key in ("x/1.jpg", "y/2.jpg", "top.jpg"):
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"x")
    source = open_store(f"s3://{s3_bucket}", S3Settings.resolve())
    assert _flat(source_entries(source, width=1)) == _flat(source.list_entries())


def test_a_consumer_that_stops_early_leaves_no_folder_listing_behind(ray_cluster, source):
    pages = source_entries(source, width=3, page_size=1)
    first = next(pages)
    pages.close()  # cancels the folders in flight; a second listing is unaffected
    assert first == [_flat(source.list_entries())[0]]
    assert _flat(source_entries(source, width=3)) == _flat(source.list_entries())


def test_a_missing_bucket_is_one_line_naming_it(ray_cluster, s3_env):
    source = open_store("s3://no-such-bucket-vitpipe/corpus", S3Settings.resolve())
    with pytest.raises(StorageError, match=r"^s3://no-such-bucket-vitpipe/corpus: bucket does not exist$"):
        _flat(source_entries(source, width=2))


def test_a_local_source_is_listed_in_this_process(tmp_path):
    for key in ("b/1.jpg", "a/2.jpg", "a/1.jpg"):
        (tmp_path / key).parent.mkdir(exist_ok=True)
        (tmp_path / key).write_bytes(b"x")
    source = open_store(str(tmp_path))
    assert [key for key, _, _ in _flat(source_entries(source, width=2))] == ["a/1.jpg", "a/2.jpg", "b/1.jpg"]


@pytest.mark.parametrize("prefix", ["corpus/", ""])
def test_a_listed_key_with_a_leading_slash_reads_its_own_object(s3_env, s3_bucket, prefix):
    # `corpus//a.jpg` lists as `/a.jpg` under `corpus`: another object than `corpus/a.jpg`.
    client = s3_env.client()
    for key in (f"{prefix}/a.jpg", f"{prefix}a.jpg", f"{prefix}/cat/b.jpg"):
        client.put_object(Bucket=s3_bucket, Key=key, Body=key.encode())
    source = open_store(f"s3://{s3_bucket}/{prefix}", S3Settings.resolve())
    listed = [key for key, _, _ in _flat(source.list_entries())]
    assert listed == ["/a.jpg", "/cat/b.jpg", "a.jpg"]
    assert [source.read(key) for key in listed] == [f"{prefix}{key}".encode() for key in listed]


def test_a_key_ending_in_a_slash_that_holds_bytes_is_listed_and_reads_back(s3_env, s3_bucket):
    # Only an empty object is a folder marker; one with bytes is an input, kept or rejected by its content.
    client = s3_env.client()
    for key, body in (("corpus/", b"root"), ("corpus/cat/", b""), ("corpus/cat/a.jpg", b"a"), ("corpus/cat/b/", b"b")):
        client.put_object(Bucket=s3_bucket, Key=key, Body=body)
    source = open_store(f"s3://{s3_bucket}/corpus", S3Settings.resolve())
    listed = [key for key, _, _ in _flat(source.list_entries())]
    assert listed == ["cat/a.jpg", "cat/b/"]
    assert source.read("cat/b/") == b"b"
