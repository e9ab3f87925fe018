"""What every shard reader shares: pixel normalisation, seeded per-key randomness, seeded passes over Parquet.

The image patch datasets (`pipelines.image.data`), the video clip datasets
(`pipelines.video.data`) and the video feature datasets all stream through
`seeded_passes` and scale pixels with `PATCH_MEAN` / `PATCH_STD`, so a seed
picks the same file orders and the same per-key draws in every one of them.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PATCH_MEAN", "PATCH_STD", "PassPlan", "key_seed", "read_each_shard", "read_items", "seeded_passes"]

PATCH_MEAN = 0.5  # per channel, on pixels scaled to [0, 1]
PATCH_STD = 0.5
MAX_BLOCKS = 4096  # blocks of (pass, file) items in `seeded_passes`


def key_seed(key: str) -> list[int]:
    """Two 32-bit words from a stable hash of `key`: with a run seed and an epoch, they seed a key's own generator."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return [int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")]


@dataclass(frozen=True)
class PassPlan:
    """Which file a `(pass, position)` reads, and which of its rows: what every read task of `seeded_passes` gets."""

    paths: list[str]
    filesystem: Any
    split: str
    columns: tuple[str, ...]
    shuffle: bool
    order_seed: int

    def pass_order(self, epoch: int) -> np.ndarray:
        """Pass `epoch`'s file order: a function of `(order_seed, epoch)` when shuffled, the given order otherwise."""
        if not self.shuffle:
            return np.arange(len(self.paths))
        return np.random.default_rng([self.order_seed, epoch]).permutation(len(self.paths))

    def item(self, index: int) -> tuple[int, str]:
        """Item `index` of the chained passes → `(pass, path)`."""
        epoch, position = divmod(index, len(self.paths))
        return epoch, self.paths[self.pass_order(epoch)[position]]

    def read(self, path: str) -> Any:
        """`path`'s `split` rows, `columns` only, as a pyarrow Table."""
        import pyarrow.dataset as pads
        import pyarrow.parquet as pq

        return pq.read_table(path, filesystem=self.filesystem, columns=list(self.columns),
                             filters=pads.field("split") == self.split)


def read_items(
    items: dict[str, np.ndarray], *, plan: PassPlan, decode: Callable[..., dict[str, np.ndarray]],
    decode_kwargs: dict[str, Any], seed: int | None, batch_size: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data UDF: item indices → each item's file read, decoded in batches of `batch_size` rows."""
    for index in items["id"].tolist():
        epoch, path = plan.item(int(index))
        table = plan.read(path)
        for start in range(0, table.num_rows, batch_size):
            yield decode(table.slice(start, batch_size), **decode_kwargs, seed=seed, epoch=epoch)


def seeded_passes(
    paths: list[str],
    filesystem: Any,
    *,
    split: str,
    columns: Sequence[str],
    shuffle: bool,
    seed: int | None,
    epochs: int,
    decode: Callable[..., dict[str, np.ndarray]],
    fn_kwargs: dict[str, Any],
    batch_size: int,
) -> Any:
    """`epochs` passes over the `split` rows of Parquet files (on `filesystem`), one after another in one Ray Dataset.

    The Dataset's items are `(pass, file)` in order: pass `e`'s files (`PassPlan.pass_order`:
    shuffled when `shuffle`, by `seed` when seeded, by one fresh draw otherwise), then
    pass `e + 1`'s. One task reads one item's rows and yields `decode(batch, **fn_kwargs,
    seed=seed, epoch=e)` over batches of `batch_size` rows, so pass 0 is read first
    rather than every pass at once; with `preserve_order` (as training reads it) rows
    come out in that order. The image, clip and feature datasets all stream through
    here, so a seed picks their file orders the same way.
    """
    import ray.data

    order_seed = seed if seed is not None else secrets.randbits(63)  # unseeded: file orders fresh per dataset
    plan = PassPlan(list(paths), filesystem, split, tuple(columns), shuffle, order_seed)
    total = epochs * len(paths)
    # One (pass, file) per block, so reads run in parallel and stream in order; Ray Data
    # plans its read tasks up front, so past MAX_BLOCKS a block holds several in a row.
    items = ray.data.range(total, override_num_blocks=min(total, MAX_BLOCKS))
    return items.map_batches(
        read_items, batch_size=None, batch_format="numpy",
        fn_kwargs={"plan": plan, "decode": decode, "decode_kwargs": fn_kwargs, "seed": seed, "batch_size": batch_size},
    )


def read_each_shard(paths: Sequence[str], filesystem: Any, columns: Sequence[str], readers: int) -> Any:
    """A Ray Dataset of `columns` plus `path` (as given) of the Parquet shards at `paths`: one block per shard,
    from at most `readers` zero-CPU tasks at a time, each yielding its shard's row groups as they are read.

    Not `ray.data.read_parquet`: its file partitioner packs files into read tasks of at least
    `target_min_block_size` whatever `override_num_blocks` says, and a task's rows come back
    together, so a stage writing one output per input shard wrote nothing, nor kept anything
    past a kill, until a whole pack was done. Zero CPUs: the reads never fuse into a following
    actor pool (whose tasks would then each take a batch of shard paths, not of rows), and
    never wait for a CPU those actors hold.
    """
    import ray.data

    items = ray.data.from_items([{"path": path} for path in paths], override_num_blocks=max(1, len(paths)))
    return items.map_batches(_read_shards, batch_size=None, batch_format="pyarrow", num_cpus=0,
                             compute=ray.data.TaskPoolStrategy(size=max(1, min(readers, len(paths)))),
                             fn_kwargs={"filesystem": filesystem, "columns": list(columns)})


def _read_shards(batch: Any, filesystem: Any, columns: list[str]) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in batch.column("path").to_pylist():
        with pq.ParquetFile(path, filesystem=filesystem) as shard:  # closes the file it opened
            for group in range(shard.num_row_groups):
                table = shard.read_row_group(group, columns=columns)
                yield table.append_column("path", pa.array([path] * table.num_rows, pa.string()))
