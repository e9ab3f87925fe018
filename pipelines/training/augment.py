"""Random-resized crop and horizontal flip of a whole batch of tensors, on the device the batch lives on.

The CPU data path crops each image with Pillow on a Ray Data worker
(`pipelines.image.data.augment_patches`). On a GPU that costs more CPU than
the step leaves spare, so here the same augmentation runs on the batch after it
reached the accelerator: one box per image (area fraction and aspect ratio drawn
as torchvision's `RandomResizedCrop` draws them), one affine grid per image, and
a single `F.grid_sample` over the batch. The boxes are drawn on a CPU
`torch.Generator`, so a seed gives the same crops on every device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipelines.core.datasets import PATCH_MEAN, PATCH_STD
from pipelines.training.recipe import AugmentConfig
from vit.patches import patchify, unpatchify

__all__ = ["augment_patch_batches", "augment_patch_tensor", "batch_generator", "crop_boxes", "normalize_pixels",
           "random_resized_crop_flip"]

TRIES = 10  # box draws per image before falling back to the whole image, as torchvision does


def batch_generator(*words: int) -> torch.Generator:
    """A CPU generator seeded from several integers (run seed, rank, epoch, batch), mixed so near seeds differ."""
    state = np.random.SeedSequence([int(w) & 0xFFFFFFFF for w in words]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def crop_boxes(n: int, height: int, width: int, aug: AugmentConfig, generator: torch.Generator) -> torch.Tensor:
    """`(n, 4)` float64 boxes `(x0, y0, w, h)` as fractions of the image, drawn on the CPU.

    Each image takes the first of `TRIES` draws whose box fits inside it (area
    fraction from `aug.scale`, aspect ratio log-uniform in `aug.ratio`), else the
    whole image.
    """
    area = torch.empty(n, TRIES, dtype=torch.float64).uniform_(*aug.scale, generator=generator)
    log_ratio = torch.empty(n, TRIES, dtype=torch.float64).uniform_(
        math.log(aug.ratio[0]), math.log(aug.ratio[1]), generator=generator)
    aspect = torch.exp(log_ratio)
    # Width and height in pixels over the image's sides: a box of `area` of the pixels with this aspect.
    w = torch.sqrt(area * aspect * height / width)
    h = torch.sqrt(area / aspect * width / height)
    fits = (w <= 1) & (h <= 1)
    first = torch.where(fits.any(1), fits.int().argmax(1), -1)
    rows = torch.arange(n)
    w = torch.where(first >= 0, w[rows, first.clamp(min=0)], torch.ones(n, dtype=torch.float64))
    h = torch.where(first >= 0, h[rows, first.clamp(min=0)], torch.ones(n, dtype=torch.float64))
    where = torch.rand(n, 2, dtype=torch.float64, generator=generator)
    return torch.stack([where[:, 0] * (1 - w), where[:, 1] * (1 - h), w, h], dim=1)


def random_resized_crop_flip(images: torch.Tensor, generator: torch.Generator, aug: AugmentConfig,
                             boxes: torch.Tensor | None = None) -> torch.Tensor:
    """`(B, C, H, W)` → each image's random box resized back to `(H, W)` (bilinear), flipped with p = 0.5.

    Runs where `images` lives; floating dtypes stay as they are, integer images
    are resampled in float32 and rounded back. `boxes` (`crop_boxes`' layout)
    overrides the random draw; the flips are still drawn.
    """
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    b, _, height, width = images.shape
    if boxes is None:
        boxes = crop_boxes(b, height, width, aug, generator)
    flips = torch.rand(b, dtype=torch.float64, generator=generator) < 0.5  # drawn either way: same boxes per seed
    sign = torch.where(flips, -1.0, 1.0).to(torch.float64) if aug.flip else torch.ones(b, dtype=torch.float64)
    x0, y0, w, h = boxes.unbind(1)
    # affine_grid maps output coordinates in [-1, 1] to input ones: scale by the box's size, shift to its centre.
    theta = torch.zeros(b, 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = w * sign
    theta[:, 0, 2] = 2 * x0 + w - 1
    theta[:, 1, 1] = h
    theta[:, 1, 2] = 2 * y0 + h - 1
    work = images if images.is_floating_point() else images.float()
    theta = theta.to(device=images.device, dtype=work.dtype, non_blocking=True)
    grid = F.affine_grid(theta, list(work.shape), align_corners=False)
    out = F.grid_sample(work, grid, mode="bilinear", padding_mode="border", align_corners=False)
    if images.is_floating_point():
        return out
    info = torch.iinfo(images.dtype)
    return out.round_().clamp_(info.min, info.max).to(images.dtype)


def normalize_pixels(patches: torch.Tensor) -> torch.Tensor:
    """uint8 pixels → float32 `(x / 255 - PATCH_MEAN) / PATCH_STD`, where they are (the CPU path's `normalize`)."""
    return patches.float().mul_(1 / (255 * PATCH_STD)).sub_(PATCH_MEAN / PATCH_STD)


def augment_patch_tensor(patches: torch.Tensor, patch_size: int, grid: tuple[int, int], generator: torch.Generator,
                         aug: AugmentConfig) -> torch.Tensor:
    """Patch sequences `(B, N, P·P·C)` → the same, each image random-resized-cropped and maybe flipped."""
    channels = patches.shape[-1] // (patch_size * patch_size)
    images = unpatchify(patches, patch_size, grid, channels)
    return patchify(random_resized_crop_flip(images, generator, aug), patch_size)


def augment_patch_batches(batches: Iterator[tuple[int, int, dict[str, Any]]], *, patch_size: int,
                          grid: tuple[int, int], aug: AugmentConfig, seed: int, rank: int,
                          device: torch.device | None = None) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """The worker's `(epoch, batches consumed, batch)` stream with `batch["patches"]` augmented on `device`.

    uint8 patches (a dataset read with `raw=True`) are normalised there first. Batch `i` of
    `epoch` on `rank` draws from its own generator (`seed`, rank, epoch, i), so a resumed run
    crops exactly as the uninterrupted one would.
    """
    for epoch, index, batch in batches:
        patches = batch["patches"] if device is None else batch["patches"].to(device, non_blocking=True)
        if not patches.is_floating_point():
            patches = normalize_pixels(patches)
        generator = batch_generator(seed, rank, epoch, index)
        yield epoch, index, {**batch, "patches": augment_patch_tensor(patches, patch_size, grid, generator, aug)}
