"""Reading the samples of one input file: a WebDataset tar shard or a Parquet table of image bytes.

Both stream: a tar is read front to back (`tarfile` in stream mode `r|` over one GET), a
Parquet table a batch of rows at a time, so a shard task holds one sample (tar) or one small
batch (Parquet), never the file. Ray Data's own `read_webdataset` / `read_parquet` are not used:
they turn a bad sample, a damaged file or a read error into a failed read of the whole dataset,
while here each is a rejection with its reason or a retried task; and the engine's unit of
reuse is one input file (its plan and output shard), not a block Ray Data cuts.

What counts as what:
- a sample with no image (`jpg`/`jpeg`/`png`/`webp` member, or an empty image cell), without the
  label a labeled ingest needs, or with a label that is no class number, is a rejection;
- **a damaged tar** (cut short, or a header that does not parse) is ONE rejection keyed by the
  shard, naming the byte offset where the unreadable member or header begins. The rule for what
  came before: every sample wholly read before the damage is kept; the sample being read when
  it came (its members may be incomplete) is dropped, and so is everything after;
- a Parquet file that is not Parquet, or lacks the named columns, is one rejection keyed by it;
- a read that kept failing for a cause that may pass raises `TransientStorageError` (Ray retries
  the shard task), and one the store refuses whatever the file (credentials, bucket) raises
  `StoreAccessError` (the stage fails), exactly as for objects (`pipelines.core.fetch`).
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator
from typing import Any

from pipelines.core.errors import StorageError, StoreAccessError, TransientStorageError
from pipelines.core.store import Store

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
# (sample key, image bytes, label or None)
Sample = tuple[str, bytes, "int | None"]
_PARQUET_BATCH = 64  # rows decoded from Parquet at once: one small batch of images in memory


class _StrictHeader(tarfile.TarInfo):
    """A header that reports a cut or garbled header as damage: `tarfile` itself ends an archive
    silently there, which would drop the rest of a truncated shard without a word."""

    @classmethod
    def frombuf(cls, buf: bytes, encoding: str, errors: str) -> tarfile.TarInfo:
        try:
            return super().frombuf(buf, encoding, errors)
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError, tarfile.InvalidHeaderError) as exc:
            # Only a block of zeros (EOFHeaderError) ends an archive cleanly.
            raise tarfile.SubsequentHeaderError(str(exc)) from None


def tar_samples(
    source: Store, key: str, rejected: list[dict[str, str]], *, labeled: bool, label_field: str | None,
    max_bytes: int | None,
) -> Iterator[Sample]:
    """The samples of WebDataset shard `key`: members grouped by basename (the name up to its
    first dot), the image from its `jpg`/`jpeg`/`png`/`webp` member, the label from `cls` or, when
    `label_field` is named, that field of its `json` member. Rejections go to `rejected`."""
    at = 0  # where the member or header being read begins
    current, parts = None, {}
    try:
        with source.open_input(key) as raw, tarfile.open(fileobj=raw, mode="r|", tarinfo=_StrictHeader) as tar:
            for member in tar:
                at = member.offset
                if not member.isfile():
                    continue
                folder, name = posixpath.split(member.name)
                base, _, suffix = name.partition(".")
                sample = posixpath.join(key, folder, base)
                if sample != current:
                    if current is not None:
                        yield from _sample(current, parts, rejected, labeled, label_field)
                    current, parts = sample, {}
                if max_bytes is not None and member.size > max_bytes:
                    parts[suffix.lower()] = f"{suffix} member is larger than {max_bytes} bytes ({member.size})"
                    continue
                handle = tar.extractfile(member)
                parts[suffix.lower()] = handle.read() if handle is not None else b""
                at = tar.offset
    except tarfile.ReadError as exc:
        rejected.append({"key": key, "reason": f"damaged tar at byte {at}: {exc}; samples before it kept"})
        return
    except (OSError, StorageError) as exc:
        _read_failed(source, key, exc, rejected)
        return
    if current is not None:
        yield from _sample(current, parts, rejected, labeled, label_field)


def _read_failed(source: Store, key: str, exc: Exception, rejected: list[dict[str, str]]) -> None:
    """A read error: raise it when its cause may pass (Ray retries the shard task) or holds for the
    whole store (credentials, bucket: the stage fails); a cause of this file alone (it went missing,
    access to it is denied) rejects the rest of the file with its reason."""
    err = source.read_error(exc, key)
    if isinstance(err, (TransientStorageError, StoreAccessError)):
        raise err from None
    rejected.append({"key": key, "reason": err.message.removeprefix(f"{source.child_uri(key)}: ")})


def _sample(
    key: str, parts: dict[str, bytes | str], rejected: list[dict[str, str]], labeled: bool, label_field: str | None
) -> Iterator[Sample]:
    """The one sample `parts` (suffix → bytes, or the reason a member was refused) make, or its rejection."""
    image = next((parts[s] for s in IMAGE_SUFFIXES if s in parts), None)
    if image is None:
        rejected.append({"key": key, "reason": f"no image member ({'/'.join(IMAGE_SUFFIXES)})"})
        return
    if isinstance(image, str):
        rejected.append({"key": key, "reason": image})
        return
    label, why = (None, "") if not labeled else _tar_label(parts, label_field)
    if why:
        rejected.append({"key": key, "reason": why})
        return
    yield key, image, label


def _tar_label(parts: dict[str, bytes | str], label_field: str | None) -> tuple[int | None, str]:
    """(the sample's class number, "") or (None, why it has none)."""
    member = "json" if label_field else "cls"
    raw = parts.get(member)
    if not isinstance(raw, bytes):
        return None, f"no {member} member for its label"
    try:
        value = json.loads(raw)[label_field] if label_field else raw.decode().strip()
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None, f"no label field {label_field!r} in its json" if label_field else "cls is not text"
    return class_number(value)


def class_number(value: Any) -> tuple[int | None, str]:
    """(a label as a class number, "") or (None, why it is none): labels must be integers >= 0."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None, f"label {value!r} is not a class number"
    if isinstance(value, (bool, float)) or number < 0:
        return None, f"label {value!r} is not a class number"
    return number, ""


def parquet_samples(
    source: Store, key: str, rejected: list[dict[str, str]], *, image_column: str, label_column: str | None,
    max_bytes: int | None,
) -> Iterator[Sample]:
    """The rows of Parquet table `key` as samples `<key>#<row>`: image bytes from `image_column`
    (binary, or Hugging Face's `{"bytes": ..., "path": ...}` struct), the label from
    `label_column` (None: unlabeled). Rows without usable bytes or label are rejections."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [image_column] + ([label_column] if label_column else [])
    row = 0
    try:
        table = pq.ParquetFile(source.open_input(key, seekable=True))
        missing = [c for c in columns if c not in table.schema_arrow.names]
        if missing:
            names = ", ".join(table.schema_arrow.names)
            rejected.append({"key": key, "reason": f"no column {missing[0]!r} (has {names})"})
            return
        for batch in table.iter_batches(batch_size=_PARQUET_BATCH, columns=columns):
            images = batch.column(image_column).to_pylist()
            labels = batch.column(label_column).to_pylist() if label_column else [None] * len(images)
            for value, label in zip(images, labels):
                sample = f"{key}#{row}"
                row += 1
                yield from _row_sample(sample, value, label, label_column is not None, rejected, max_bytes)
    except pa.ArrowInvalid as exc:
        rejected.append({"key": key, "reason": f"not a readable Parquet table at row {row}: {str(exc)[:200]}"})
    except (OSError, StorageError) as exc:
        _read_failed(source, key, exc, rejected)


def _row_sample(
    key: str, value: Any, label: Any, labeled: bool, rejected: list[dict[str, str]], max_bytes: int | None
) -> Iterator[Sample]:
    data = value.get("bytes") if isinstance(value, dict) else value
    why = ""
    if not isinstance(data, bytes) or not data:
        where = f" (path {value.get('path')!r})" if isinstance(value, dict) and value.get("path") else ""
        why = f"no image bytes{where}"
    elif max_bytes is not None and len(data) > max_bytes:
        why = f"image is larger than {max_bytes} bytes ({len(data)})"
    number = None
    if not why and labeled:
        number, why = class_number(label)
    if why:
        rejected.append({"key": key, "reason": why})
        return
    yield key, data, number
