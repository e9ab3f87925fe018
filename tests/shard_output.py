"""What the ingest tests of every kind check on a finished output folder: file times, and completing one
that was damaged by hand (its last shard and its marker deleted, a stray temporary file added).

A real interruption (SIGKILL mid-write) is tested in tests/test_ingest_kill.py."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipelines.core import shards


def mtimes(root: str) -> dict[str, int]:
    """Every file under `root` with its modification time (ns)."""
    return {str(p): p.stat().st_mtime_ns for p in Path(root).rglob("*") if p.is_file()}


def assert_completing_writes_only_the_missing_shard(finished: Any, out: Path, rerun: Callable[[Path], Any]) -> None:
    """Copy the `finished` ingest to `out`, damage the copy (delete its last shard and its `_SUCCESS`, add a
    stray temporary file), `rerun(out)`, and check that only the deleted shard was written again, every other
    shard kept as it was and the stray file removed."""
    shutil.copytree(finished.output, out)
    (out / shards.SUCCESS).unlink()
    lost = out / finished.manifest["shards"][-1]["path"]
    lost.unlink()
    (out / "shards" / ".tmp-vitpipe-1234-shard-000099.parquet").write_bytes(b"partial")
    before = mtimes(str(out))
    result = rerun(out)
    assert (result.shards_written, result.shards_reused) == (1, len(finished.manifest["shards"]) - 1)
    after = mtimes(str(out))
    untouched = [p for p in before if p.endswith(".parquet") and ".tmp-vitpipe" not in p]
    assert all(after[p] == before[p] for p in untouched)
    assert lost.exists() and not any(".tmp-vitpipe" in p for p in after)
    assert result.manifest["content_hash"] == finished.manifest["content_hash"]


def wait_for_shards(out: Path, proc: subprocess.Popen, count: int, timeout: float, log: Path | None = None) -> None:
    """Return once `count` shards are in place under `out` (each lands by an atomic rename, so whole); fail,
    with the end of `log` if given, if `proc` ends or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((out / shards.SHARD_DIR).glob("shard-*.parquet"))) >= count:  # not a .tmp- file in flight
            return
        time.sleep(0.02)
    state = "ended" if proc.poll() is not None else "timed out"
    raise AssertionError(f"no {count} shards before the stage {state}" + (f": {log.read_text()[-3000:]}" if log else ""))
