"""Specification of `vit.seqmatmul`: products of a long sequence with a few rows, split along it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vit.seqmatmul import CHUNK, long_times_small, small_times_long


class ReductionLengths(TorchDispatchMode):
    """Records the contracted length of every matrix product run (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.lengths = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            self.lengths.append(args[0].shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n", [1, CHUNK, 3 * CHUNK + 5])
@pytest.mark.parametrize("product, shapes", [
    (long_times_small, ((2, 3, "n", 8), (2, 3, 8, 4))),
    (small_times_long, ((2, 3, 4, "n"), (2, 3, "n", 8))),
])
def test_values_and_gradients_equal_a_plain_matmul(product, shapes, n):
    a, b = (torch.randn(*(n if s == "n" else s for s in shape), dtype=torch.float64) for shape in shapes)
    weight = torch.randn_like(a @ b)
    grads = []
    for fn in (product, torch.matmul):
        leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        out = fn(*leaves)
        (out * weight).sum().backward()
        grads.append((out, *(t.grad for t in leaves)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_no_product_reduces_over_more_than_a_chunk_forward_or_backward():
    n = 20 * CHUNK
    long_a = torch.randn(1, 2, n, 16, requires_grad=True)
    small_b = torch.randn(1, 2, 16, 4, requires_grad=True)
    rows = torch.randn(1, 2, 4, n, requires_grad=True)
    with ReductionLengths() as rec:
        (long_times_small(long_a, small_b).sum() + small_times_long(rows, long_a).sum()).backward()
    assert rec.lengths and max(rec.lengths) <= CHUNK
    with ReductionLengths() as plain:
        ((long_a @ small_b).sum() + (rows @ long_a).sum()).backward()
    assert max(plain.lengths) == n  # what the split avoids
