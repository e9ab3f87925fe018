"""The image ingest stage: a corpus of image objects → sharded, patchified Parquet + `manifest.json`.

It runs on the sharded-ingest engine (`pipelines.core.ingest`): the engine plans
shards from the listing and runs `process_shard` on each, which fetches the
objects, decodes, resizes and patchifies them (`pipelines.image.patches`), and
writes the shard atomically; `_assemble_manifest` then describes the output.
See `pipelines.core.shards` for the format.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pipelines.core import shards
from pipelines.core.fetch import fetch_planned
from pipelines.core.ingest import (IngestKind, IngestResult, manifest_summary, public_config, run_sharded_ingest,
                                   shard_counts)
from pipelines.core.samples import parquet_samples, tar_samples
from pipelines.core.sources import file_plans, object_plans
from pipelines.core.storage import S3Settings, Store
from pipelines.image.patches import RejectedImage, decode_image, patchify
from pipelines.image.configs import IngestConfig


def run_ingest(config: IngestConfig, *, force: bool = False) -> IngestResult:
    """Run (or resume, or skip) the image ingest; errors as `run_sharded_ingest` raises them."""
    return run_sharded_ingest(config, IMAGES, force=force)


def plan_images(config: IngestConfig, source: Store, manifest: Store | None) -> Iterator[dict[str, Any]]:
    """The image ingest's shard plans (the engine's planner; see `pipelines.core.sources`)."""
    if config.input_format == "objects":
        return object_plans(config, source, manifest, labeled=config.labeled)
    suffix = ".tar" if config.input_format == "webdataset" else ".parquet"
    return file_plans(source, config.source, suffix, config.list_concurrency)


def process_shard(plan: dict[str, Any], config: IngestConfig, source: Store, out: Store) -> dict[str, Any]:
    """Decode and write one planned shard; returns its summary (the engine reuses one already written)."""
    key = plan["key"]
    size, p = config.image_size, config.patch_size
    grid = size // p
    # A file of samples holds an unknown number of them: start at a shard's size and grow.
    pixels = _pixel_buffer((config.shard_size if "file" in plan else len(plan["keys"]), grid * grid, p * p * 3))
    kept: dict[str, list[Any]] = {"keys": [], "labels": [], "splits": [], "names": []}
    fixed = 0  # rows whose split the manifest fixed
    rejected: list[dict[str, str]] = []

    for obj, data, label, name, split in _samples(plan, config, source, rejected):
        try:
            image = decode_image(data, size, max_pixels=config.max_pixels)
        except RejectedImage as why:
            rejected.append({"key": obj, "reason": str(why)})
            continue
        finally:
            del data  # dropped before the next fetch: fetch_planned's memory bound counts on it
        if len(kept["keys"]) == len(pixels):
            pixels = np.concatenate([pixels, np.empty_like(pixels)])
        patchify(image, p, out=pixels[len(kept["keys"])])
        kept["keys"].append(obj)
        kept["labels"].append(label)
        kept["splits"].append(split or shards.split_of(obj, config.val_fraction, config.test_fraction))
        fixed += bool(split)
        kept["names"].append(name)
    if "file" in plan:  # the classes of a file's samples are the labels found in it
        plan = {**plan, "classes": {n: y for n, y in zip(kept["names"], kept["labels"]) if y is not None}}

    n = len(kept["keys"])
    table = shards.build_table(pixels[:n], kept["labels"], kept["keys"], kept["splits"])
    summary = {
        "key": key,
        "plan_fingerprint": plan["fingerprint"],
        "rows": n,
        "fixed_splits": fixed,
        "hash": shards.rows_hash(kept["keys"], kept["labels"], kept["splits"], memoryview(pixels[:n].reshape(-1))),
        **shard_counts(plan, kept["splits"], kept["names"]),
        "rejected": rejected,
    }
    shards.write_shard(out, key, table, summary, config.compression)
    return summary


# key, bytes, label, class name, and the split a label manifest fixed (or "")
ShardSample = tuple[str, bytes, "int | None", str, str]


def _samples(
    plan: dict[str, Any], config: IngestConfig, source: Store, rejected: list[dict[str, str]]
) -> Iterator[ShardSample]:
    """The plan's samples, read a few at a time: its objects, or the samples of its input file."""
    if "file" not in plan:
        for i, data in fetch_planned(plan, source, rejected, io_threads=config.io_threads,
                                     max_bytes=config.max_object_bytes):
            yield plan["keys"][i], data, plan["labels"][i], plan["names"][i], plan["splits"][i]
            del data  # the caller holds the only reference now
        return
    if config.input_format == "webdataset":
        found = tar_samples(source, plan["file"], rejected, labeled=config.labeled, label_field=config.label_field,
                            max_bytes=config.max_object_bytes)
    else:
        found = parquet_samples(source, plan["file"], rejected, image_column=config.image_column,
                                label_column=config.label_column if config.labeled else None,
                                max_bytes=config.max_object_bytes)
    for key, data, label in found:
        yield key, data, label, "" if label is None else str(label), ""
        del data


_buffers: dict[tuple[int, ...], np.ndarray] = {}


def _pixel_buffer(shape: tuple[int, int, int]) -> np.ndarray:
    """A reusable uint8 buffer: Ray reuses worker processes, and touching fresh memory for
    every shard costs as much as patchifying it. Safe because a shard is written before
    the next one starts in the same process."""
    n, rest = shape[0], shape[1:]
    cached = next((b for s, b in _buffers.items() if s[1:] == rest and s[0] >= n), None)
    if cached is None:
        _buffers.clear()
        cached = _buffers[shape] = np.empty(shape, dtype=np.uint8)
    return cached[:n]


def _assemble_manifest(
    config: IngestConfig, settings: S3Settings, fingerprint: str, summaries: list[dict[str, Any]]
) -> dict[str, Any]:
    common = manifest_summary(summaries, "images")
    grid = config.image_size // config.patch_size
    return {
        "format": shards.FORMAT,
        "labeled": config.labeled,
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "channels": 3,
        "grid": [grid, grid],
        "num_patches": grid * grid,
        "patch_dim": config.patch_size**2 * 3,
        **common,
        "content_hash": shards.content_hash(
            config.image_size, config.patch_size, common["classes"], [s["hash"] for s in summaries]
        ),
        "fingerprint": fingerprint,
        "config": public_config(config, settings),
    }


IMAGES = IngestKind("ingest", shards.FORMAT, "images", process_shard, _assemble_manifest, plan_images)
