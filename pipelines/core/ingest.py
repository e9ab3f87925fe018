"""The sharded-ingest engine every ingest stage runs on: a corpus of objects → Parquet shards + `manifest.json`.

The work is a Ray Data pipeline of two operators:

1. *plan* (one task) runs the kind's planner (`pipelines.core.sources`): it streams the
   listing page by page — `<class>/<file>` folders, a label manifest's rows, any object
   (unlabeled), or one plan per WebDataset/Parquet input file — into shard plans. On S3 the class
   folders are listed in parallel by Ray tasks, in key order (`pipelines.core.listing`). Each plan holds
   its keys, labels and each object's version tag (size and ETag or mtime), and
   a fingerprint of all of it under the config. The task ends with the input
   digest: a hash of every plan fingerprint in order. It runs up to `PLANS_AHEAD` plans ahead of
   the shard tasks, so on a corpus of fewer shards its worker is soon free for a decoder.
2. *process* (many tasks, one shard each) runs the stage's `IngestKind.process`:
   it reuses the shard when its footer holds the plan's fingerprint; otherwise it
   fetches the objects with a few I/O threads (`pipelines.core.fetch`), decodes them,
   and writes the shard atomically. That makes an interrupted run resumable, and a
   changed input (a corrected label, an added or replaced object) rewrite only the
   shards whose plans changed.

The driver only collects per-shard summaries (counts, rejects, hashes) and the
digest. When no shard was written or dropped and `_SUCCESS` holds the same config
fingerprint and input digest, the run is skipped; otherwise it writes
`manifest.json` (`IngestKind.assemble`, on `manifest_summary`) and `_SUCCESS` last.
See `pipelines.core.shards` for the format and the output's life cycle.
The image ingest (`pipelines.image.ingest`) and the video ingest
(`pipelines.video.ingest`) each extend `ShardedIngestConfig` and name an `IngestKind`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipelines.core import plan as ingest_plan, shards
from pipelines.core.cluster import connect, ray_remote_args
from pipelines.core.sources import Planner, object_plans
from pipelines.core.fetch import reusable
from pipelines.core.errors import (IngestError, StorageError, TransientStorageError, VitpipeError, error_class,
                                   find_vitpipe_error)
from pipelines.core.stage_config import ShardedIngestConfig
from pipelines.core.storage import S3Settings, Store, open_store
from pipelines.core.uris import pattern_root

log = logging.getLogger("vitpipe.ingest")
@dataclass
class IngestResult:
    """What a run produced; `skipped` when a finished output of the same input and config was found."""

    output: str
    manifest: dict[str, Any]
    counts: dict[str, Any]
    shards_written: int
    shards_reused: int
    skipped: bool
    seconds: float


@dataclass(frozen=True)
class IngestKind:
    """What differs between ingest stages that share this machinery.

    `planner(config, source, manifest)` streams the shard plans (default `object_plans`: one
    object per sample). `process(plan, config, source, out) -> summary` makes one shard (in a Ray task; a
    module-level function), or reuses it when `shards.existing_summary` finds it written for
    the plan's fingerprint; `assemble(config, settings, fingerprint, summaries) -> manifest`
    builds the manifest, whose `counts[noun]` are the kept objects.
    """

    name: str  # in log lines: "ingest", "video-ingest"
    format: str  # the output format, part of the config fingerprint
    noun: str  # "images", "videos"
    process: Callable[..., dict[str, Any]]
    assemble: Callable[..., dict[str, Any]]
    planner: Planner = object_plans  # (config, source, label manifest or None) -> unsealed shard plans


def run_sharded_ingest(config: ShardedIngestConfig, kind: IngestKind, *, force: bool = False) -> IngestResult:
    """The stage flow shared by every ingest: check the source, run the plan → process pipeline
    (one listing pass; shards whose plan did not change are reused), drop stale shards, write the
    manifest, apply the rejection threshold, and write `_SUCCESS` last. A rerun that finds its
    input and config unchanged writes nothing and is `skipped`. `force` rewrites every shard.

    Raises `StorageError` (one line naming the URI) when the source, manifest or output cannot be
    reached, and `IngestError` when more than `max_reject_fraction` of the objects are rejected.
    """
    start = time.perf_counter()
    settings = S3Settings.resolve(config.endpoint_url)
    source = open_store(pattern_root(config.source), settings)
    out = open_store(config.output, settings)
    fingerprint = shards.fingerprint({"format": kind.format, **config.identity()})

    shards.check_output(out, kind.format)
    manifest_store = open_store(config.manifest, settings) if config.manifest else None
    _check_source(source, manifest_store)
    if force:
        out.delete(shards.SUCCESS)
        shards.remove_stale_shards(out, keep=set())

    summaries, input_digest = _run_pipeline(config, source, manifest_store, out, fingerprint, kind)
    written = sum(not s.get("reused") for s in summaries)
    stale = shards.stale_shards(out, {s["key"] for s in summaries})
    done = None if written or stale else shards.finished_manifest(out, fingerprint, input_digest)
    if done is not None:
        log.info("%s: %s is complete for this input and config; nothing to do", kind.name, config.output)
        return IngestResult(config.output, done, done["counts"], 0, len(summaries), True, time.perf_counter() - start)
    out.delete(shards.SUCCESS)  # from here on, an older marker no longer describes the output
    for key in stale:
        out.delete(key)
    manifest = {**kind.assemble(config, settings, fingerprint, summaries), "input_digest": input_digest}
    out.write(shards.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _check_rejects(config, kind, manifest, out)
    shards.write_success(out, fingerprint, manifest["content_hash"], input_digest)
    counts = manifest["counts"]
    log.info(
        "%s: %d %s (%d rejected) in %d shards (%d written, %d reused) -> %s", kind.name,
        counts[kind.noun], kind.noun, counts["rejected"], len(summaries), written, len(summaries) - written,
        config.output,
    )
    return IngestResult(config.output, manifest, counts, written, len(summaries) - written, False, time.perf_counter() - start)


def _check_rejects(config: ShardedIngestConfig, kind: IngestKind, manifest: dict[str, Any], out: Store) -> None:
    """Fail in one line when more than `max_reject_fraction` of the objects were rejected."""
    counts = manifest["counts"]
    total = counts[kind.noun] + counts["rejected"]
    if total and counts["rejected"] / total > config.max_reject_fraction:
        first = manifest["rejected"][0]
        raise IngestError(
            f"{config.source}: {counts['rejected']} of {total} objects rejected "
            f"({100 * counts['rejected'] / total:.1f}% > {100 * config.max_reject_fraction:.1f}%), "
            f"e.g. {first['key']}: {first['reason']}; the full list is in {out.child_uri(shards.MANIFEST)}"
        )


# ---------------------------------------------------------------- driver-side checks


def _check_source(source: Store, manifest: Store | None) -> None:
    source.check()
    if manifest is not None:
        fs, path = manifest.arrow()
        try:
            info = fs.get_file_info(path)
        except OSError as exc:
            raise manifest.error(exc) from None
        if info.type.name != "File":
            raise StorageError(f"{manifest.uri}: manifest does not exist")
        return
    if next(iter(source.list_pages(page_size=1)), None) is None:
        raise StorageError(f"{source.uri}: no objects under this prefix")


# ---------------------------------------------------------------- the Ray Data pipeline


def _run_pipeline(
    config: ShardedIngestConfig, source: Store, manifest: Store | None, out: Store, fingerprint: str, kind: IngestKind,
) -> tuple[list[dict[str, Any]], str]:
    """The shard summaries (sorted by shard key) and the input digest the planner computed."""
    import ray.data

    connect()  # joined here, not by Ray's auto-init: see pipelines.core.cluster
    ctx = ray.data.DataContext.get_current()
    previous = ctx.target_max_block_size, ctx.op_resource_reservation_enabled
    # One shard plan per block, so each plan becomes its own task as soon as it is listed.
    ctx.target_max_block_size = 1
    # The planner holds no CPU, so a reservation for it only keeps decoders waiting: with it on,
    # a 2-CPU node ran one shard task at a time for the first seconds and left ~0.15 s between tasks.
    ctx.op_resource_reservation_enabled = False
    # The context is captured when the dataset is created; restore it for everyone else.
    try:
        with ray_remote_args():
            ds = ray.data.from_items([{"plan": 0}]).map_batches(
                _plan_udf,
                batch_size=1,
                fn_kwargs={"config": config, "source": source, "manifest": manifest, "fingerprint": fingerprint,
                           "planner": kind.planner},
                num_cpus=0,  # listing is I/O; it must not hold a CPU slot the decoders need
                # Ray Data pauses a task 2 unread blocks ahead and reads a planner's output within a byte budget;
                # the planner then lived as long as the decoders, and a decoder waited for a new worker process.
                _generator_backpressure_num_objects=2 * PLANS_AHEAD,  # a block and its metadata per plan
            )
            ds = ds.map_batches(
                _process_udf,
                batch_size=1,
                fn_kwargs={"config": config, "source": source, "out": out, "process": kind.process},
                num_cpus=1,
                compute=ray.data.TaskPoolStrategy(size=config.concurrency) if config.concurrency else None,
                # A shard whose reads kept failing for a cause that may pass is tried again as a whole.
                max_retries=SHARD_TASK_RETRIES,
                retry_exceptions=[TransientStorageError],
            )
    finally:
        ctx.target_max_block_size, ctx.op_resource_reservation_enabled = previous
    summaries, digest = [], None
    try:
        for row in ds.iter_rows():
            summary = json.loads(row["summary"])
            if "error" in summary:  # a user-facing error on a worker: stop and report it as one line
                raise error_class(summary["error_type"])(summary["error"])
            if "input_digest" in summary:
                digest = summary["input_digest"]
            else:
                summaries.append(summary)
    except VitpipeError:
        raise
    except Exception as exc:  # a shard task that failed on every try: its own one-line error, if it has one
        known = find_vitpipe_error(exc)
        if known is None:
            raise
        raise known from None
    if digest is None:  # the planner always ends with its digest; without it the listing was cut short
        raise IngestError(f"{config.source}: the planner ended before the listing did")
    return sorted(summaries, key=lambda s: s["key"]), digest


# Plans the planner may list ahead of the shard tasks (a 256-image plan is ~15 KB in the object store): up to
# this many shards it lists everything at once and frees its worker for a decoder.
PLANS_AHEAD = 256

# Tries of a shard task after its first one fails with a `TransientStorageError`.
SHARD_TASK_RETRIES = 2


# Errors travel from workers as data (`error_class` turns them back): Ray re-raises worker
# exceptions wrapped, with the original's class and message buried in a traceback.
def _error_row(column: str, err: VitpipeError) -> dict[str, Any]:
    return {column: np.array([json.dumps({"error": err.message, "error_type": type(err).__name__})], dtype=object)}


def _plan_udf(
    batch: dict[str, Any], *, config: ShardedIngestConfig, source: Store, manifest: Store | None, fingerprint: str,
    planner: Planner,
) -> Iterator[dict[str, Any]]:
    """Stream the kind's shard plans, each with its shard key and plan fingerprint (its keys,
    version tags, labels, splits, under this config), then one last row: the input digest,
    a hash of every plan fingerprint in order. One listing pass, never held whole."""
    digest = hashlib.sha256(fingerprint.encode())
    try:
        for plan in planner(config, source, manifest):
            ingest_plan.seal(plan, fingerprint)
            digest.update(plan["fingerprint"].encode())
            yield {"plan": np.array([json.dumps(plan)], dtype=object)}
    except VitpipeError as err:
        yield _error_row("plan", err)
        return
    done = {"input_digest": "sha256:" + digest.hexdigest()}
    yield {"plan": np.array([json.dumps(done)], dtype=object)}


def _reused_shard(out: Store, plan: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of the plan's shard when an earlier run wrote it for this very plan and it may be kept."""
    existing = shards.existing_summary(out, plan["key"], plan["fingerprint"])
    return existing if existing is not None and reusable(existing) else None


def _process_udf(
    batch: dict[str, Any], *, config: ShardedIngestConfig, source: Store, out: Store, process: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    plan = json.loads(batch["plan"][0])
    if "error" in plan or "input_digest" in plan:
        return {"summary": batch["plan"]}  # pass the planner's error or digest on to the driver
    try:
        summary = _reused_shard(out, plan) or process(plan, config, source, out)
    except TransientStorageError:
        raise  # Ray retries the task (`SHARD_TASK_RETRIES`); it never becomes a rejection
    except VitpipeError as err:
        return _error_row("summary", err)
    return {"summary": np.array([json.dumps(summary)], dtype=object)}


# ---------------------------------------------------------------- helpers of a kind's shard step


def shard_counts(plan: dict[str, Any], splits: list[str], names: list[str]) -> dict[str, Any]:
    """The per-split and per-split-class counts of a shard's kept rows, and the plan's classes."""
    by_split_class: dict[str, Counter[str]] = defaultdict(Counter)
    for split, name in zip(splits, names):
        by_split_class[split][name] += 1
    return {
        "classes": plan["classes"],
        "split": dict(Counter(splits)),
        "split_class": {s: dict(c) for s, c in by_split_class.items()},
    }


# ---------------------------------------------------------------- finishing


def _split_source(fixed: int, rows: int) -> str:
    """"manifest" when the manifest fixed every row's split, "hash" when it fixed none."""
    if fixed == 0:
        return "hash"
    return "manifest" if fixed == rows else "mixed"


def manifest_summary(summaries: list[dict[str, Any]], noun: str) -> dict[str, Any]:
    """The manifest fields every ingest shares, from the shard summaries: classes, counts
    (per split, per class, kept `noun` and rejected), split source, rejects, shard list."""
    classes: dict[str, int] = {}
    for s in summaries:
        classes.update(s["classes"])
    classes = dict(sorted(classes.items(), key=lambda kv: kv[1]))
    split_counts = {split: sum(s["split"].get(split, 0) for s in summaries) for split in shards.SPLITS}
    split_class = {
        split: {name: sum(s["split_class"].get(split, {}).get(name, 0) for s in summaries) for name in classes}
        for split in shards.SPLITS
    }
    rejected = sorted((r for s in summaries for r in s["rejected"]), key=lambda r: r["key"])
    return {
        "classes": classes,
        "num_classes": max(classes.values(), default=-1) + 1,  # labels may skip ids: see shards.class_names
        "counts": {
            **split_counts,
            noun: sum(s["rows"] for s in summaries),
            "rejected": len(rejected),
            "classes": {name: sum(split_class[sp][name] for sp in shards.SPLITS) for name in classes},
            "split_classes": split_class,
        },
        "split_source": _split_source(sum(s["fixed_splits"] for s in summaries), sum(s["rows"] for s in summaries)),
        "rejected": rejected,
        "shards": [{"path": s["key"], "rows": s["rows"], "split": s["split"]} for s in summaries],
    }


def public_config(config: ShardedIngestConfig, settings: S3Settings) -> dict[str, Any]:
    """The config as recorded in a manifest (the endpoint as resolved, never credentials)."""
    public = config.model_dump(mode="json")
    public["endpoint_url"] = settings.public()["endpoint_url"]
    return public
