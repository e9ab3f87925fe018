"""pipelines.image.data: Ray Datasets of patch batches with CPU augmentation, splits in memory;
and the manifest reader they use (`pipelines.core.shards.read_manifest`)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.data
import torch

from pipelines.core import shards
from pipelines.core.datasets import PATCH_MEAN, PATCH_STD, read_each_shard
from pipelines.core.shards import read_manifest
from pipelines.image.data import (
    augment_patches,
    load_split,
    normalize,
    patch_dataset,
    random_resized_crop,
)
from pipelines.core.errors import VitpipeError
from pipelines.image.patches import patchify_batch
from pipelines.training.recipe import AugmentConfig


def stored_rows(output: str, split: str) -> dict[str, tuple[np.ndarray, int]]:
    rows = {}
    for entry in read_manifest(output)["shards"]:
        for row in pq.read_table(Path(output, entry["path"])).to_pylist():
            if row["split"] == split:
                rows[row["key"]] = (np.frombuffer(row["patches"], dtype=np.uint8), row["label"])
    return rows


def collect(ds) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    patches, labels = [], []
    for batch in ds.iter_torch_batches(batch_size=32):
        patches.append(batch["patches"])
        labels.append(batch["label"])
    return patches, labels


def fingerprints(patches: list[torch.Tensor]) -> list[str]:
    """Order-free identity of rows: Ray may deliver batches in any order."""
    return sorted(hashlib.sha1(row.numpy().tobytes()).hexdigest() for p in patches for row in p)


def test_read_manifest_refuses_an_unfinished_output(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(VitpipeError, match="not a finished ingest output"):
        read_manifest(str(tmp_path))


def finished(folder: Path, manifest: dict) -> str:
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "_SUCCESS").write_text("{}")
    return str(folder)


def test_read_manifest_refuses_an_output_of_another_format_naming_what_it_holds(tmp_path):
    videos = shards.Holds("vitpipe-video/1", "a video dataset")
    with pytest.raises(VitpipeError) as err:
        read_manifest(finished(tmp_path, {"format": "vitpipe-embeddings/1"}), expect=videos)
    assert str(err.value) == f"{tmp_path}: not a video dataset (format 'vitpipe-embeddings/1', expected 'vitpipe-video/1')"


def test_a_manifest_that_names_no_format_is_read_as_an_image_dataset(tmp_path):
    uri = finished(tmp_path, {"counts": {"train": 1}})
    assert read_manifest(uri, expect=shards.IMAGES) == {"counts": {"train": 1}}
    with pytest.raises(VitpipeError, match="format 'vitpipe-patches/1'"):
        read_manifest(uri, expect=shards.Holds("vitpipe-video/1", "a video dataset"))


@pytest.fixture(scope="module")
def eval_pass(tiny_dataset):
    """One pass over the train split without augmentation."""
    return collect(patch_dataset(tiny_dataset, "train", augment=False))


@pytest.fixture(scope="module")
def augmented_passes(tiny_dataset):
    """Two seeded augmented epochs over the train split, in one Ray Data execution."""
    return collect(patch_dataset(tiny_dataset, "train", augment=True, seed=3, epochs=2))


def test_batches_are_normalised_float_patches_and_int64_labels(tiny_dataset, eval_pass):
    m = read_manifest(tiny_dataset)
    x, y = torch.cat(eval_pass[0]), torch.cat(eval_pass[1])
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.shape == (m["counts"]["train"], m["num_patches"], m["patch_dim"])
    assert x.min() >= -1.0 and x.max() <= 1.0


def test_eval_batches_are_exactly_the_stored_pixels(tiny_dataset, eval_pass):
    rows = stored_rows(tiny_dataset, "train")
    expected = sorted(hashlib.sha1(normalize(p).tobytes()).hexdigest() for p, _ in rows.values())
    got = sorted(hashlib.sha1(row.numpy().reshape(-1).tobytes()).hexdigest() for p in eval_pass[0] for row in p)
    assert got == expected
    assert sorted(torch.cat(eval_pass[1]).tolist()) == sorted(label for _, label in rows.values())


def test_normalisation_constants_map_0_and_255_to_the_ends():
    assert np.allclose(normalize(np.array([0, 255], dtype=np.uint8)), [-PATCH_MEAN / PATCH_STD, (1 - PATCH_MEAN) / PATCH_STD])


def _expected_augmented(output: str, seed: int, epoch: int) -> list[str]:
    m = read_manifest(output)
    rows = stored_rows(output, "train")
    keys = sorted(rows)
    patches = np.stack([rows[k][0].reshape(m["num_patches"], m["patch_dim"]) for k in keys])
    out = augment_patches(
        patches, keys, patch_size=m["patch_size"], grid=tuple(m["grid"]), seed=seed, epoch=epoch, aug=AugmentConfig()
    )
    return fingerprints([torch.from_numpy(normalize(out))])


def test_seeded_augmentation_on_workers_is_the_function_of_seed_epoch_and_key(tiny_dataset, augmented_passes):
    expected = sorted(_expected_augmented(tiny_dataset, 3, 0) + _expected_augmented(tiny_dataset, 3, 1))
    assert fingerprints(augmented_passes[0]) == expected


def test_augmented_epochs_differ_from_each_other_and_from_the_stored_pixels(tiny_dataset, eval_pass):
    epoch0, epoch1 = _expected_augmented(tiny_dataset, 3, 0), _expected_augmented(tiny_dataset, 3, 1)
    plain = fingerprints(eval_pass[0])
    assert len(set(epoch0) & set(epoch1)) < len(plain) // 4
    assert len(set(epoch0) & set(plain)) < len(plain) // 2


def test_augmented_passes_keep_shapes_and_labels(eval_pass, augmented_passes):
    assert torch.cat(augmented_passes[0]).shape[1:] == torch.cat(eval_pass[0]).shape[1:]
    assert sorted(torch.cat(augmented_passes[1]).tolist()) == sorted(torch.cat(eval_pass[1]).tolist() * 2)


def test_unseeded_augmentation_draws_fresh_crops_each_time():
    patches = patchify_batch(np.random.default_rng(2).integers(0, 256, size=(4, 8, 8, 3), dtype=np.uint8), 4)
    kwargs = dict(patch_size=4, grid=(2, 2), seed=None, epoch=0, aug=AugmentConfig())
    draws = {augment_patches(patches, list("abcd"), **kwargs).tobytes() for _ in range(4)}
    assert len(draws) > 1


def test_crop_of_the_whole_image_is_identity_or_mirror():
    image = np.random.default_rng(0).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    whole = AugmentConfig(scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=True)
    outs = {random_resized_crop(image, np.random.default_rng(s), whole).tobytes() for s in range(20)}
    assert outs == {image.tobytes(), image[:, ::-1].tobytes()}


def test_augment_patches_is_a_function_of_seed_epoch_and_key():
    images = np.random.default_rng(1).integers(0, 256, size=(3, 8, 8, 3), dtype=np.uint8)
    patches = patchify_batch(images, 4)
    kwargs = dict(patch_size=4, grid=(2, 2), aug=AugmentConfig())
    a = augment_patches(patches, ["x", "y", "z"], seed=1, epoch=0, **kwargs)
    b = augment_patches(patches[::-1].copy(), ["z", "y", "x"], seed=1, epoch=0, **kwargs)
    c = augment_patches(patches, ["x", "y", "z"], seed=1, epoch=1, **kwargs)
    assert a.shape == patches.shape and a.dtype == np.uint8
    assert np.array_equal(a, b[::-1])  # same key, same crop, whatever the batch order
    assert not np.array_equal(a, c)


def test_load_split_returns_tensors_ordered_by_key(tiny_dataset):
    rows = stored_rows(tiny_dataset, "test")
    x, y = load_split(tiny_dataset, "test")
    keys = sorted(rows)
    assert x.shape[0] == len(keys) and y.dtype == torch.int64
    assert np.allclose(x[0].numpy().reshape(-1), normalize(rows[keys[0]][0]))
    assert y.tolist() == [rows[k][1] for k in keys]


def _first_per_class(rows: dict[str, tuple[np.ndarray, int]], k: int) -> list[str]:
    """The first `k` keys of each class, going through the keys in sorted order."""
    taken: dict[int, int] = {}
    chosen = []
    for key in sorted(rows):
        label = rows[key][1]
        if taken.get(label, 0) < k:
            taken[label] = taken.get(label, 0) + 1
            chosen.append(key)
    return chosen


def test_load_split_takes_the_first_k_per_class_in_key_order(tiny_dataset):
    rows = stored_rows(tiny_dataset, "train")
    keys = _first_per_class(rows, 2)
    assert min(Counter(label for _, label in rows.values()).values()) > 2  # more than k a class: first is not last
    x, y = load_split(tiny_dataset, "train", per_class=2)
    assert y.tolist() == [rows[k][1] for k in keys]
    assert np.allclose(x.numpy().reshape(len(keys), -1), np.stack([normalize(rows[k][0]) for k in keys]))


def test_load_split_limit_keeps_the_first_rows_in_key_order(tiny_dataset):
    rows = stored_rows(tiny_dataset, "train")
    keys = sorted(rows)[:5]
    x, y = load_split(tiny_dataset, "train", limit=5)
    assert y.tolist() == [rows[k][1] for k in keys]
    assert np.allclose(x.numpy().reshape(5, -1), np.stack([normalize(rows[k][0]) for k in keys]))


def test_unknown_split_is_a_value_error(tiny_dataset):
    with pytest.raises(ValueError, match="split must be one of"):
        patch_dataset(tiny_dataset, "holdout", augment=False)


def test_manifest_split_counts_match_the_shards(tiny_dataset):
    m = read_manifest(tiny_dataset)
    for split in shards.SPLITS:
        assert len(stored_rows(tiny_dataset, split)) == m["counts"][split]


class _Unchanged:
    def __call__(self, batch):
        return batch


@pytest.mark.timeout(300)
def test_read_each_shard_feeds_an_actor_pool_one_shard_per_block_even_when_the_actors_take_every_cpu(
        ray_cluster, tmp_path):
    # Eight small shards: read_parquet packs them into one read task; fused into the actors' tasks (same
    # CPU request), each actor task would take a batch of 16 shard paths.
    paths = []
    for i in range(8):
        pq.write_table(pa.table({"key": [f"{i}-{j}" for j in range(50)], "x": [i] * 50}), tmp_path / f"{i}.parquet")
        paths.append(str(tmp_path / f"{i}.parquet"))
    ds = read_each_shard(paths, None, ["key"], readers=2)
    assert ds.columns() == ["key", "path"]
    cpus = int(ray.cluster_resources()["CPU"])
    ds = ds.map_batches(_Unchanged, batch_size=16, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=cpus),
                        num_cpus=1)
    blocks = [set(b["path"].to_pylist()) for b in ds.iter_batches(batch_size=None, batch_format="pyarrow")]
    assert all(len(b) == 1 for b in blocks), blocks
    assert sorted(p for b in blocks for p in b) == sorted(paths)

