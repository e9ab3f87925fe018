"""The image ingest's input formats on the S3 server: unlabeled objects, WebDataset tar shards and
Parquet tables of image bytes; their bad input, and reruns that reuse per input shard."""

from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.core import shards
from pipelines.core.shards import read_manifest
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig
from tests.corpus_files import jpeg, webdataset_tar
from tests.process_output import result_json


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
        client.put_object(Bucket=bucket, Key=f"loose/{key}", Body=jpeg(i))
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


def test_an_output_inside_a_brace_ranges_folder_is_refused():
    with pytest.raises(ValueError, match="inside source"):
        IngestConfig(source="/data/{000000..000009}.tar", output="/data/out", input_format="webdataset")


def test_an_unlabeled_ingest_takes_no_label_manifest():
    with pytest.raises(ValueError, match="unlabeled"):
        IngestConfig(source="/src", output="/out", manifest="/labels.csv", labeled=False)


# ---------------------------------------------------------------- WebDataset tar shards


def _wds_shard(shard: int, n: int = 4) -> bytes:
    return webdataset_tar([{f"s{shard}-{i}.jpg": jpeg(10 * shard + i), f"s{shard}-{i}.cls": str(i % 3).encode(),
                            f"s{shard}-{i}.json": json.dumps({"y": 7}).encode()} for i in range(n)])


@pytest.fixture(scope="module")
def wds(ray_cluster, s3_server):
    """Four tar shards of four labeled samples each under s3://formats-wds/tars/."""
    client = s3_server.client()
    client.create_bucket(Bucket="formats-wds")
    for shard in range(4):
        client.put_object(Bucket="formats-wds", Key=f"tars/{shard:06d}.tar", Body=_wds_shard(shard))
    return "formats-wds"


def test_webdataset_samples_are_grouped_by_basename_with_their_cls_label(s3_server, wds):
    result = _ingest(s3_server, f"s3://{wds}/tars", f"s3://{wds}/out-listing", input_format="webdataset")
    rows = _shard_rows(s3_server, wds, "out-listing")
    assert [(r["key"], r["label"]) for r in rows] == sorted(
        (f"{s:06d}.tar/s{s}-{i}", i % 3) for s in range(4) for i in range(4))
    assert result.manifest["classes"] == {"0": 0, "1": 1, "2": 2} and result.manifest["labeled"] is True


def test_webdataset_brace_range_reads_only_the_shards_it_names(s3_server, wds):
    result = _ingest(s3_server, f"s3://{wds}/tars/{{000001..000002}}.tar", f"s3://{wds}/out-range",
                     input_format="webdataset")
    keys = {r["key"].split("/")[0] for r in _shard_rows(s3_server, wds, "out-range")}
    assert keys == {"000001.tar", "000002.tar"} and result.counts["images"] == 8


def test_webdataset_label_can_come_from_a_named_json_field(s3_server, wds):
    _ingest(s3_server, f"s3://{wds}/tars", f"s3://{wds}/out-json", input_format="webdataset", label_field="y")
    assert {r["label"] for r in _shard_rows(s3_server, wds, "out-json")} == {7}


def test_webdataset_rerun_of_the_same_shards_writes_nothing(s3_server, wds):
    _ingest(s3_server, f"s3://{wds}/tars", f"s3://{wds}/out-listing", input_format="webdataset")  # made once
    again = _ingest(s3_server, f"s3://{wds}/tars", f"s3://{wds}/out-listing", input_format="webdataset")
    assert again.skipped and again.shards_written == 0 and again.shards_reused == 4


def test_webdataset_rerun_after_one_shard_changed_rewrites_only_its_shard(s3_server, wds):
    client = s3_server.client()
    for shard in range(4):
        client.copy_object(Bucket=wds, Key=f"changing/{shard:06d}.tar", CopySource=f"{wds}/tars/{shard:06d}.tar")
    _ingest(s3_server, f"s3://{wds}/changing", f"s3://{wds}/out-changed", input_format="webdataset")
    client.put_object(Bucket=wds, Key="changing/000002.tar", Body=_wds_shard(2, n=3))
    again = _ingest(s3_server, f"s3://{wds}/changing", f"s3://{wds}/out-changed", input_format="webdataset")
    assert (again.shards_written, again.shards_reused, again.counts["images"]) == (1, 3, 15)


def test_a_webdataset_shard_whose_key_holds_an_empty_folder_name_is_read(s3_server, wds):
    # pyarrow refuses a path with an empty component, so `doubled//000001.tar` failed the whole ingest.
    client = s3_server.client()
    for key in ("doubled//000001.tar", "doubled/a//000002.tar"):
        client.put_object(Bucket=wds, Key=key, Body=_wds_shard(int(key[-5])))
    result = _ingest(s3_server, f"s3://{wds}/doubled", f"s3://{wds}/out-doubled", input_format="webdataset")
    assert result.counts["images"] == 8 and result.counts["rejected"] == 0
    assert _shard_rows(s3_server, wds, "out-doubled")[0]["key"] == "/000001.tar/s1-0"


@pytest.fixture(scope="module")
def damaged(ray_cluster, s3_server):
    """A good shard, one cut short in the middle of its third sample, and one with bad samples."""
    client = s3_server.client()
    client.create_bucket(Bucket="formats-damaged")
    whole = _wds_shard(1)
    third = tarfile.open(fileobj=io.BytesIO(whole)).getmember("s1-2.jpg").offset  # where the third sample begins
    cut = third + 700  # inside its image's data
    bad = webdataset_tar([{"a.jpg": b"not a jpeg", "a.cls": b"0"}, {"b.cls": b"1"}, {"c.jpg": jpeg(5), "c.cls": b"dog"},
                          {"d.jpg": jpeg(6), "d.cls": b"2"}])
    for name, body in (("000000.tar", _wds_shard(0)), ("000001.tar", whole[:cut]), ("000002.tar", bad)):
        client.put_object(Bucket="formats-damaged", Key=f"tars/{name}", Body=body)
    return "formats-damaged", third


def _damaged_ingest(s3_server, damaged):
    bucket, _ = damaged
    return _ingest(s3_server, f"s3://{bucket}/tars", f"s3://{bucket}/out", input_format="webdataset",
                   max_reject_fraction=1.0)


def test_a_truncated_tar_is_one_rejection_naming_the_shard_and_byte_offset(s3_server, damaged):
    result = _damaged_ingest(s3_server, damaged)
    damage = [r for r in result.manifest["rejected"] if r["key"] == "000001.tar"]
    assert len(damage) == 1 and "\n" not in damage[0]["reason"]
    assert f"damaged tar at byte {damaged[1]}:" in damage[0]["reason"], damage


def test_samples_read_before_a_tars_damage_are_kept_and_the_one_it_cut_is_dropped(s3_server, damaged):
    _damaged_ingest(s3_server, damaged)
    kept = [r["key"] for r in _shard_rows(s3_server, damaged[0], "out") if r["key"].startswith("000001.tar")]
    assert kept == ["000001.tar/s1-0", "000001.tar/s1-1"]


def test_bad_samples_in_a_tar_are_rejections_with_reasons(s3_server, damaged):
    result = _damaged_ingest(s3_server, damaged)
    reasons = {r["key"]: r["reason"] for r in result.manifest["rejected"] if r["key"].startswith("000002.tar/")}
    assert set(reasons) == {"000002.tar/a", "000002.tar/b", "000002.tar/c"}
    assert "not an image" in reasons["000002.tar/a"] and "no image member" in reasons["000002.tar/b"]
    assert "not a class number" in reasons["000002.tar/c"]


# ---------------------------------------------------------------- Parquet tables of image bytes


@pytest.fixture(scope="module")
def tables(ray_cluster, s3_server):
    """Two tables of Hugging Face image structs (`img`) and class numbers (`y`); three rows are broken."""
    client = s3_server.client()
    client.create_bucket(Bucket="formats-parquet")
    for part in range(2):
        images = [{"bytes": jpeg(100 * part + i), "path": f"{i}.jpg"} for i in range(5)]
        if part == 1:
            images[1] = {"bytes": b"\xff\xd8 broken", "path": "broken.jpg"}
            images[3] = {"bytes": None, "path": "elsewhere.jpg"}
            images[4] = {"bytes": b"", "path": "empty.jpg"}
        table = pa.table({"img": images, "y": [part, part, part + 1, part, part]})
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=2)
        client.put_object(Bucket="formats-parquet", Key=f"tables/part-{part}.parquet", Body=buf.getvalue())
    client.put_object(Bucket="formats-parquet", Key="tables/README.txt", Body=b"not an input")
    return "formats-parquet"


def _parquet_ingest(s3_server, bucket: str, output: str, **fields):
    fields = {"input_format": "parquet", "image_column": "img", "label_column": "y", "max_reject_fraction": 1.0,
              **fields}
    return _ingest(s3_server, f"s3://{bucket}/tables", f"s3://{bucket}/{output}", **fields)


def test_parquet_rows_become_samples_with_their_labels(s3_server, tables):
    result = _parquet_ingest(s3_server, tables, "out")
    rows = _shard_rows(s3_server, tables, "out")
    assert [(r["key"], r["label"]) for r in rows] == [
        ("part-0.parquet#0", 0), ("part-0.parquet#1", 0), ("part-0.parquet#2", 1), ("part-0.parquet#3", 0),
        ("part-0.parquet#4", 0), ("part-1.parquet#0", 1), ("part-1.parquet#2", 2)]
    assert result.manifest["classes"] == {"0": 0, "1": 1, "2": 2}


def test_parquet_rows_with_broken_bytes_are_rejections_with_reasons(s3_server, tables):
    result = _parquet_ingest(s3_server, tables, "out")
    reasons = {r["key"]: r["reason"] for r in result.manifest["rejected"]}
    assert set(reasons) == {"part-1.parquet#1", "part-1.parquet#3", "part-1.parquet#4"}
    assert "not an image" in reasons["part-1.parquet#1"]
    assert "no image bytes (path 'elsewhere.jpg')" in reasons["part-1.parquet#3"]


def test_a_parquet_table_whose_key_holds_an_empty_folder_name_is_read(s3_server, tables):
    client = s3_server.client()
    body = client.get_object(Bucket=tables, Key="tables/part-0.parquet")["Body"].read()
    client.put_object(Bucket=tables, Key="doubled//part-0.parquet", Body=body)
    result = _ingest(s3_server, f"s3://{tables}/doubled", f"s3://{tables}/out-doubled", input_format="parquet",
                     image_column="img", label_column="y")
    assert result.counts["images"] == 5 and result.counts["rejected"] == 0


def test_unlabeled_parquet_ingest_reads_no_label_column(s3_server, tables):
    result = _parquet_ingest(s3_server, tables, "out-unlabeled", labeled=False, label_column="absent")
    assert result.manifest["labeled"] is False and result.counts["images"] == 7
    assert {r["label"] for r in _shard_rows(s3_server, tables, "out-unlabeled")} == {None}


def test_parquet_rerun_of_the_same_tables_writes_nothing(s3_server, tables):
    _parquet_ingest(s3_server, tables, "out")  # made once per module
    again = _parquet_ingest(s3_server, tables, "out")
    assert again.skipped and again.shards_written == 0 and again.shards_reused == 2


def test_cli_ingest_reads_a_local_brace_range_of_tars_unlabeled(ray_cluster, tmp_path):
    from typer.testing import CliRunner

    from pipelines.cli import app

    (tmp_path / "tars").mkdir()
    for shard in range(3):
        (tmp_path / "tars" / f"{shard:06d}.tar").write_bytes(_wds_shard(shard, n=2))
    args = ["ingest", str(tmp_path / "tars" / "{000000..000001}.tar"), str(tmp_path / "out"), "--input-format", "webdataset",
            "--unlabeled", "--image-size", "16", "--patch-size", "4", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result_json(result.stdout)["counts"]["images"] == 4
    assert read_manifest(str(tmp_path / "out"))["labeled"] is False
