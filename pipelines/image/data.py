"""Reading an ingested image dataset: a Ray Dataset of patch batches, small splits in memory.

`patch_dataset` is what the training stages stream: Parquet shards read by Ray
Data, decoded on CPU workers into `patches` float32 `(B, N, P*P*3)` normalised
with `PATCH_MEAN` / `PATCH_STD` (`pipelines.core.datasets`), and `label` int64.
With `augment=True` each image gets a random-resized crop and a horizontal flip,
applied to the pixels behind the patches (unpatchify → crop → resize → patchify).

Augmentation randomness: with `seed=None` every pass draws fresh crops (what a
training loop that iterates the same Dataset for several epochs wants). With an
integer seed the crop of an image depends only on `(seed, epoch, key)`, so a run
is reproducible; `epochs=k` then chains k passes with epochs 0..k-1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from pipelines.core import shards
from pipelines.core.datasets import PATCH_MEAN, PATCH_STD, key_seed, seeded_passes
from pipelines.core.errors import VitpipeError
from pipelines.core.storage import open_store
from pipelines.image.patches import patchify_batch, unpatchify
from pipelines.training.recipe import AugmentConfig

__all__ = [
    "augment_patches",
    "load_split",
    "normalize",
    "patch_dataset",
]


def normalize(patches: np.ndarray) -> np.ndarray:
    """uint8 pixels → float32 `(x / 255 - PATCH_MEAN) / PATCH_STD`."""
    return (patches.astype(np.float32) * np.float32(1 / (255 * PATCH_STD))) - np.float32(PATCH_MEAN / PATCH_STD)


def labels_array(column: Any) -> np.ndarray:
    """A label column as int64; an unlabeled ingest's null labels become -1."""
    import pyarrow.compute as pc

    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if column.null_count == len(column):  # every label null, whatever the column's type
        return np.full(len(column), -1, dtype=np.int64)
    return pc.fill_null(column, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def patches_array(column: Any, num_patches: int, patch_dim: int) -> np.ndarray:
    """A pyarrow binary column of patch bytes → uint8 `(B, N, D)` (zero-copy when contiguous)."""
    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    n = len(column)
    if n == 0:
        return np.zeros((0, num_patches, patch_dim), dtype=np.uint8)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[column.offset : column.offset + n + 1]
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    return data.reshape(n, num_patches, patch_dim)


def random_resized_crop(image: np.ndarray, rng: np.random.Generator, aug: AugmentConfig) -> np.ndarray:
    """One `(S, S, 3)` uint8 image → a random crop resized back to `(S, S)`, maybe flipped."""
    h, w = image.shape[:2]
    box = (0, 0, w, h)
    for _ in range(10):
        area = h * w * rng.uniform(*aug.scale)
        aspect = float(np.exp(rng.uniform(np.log(aug.ratio[0]), np.log(aug.ratio[1]))))
        cw, ch = int(round(np.sqrt(area * aspect))), int(round(np.sqrt(area / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            box = (x0, y0, x0 + cw, y0 + ch)
            break
    out = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BILINEAR, box=box))
    if aug.flip and rng.random() < 0.5:
        out = out[:, ::-1]
    return out


def augment_patches(
    patches: np.ndarray, keys: list[str], *, patch_size: int, grid: tuple[int, int],
    seed: int | None, epoch: int, aug: AugmentConfig,
) -> np.ndarray:
    """Random-resized-crop + flip a batch of uint8 patch sequences; returns the same shape and order."""
    images = unpatchify(patches, patch_size, grid)
    fresh = np.random.default_rng() if seed is None else None
    out = np.empty_like(images)
    for i, key in enumerate(keys):
        rng = fresh if fresh is not None else np.random.default_rng([seed, epoch, *key_seed(key)])
        out[i] = random_resized_crop(images[i], rng, aug)
    return patchify_batch(out, patch_size)


def _decode_batch(
    table: Any, *, layout: tuple[int, int, int, tuple[int, int]], augment: bool, seed: int | None, epoch: int,
    aug: AugmentConfig, raw: bool,
) -> dict[str, np.ndarray]:
    """Ray Data UDF: Parquet rows → normalised float patches (augmented when asked), or the stored uint8 (`raw`)."""
    n, d, p, grid = layout
    patches = patches_array(table.column("patches"), n, d)
    if augment:
        keys = table.column("key").to_pylist()
        patches = augment_patches(patches, keys, patch_size=p, grid=grid, seed=seed, epoch=epoch, aug=aug)
    labels = labels_array(table.column("label"))
    return {"patches": patches if raw else normalize(patches), "label": labels}


def patch_dataset(
    uri: str,
    split: str,
    *,
    augment: bool,
    seed: int | None = None,
    epochs: int = 1,
    shuffle: bool | None = None,
    aug: AugmentConfig | None = None,
    endpoint_url: str | None = None,
    batch_size: int = 64,
    raw: bool = False,
) -> Any:
    """A Ray Dataset over one split of an ingested output.

    Rows (via `iter_torch_batches`): `patches` float32 `(N, P*P*3)`, `label` int64.
    With `raw` the patches stay the stored uint8 pixels, a quarter of the bytes to
    move: the training worker normalises them on its device (`pipelines.training.augment`).
    `shuffle` (default: same as `augment`) shuffles the shard file order, seeded
    when `seed` is given; mix rows further with `local_shuffle_buffer_size` when
    iterating. `epochs` > 1 chains that many passes (each with its own crops).
    """
    if split not in shards.SPLITS:
        raise ValueError(f"split must be one of {', '.join(shards.SPLITS)}, got {split!r}")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    store = open_store(uri, endpoint_url=endpoint_url)
    manifest = shards.read_manifest(store, expect=shards.IMAGES)
    keys = [s["path"] for s in manifest["shards"] if s.get("split", {}).get(split, 0) > 0]
    if not keys:
        raise VitpipeError(f"{store.uri}: split {split!r} has no images")
    filesystem, _ = store.arrow()
    paths = [store.arrow(k)[1] for k in keys]
    layout = (manifest["num_patches"], manifest["patch_dim"], manifest["patch_size"], tuple(manifest["grid"]))
    return seeded_passes(
        paths, filesystem, split=split, columns=("patches", "label", "key", "split"),
        shuffle=augment if shuffle is None else shuffle, seed=seed, epochs=epochs, decode=_decode_batch,
        fn_kwargs={"layout": layout, "augment": augment, "aug": aug or AugmentConfig(), "raw": raw},
        batch_size=batch_size,
    )


def load_split(
    uri: str,
    split: str,
    *,
    limit: int | None = None,
    per_class: int | None = None,
    endpoint_url: str | None = None,
) -> tuple[Any, Any]:
    """Load a (small) split into memory: `(patches float32 (B, N, D), labels int64 (B,))` torch tensors.

    Rows are ordered by key. `per_class` keeps the first k images of each class
    (few-shot sets); `limit` caps the total. No Ray needed.
    """
    import pyarrow as pa
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq
    import torch

    if split not in shards.SPLITS:
        raise ValueError(f"split must be one of {', '.join(shards.SPLITS)}, got {split!r}")
    store = open_store(uri, endpoint_url=endpoint_url)
    manifest = shards.read_manifest(store, expect=shards.IMAGES)
    tables = []
    for entry in manifest["shards"]:
        if entry.get("split", {}).get(split, 0) > 0:
            fs, path = store.arrow(entry["path"])
            tables.append(
                pq.read_table(path, filesystem=fs, columns=["patches", "label", "key"], filters=pads.field("split") == split)
            )
    if not tables:
        raise VitpipeError(f"{store.uri}: split {split!r} has no images")
    table = pa.concat_tables(tables).sort_by("key")
    keep = _select(labels_array(table.column("label")), per_class, limit)
    table = table.take(pa.array(keep, pa.int64()))
    patches = normalize(patches_array(table.column("patches"), manifest["num_patches"], manifest["patch_dim"]))
    labels = labels_array(table.column("label"))
    return torch.from_numpy(patches), torch.from_numpy(labels)


def _select(labels: np.ndarray, per_class: int | None, limit: int | None) -> np.ndarray:
    idx = np.arange(len(labels))
    if per_class is not None:
        taken: dict[int, int] = {}
        chosen = []
        for i, y in enumerate(labels.tolist()):
            if taken.get(y, 0) < per_class:
                taken[y] = taken.get(y, 0) + 1
                chosen.append(i)
        idx = np.asarray(chosen, dtype=np.int64)
    return idx[:limit] if limit is not None else idx
