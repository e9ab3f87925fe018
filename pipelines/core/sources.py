"""Where an ingest's samples come from: the planners that cut a source into shard plans.

Two shapes of corpus:

- *One object per sample* (`object_plans`): `<class>/<file>` folders, a CSV/Parquet label
  manifest, or, unlabeled, every object under the source. The listing is cut into shards by
  content-defined windows (`pipelines.core.plan`).
- *Files of samples* (`file_plans`): WebDataset tar shards or Parquet tables of image bytes.
  Each input file is one plan and one output shard, so a rerun reuses per input file: the plan
  holds the file's key and version tag (size and ETag or mtime), and the shard written for it
  is kept while they match. Its samples are read in the shard task (`pipelines.core.samples`).

A source may end in a brace range, `s3://bucket/prefix/{000000..000999}.tar`: its folder is
listed and only the names the range spells are read; without one, every file with the
format's suffix under the source is.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any

from pipelines.core import listing, plan as ingest_plan
from pipelines.core.errors import IngestError
from pipelines.core.storage import Store
from pipelines.core.uris import BRACE_RANGE, pattern_root

# (config, source, label manifest or None) -> the unsealed shard plans, streamed.
Planner = Callable[[Any, Store, "Store | None"], Iterator[dict[str, Any]]]

def object_plans(
    config: Any, source: Store, manifest: Store | None, *, labeled: bool = True
) -> Iterator[dict[str, Any]]:
    """Shard plans of a corpus of one object per sample: `<class>/<file>` folders, the rows of a
    label manifest tagged from one listing of the source, or (unlabeled) every object under it."""
    pages = listing.source_entries(source, width=config.list_concurrency)
    if manifest is not None:
        items = ingest_plan.tagged(ingest_plan.manifest_items(manifest), ingest_plan.ListingIndex(pages), source)
    elif labeled:
        items = ingest_plan.folder_items(pages)
    else:
        items = ingest_plan.unlabeled_items(pages)
    yield from ingest_plan.cut_shards(items, config.shard_size, config.mix_window, config.seed)


def name_filter(uri: str, suffix: str) -> Callable[[str], bool]:
    """Which listed keys (relative to `pattern_root(uri)`) are input files: the names a brace range
    spells (numbers of the range's width, within it), else any key ending in `suffix`."""
    name = uri.rstrip("/").rpartition("/")[2]
    ranges = [(int(m.group(1)), int(m.group(2))) for m in BRACE_RANGE.finditer(name)]
    if pattern_root(uri) == uri:
        return lambda key: key.endswith(suffix)
    parts = BRACE_RANGE.split(name)[::3]  # the literal text around the ranges
    regex = re.compile("".join(re.escape(p) + (f"(\\d{{{len(m.group(1))}}})" if i < len(ranges) else "")
                               for i, (p, m) in enumerate(zip(parts, [*BRACE_RANGE.finditer(name), None]))))

    def matches(key: str) -> bool:
        found = regex.fullmatch(key)
        return bool(found) and all(lo <= int(v) <= hi for v, (lo, hi) in zip(found.groups(), ranges))

    return matches


def file_plans(source: Store, uri: str, suffix: str, width: int) -> Iterator[dict[str, Any]]:
    """One plan per input file under `source` that `uri` names (see `name_filter`), in key order.

    Raises `IngestError` when no file matches: an empty corpus is a mistake, not an empty output.
    """
    matches = name_filter(uri, suffix)
    found = False
    for page in listing.source_entries(source, width=width):
        for key, size, version in page:
            if matches(key):
                found = True
                yield file_plan(key, ingest_plan.version_tag(size, version))
    if not found:
        raise IngestError(f"{uri}: no {suffix} files match under {source.uri}")


def file_plan(key: str, tag: str) -> dict[str, Any]:
    """The plan of one input file of samples: its shard is named after the file's key."""
    name = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    return {"shard": f"{name}-in", "file": key, "keys": [key], "labels": [None], "splits": [""], "classes": {},
            "names": [""], "reasons": [""], "tags": [tag]}
