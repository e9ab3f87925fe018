"""Planning the ingest: the source listing (or a manifest) cut into shard plans.

A plan is a JSON-able dict: the shard's name, the keys of one shard with their
labels, fixed splits (or "" for hash splits), class names, each object's version
tag (a digest of its size and ETag or mtime), and a rejection reason for items
refused before any read (a file outside a class folder, an unsafe manifest key, a manifest
key the listing lacks).

Shard assignment is local, so a changed input rewrites few shards: the item
stream is cut into windows at *content-defined* boundaries (a key whose hash
falls in a 1-in-`shard_size * mix_window` bucket ends its window), and each
window's keys are shuffled (seeded by the window's first key) and dealt into
shards named after the window. An added or removed key changes only its own
window's shards; a changed label or a replaced object only its own shard.
Memory stays bounded: one window of items, plus the set of class names (and,
with a label manifest, a compact index of the listing: 17 bytes an object).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from pipelines.core import shards
from pipelines.core.errors import IngestError
from pipelines.core.storage import Entry, Store

# A row is (key, label, split or "", class name, reason); a non-empty reason rejects it at planning.
# The label is None in an unlabeled ingest.
Row = tuple[str, int | None, str, str, str]
# An item is a row plus the object's version tag (`version_tag`; "" when the object is not listed, and
# then the row is rejected).
Item = tuple[str, int | None, str, str, str, str]

# A window is cut short at this many times its expected size, only to bound memory.
_MAX_WINDOW_FACTOR = 16


def version_tag(size: int, version: str) -> str:
    """A short digest of what tells one version of an object from another: size and ETag or mtime."""
    return hashlib.blake2b(f"{size}:{version}".encode(), digest_size=8).hexdigest()


def folder_items(pages: Iterable[list[Entry]]) -> Iterator[Item]:
    """`<class>/<file>` layout, from the source's listing pages in key order: classes are
    numbered in listing (lexicographic) order."""
    classes: dict[str, int] = {}
    for page in pages:
        for key, size, version in page:
            tag = version_tag(size, version)
            name, sep, _ = key.partition("/")
            if not sep:
                yield key, -1, "", "", "not inside a class folder", tag
                continue
            yield key, classes.setdefault(name, len(classes)), "", name, "", tag


def unlabeled_items(pages: Iterable[list[Entry]]) -> Iterator[Item]:
    """Every listed object, wherever it lies, with no label: an unlabeled corpus has no class folders."""
    for page in pages:
        for key, size, version in page:
            yield key, None, "", "", "", version_tag(size, version)


class ListingIndex:
    """The version tags of every object under a prefix, from one pass over its listing pages, for
    a label manifest whose rows come in any order: 17 bytes an object (key hash, tag, named yet), sorted."""

    def __init__(self, pages: Iterable[list[Entry]]) -> None:
        hashes: list[np.ndarray] = []
        tags: list[np.ndarray] = []
        for page in pages:
            hashes.append(np.array([_key_hash(key) for key, _, _ in page], dtype=np.uint64))
            tags.append(np.array([int(version_tag(size, v), 16) for _, size, v in page], dtype=np.uint64))
        keys = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        self.tags = (np.concatenate(tags) if tags else np.zeros(0, np.uint64))[order]
        self.named = np.zeros(len(self.keys), dtype=bool)  # which objects a manifest row already named

    def tag(self, key: str, *, name: bool = False) -> str | None:
        """The object's version tag, or "" when the listing does not hold it (reading it will fail).

        With `name`, a row names the object: None when an earlier row already named it."""
        h = np.uint64(_key_hash(key))
        i = int(np.searchsorted(self.keys, h))
        if i >= len(self.keys) or self.keys[i] != h:
            return ""
        if name:
            if self.named[i]:
                return None
            self.named[i] = True
        return f"{int(self.tags[i]):016x}"


def tagged(rows: Iterator[Row], index: ListingIndex, source: Store) -> Iterator[Item]:
    """Manifest rows with the version tag of the object each names, found under the key the source
    lists it by (locally `./cat/a.jpg` is `cat/a.jpg`). A row whose object the listing lacks (missing,
    a hidden name, another spelling of an S3 key) is rejected: with no version to track, a later change
    to the object would never rewrite its shard. A row naming an object an earlier row named under another
    spelling (`./cat/a.jpg` after `cat/a.jpg`) raises IngestError: kept, one file would be two samples, each
    with its own label and split (one in train, one in test)."""
    for key, label, split, name, reason in rows:
        listed = source.listed_key(key)
        tag = index.tag(listed, name=not reason)
        if tag is None:
            raise IngestError(f"{source.child_uri(listed)}: the label manifest names it twice (again as {key!r})")
        yield key, label, split, name, reason or ("" if tag else "not in the source listing"), tag


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "big")


def manifest_items(manifest: Store) -> Iterator[Row]:
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
    """Group the item stream into shard plans: content-defined windows of about `window` shards,
    each shuffled and dealt into shards of at most `shard_size` items, named after the window."""
    period = shard_size * window
    buffer: list[Item] = []
    for item in items:
        buffer.append(item)
        if _key_hash(item[0]) % period == 0 or len(buffer) >= _MAX_WINDOW_FACTOR * period:
            yield from _window_plans(buffer, shard_size, seed)
            buffer = []
    if buffer:
        yield from _window_plans(buffer, shard_size, seed)


def _window_plans(window: list[Item], shard_size: int, seed: int) -> Iterator[dict[str, Any]]:
    """One window's shards: near-equal parts of its seeded shuffle, so none is tiny."""
    first = _key_hash(window[0][0])
    order = np.random.default_rng([seed, first]).permutation(len(window))
    parts = np.array_split(order, -(-len(window) // shard_size))
    for j, part in enumerate(parts):
        yield _plan_of(f"{first:016x}-{j:03d}", [window[i] for i in part])


def _plan_of(name: str, items: list[Item]) -> dict[str, Any]:
    return {
        "shard": name,
        "keys": [it[0] for it in items],
        "labels": [it[1] for it in items],
        "splits": [it[2] for it in items],
        "classes": {it[3]: it[1] for it in items if not it[4] and it[1] is not None},
        "names": [it[3] for it in items],
        "reasons": [it[4] for it in items],
        "tags": [it[5] for it in items],
    }


def seal(plan: dict[str, Any], config_fingerprint: str) -> dict[str, Any]:
    """Give a plan its shard key and its fingerprint (everything it holds, under this config):
    the shard written for it is reused while the fingerprint in its footer matches."""
    plan["key"] = shards.shard_key(plan.pop("shard"))
    plan["fingerprint"] = shards.fingerprint({"config": config_fingerprint, "plan": plan})
    return plan
