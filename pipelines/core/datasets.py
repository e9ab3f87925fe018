"""What every shard reader shares: pixel normalisation, seeded per-key randomness, seeded passes over Parquet.

The image patch datasets (`pipelines.image.data`), the video clip datasets
(`pipelines.video.data`) and the video feature datasets all stream through
`seeded_passes` and scale pixels with `PATCH_MEAN` / `PATCH_STD`, so a seed
picks the same file orders and the same per-key draws in every one of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["PATCH_MEAN", "PATCH_STD", "key_seed", "seeded_passes"]

PATCH_MEAN = 0.5  # per channel, on pixels scaled to [0, 1]
PATCH_STD = 0.5


def key_seed(key: str) -> list[int]:
    """Two 32-bit words from a stable hash of `key`: with a run seed and an epoch, they seed a key's own generator."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return [int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")]


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
    """`epochs` passes over the `split` rows of Parquet files (on `filesystem`), chained into one Ray Dataset.

    Pass `e` reads the files in shuffled order when `shuffle` (fixed by `seed + e`
    when seeded, fresh otherwise) and maps `decode(batch, **fn_kwargs, seed=seed, epoch=e)`
    over pyarrow batches of `batch_size` rows. The image, clip and feature datasets
    all stream through here, so a seed picks their file orders the same way.
    """
    import ray.data
    from ray.data.expressions import col

    passes = []
    for epoch in range(epochs):
        order = None
        if shuffle:
            order = ray.data.FileShuffleConfig(seed=seed + epoch) if seed is not None else "files"
        ds = (
            ray.data.read_parquet(paths, filesystem=filesystem, shuffle=order)
            .select_columns(list(columns))
            .filter(expr=col("split") == split)
        )
        passes.append(
            ds.map_batches(decode, fn_kwargs={**fn_kwargs, "seed": seed, "epoch": epoch},
                           batch_format="pyarrow", batch_size=batch_size)
        )
    return passes[0].union(*passes[1:]) if len(passes) > 1 else passes[0]
