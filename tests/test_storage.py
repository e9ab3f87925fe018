"""pipelines.core.storage: URIs, listing, atomic writes, credentials and one-line errors (real S3 server);
and the URI scrubber every log line and error message goes through (`pipelines.core.uris`)."""

from __future__ import annotations

import datetime as dt
import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.core.errors import StorageError
from pipelines.core.fetch import fetch
from pipelines.core.s3 import parse_timestamp, storage_error
from pipelines.core.storage import LocalStore, S3Settings, open_store, parse_uri, ray_storage
from pipelines.core.uris import scrub_userinfo, strip_userinfo

KEYS = ["a.txt", "a/b.jpg", "a-b/c.jpg", "b/x/y.png", "b/z.png", "c"]


def test_parse_uri_splits_bucket_and_prefix():
    loc = parse_uri("s3://my-bucket/some/prefix/")
    assert (loc.scheme, loc.bucket, loc.path) == ("s3", "my-bucket", "some/prefix")
    assert loc.uri == "s3://my-bucket/some/prefix"


@pytest.mark.parametrize("prefix", ["data#1/x", "q?v=1/x", "a b/%41+/x"])
def test_an_s3_prefix_is_taken_literally_as_s3_keys_are(prefix):
    # A `#` or `?` cut the prefix short: `s3://b/data#1/x` read and wrote `s3://b/data`.
    loc = parse_uri(f"s3://my-bucket/{prefix}/")
    assert (loc.bucket, loc.path, loc.uri) == ("my-bucket", prefix, f"s3://my-bucket/{prefix}")


def test_parse_uri_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_uri("data/x").path == str(tmp_path / "data" / "x")
    assert parse_uri(f"file://{tmp_path}").path == str(tmp_path)


@pytest.mark.parametrize(
    "uri, words",
    [
        ("gs://bucket/x", "unsupported scheme"),
        ("s3://AKIA:secret@bucket/x", "credentials in the URI"),
        ("s3://Bad_Bucket/x", "not a valid bucket name"),
        ("", "non-empty"),
    ],
)
def test_parse_uri_rejects_bad_uris_with_one_line(uri, words):
    with pytest.raises(ValueError, match=words) as info:
        parse_uri(uri)
    assert "secret" not in str(info.value)
    assert "\n" not in str(info.value)


def _put_local(root, keys):
    for key in keys:
        path = root.joinpath(*key.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())


@pytest.mark.parametrize(
    "uri, shown",
    [
        # what the tracking scrubber handled: an MLflow server URL with a password
        ("http://alice:hunter2@mlflow.example:5000/x", "http://mlflow.example:5000/x"),
        # what the S3 scrubber handled: keys in an s3:// URI, and an endpoint with credentials
        ("s3://AKIA:secret@bucket/x", "s3://bucket/x"),
        ("http://minio:minio123@127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("http://user@host/p", "http://host/p"),
        # the host as written: case, IPv6 brackets, a port that is not a number, an unclosed bracket
        ("http://u:p@MLflow.Example:5000/", "http://MLflow.Example:5000/"),
        ("http://u:p@[::1]:5000/x", "http://[::1]:5000/x"),
        ("http://u:p@host:port/x", "http://host:port/x"),
        ("http://u:p@[::1/x", "http://[::1/x"),
        # an unquoted @ in the password; an @ after the authority is not userinfo
        ("http://u:p@ss@host/x?q=a@b#c@d", "http://host/x?q=a@b#c@d"),
        ("//u:p@host/x", "//host/x"),
        # nothing to strip
        ("s3://bucket/runs", "s3://bucket/runs"),
        ("http://host/a@b", "http://host/a@b"),
        ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
        ("runs:/abc/model", "runs:/abc/model"),
        ("/data/a@b/x", "/data/a@b/x"),
    ],
)
def test_strip_userinfo_drops_credentials_and_keeps_the_rest_as_written(uri, shown):
    assert strip_userinfo(uri) == shown


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("Failed to connect to Ray at address: http://u:s3cret@127.0.0.1:1.", "Failed to connect to Ray at address: http://127.0.0.1:1."),
        ("SSL validation failed for https://minio:hunter2@h:9000/bkt/a.jpg [SSL] (_ssl.c:1006)",
         "SSL validation failed for https://h:9000/bkt/a.jpg [SSL] (_ssl.c:1006)"),
        ("two: a https://u:p@ss@one/x b s3://K:S@two/y", "two: a https://one/x b s3://two/y"),
        ("a mail address user@example.com and http://host/a@b stay", "a mail address user@example.com and http://host/a@b stay"),
    ],
)
def test_scrub_userinfo_drops_the_credentials_of_every_url_inside_a_text(text, shown):
    assert scrub_userinfo(text) == shown


def test_local_listing_is_sorted_like_s3_and_skips_hidden_names(tmp_path):
    _put_local(tmp_path, KEYS + [".DS_Store", "a/.hidden.jpg"])
    keys = [k for page in LocalStore(str(tmp_path)).list_pages() for k in page]
    assert keys == sorted(KEYS)  # "a-b/..." < "a.txt" < "a/..." in byte order


def test_local_and_s3_listings_agree(tmp_path, s3_env, s3_bucket):
    s3_server = s3_env
    _put_local(tmp_path, KEYS)
    client = s3_server.client()
    for key in KEYS:
        client.put_object(Bucket=s3_bucket, Key=f"root/{key}", Body=key.encode())
    client.put_object(Bucket=s3_bucket, Key="root/dir-marker/", Body=b"")
    settings = S3Settings(s3_server.endpoint_url)
    s3_keys = [k for page in open_store(f"s3://{s3_bucket}/root", settings).list_pages() for k in page]
    local_keys = [k for page in LocalStore(str(tmp_path)).list_pages() for k in page]
    assert s3_keys == local_keys


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_listing_streams_in_pages(kind, tmp_path, s3_env, s3_bucket):
    s3_server = s3_env
    keys = [f"c/{i:03d}.jpg" for i in range(7)]
    if kind == "local":
        _put_local(tmp_path, keys)
        store = LocalStore(str(tmp_path))
    else:
        client = s3_server.client()
        for key in keys:
            client.put_object(Bucket=s3_bucket, Key=key, Body=b"x")
        settings = S3Settings(s3_server.endpoint_url)
        store = open_store(f"s3://{s3_bucket}", settings)
    pages = store.list_pages(page_size=3)
    assert next(pages) == keys[:3]  # a generator: the first page arrives before the rest is listed
    assert [len(p) for p in pages] == [3, 1]


def test_local_write_is_atomic_and_leaves_no_temporary_file(tmp_path):
    store = LocalStore(str(tmp_path))
    store.write("d/obj.bin", b"old")
    store.write("d/obj.bin", b"new")
    assert (tmp_path / "d" / "obj.bin").read_bytes() == b"new"
    assert os.listdir(tmp_path / "d") == ["obj.bin"]


def test_local_keys_cannot_escape_the_root(tmp_path):
    with pytest.raises(StorageError, match="escapes the storage root"):
        LocalStore(str(tmp_path / "root")).read("../secret.txt")


def test_s3_store_round_trips_bytes(s3_env, s3_bucket):
    settings = S3Settings(s3_env.endpoint_url)
    store = open_store(f"s3://{s3_bucket}/p", settings)
    store.write("x/y.bin", b"payload")
    assert store.exists("x/y.bin") and not store.exists("x/z.bin")
    assert store.read("x/y.bin") == b"payload"
    store.delete("x/y.bin")
    assert not store.exists("x/y.bin")


def test_s3_clients_read_listing_and_header_timestamps_as_aware_utc_datetimes(s3_env, s3_bucket):
    # The listing client reads LastModified with the fast ISO 8601 path; headers (RFC 822) take botocore's.
    client = S3Settings(s3_env.endpoint_url).boto3_client("s3")
    client.put_object(Bucket=s3_bucket, Key="stamp/a", Body=b"x")
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="stamp/")["Contents"][0]["LastModified"]
    headed = client.head_object(Bucket=s3_bucket, Key="stamp/a")["LastModified"]
    assert listed.utcoffset() == headed.utcoffset() == dt.timedelta(0)
    assert abs(listed - headed) < dt.timedelta(seconds=1)  # the header has whole seconds


@pytest.mark.parametrize("value", ["2026-12-05T03:50:00.123Z", "2026-12-05T03:50:00", "Sat, 05 Dec 2026 03:50:00 GMT",
                                   1796441400, "1796441400"])
def test_parse_timestamp_agrees_with_botocores_parser(value):
    from botocore.utils import parse_timestamp as botocore_parse

    assert parse_timestamp(value) == botocore_parse(value)  # naive against aware compares unequal


def test_settings_resolve_the_endpoint_from_the_environment_and_clients_use_its_credentials(s3_env, s3_bucket):
    settings = S3Settings.resolve()
    assert settings.endpoint_url == s3_env.endpoint_url
    open_store(f"s3://{s3_bucket}", settings).check()  # signed with the environment's keys
    assert settings.public() == {"endpoint_url": s3_env.endpoint_url, "region": "us-east-1"}


def test_settings_resolve_credentials_from_a_profile(s3_server, s3_bucket, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[ingest]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_PROFILE", "ingest")
    store = open_store(f"s3://{s3_bucket}", endpoint_url=s3_server.endpoint_url)
    store.write("k", b"v")
    assert store.read("k") == b"v"


def test_a_process_reuses_one_s3_client_per_settings(s3_env):
    settings = S3Settings(s3_env.endpoint_url)
    assert settings.boto3_client("s3") is S3Settings(s3_env.endpoint_url).boto3_client("s3")
    assert settings.boto3_client("s3") is not S3Settings(s3_env.endpoint_url, max_attempts=2).boto3_client("s3")


def test_a_store_opened_after_the_credential_variables_change_signs_with_the_new_keys(s3_env, s3_bucket, monkeypatch):
    settings = S3Settings(s3_env.endpoint_url)
    open_store(f"s3://{s3_bucket}", settings).check()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match="access denied|signature"):
        open_store(f"s3://{s3_bucket}", settings).check()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    open_store(f"s3://{s3_bucket}", settings).check()


def test_a_store_opened_after_the_credentials_file_is_rewritten_signs_with_its_new_keys(
    s3_server, s3_bucket, tmp_path, monkeypatch
):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    creds = tmp_path / "credentials"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    settings = S3Settings(s3_server.endpoint_url)
    creds.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = rotated-away\n")
    with pytest.raises(StorageError, match="access denied|signature"):
        open_store(f"s3://{s3_bucket}", settings).check()
    creds.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n")
    open_store(f"s3://{s3_bucket}", settings).check()


def test_settings_and_stores_carry_no_secret_into_what_a_ray_worker_receives(s3_env):
    settings = S3Settings.resolve()
    assert s3_env.secret_key not in repr(settings)
    store = open_store("s3://some-bucket/x", settings)
    blob = pickle.dumps(store)  # what a Ray worker receives
    assert s3_env.secret_key.encode() not in blob and s3_env.access_key.encode() not in blob
    assert pickle.loads(blob).settings == settings


def test_ray_trains_filesystem_carries_no_secret(s3_env, s3_bucket):
    path, filesystem = ray_storage(f"s3://{s3_bucket}/runs")
    blob = pickle.dumps(filesystem)  # what Ray Train ships to its workers
    assert s3_env.secret_key.encode() not in blob and s3_env.access_key.encode() not in blob
    assert path == f"{s3_bucket}/runs"


def _size_of(filesystem, path: str) -> int:
    return filesystem.get_file_info(path).size  # one HEAD


def test_a_filesystem_pickled_to_a_ray_worker_keeps_its_retries(ray_cluster, s3_env, s3_bucket):
    import ray

    from tests.fault_proxy import FaultProxy

    s3_env.client().put_object(Bucket=s3_bucket, Key="retry/x.bin", Body=b"abc")
    with FaultProxy(s3_env.endpoint_url) as proxy:
        proxy.fail("retry/x.bin", "slowdown", 4, method="HEAD")  # past pyarrow's default of 3 attempts
        filesystem = S3Settings(proxy.url, max_attempts=6).arrow_filesystem()
        size = ray.get(ray.remote(_size_of).remote(filesystem, f"{s3_bucket}/retry/x.bin"))
    assert size == 3 and proxy.injected["retry/x.bin", "slowdown"] == 4


def _s3_error(s3_server, uri, endpoint_url=None, keys=None):
    """The one-line error of checking `uri`, with the server's keys (or `keys`) in this process's chain."""
    access_key, secret_key = keys or (s3_server.access_key, s3_server.secret_key)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**s3_server.env, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}.items():
            mp.setenv(name, value)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.delenv("AWS_PROFILE", raising=False)
        with pytest.raises(StorageError) as info:
            open_store(uri, S3Settings(endpoint_url or s3_server.endpoint_url)).check()
    message = str(info.value)
    assert "\n" not in message and message.startswith(uri)
    return message


def test_missing_bucket_is_one_line_naming_the_uri(s3_server):
    assert "bucket does not exist" in _s3_error(s3_server, "s3://no-such-bucket/data")


def test_wrong_endpoint_is_one_line_naming_the_uri(s3_server, s3_bucket):
    closed = f"http://127.0.0.1:{_closed_port()}"
    message = _s3_error(s3_server, f"s3://{s3_bucket}/data", endpoint_url=closed)
    assert f"cannot connect to {closed}" in message


def test_unknown_access_key_is_one_line_naming_the_uri(s3_server, s3_bucket):
    message = _s3_error(s3_server, f"s3://{s3_bucket}/data", keys=("AKIAAAAAAAAAAAAAAAAA", "x" * 40))
    assert "access key is not known" in message


def test_wrong_secret_is_one_line_without_the_secret(s3_server, s3_bucket):
    wrong = "wrong-secret-" + "y" * 27
    message = _s3_error(s3_server, f"s3://{s3_bucket}/data", keys=(s3_server.access_key, wrong))
    assert "signature does not match" in message and wrong not in message


@pytest.mark.parametrize(
    ("error", "password"),
    [("SSLError", "hunter2"), ("ReadTimeoutError", "hunter2"),
     ("ReadTimeoutError", "p" * 300)],  # longer than the cause's line, which is cut at 200 characters
    ids=["ssl", "read-timeout", "password-longer-than-the-line"],
)
def test_a_password_in_the_endpoint_url_never_reaches_a_storage_error(error, password):
    from botocore import exceptions as bce

    url = f"https://minio:{password}@s3.example:9000/bkt/data/a.jpg"
    exc = getattr(bce, error)(endpoint_url=url, error="wrong version number")
    assert password[:7] in str(exc)  # botocore quotes the request URL
    message = storage_error("s3://bkt/data/a.jpg", exc).message
    assert message.startswith("s3://bkt/data/a.jpg: ") and password[:7] not in message


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


def test_ray_storage_is_a_path_locally(tmp_path):
    assert ray_storage(str(tmp_path / "runs")) == (str(tmp_path / "runs"), None)


def test_ray_storage_gives_a_pyarrow_filesystem_that_can_write_to_s3(s3_env, s3_bucket):
    path, fs = ray_storage(f"s3://{s3_bucket}/runs")
    assert path == f"{s3_bucket}/runs"
    # Multipart uploads (what Ray Train checkpoints use) must work against the test server.
    pq.write_table(pa.table({"x": [1, 2, 3]}), f"{path}/t.parquet", filesystem=fs)
    assert pq.read_table(f"{path}/t.parquet", filesystem=fs).column("x").to_pylist() == [1, 2, 3]


def test_an_s3_store_reads_every_key_through_one_arrow_filesystem(s3_env, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/shards")
    for name in ("a.parquet", "b.parquet"):
        fs, path = store.arrow(name)
        pq.write_table(pa.table({"x": [len(name)]}), path, filesystem=fs)
    assert store.arrow("a.parquet")[0] is store.arrow("b.parquet")[0]
    copy = pickle.loads(pickle.dumps(store))  # a Ray worker's copy makes its own
    fs, path = copy.arrow("b.parquet")
    assert pq.read_table(path, filesystem=fs).column("x").to_pylist() == [9]


def test_local_listing_survives_a_symlink_loop(tmp_path):
    _put_local(tmp_path, ["a/x.jpg"])
    (tmp_path / "a" / "loop").symlink_to(tmp_path)
    assert [k for page in LocalStore(str(tmp_path)).list_pages() for k in page] == ["a/x.jpg"]


def _listed(store):
    return [entry for page in store.list_entries() for entry in page]


def test_a_dangling_symlink_is_listed_and_its_read_rejects_it_with_its_cause(tmp_path):
    _put_local(tmp_path, ["cat/a.jpg", "dog/b.jpg"])
    (tmp_path / "cat" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    store = LocalStore(str(tmp_path))
    assert [key for key, _, _ in _listed(store)] == ["cat/a.jpg", "cat/gone.jpg", "dog/b.jpg"]
    assert fetch(store, "cat/gone.jpg") == "does not exist"


def test_a_dangling_symlink_mended_later_gets_a_new_version(tmp_path):
    (tmp_path / "gone.jpg").symlink_to(tmp_path / "target.jpg")
    store = LocalStore(str(tmp_path))
    before = _listed(store)
    (tmp_path / "target.jpg").write_bytes(b"img")
    assert _listed(store) != before and _listed(store)[0][1] == 3


def test_a_folder_that_cannot_be_read_fails_the_listing_naming_itself(tmp_path, monkeypatch):
    _put_local(tmp_path, ["cat/a.jpg", "locked/z.jpg"])
    scandir = os.scandir

    def refused(path):  # as root, permission bits refuse nothing: the refusal is planted
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refused)
    with pytest.raises(StorageError, match=rf"^{tmp_path}/locked: permission denied$"):
        _listed(LocalStore(str(tmp_path)))
