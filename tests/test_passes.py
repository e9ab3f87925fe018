"""pipelines.core.datasets.seeded_passes: many passes over Parquet shards as one chain, pass after pass.

The shards here are six small Parquet files of `key`/`split` rows; the decode function
stands in for the image, clip and feature decoders: it returns each row's key, the pass
it was decoded in and a per-row draw seeded like theirs (`seed`, pass, key).
Datasets are read with `preserve_order`, as training reads them.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipelines.core.datasets import PassPlan, key_seed, read_items, seeded_passes

FILES, TRAIN_ROWS, VAL_ROWS = 6, 4, 1


def file_keys(index: int) -> list[str]:
    return [f"f{index}-r{row}" for row in range(TRAIN_ROWS + VAL_ROWS)]


@pytest.fixture(scope="module")
def shard_paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("passes")
    paths = []
    for index in range(FILES):
        keys = file_keys(index)
        splits = ["train"] * TRAIN_ROWS + ["val"] * VAL_ROWS
        path = root / f"shard-{index}.parquet"
        pq.write_table(pa.table({"key": keys, "split": splits}), path)
        paths.append(str(path))
    return paths


@pytest.fixture
def ordered(ray_cluster):
    """Ray Data preserving block order, as training runs it (`pipelines.training.trainer`)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    saved = copy.copy(context.execution_options)
    context.execution_options.preserve_order = True
    yield
    context.execution_options = saved


def decode_rows(table: Any, *, seed: int | None, epoch: int, log: str | None = None) -> dict[str, np.ndarray]:
    """Stand-in decoder: each row's key, pass and seeded draw; appends the pass to `log` when given."""
    if log is not None:
        with open(log, "a") as f:
            f.write(f"{epoch}\n")
    keys = table.column("key").to_pylist()
    draws = [np.random.default_rng([seed, epoch, *key_seed(k)]).random() for k in keys]
    return {"key": np.asarray(keys), "epoch": np.full(len(keys), epoch), "draw": np.asarray(draws)}


def passes(paths: list[str], *, epochs: int, seed: int | None = 0, shuffle: bool = True, **decode_kwargs: Any) -> Any:
    return seeded_passes(paths, pafs.LocalFileSystem(), split="train", columns=("key", "split"), shuffle=shuffle,
                         seed=seed, epochs=epochs, decode=decode_rows, fn_kwargs=decode_kwargs, batch_size=3)


def rows(ds: Any) -> list[tuple[str, int, float]]:
    out = []
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        out += zip(batch["key"].tolist(), batch["epoch"].tolist(), batch["draw"].tolist())
    return out


@pytest.mark.timeout(300)  # passes read side by side (a union of passes) gave no first batch in 6 minutes
def test_the_first_batch_arrives_before_later_passes_are_read(shard_paths, ordered, tmp_path):
    log = tmp_path / "decoded-passes.txt"
    log.touch()
    batches = iter(passes(shard_paths, epochs=40, log=str(log)).iter_batches(batch_size=1))
    first = next(batches)
    decoded = {int(line) for line in log.read_text().split()}
    batches.close()
    assert first["epoch"].tolist() == [0]
    assert max(decoded) < 5, f"passes decoded before the first batch: {sorted(decoded)}"


def test_each_pass_yields_every_split_row_once_and_passes_come_in_order(shard_paths, ordered):
    got = rows(passes(shard_paths, epochs=3))
    train_keys = Counter(k for i in range(FILES) for k in file_keys(i)[:TRAIN_ROWS])
    epochs = [epoch for _, epoch, _ in got]
    assert epochs == sorted(epochs)
    for epoch in range(3):
        assert Counter(k for k, e, _ in got if e == epoch) == train_keys


def test_without_shuffle_every_pass_reads_the_files_in_the_given_order(shard_paths, ordered):
    got = [key for key, _, _ in rows(passes(shard_paths, epochs=2, shuffle=False))]
    assert got == [k for i in range(FILES) for k in file_keys(i)[:TRAIN_ROWS]] * 2


def test_the_same_seed_gives_the_same_rows_in_the_same_order_with_the_same_draws(shard_paths, ordered):
    assert rows(passes(shard_paths, epochs=3, seed=5)) == rows(passes(shard_paths, epochs=3, seed=5))


def test_a_different_seed_gives_a_different_file_order(shard_paths, ordered):
    def keys(seed: int) -> list[str]:
        return [key for key, _, _ in rows(passes(shard_paths, epochs=3, seed=seed))]

    assert keys(5) != keys(6)


def test_every_pass_has_its_own_file_order(shard_paths, ordered):
    got = rows(passes(shard_paths, epochs=3, seed=5))
    orders = [[k for k, e, _ in got if e == epoch] for epoch in range(3)]
    assert len({tuple(order) for order in orders}) > 1


def test_a_block_of_several_items_reads_them_one_after_another(shard_paths):
    # Past MAX_BLOCKS items share a block; the task then reads its items in index order.
    plan = PassPlan(shard_paths, pafs.LocalFileSystem(), "train", ("key", "split"), shuffle=False, order_seed=0)
    batches = read_items({"id": np.arange(FILES - 1, FILES + 2)}, plan=plan, decode=decode_rows, decode_kwargs={},
                          seed=0, batch_size=3)
    got = [(k, int(e)) for batch in batches for k, e in zip(batch["key"].tolist(), batch["epoch"])]
    last_file = [(k, 0) for k in file_keys(FILES - 1)[:TRAIN_ROWS]]
    assert got == last_file + [(k, 1) for i in (0, 1) for k in file_keys(i)[:TRAIN_ROWS]]
