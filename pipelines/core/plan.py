"""Planning the ingest: the source listing (or a manifest) cut into shard plans.

A plan is a JSON-able dict: the keys of one shard with their labels, fixed
splits (or "" for hash splits), class names, and a rejection reason for items
refused before any read (a file outside a class folder, an unsafe manifest key).
Plans depend only on the listing order and the config, which keeps shard ids
stable across reruns; keys are shuffled within windows of shards (seeded), so a
shard mixes classes without a global shuffle. Memory stays bounded: one window
of items, plus the set of class names.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from pipelines.core import shards
from pipelines.core.errors import IngestError
from pipelines.core.storage import Store

# An item is (key, label, split or "", class name, reason); a non-empty reason rejects it at planning.
Item = tuple[str, int, str, str, str]


def folder_items(source: Store) -> Iterator[Item]:
    """`<class>/<file>` layout: classes are numbered in listing (lexicographic) order."""
    classes: dict[str, int] = {}
    for page in source.list_pages():
        for key in page:
            name, sep, _ = key.partition("/")
            if not sep:
                yield key, -1, "", "", "not inside a class folder"
                continue
            yield key, classes.setdefault(name, len(classes)), "", name, ""


def manifest_items(manifest: Store) -> Iterator[Item]:
    """Rows of a CSV/Parquet manifest (key, label[, split]); string labels are numbered in sorted order."""
    classes = manifest_classes(manifest)
    for batch in manifest_batches(manifest):
        keys = batch.column("key").to_pylist()
        labels = batch.column("label").to_pylist()
        splits = batch.column("split").to_pylist() if "split" in batch.schema.names else [""] * len(keys)
        for key, label, split in zip(keys, labels, splits):
            name = str(label)
            if not key or key.startswith("/") or ".." in key.split("/"):
                yield str(key), -1, "", "", "invalid key in manifest"
                continue
            if split and split not in shards.SPLITS:
                raise IngestError(f"{manifest.uri}: split {split!r} of {key} is not one of {', '.join(shards.SPLITS)}")
            yield key, classes[name], split or "", name, ""


def manifest_batches(manifest: Store) -> Iterator[Any]:
    """Record batches of a CSV/Parquet manifest, streamed; checks the required columns."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    fs, path = manifest.arrow()
    try:
        if path.endswith(".parquet"):
            batches: Iterator[Any] = pq.ParquetFile(fs.open_input_file(path)).iter_batches(batch_size=65536)
        elif path.endswith(".csv"):
            convert = pacsv.ConvertOptions(column_types={"key": pa.string(), "split": pa.string()})
            batches = pacsv.open_csv(fs.open_input_stream(path), convert_options=convert)
        else:
            raise IngestError(f"{manifest.uri}: a manifest must be a .csv or .parquet file")
        for batch in batches:
            for column in ("key", "label"):
                if column not in batch.schema.names:
                    raise IngestError(f"{manifest.uri}: missing column {column!r} (expected key,label[,split])")
            if batch.column("key").null_count or batch.column("label").null_count:
                raise IngestError(f"{manifest.uri}: empty key or label")
            yield batch
    except (OSError, pa.ArrowInvalid) as exc:
        if isinstance(exc, OSError) and "AWS Error" in str(exc):
            raise manifest.error(exc) from None
        raise IngestError(f"{manifest.uri}: cannot read manifest ({' '.join(str(exc).split())[:200]})") from None


def manifest_classes(manifest: Store) -> dict[str, int]:
    """First pass over the manifest: integer labels keep their value, names are numbered sorted.

    Also refuses a manifest that names a key twice (its two labels would both be kept).
    """
    import pyarrow.types as pat

    values: set[Any] = set()
    integer = True
    hashes = []  # 8 bytes a row: 14 M keys hold ~110 MB here, not a set of the keys themselves
    for batch in manifest_batches(manifest):
        column = batch.column("label")
        integer = integer and pat.is_integer(column.type)
        values.update(column.to_pylist())
        hashes.append(np.fromiter(map(hash, batch.column("key").to_pylist()), dtype=np.int64))
    _check_unique_keys(manifest, np.concatenate(hashes) if hashes else np.empty(0, np.int64))
    if integer:
        if min(values, default=0) < 0:
            raise IngestError(f"{manifest.uri}: labels must be non-negative")
        return {str(v): int(v) for v in sorted(values)}
    return {name: i for i, name in enumerate(sorted(str(v) for v in values))}


def _check_unique_keys(manifest: Store, hashes: np.ndarray) -> None:
    """Raise one line naming the first row whose key an earlier row already named."""
    ordered = np.sort(hashes)
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not repeated:
        return
    seen: set[str] = set()  # only keys whose hash repeats: equal hashes of different keys are not duplicates
    for batch in manifest_batches(manifest):
        for key in batch.column("key").to_pylist():
            if hash(key) in repeated:
                if key in seen:
                    raise IngestError(f"{manifest.uri}: key {key} appears more than once")
                seen.add(key)


def cut_shards(items: Iterator[Item], shard_size: int, window: int, seed: int) -> Iterator[dict[str, Any]]:
    """Group the item stream into shard plans, shuffling keys within windows of `window` shards."""
    items = iter(items)
    buffer: list[Item] = []
    for n_windows in itertools.count():
        buffer.clear()
        for item in items:
            buffer.append(item)
            if len(buffer) == shard_size * window:
                break
        if not buffer:
            return
        order = np.random.default_rng([seed, n_windows]).permutation(len(buffer))
        mixed = [buffer[i] for i in order]
        for lo in range(0, len(mixed), shard_size):
            yield _plan_of(mixed[lo : lo + shard_size])
        if len(buffer) < shard_size * window:
            return


def _plan_of(items: list[Item]) -> dict[str, Any]:
    return {
        "keys": [it[0] for it in items],
        "labels": [it[1] for it in items],
        "splits": [it[2] for it in items],
        "classes": {it[3]: it[1] for it in items if not it[4]},
        "names": [it[3] for it in items],
        "reasons": [it[4] for it in items],
    }
