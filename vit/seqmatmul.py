"""Products of a long sequence with a few rows (the global tokens), split along the sequence.

`P @ V` with P `(G, N)` and V `(N, D)`, G a handful and N tens of thousands, is one long reduction
over N: a GEMM library runs it on a few thread blocks (its output is one G×D tile per head), each
looping over all of N, and on a GPU that takes milliseconds. The same reduction hides in the
backward pass of `V @ w` (the gradient of w). Cutting N into chunks of `CHUNK` rows turns each into
many small independent products summed at the end, which fill the GPU; on a CPU it costs nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CHUNK", "long_times_small", "small_times_long"]

CHUNK = 128


def _chunks(n: int) -> tuple[int, int]:
    count = -(-n // CHUNK)
    return count, count * CHUNK - n


def long_times_small(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for a `(..., N, K)` long and b `(..., K, M)` small: b is broadcast over chunks of
    a's rows, so b's gradient is a sum of per-chunk products rather than one reduction over N."""
    n = a.shape[-2]
    count, pad = _chunks(n)
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
    out = a.unflatten(-2, (count, CHUNK)) @ b.unsqueeze(-3)  # (..., count, CHUNK, M)
    out = out.flatten(-3, -2)
    return out[..., :n, :] if pad else out


def small_times_long(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for a `(..., M, N)` and b `(..., N, K)` with N long and M small: per-chunk products
    `(..., count, M, K)`, then their sum."""
    count, pad = _chunks(a.shape[-1])
    if pad:
        a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))
    a = a.unflatten(-1, (count, CHUNK)).movedim(-2, -3)  # (..., count, M, CHUNK)
    return (a @ b.unflatten(-2, (count, CHUNK))).sum(-3)
