"""The format of an embed stage output ("vitpipe-embeddings/1"): its shards' schema, their hash, and a reader.

Shards live where an ingest keeps its own (`pipelines.core.shards`), one row
per image: `key`, `embedding` (fixed-size list of float32), `label` (int32;
only when the ingest is labeled) and `split`. `pipelines.image.embed` writes them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pyarrow as pa

from pipelines.core.shards import Holds, read_manifest
from pipelines.core.storage import open_store

FORMAT = "vitpipe-embeddings/1"
EMBEDDINGS = Holds(FORMAT, "an embed output")


def schema(dim: int, labeled: bool) -> pa.Schema:
    """The embedding shards' schema."""
    return pa.schema([
        pa.field("key", pa.string(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32(), dim), nullable=False),
        *([pa.field("label", pa.int32(), nullable=False)] if labeled else []),
        pa.field("split", pa.string(), nullable=False),
    ])


def rows_hash(table: pa.Table) -> str:
    """sha256 over an embedding shard's rows: keys, labels and splits, then the float32 embeddings."""
    h = hashlib.sha256()
    meta = [table.column(name).to_pylist() for name in ("key", "label", "split") if name in table.column_names]
    h.update(json.dumps(meta).encode())
    values = table.column("embedding").combine_chunks().flatten() if table.num_rows else pa.array([], pa.float32())
    h.update(values.to_numpy(zero_copy_only=False).astype(np.float32).tobytes())
    return h.hexdigest()


def read_embeddings(uri: str, *, endpoint_url: str | None = None) -> tuple[dict[str, Any], pa.Table]:
    """The manifest and every row of a finished embed output, in key order (a small output: all in memory).

    Raises `VitpipeError` (one line naming the URI) when `uri` is not a finished embed output.
    """
    import pyarrow.parquet as pq

    store = open_store(uri, endpoint_url=endpoint_url)
    manifest = read_manifest(store, expect=EMBEDDINGS)
    target = schema(int(manifest["embedding_dim"]), bool(manifest["labeled"]))
    tables = [pq.read_table(path, filesystem=fs) for fs, path in (store.arrow(s["path"]) for s in manifest["shards"])]
    table = pa.concat_tables(tables) if tables else target.empty_table()
    return manifest, table.cast(target).sort_by("key")


def embedding_matrix(table: pa.Table) -> np.ndarray:
    """The `embedding` column as a float32 `(rows, dim)` array."""
    column = table.column("embedding").combine_chunks()
    dim = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)


__all__ = ["EMBEDDINGS", "FORMAT", "embedding_matrix", "read_embeddings", "rows_hash", "schema"]
