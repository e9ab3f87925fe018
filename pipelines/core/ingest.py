"""The sharded-ingest engine every ingest stage runs on: a corpus of objects → Parquet shards + `manifest.json`.

The work is a Ray Data pipeline of two operators:

1. *plan* (one task) streams the source listing page by page — `<class>/<file>`
   folders, or the rows of a CSV/Parquet manifest — and cuts it into shard plans
   of `shard_size` keys (`pipelines.core.plan`). Keys are shuffled within a window
   of `mix_window` shards (seeded), so a shard mixes classes without a global
   shuffle. Plans depend only on the listing and the config, which makes shard
   ids stable across reruns.
2. *process* (many tasks, one shard each) runs the stage's `IngestKind.process`:
   it fetches the objects with a few I/O threads (`fetch_planned`), decodes them,
   and writes the shard atomically. A shard already written for the same plan and
   config is reused, which is what makes an interrupted run resumable.

The driver only collects per-shard summaries (counts, rejects, hashes), writes
`manifest.json` (`IngestKind.assemble`, on `manifest_summary`), and writes
`_SUCCESS` last. A rerun whose `_SUCCESS` holds the same config fingerprint does
nothing. See `pipelines.core.shards` for the format and the output's life cycle.
The image ingest (`pipelines.image.ingest`) and the video ingest
(`pipelines.video.ingest`) each extend `ShardedIngestConfig` and name an `IngestKind`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipelines.core import plan as ingest_plan, shards
from pipelines.core.errors import IngestError, StorageError, VitpipeError
from pipelines.core.storage import S3Settings, S3Store, Store, open_store, parse_uri

log = logging.getLogger("vitpipe.ingest")
# Config fields that do not change the shards written, so they stay out of the output's fingerprint.
NOT_IDENTITY = {
    "output", "endpoint_url",  # where the shards go and which endpoint serves the objects
    "concurrency", "io_threads",  # how fast
    "max_reject_fraction",  # how strict: it decides whether the stage fails, not what it writes
}


class ShardedIngestConfig(BaseModel):
    """Fields every ingest stage shares (`pipelines.image.ingest`, `pipelines.video.ingest`): where the
    objects are, where the shards go, splits, sharding, strictness. Holds no credentials."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str  # s3://bucket/prefix or a local directory
    output: str  # s3://bucket/prefix or a local directory
    manifest: str | None = None  # CSV/Parquet with columns key,label[,split]; keys relative to source
    endpoint_url: str | None = None  # S3-compatible endpoint; default AWS_ENDPOINT_URL(_S3) or AWS
    val_fraction: float = Field(0.1, ge=0.0, le=1.0)
    test_fraction: float = Field(0.0, ge=0.0, le=1.0)
    max_reject_fraction: float = Field(0.01, ge=0.0, le=1.0)
    seed: int = 0
    shard_size: int = Field(512, ge=1)
    mix_window: int = Field(8, ge=1)  # shards whose keys are shuffled together
    concurrency: int | None = Field(None, ge=1)  # shard tasks at once; None: as many as CPUs allow
    io_threads: int = Field(8, ge=1, le=64)  # S3 fetches in flight per shard task
    compression: Literal["none", "snappy", "lz4", "zstd"] = "lz4"

    @field_validator("source", "output", "manifest")
    @classmethod
    def _valid_uri(cls, value: str | None) -> str | None:
        if value is not None:
            parse_uri(value)  # raises ValueError naming the URI
        return value

    @model_validator(mode="after")
    def _consistent_splits_and_paths(self) -> ShardedIngestConfig:
        if self.val_fraction + self.test_fraction > 1.0:
            raise ValueError(f"val_fraction + test_fraction = {self.val_fraction + self.test_fraction} exceeds 1")
        if parse_uri(self.source).uri.rstrip("/") == parse_uri(self.output).uri.rstrip("/"):
            raise ValueError(f"output {self.output} must differ from source")
        return self

    def identity(self) -> dict[str, Any]:
        """The fields that decide the output's content (not how fast or how strictly it is made)."""
        return self.model_dump(mode="json", exclude=NOT_IDENTITY)


@dataclass
class IngestResult:
    """What a run produced; `skipped` when a finished output with the same config was found."""

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

    `process(plan, config, source, out, fingerprint) -> summary` makes one shard (in a Ray
    task; a module-level function); `assemble(config, settings, fingerprint, summaries) ->
    manifest` builds the manifest, whose `counts[noun]` are the kept objects.
    """

    name: str  # in log lines: "ingest", "video-ingest"
    format: str  # the output format, part of the config fingerprint
    noun: str  # "images", "videos"
    process: Callable[..., dict[str, Any]]
    assemble: Callable[..., dict[str, Any]]


def run_sharded_ingest(config: ShardedIngestConfig, kind: IngestKind, *, force: bool = False) -> IngestResult:
    """The stage flow shared by every ingest: skip a finished output, check the source, run the
    plan → process pipeline, drop stale shards, write the manifest, apply the rejection
    threshold, and write `_SUCCESS` last. `force` rewrites every shard of the output."""
    start = time.perf_counter()
    settings = S3Settings.resolve(config.endpoint_url)
    source = open_store(config.source, settings)
    out = open_store(config.output, settings)
    fingerprint = shards.fingerprint({"format": kind.format, **config.identity()})

    shards.check_output(out)
    done = None if force else shards.finished_manifest(out, fingerprint)
    if done is not None:
        log.info("%s: %s is complete for this config; nothing to do", kind.name, config.output)
        return IngestResult(config.output, done, done["counts"], 0, 0, True, time.perf_counter() - start)
    manifest_store = open_store(config.manifest, settings) if config.manifest else None
    _check_source(source, manifest_store)
    out.delete(shards.SUCCESS)  # whatever happens next, an older marker no longer describes the output
    if force:
        shards.remove_stale_shards(out, keep=set())

    summaries = _run_pipeline(config, source, manifest_store, out, fingerprint, kind.process)
    shards.remove_stale_shards(out, {s["key"] for s in summaries})
    manifest = kind.assemble(config, settings, fingerprint, summaries)
    out.write(shards.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())

    counts = manifest["counts"]
    total = counts[kind.noun] + counts["rejected"]
    if total and counts["rejected"] / total > config.max_reject_fraction:
        first = manifest["rejected"][0]
        raise IngestError(
            f"{config.source}: {counts['rejected']} of {total} objects rejected "
            f"({100 * counts['rejected'] / total:.1f}% > {100 * config.max_reject_fraction:.1f}%), "
            f"e.g. {first['key']}: {first['reason']}; the full list is in {out.child_uri(shards.MANIFEST)}"
        )
    out.write(shards.SUCCESS, json.dumps({"fingerprint": fingerprint, "content_hash": manifest["content_hash"]}).encode())
    written = sum(not s.get("reused") for s in summaries)
    log.info(
        "%s: %d %s (%d rejected) in %d shards (%d written, %d reused) -> %s", kind.name,
        counts[kind.noun], kind.noun, counts["rejected"], len(summaries), written, len(summaries) - written,
        config.output,
    )
    return IngestResult(config.output, manifest, counts, written, len(summaries) - written, False, time.perf_counter() - start)


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
    config: ShardedIngestConfig, source: Store, manifest: Store | None, out: Store, fingerprint: str,
    process: Callable[..., dict[str, Any]],
) -> list[dict[str, Any]]:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    previous = ctx.target_max_block_size, ctx.op_resource_reservation_enabled
    # One shard plan per block, so each plan becomes its own task as soon as it is listed.
    ctx.target_max_block_size = 1
    # The planner holds no CPU, so a reservation for it only keeps decoders waiting: with it on,
    # a 2-CPU node ran one shard task at a time for the first seconds and left ~0.15 s between tasks.
    ctx.op_resource_reservation_enabled = False
    # The context is captured when the dataset is created; restore it for everyone else.
    try:
        ds = ray.data.from_items([{"plan": 0}]).map_batches(
            _plan_udf,
            batch_size=1,
            fn_kwargs={"config": config, "source": source, "manifest": manifest},
            num_cpus=0,  # listing is I/O; it must not hold a CPU slot the decoders need
        )
        ds = ds.map_batches(
            _process_udf,
            batch_size=1,
            fn_kwargs={"config": config, "source": source, "out": out, "fingerprint": fingerprint, "process": process},
            num_cpus=1,
            compute=ray.data.TaskPoolStrategy(size=config.concurrency) if config.concurrency else None,
        )
    finally:
        ctx.target_max_block_size, ctx.op_resource_reservation_enabled = previous
    summaries = []
    for row in ds.iter_rows():
        summary = json.loads(row["summary"])
        if "error" in summary:  # a user-facing error on a worker: stop and report it as one line
            raise _ERRORS.get(summary["error_type"], VitpipeError)(summary["error"])
        summaries.append(summary)
    return sorted(summaries, key=lambda s: s["index"])


# Errors travel from workers as data: Ray re-raises worker exceptions wrapped, with the
# original's class and message buried in a traceback.
_ERRORS: dict[str, type[VitpipeError]] = {cls.__name__: cls for cls in (VitpipeError, StorageError, IngestError)}


def _error_row(column: str, err: VitpipeError) -> dict[str, Any]:
    return {column: np.array([json.dumps({"error": err.message, "error_type": type(err).__name__})], dtype=object)}


def _plan_udf(batch: dict[str, Any], *, config: ShardedIngestConfig, source: Store, manifest: Store | None) -> Iterator[dict[str, Any]]:
    try:
        items = ingest_plan.manifest_items(manifest) if manifest is not None else ingest_plan.folder_items(source)
        for index, plan in enumerate(ingest_plan.cut_shards(items, config.shard_size, config.mix_window, config.seed)):
            plan["index"] = index
            yield {"plan": np.array([json.dumps(plan)], dtype=object)}
    except VitpipeError as err:
        yield _error_row("plan", err)


def _process_udf(
    batch: dict[str, Any], *, config: ShardedIngestConfig, source: Store, out: Store, fingerprint: str,
    process: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    plan = json.loads(batch["plan"][0])
    if "error" in plan:
        return {"summary": batch["plan"]}  # pass the planner's error on to the driver
    try:
        summary = process(plan, config, source, out, fingerprint)
    except VitpipeError as err:
        return _error_row("summary", err)
    return {"summary": np.array([json.dumps(summary)], dtype=object)}


# ---------------------------------------------------------------- helpers of a kind's shard step


def fetch_planned(
    plan: dict[str, Any], config: ShardedIngestConfig, source: Store, rejected: list[dict[str, str]]
) -> Iterator[tuple[int, bytes]]:
    """`(position in plan, bytes)` of the plan's objects, in plan order, read a few at a time.

    Objects the planner refused and objects that cannot be read are appended to
    `rejected` with their reason instead.
    """
    todo = [i for i, reason in enumerate(plan["reasons"]) if not reason]
    rejected.extend({"key": plan["keys"][i], "reason": r} for i, r in enumerate(plan["reasons"]) if r)
    # Remote reads wait on the network, so keep several in flight; local reads need only run ahead.
    threads = config.io_threads if isinstance(source, S3Store) else 2
    with ThreadPoolExecutor(min(threads, max(1, len(todo)))) as pool:
        for i, data in zip(todo, pool.map(lambda i: fetch(source, plan["keys"][i]), todo)):
            if isinstance(data, StorageError):
                rejected.append({"key": plan["keys"][i], "reason": f"unreadable ({data.message.split(': ', 1)[-1]})"})
                continue
            yield i, data


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


def fetch(source: Store, key: str) -> bytes | StorageError:
    """An object's bytes, or the `StorageError` that reading it raised (a per-object rejection)."""
    try:
        return source.read(key)
    except StorageError as exc:
        return exc


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
        "num_classes": len(classes),
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
