"""Patch order shared by the model and the ingest stage.

A patch sequence is row-major over the grid of patches; each patch is flattened
as (row, col, channel), i.e. channels-last, so a uint8 HWC image can be
patchified without a transpose and a stored sequence reads back as `(N, P*P*C)`.
"""

from __future__ import annotations

import torch


def grid_size(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """Return the patch grid (rows, cols) of an image, or raise if it does not tile."""
    if patch_size <= 0:
        raise ValueError(f"patch_size must be positive, got {patch_size}")
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"image size {height}x{width} is not divisible by patch size {patch_size}"
        )
    return height // patch_size, width // patch_size


def patchify(images: torch.Tensor, patch_size: int, *, channels_last: bool = False) -> torch.Tensor:
    """Split images into flattened patches.

    images: `(B, C, H, W)`, or `(B, H, W, C)` with `channels_last=True` (the layout
    of decoded uint8 pixels). Returns `(B, N, P*P*C)` in the model's patch order;
    the dtype is kept.
    """
    if images.ndim != 4:
        raise ValueError(f"images must have 4 dimensions (B, C, H, W), got shape {tuple(images.shape)}")
    if not channels_last:
        images = images.permute(0, 2, 3, 1)
    b, h, w, c = images.shape
    gh, gw = grid_size(h, w, patch_size)
    p = patch_size
    x = images.reshape(b, gh, p, gw, p, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, gh * gw, p * p * c)


def unpatchify(patches: torch.Tensor, patch_size: int, grid: tuple[int, int], channels: int = 3) -> torch.Tensor:
    """Inverse of `patchify`: `(B, N, P*P*C)` back to `(B, C, H, W)`."""
    b, n, d = patches.shape
    gh, gw = grid
    p = patch_size
    if n != gh * gw or d != p * p * channels:
        raise ValueError(
            f"patch sequence of shape {tuple(patches.shape)} does not match grid {gh}x{gw}, "
            f"patch size {p} and {channels} channels"
        )
    x = patches.reshape(b, gh, gw, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, gh * p, gw * p)
