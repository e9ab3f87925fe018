"""Position-embedding helpers: pure functions on tensors.

Used when loading weights trained at another resolution and at call time when
an input's token grid differs from the configured one (paper §3.2).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F


def check_grid(name: str, grid: tuple[int, int]) -> tuple[int, int]:
    """Return `grid` as `(rows, cols)` ints, or raise naming `name` unless it is two positive ints."""
    ok = isinstance(grid, (tuple, list)) and len(grid) == 2 and all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) and s > 0 for s in grid)
    if not ok:
        raise ValueError(f"{name} must be two positive ints (rows, cols), got {grid!r}")
    return int(grid[0]), int(grid[1])


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    old_grid: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Resize a `(1, prefix + gh*gw, D)` table to `new_grid` by 2-D bicubic interpolation.

    The prefix rows (class-token position) are kept as they are. `old_grid`
    defaults to a square grid; a table that is not square needs it given.
    Downsampling is antialiased; upsampling is plain bicubic (as Hugging Face's
    `interpolate_pos_encoding`), so upsampled tables match theirs.
    """
    if pos_embed.ndim != 3:
        raise ValueError(f"pos_embed must be (1, tokens, dim), got shape {tuple(pos_embed.shape)}")
    new_grid = check_grid("new_grid", new_grid)
    if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be an int >= 0, got {num_prefix_tokens!r}")
    n = pos_embed.shape[1] - num_prefix_tokens
    if old_grid is not None:
        old_grid = check_grid("old_grid", old_grid)
    else:
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"pos_embed has {n} patch positions, which is not a square grid; pass old_grid")
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n:
        raise ValueError(f"pos_embed has {n} patch positions, but old_grid {tuple(old_grid)} does not hold {n}")
    if new_grid == tuple(old_grid):
        return pos_embed
    prefix, patches = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    dtype = patches.dtype
    grid = patches.reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2).float()
    shrinking = new_grid[0] < old_grid[0] or new_grid[1] < old_grid[1]
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", align_corners=False, antialias=shrinking)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(dtype)
    return torch.cat([prefix, patches], dim=1)


def resample_1d(table: torch.Tensor, length: int) -> torch.Tensor:
    """Resize a `(n, D)` table of 1-D positions to `(length, D)` by linear interpolation."""
    if table.shape[0] == length:
        return table
    x = table.t().unsqueeze(0).float()  # (1, D, n)
    x = F.interpolate(x, size=length, mode="linear", align_corners=False)
    return x.squeeze(0).t().to(table.dtype)


def sincos_2d(
    grid: tuple[int, int],
    dim: int,
    temperature: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings, `(gh*gw, dim)`, row-major over the grid.

    A quarter of the channels each hold sin(x), cos(x), sin(y), cos(y) at
    geometrically spaced frequencies, as in MoCo v3 and big_vision.
    """
    if dim % 4:
        raise ValueError(f"sincos_2d needs dim divisible by 4, got {dim}")
    gh, gw = grid
    y, x = torch.meshgrid(
        torch.arange(gh, dtype=torch.float32, device=device),
        torch.arange(gw, dtype=torch.float32, device=device),
        indexing="ij",
    )
    quarter = dim // 4
    omega = torch.arange(quarter, dtype=torch.float32, device=device) / max(quarter - 1, 1)
    omega = temperature ** (-omega)
    x = x.reshape(-1, 1) * omega
    y = y.reshape(-1, 1) * omega
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).to(dtype)


__all__ = ["check_grid", "resample_1d", "resample_pos_embed", "sincos_2d"]
