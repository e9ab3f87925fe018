"""SIGKILL during the video features stage: `vitpipe video-features` is killed once some feature shards are
written; a rerun finishes with every video's features exactly once and rewrites only the shards that were not
finished (the driver writes each feature shard, so killing it stops the writes mid-run).

The stage runs as a user runs it, a subprocess on the session's Ray cluster (`--address`). The stage reads
one source shard per Ray Data task, so feature shards land one by one; the backbone is ViT-Ti/16 at 128×128
frames (untrained: the stage does not care what the weights learned), so each shard takes a few tenths of a
second on one CPU and the kill lands between shards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import yaml

from pipelines.core import shards
from pipelines.video.feature_data import decode_features, table_hash
from tests.process_output import result_json
from tests.shard_output import wait_for_shards
from tests.video_fixtures import write_video_shards

REPO = Path(__file__).resolve().parents[1]
VIDEOS, FRAMES, PER_SHARD, SIZE = 24, 24, 2, 128  # 12 shards of ~50 ViT-Ti/16 frames each
KILL_AFTER = 3  # finished feature shards


def _backbone(directory: Path) -> str:
    import vit

    vit.save_checkpoint(vit.create_model("ViT-Ti/16", image_size=SIZE, num_classes=2), directory)
    return str(directory)


def _config_file(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """The stage's config file, its output folder, and the source videos' keys."""
    data = write_video_shards(tmp_path / "videos", videos=VIDEOS, size=SIZE, frames=(FRAMES, FRAMES),
                              per_shard=PER_SHARD)
    keys = sorted(row["key"] for path in sorted(Path(data, shards.SHARD_DIR).glob("*.parquet"))
                  for row in pq.read_table(path, columns=["key"]).to_pylist())
    out = tmp_path / "features"
    config = dict(data=data, output=str(out), init=_backbone(tmp_path / "backbone"), precision="fp32",
                  num_workers=1, cpus_per_worker=1, videos_per_batch=1, batch_size=64,
                  tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, out, keys


def _features(config: Path, ray_address: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipelines.cli", "video-features", str(config), "--address", ray_address]
    with open(log, "ab") as sink:
        return subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _written(out: Path) -> dict[str, tuple[int, int, str]]:
    """Feature shards in place (each appears by an atomic rename, so whole), with their inode, modification
    time and footer fingerprint."""
    done = {}
    for path in (out / shards.SHARD_DIR).glob("shard-*.parquet"):
        summary = shards.read_summary(pafs.LocalFileSystem(), str(path))
        assert summary is not None, f"{path.name} is in place without a summary"
        stat = path.stat()
        done[path.name] = (stat.st_ino, stat.st_mtime_ns, summary["plan_fingerprint"])
    return done


def _stored(out: Path) -> list[str]:
    """Every stored video's key (one per row), each shard's footer hash checked against its rows."""
    keys = []
    for path in sorted((out / shards.SHARD_DIR).iterdir()):
        table = pq.read_table(path)
        assert shards.read_summary(pafs.LocalFileSystem(), str(path))["hash"] == table_hash(table), path.name
        for row in table.to_pylist():
            assert decode_features(row).shape == (FRAMES, 192), row["key"]  # ViT-Ti's width
        keys += table.column("key").to_pylist()
    return keys


def test_a_rerun_after_sigkill_finishes_every_video_once_and_rewrites_only_unfinished_feature_shards(
    ray_cluster, tmp_path
):
    config, out, keys = _config_file(tmp_path)
    log = tmp_path / "features.log"

    first = _features(config, ray_cluster.address, log)
    try:
        wait_for_shards(out, first, KILL_AFTER, timeout=120.0, log=log)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver (it writes the shards) and anything it forked
        first.wait()
    time.sleep(1)  # let Ray end the killed job's actor
    finished = _written(out)
    total = VIDEOS // PER_SHARD
    assert KILL_AFTER <= len(finished) < total and not (out / shards.SUCCESS).exists()

    second = _features(config, ray_cluster.address, log)
    try:
        assert second.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    result = result_json(log.read_text())

    assert (result["shards_reused"], result["shards_written"]) == (len(finished), total - len(finished))
    after = _written(out)
    assert len(after) == total and all(after[name] == kept for name, kept in finished.items())  # not rewritten
    assert sorted(p.name for p in (out / shards.SHARD_DIR).iterdir()) == sorted(after)  # no partial files left
    assert sorted(_stored(out)) == keys  # every video's features exactly once
    assert result["counts"]["videos"] == VIDEOS and (out / shards.SUCCESS).exists()
