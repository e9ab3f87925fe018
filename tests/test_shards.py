"""`shards.regroup`: an actor pool's output rows collected back per source shard.

The source shards are real Parquet files in a local store; the stream stands in for the actor pool's
`iter_batches`, yielding rows tagged with their source shard's file name as the embed and video features
stages' actors tag them.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.core import shards
from pipelines.core.errors import VitpipeError
from pipelines.core.storage import Store, open_store

A, B, EMPTY = shards.shard_key(0), shards.shard_key(1), shards.shard_key(2)


def source_with(tmp_path: Path, rows: dict[str, int]) -> Store:
    """A local store holding one source shard per key, with `rows[key]` rows each."""
    for key, n in rows.items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"key": [f"{key}#{i}" for i in range(n)]}), tmp_path / key)
    return open_store(str(tmp_path))


def batch(*rows: tuple[str, int]) -> pa.Table:
    """Actor output rows: `(source key, row index)` each, tagged with the source shard's file name."""
    return pa.table({"value": [f"{key}#{i}" for key, i in rows],
                     "path": [posixpath.basename(key) for key, _ in rows]})


def values(parts: list[pa.Table]) -> list[str]:
    return [v for part in parts for v in part.column("value").to_pylist()]


def test_interleaved_rows_come_back_grouped_per_shard(tmp_path: Path) -> None:
    source = source_with(tmp_path, {A: 3, B: 2})
    stream = [batch((A, 0), (B, 0)), batch((B, 1), (A, 1)), batch((A, 2))]
    got = {key: parts for key, parts in shards.regroup(source, [A, B], lambda fs, paths: stream, unit="images")}
    assert {key: values(parts) for key, parts in got.items()} == {A: [f"{A}#0", f"{A}#1", f"{A}#2"],
                                                                 B: [f"{B}#0", f"{B}#1"]}
    assert all(part.column_names == ["value"] for parts in got.values() for part in parts)


def test_a_shard_is_yielded_as_soon_as_its_last_row_arrives(tmp_path: Path) -> None:
    source = source_with(tmp_path, {A: 1, B: 2})
    sent: list[int] = []

    def stream(filesystem, paths) -> Iterator[pa.Table]:
        for n, b in enumerate([batch((A, 0), (B, 0)), batch((B, 1))]):
            sent.append(n)
            yield b

    completed = shards.regroup(source, [A, B], stream, unit="images")
    assert next(completed)[0] == A
    assert sent == [0]  # the second batch is not yet asked for
    assert next(completed)[0] == B


def test_empty_shards_are_yielded_first_and_never_streamed(tmp_path: Path) -> None:
    source = source_with(tmp_path, {A: 1, EMPTY: 0})
    streamed: list[list[str]] = []

    def stream(filesystem, paths) -> list[pa.Table]:
        streamed.append([posixpath.basename(p) for p in paths])
        return [batch((A, 0))]

    assert [(key, len(parts)) for key, parts in shards.regroup(source, [EMPTY, A], stream, unit="videos")] == [
        (EMPTY, 0), (A, 1)]
    assert streamed == [[posixpath.basename(A)]]


def test_only_empty_shards_never_start_the_stream(tmp_path: Path) -> None:
    source = source_with(tmp_path, {EMPTY: 0})

    def stream(filesystem, paths):
        raise AssertionError("the stream was started with nothing to read")

    assert list(shards.regroup(source, [EMPTY], stream, unit="videos")) == [(EMPTY, [])]


def test_a_missing_row_raises_one_line_naming_the_shard_and_k_of_n(tmp_path: Path) -> None:
    source = source_with(tmp_path, {A: 2, B: 3})
    stream = [batch((A, 0), (B, 0)), batch((A, 1), (B, 1))]
    with pytest.raises(VitpipeError) as caught:
        list(shards.regroup(source, [A, B], lambda fs, paths: stream, unit="videos"))
    assert str(caught.value) == f"{source.child_uri(B)}: 2 of 3 videos came back"
