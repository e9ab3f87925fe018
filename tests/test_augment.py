"""pipelines.training.augment: random-resized crop and flip of a whole batch on the device it lives on
(here CPU torch), with boxes drawn from a seeded torch.Generator."""

from __future__ import annotations

import math

import pytest
import torch

from pipelines.image.data import normalize
from pipelines.image.pretrain import load_config, pretrain_hooks
from pipelines.training.augment import (
    augment_patch_batches,
    augment_patch_tensor,
    batch_generator,
    normalize_pixels,
    random_resized_crop_flip,
)
from pipelines.training.recipe import AugmentConfig
from vit.patches import patchify

WHOLE = torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)  # a box covering the whole image


def ramps(b: int, height: int, width: int) -> torch.Tensor:
    """float64 images whose channel 0 holds each pixel centre's x and channel 1 its y, in pixels."""
    x = torch.arange(width, dtype=torch.float64) + 0.5
    y = torch.arange(height, dtype=torch.float64) + 0.5
    img = torch.stack([x.expand(height, width), y[:, None].expand(height, width)])
    return img.expand(b, 2, height, width).contiguous()


def test_output_keeps_the_shape_and_dtype_of_the_input():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.uint8):
        images = (torch.rand(5, 3, 24, 40, generator=g) * 255).to(dtype)
        out = random_resized_crop_flip(images, g, AugmentConfig())
        assert out.shape == images.shape and out.dtype == dtype


def test_flip_mirrors_the_image_left_to_right():
    images = torch.rand(64, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    out = random_resized_crop_flip(images, torch.Generator().manual_seed(2), AugmentConfig(flip=True),
                                   boxes=WHOLE.expand(64, 4))
    flipped = [torch.allclose(o, i.flip(-1), atol=1e-6) for o, i in zip(out, images)]
    kept = [torch.allclose(o, i, atol=1e-6) for o, i in zip(out, images)]
    assert all(f != k for f, k in zip(flipped, kept))  # each image is exactly one of the two
    assert 10 < sum(flipped) < 54  # about half are flipped


def test_crops_respect_the_scale_and_ratio_bounds():
    aug = AugmentConfig(scale=(0.2, 0.6), ratio=(0.5, 1.5), flip=True)
    height, width = 48, 64
    out = random_resized_crop_flip(ramps(256, height, width), torch.Generator().manual_seed(3), aug)
    # On a linear ramp, bilinear resampling is exact: the step between two output pixels is the box's side
    # over the image's (the output is as large as the image), and the ramps' ranges lie inside the image.
    mid_y, mid_x = height // 2, width // 2
    w = (out[:, 0, mid_y, mid_x] - out[:, 0, mid_y, mid_x - 1]).abs()
    h = out[:, 1, mid_y, mid_x] - out[:, 1, mid_y - 1, mid_x]
    area = w * h
    ratio = (w * width) / (h * height)
    assert area.min() >= 0.2 - 1e-9 and area.max() <= 0.6 + 1e-9
    assert ratio.min() >= 0.5 - 1e-9 and ratio.max() <= 1.5 + 1e-9
    assert out[:, 0].min() >= 0.5 - 1e-9 and out[:, 0].max() <= width - 0.5 + 1e-9
    assert out[:, 1].min() >= 0.5 - 1e-9 and out[:, 1].max() <= height - 0.5 + 1e-9
    assert area.max() - area.min() > 0.2  # the boxes vary over the range, not one fixed crop


def test_a_box_that_cannot_fit_falls_back_to_the_whole_image():
    # An area of the whole image at an aspect of 2 never fits: every draw fails, the whole image is kept.
    images = ramps(4, 16, 16)
    out = random_resized_crop_flip(images, torch.Generator().manual_seed(4),
                                   AugmentConfig(scale=(1.0, 1.0), ratio=(2.0, 2.0), flip=False))
    assert torch.allclose(out, images, atol=1e-9)


def test_the_same_seed_gives_the_same_output_and_another_seed_another():
    images = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    a = random_resized_crop_flip(images, torch.Generator().manual_seed(7), AugmentConfig())
    b = random_resized_crop_flip(images, torch.Generator().manual_seed(7), AugmentConfig())
    c = random_resized_crop_flip(images, torch.Generator().manual_seed(8), AugmentConfig())
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_the_identity_box_without_flip_gives_the_input_back():
    images = torch.rand(3, 3, 20, 12, generator=torch.Generator().manual_seed(6))
    out = random_resized_crop_flip(images, torch.Generator(), AugmentConfig(flip=False), boxes=WHOLE.expand(3, 4))
    assert torch.allclose(out, images, atol=1e-6)


def test_uint8_images_come_back_rounded_and_exact_for_the_identity_box():
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    out = random_resized_crop_flip(images, torch.Generator(), AugmentConfig(flip=False), boxes=WHOLE.expand(2, 4))
    assert torch.equal(out, images)


def test_patch_sequences_are_augmented_as_the_images_behind_them():
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(10))
    patches = patchify(images, 4)
    aug = AugmentConfig()
    got = augment_patch_tensor(patches, 4, (4, 4), torch.Generator().manual_seed(11), aug)
    want = patchify(random_resized_crop_flip(images, torch.Generator().manual_seed(11), aug), 4)
    assert torch.allclose(got, want, atol=1e-6)


def test_a_batch_crops_by_seed_rank_epoch_and_index_alone():
    patches = torch.rand(6, 16, 48, generator=torch.Generator().manual_seed(12))
    stream = [(0, i, {"patches": patches.clone(), "label": torch.zeros(6)}) for i in range(1, 4)]
    kwargs = dict(patch_size=4, grid=(4, 4), aug=AugmentConfig(), seed=3, rank=1)
    whole = list(augment_patch_batches(iter(stream), **kwargs))
    resumed = list(augment_patch_batches(iter(stream[2:]), **kwargs))  # a run resumed at the third batch
    assert torch.equal(whole[2][2]["patches"], resumed[0][2]["patches"])
    assert not torch.equal(whole[0][2]["patches"], whole[1][2]["patches"])
    other_rank = next(augment_patch_batches(iter(stream), **{**kwargs, "rank": 0}))
    assert not torch.equal(whole[0][2]["patches"], other_rank[2]["patches"])


def test_uint8_pixels_are_normalised_on_the_device_as_the_cpu_path_normalises_them():
    pixels = torch.randint(0, 256, (2, 16, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(14))
    assert torch.allclose(normalize_pixels(pixels), torch.from_numpy(normalize(pixels.numpy())), atol=1e-6)
    kwargs = dict(patch_size=4, grid=(4, 4), aug=AugmentConfig(), seed=0, rank=0)
    raw = next(augment_patch_batches(iter([(0, 1, {"patches": pixels})]), **kwargs))[2]["patches"]
    floats = iter([(0, 1, {"patches": normalize_pixels(pixels)})])
    normalised = next(augment_patch_batches(floats, **kwargs))[2]["patches"]
    assert raw.dtype == torch.float32 and torch.allclose(raw, normalised, atol=1e-5)


def test_batch_generators_differ_for_neighbouring_words():
    draws = {batch_generator(0, 0, 0, i).initial_seed() for i in range(100)}
    draws |= {batch_generator(1, 0, 0, i).initial_seed() for i in range(100)}
    assert len(draws) == 200


@pytest.mark.parametrize("bad", [torch.zeros(3, 8, 8), torch.zeros(1, 1, 3, 8, 8)])
def test_images_of_the_wrong_rank_are_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"images must be \(B, C, H, W\)"):
        random_resized_crop_flip(bad, torch.Generator(), AugmentConfig())


def test_the_default_recipe_crops_between_a_quarter_and_all_of_the_image():
    out = random_resized_crop_flip(ramps(128, 32, 32), torch.Generator().manual_seed(13), AugmentConfig())
    w = (out[:, 0, 16, 16] - out[:, 0, 16, 15]).abs()
    h = out[:, 1, 16, 16] - out[:, 1, 15, 16]
    assert (w * h).min() >= 0.25 - 1e-9 and math.isclose(float((w * h).max()), 1.0, abs_tol=0.1)


# ---------------------------------------------------------------- the pretrain recipe's switch

MANIFEST = {"patch_size": 4, "grid": [4, 4]}


def pretrain_config(**kw):
    return load_config({"data": "/data", "steps": 10, "warmup_steps": 1, **kw})


def test_pretraining_augments_on_the_cpu_data_workers_by_default():
    assert pretrain_config().augment_on == "cpu"
    assert pretrain_hooks(pretrain_config(), MANIFEST).aug is None


def test_augment_on_device_hands_the_crop_to_the_worker_loop_at_the_datas_patch_layout():
    hooks = pretrain_hooks(pretrain_config(augment_on="device"), MANIFEST)
    assert (hooks.aug, hooks.patch_size, hooks.grid) == (AugmentConfig(), 4, (4, 4))
    assert pretrain_hooks(pretrain_config(augment_on="device", augment=False), MANIFEST).aug is None


def test_an_unknown_place_for_augmentation_is_refused_in_one_line():
    with pytest.raises(ValueError, match="augment_on") as err:
        pretrain_config(augment_on="gpu")
    assert "\n" not in str(err.value)
