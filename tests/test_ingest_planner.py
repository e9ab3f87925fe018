"""The ingest planner lists ahead of the shard tasks, so its worker is free for a decoder early.

A planner held back to the decoders' pace keeps a worker process busy for the whole run; the
first decoder that finds no idle worker then waits for Ray to start another (issue 18 §4).
"""
from __future__ import annotations

import time
from pathlib import Path

from pipelines.core.ingest import IngestKind, run_sharded_ingest
from pipelines.image.configs import IngestConfig

PLANS = 24
SHARD_SECONDS = 0.8  # far longer than listing 24 plans takes, even on a busy machine


def _counting_planner(config, source, manifest):
    """`PLANS` plans of 256 keys, the size of real ones (Ray Data holds a planner back by bytes); once the
    last is taken, the time goes to `planner-done` beside the output."""
    for i in range(PLANS):
        yield {"shard": i, "items": [f"class_{j % 10}/image-{i:05d}-{j:03d}.jpg" for j in range(256)]}
    (Path(config.output).parent / "planner-done").write_text(repr(time.time()))


def _slow_shard(plan, config, source, out):
    """A shard step that takes `SHARD_SECONDS` and notes when it ended."""
    time.sleep(SHARD_SECONDS)
    (Path(config.output).parent / "shard-ends").mkdir(exist_ok=True)
    (Path(config.output).parent / "shard-ends" / Path(plan["key"]).name).write_text(repr(time.time()))
    return {"key": plan["key"], "rejected": []}


def _assemble(config, settings, fingerprint, summaries):
    return {"counts": {"objects": len(summaries), "rejected": 0}, "rejected": [], "content_hash": "-"}


def test_the_planner_lists_every_plan_before_the_first_shard_task_ends(ray_cluster, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "one.bin").write_bytes(b"x")  # the stage checks that the source holds something
    kind = IngestKind("timed", "timed/1", "objects", _slow_shard, _assemble, planner=_counting_planner)

    result = run_sharded_ingest(IngestConfig(source=str(source), output=str(tmp_path / "out")), kind)

    assert result.counts["objects"] == PLANS
    planner_done = float((tmp_path / "planner-done").read_text())
    first_shard_end = min(float(p.read_text()) for p in (tmp_path / "shard-ends").iterdir())
    assert planner_done < first_shard_end
