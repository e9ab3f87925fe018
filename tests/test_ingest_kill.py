"""SIGKILL during ingest: `vitpipe ingest` is killed while shards are being written; a rerun
finishes with every object exactly once and rewrites only the shards that were not finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipelines.core import shards
from tests.corpus_files import jpeg
from tests.shard_output import wait_for_shards

REPO = Path(__file__).resolve().parents[1]
N_OBJECTS, SHARD_SIZE = 800, 16  # 50 shards: several seconds of work on two cores


def _upload_corpus(client, bucket: str) -> list[str]:
    rng = np.random.default_rng(3)
    bodies = {}
    for i in range(N_OBJECTS):
        bodies[f"class{i % 4}/{i:05d}.jpg"] = jpeg(rng, 24)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=f"corpus/{kv[0]}", Body=kv[1]), bodies.items()))
    return sorted(bodies)


def _ingest(bucket: str, out: Path, ray_address: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipelines.cli", "ingest", f"s3://{bucket}/corpus", str(out), "--image-size", "16",
               "--patch-size", "4", "--shard-size", str(SHARD_SIZE), "--concurrency", "2", "--ray-address", ray_address,
               "--json"]
    with open(log, "ab") as sink:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=sink, start_new_session=True)


def _finished(out: Path) -> dict[str, int]:
    """Shards whose footer holds a summary (fully written), with their modification times."""
    done = {}
    for path in (out / shards.SHARD_DIR).glob("*.parquet"):
        if shards.read_summary(pafs.LocalFileSystem(), str(path)) is not None:
            done[path.name] = path.stat().st_mtime_ns
    return done


def test_a_rerun_after_sigkill_finishes_with_every_object_once_and_rewrites_only_unfinished_shards(
    ray_cluster, s3_server, s3_bucket, tmp_path
):
    keys = _upload_corpus(s3_server.client(), s3_bucket)
    out, log = tmp_path / "out", tmp_path / "ingest.log"
    env = {**os.environ, **s3_server.env, "VITPIPE_LOG_DIR": str(tmp_path / "logs")}

    first = _ingest(s3_bucket, out, ray_cluster.address, env, log)
    try:
        wait_for_shards(out, first, count=3, timeout=300.0)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver and anything it forked, mid-write
        first.wait()
    time.sleep(2)  # let Ray reap the killed driver's shard tasks
    finished = _finished(out)
    assert not (out / shards.SUCCESS).exists()

    second = _ingest(s3_bucket, out, ray_cluster.address, env, log)
    stdout, _ = second.communicate(timeout=600)
    assert second.returncode == 0, log.read_text()[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])

    total = result["shards_written"] + result["shards_reused"]
    assert result["shards_reused"] == len(finished) and result["shards_written"] == total - len(finished) > 0
    after = _finished(out)
    assert all(after[name] == mtime for name, mtime in finished.items())  # finished shards were not rewritten
    assert sorted(p.name for p in (out / shards.SHARD_DIR).iterdir()) == sorted(after)  # no partial files left
    tables = [pq.read_table(out / shards.SHARD_DIR / name, columns=["key"]) for name in after]
    stored = [key for table in tables for key in table.column("key").to_pylist()]
    assert sorted(stored) == keys  # every object exactly once
    assert result["counts"]["images"] == N_OBJECTS and (out / shards.SUCCESS).exists()
