"""The labeled rows of an ingest output by role, for fine-tuning trials and few-shot evaluation: which rows
each role reads, at which resolution, how augmented.

The rows are an ingest output's Parquet shards of uint8 patch sequences.
Every role is decoded the same way (`decode_arrays`): optional random-resized
crop, resize to the asked resolution, normalisation, always in the shared
`vit.patches` order.

* train: the `train` split, minus the minival when the data has no `val` split;
* val: the `val` split, or that minival (a stable hash of each key picks it);
* test: the `test` split.

Training rows reach the workers one of two ways. Transfer datasets are
usually small, so by default (`memory`) the trial driver reads them once and
hands the workers an object ref; each worker draws its own shuffled,
augmented batches from it. Larger sets stream through Ray Data (`stream`), as
in pretraining. Evaluation rows are always read with plain pyarrow.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipelines.core.errors import VitpipeError
from pipelines.core.datasets import seeded_passes
from pipelines.core.shards import split_of
from pipelines.core.storage import open_store
from pipelines.image.data import augment_patches, normalize, patches_array
from pipelines.image.patches import resize_patches
from pipelines.training.recipe import AugmentConfig

HOLDOUT_SALT = "finetune-holdout/"  # keys hashed with this salt pick the minival images
Role = Literal["train", "val", "test"]


@dataclass(frozen=True)
class DataSpec:
    """How a trial reads the ingested data (built on the driver; may hold S3 credentials)."""

    uri: str
    manifest: dict[str, Any]
    settings: Any = None  # pipelines.core.storage.S3Settings for s3:// data
    holdout: float = 0.0  # fraction of train held out as minival when the data has no val split


def augment_config(strength: float, hflip: bool) -> Any:
    """Random-resized-crop parameters for an augmentation strength in [0, 1]; None at 0.

    Strength 1 is the pretraining default: crops of 25–100% of the area, aspect 3/4–4/3.
    """
    if strength <= 0:
        return None
    stretch = 1 + strength / 3
    return AugmentConfig(scale=(1 - 0.75 * strength, 1.0), ratio=(1 / stretch, stretch), flip=hflip)


def in_holdout(keys: list[str], fraction: float) -> np.ndarray:
    """Which keys belong to the minival carved out of train (a stable hash of the key)."""
    return np.array([split_of(HOLDOUT_SALT + k, fraction, 0.0) == "val" for k in keys], dtype=bool)


def decode_arrays(
    patches: np.ndarray, labels: np.ndarray, keys: list[str], *, manifest: dict[str, Any], size: int, aug: Any,
    seed: int | None = None, epoch: int = 0,
) -> dict[str, np.ndarray]:
    """uint8 patch sequences → normalised float32 patches at `size`×`size` (augmented when `aug`), int64 labels.

    With an integer `seed` each image's crop depends only on `(seed, epoch, key)`
    (`augment_patches`); with None every call draws fresh crops.
    """
    p, grid = manifest["patch_size"], tuple(manifest["grid"])
    if aug is not None and len(patches):
        patches = augment_patches(patches, keys, patch_size=p, grid=grid, seed=seed, epoch=epoch, aug=aug)
    if size != manifest["image_size"] and len(patches):
        patches = resize_patches(patches, p, grid, size)
    patches = patches.reshape(len(patches), (size // p) ** 2, manifest["patch_dim"])
    return {"patches": normalize(patches), "label": np.asarray(labels, dtype=np.int64)}


def select_rows(table: Any, keep: str, holdout: float) -> Any:
    """Rows of a split's table that belong to `keep`: "all", "train" (minus the minival) or "holdout"."""
    if holdout <= 0 or keep == "all":
        return table
    mask = in_holdout(table.column("key").to_pylist(), holdout)
    return table.filter(mask if keep == "holdout" else ~mask)


def decode_batch(table: Any, *, manifest: dict[str, Any], keep: str, holdout: float, size: int, aug: Any,
                 seed: int | None = None, epoch: int = 0) -> dict[str, np.ndarray]:
    """Parquet rows (`patches`, `label`, `key`) → `decode_arrays`, after keeping the rows of `keep`."""
    table = select_rows(table, keep, holdout)
    patches = patches_array(table.column("patches"), manifest["num_patches"], manifest["patch_dim"])
    return decode_arrays(patches, table.column("label").to_numpy(), table.column("key").to_pylist(),
                         manifest=manifest, size=size, aug=aug, seed=seed, epoch=epoch)


def source(data: DataSpec, role: Role) -> tuple[str, str]:
    """(stored split, row filter) that make up `role`."""
    has_val = int(data.manifest.get("counts", {}).get("val", 0)) > 0
    if role == "test":
        return "test", "all"
    if role == "val" and has_val:
        return "val", "all"
    if data.holdout <= 0:
        return "train", "all"
    return "train", "holdout" if role == "val" else "train"


def _tables(data: DataSpec, role: Role) -> Iterator[tuple[Any, str]]:
    """Each shard's rows of `role`'s split as a pyarrow table, with the row filter to apply."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    split, keep = source(data, role)
    store = open_store(data.uri, data.settings)
    for entry in data.manifest["shards"]:
        if entry.get("split", {}).get(split, 0) > 0:
            fs, path = store.arrow(entry["path"])
            yield pq.read_table(path, filesystem=fs, columns=["patches", "label", "key"], filters=pads.field("split") == split), keep


def iter_rows(data: DataSpec, role: Role, *, size: int, batch_size: int = 256) -> Iterator[dict[str, np.ndarray]]:
    """Decoded rows of one role, shard by shard and `batch_size` at a time, read with pyarrow (no Ray)."""
    for table, keep in _tables(data, role):
        for start in range(0, table.num_rows, batch_size):
            yield decode_batch(table.slice(start, batch_size), manifest=data.manifest, keep=keep, holdout=data.holdout, size=size, aug=None)


def load_rows(data: DataSpec, role: Role, *, size: int) -> tuple[np.ndarray, np.ndarray]:
    """All rows of one role in memory, decoded: `(patches float32 (B, N, D), labels int64 (B,))`."""
    parts = [p for p in iter_rows(data, role, size=size) if len(p["label"])]
    if not parts:
        raise VitpipeError(f"{data.uri}: no {role} images")
    return np.concatenate([p["patches"] for p in parts]), np.concatenate([p["label"] for p in parts])


# ---------------------------------------------------------------- training rows


@dataclass
class MemoryRows:
    """A trial's training rows held raw (uint8) in the object store, decoded per batch by each worker."""

    patches: np.ndarray  # uint8 (B, N, D) at the data's image size
    labels: np.ndarray
    keys: list[str]
    manifest: dict[str, Any]
    size: int
    aug: Any


def raw_bytes(data: DataSpec, role: Role = "train") -> int:
    """About how many bytes `role`'s raw rows take (from the manifest's counts)."""
    split, _ = source(data, role)
    count = int(data.manifest.get("counts", {}).get(split, 0))
    return count * int(data.manifest["num_patches"]) * int(data.manifest["patch_dim"])


def memory_rows(data: DataSpec, *, size: int, aug: Any) -> MemoryRows:
    """Read the training rows once, undecoded (so every epoch can crop them afresh)."""
    import pyarrow as pa

    tables = [select_rows(t, keep, data.holdout) for t, keep in _tables(data, "train")]
    table = pa.concat_tables(tables) if tables else None
    if table is None or table.num_rows == 0:
        raise VitpipeError(f"{data.uri}: no train images")
    patches = np.array(patches_array(table.column("patches"), data.manifest["num_patches"], data.manifest["patch_dim"]))
    return MemoryRows(patches, table.column("label").to_numpy().astype(np.int64), table.column("key").to_pylist(),
                      data.manifest, size, aug)


def memory_batches(rows: MemoryRows, *, batch_size: int, rank: int, world: int, seed: int, epoch: int, skip: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Yield `(epoch, batches consumed in it, batch)` forever from in-memory rows.

    Each epoch is a fresh permutation (a function of seed and epoch, the same on
    every rank), dealt out rank by rank; `skip` drops the first batches of the
    resumed epoch, so a restored worker continues from its data position. Crops
    are a function of `(seed, epoch, key)` too, so a resumed trial sees the same ones.
    """
    import torch

    per_rank = len(rows.labels) // world
    if per_rank < batch_size:
        raise ValueError(f"the train split gives worker {rank} {per_rank} images, less than one batch of {batch_size}")
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(rows.labels))[rank::world][:per_rank]
        for i in range(skip, per_rank // batch_size):
            idx = order[i * batch_size : (i + 1) * batch_size]
            out = decode_arrays(rows.patches[idx], rows.labels[idx], [rows.keys[j] for j in idx],
                                manifest=rows.manifest, size=rows.size, aug=rows.aug, seed=seed, epoch=epoch)
            yield epoch, i + 1, {"patches": torch.from_numpy(out["patches"]), "label": torch.from_numpy(out["label"])}
        epoch, skip = epoch + 1, 0


def train_dataset(data: DataSpec, *, size: int, aug: Any = None, seed: int | None = None, epochs: int = 1) -> Any:
    """A Ray Dataset of `epochs` passes over the training rows at resolution `size`, augmented when asked.

    Each pass has its own file order and crops (`seeded_passes`): functions of `seed`, so a trial that
    reads them in order (`preserve_order`) repeats, and a resumed one skips the very batches it trained
    on; with no seed they are fresh.
    """
    split, keep = source(data, "train")
    store = open_store(data.uri, data.settings)
    keys = [s["path"] for s in data.manifest["shards"] if s.get("split", {}).get(split, 0) > 0]
    if not keys:
        raise VitpipeError(f"{data.uri}: split {split!r} has no images")
    filesystem, _ = store.arrow()
    kwargs = {"manifest": data.manifest, "keep": keep, "holdout": data.holdout, "size": size, "aug": aug}
    return seeded_passes([store.arrow(k)[1] for k in keys], filesystem, split=split,
                         columns=("patches", "label", "key", "split"), shuffle=True, seed=seed, epochs=epochs,
                         decode=decode_batch, fn_kwargs=kwargs, batch_size=256)


def training_rows(data: DataSpec) -> int:
    """About how many rows the training role holds (the minival is carved out by a hash of the key)."""
    split, keep = source(data, "train")
    rows = int(data.manifest.get("counts", {}).get(split, 0))
    return int(rows * (1 - data.holdout)) if keep == "train" else rows


__all__ = [
    "DataSpec",
    "MemoryRows",
    "augment_config",
    "decode_arrays",
    "decode_batch",
    "in_holdout",
    "iter_rows",
    "load_rows",
    "memory_batches",
    "memory_rows",
    "raw_bytes",
    "source",
    "train_dataset",
    "training_rows",
]
