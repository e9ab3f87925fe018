"""Specification of `vit.attention.sliding_window_attention` and the Longformer self-attention module.

The reference is a dense masked attention written out directly from the
definition (it builds the whole N×N matrix, which the kernel must never do).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformers
from transformers.models.longformer.modeling_longformer import LongformerSelfAttention as HFSelfAttention

from vit.attention import sliding_window_attention
from vit.longformer import LongformerSelfAttention

BATCH, HEADS, DIM = 2, 3, 4


def dense_reference(q, k, v, *, window, dilation=1, global_mask=None, global_qkv=None, padding_mask=None):
    """Longformer attention by definition, as one masked N×N softmax (float64)."""
    q, k, v = (t.double() for t in (q, k, v))
    bsz, _, n, dim = q.shape
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    offset = j - i
    band = (offset.abs() <= (window // 2) * dilation) & (offset % dilation == 0)
    pad = torch.zeros(bsz, n, dtype=torch.bool) if padding_mask is None else padding_mask
    glob = torch.zeros(bsz, n, dtype=torch.bool) if global_mask is None else global_mask & ~pad
    allowed = (band[None] | glob[:, None, :]) & ~pad[:, None, :]
    scores = (q @ k.transpose(-1, -2)) / dim**0.5
    probs = torch.nan_to_num(scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1))
    local = probs @ v
    q_g, k_g, v_g = (q, k, v) if global_qkv is None else (t.double() for t in global_qkv)
    g_scores = ((q_g @ k_g.transpose(-1, -2)) / dim**0.5).masked_fill(pad[:, None, None, :], float("-inf"))
    out = torch.where(glob[:, None, :, None], g_scores.softmax(-1) @ v_g, local)
    return out.masked_fill(pad[:, None, :, None], 0.0)


def make_case(n: int, *, globals_: bool, padding: bool, seed: int):
    """Random q, k, v, global q/k/v and masks: globals at random positions plus the
    first and last token; padding at the end of one sequence and in the middle of the other."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(BATCH, HEADS, n, DIM, generator=g) for _ in range(6)]
    kwargs = {}
    if globals_:
        gm = torch.rand(BATCH, n, generator=g) < 0.2
        gm[0, 0] = True
        gm[1, n - 1] = True
        kwargs["global_mask"] = gm
        kwargs["global_qkv"] = tuple(tensors[3:])
    if padding:
        pm = torch.zeros(BATCH, n, dtype=torch.bool)
        pm[0, n - n // 3:] = True  # a padded tail
        pm[1, n // 3: n // 3 + max(1, n // 4)] = True  # a padded run in the middle
        if n > 1:
            pm[1, 0] = False
        kwargs["padding_mask"] = pm
    return tensors[:3], kwargs


CASES = [(g, p) for g in (False, True) for p in (False, True)]
LENGTHS = [1, 3, 7, 13, 30]  # below, at and past the window; none is a multiple of every window


@pytest.mark.parametrize("dilation", [1, 2, 3])
@pytest.mark.parametrize("window", [2, 4, 6, 8])
def test_output_equals_dense_masked_reference(window, dilation):
    for n in LENGTHS:
        for seed, (globals_, padding) in enumerate(CASES):
            (q, k, v), kw = make_case(n, globals_=globals_, padding=padding, seed=seed)
            got = sliding_window_attention(q, k, v, window=window, dilation=dilation, **kw)
            want = dense_reference(q, k, v, window=window, dilation=dilation, **kw)
            torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0, msg=f"n={n} {sorted(kw)}")


@pytest.mark.parametrize("dilation", [1, 2, 3])
@pytest.mark.parametrize("window", [2, 4, 6, 8])
def test_gradients_equal_dense_masked_reference(window, dilation):
    for n in (5, 13, 30):
        (q, k, v), kw = make_case(n, globals_=True, padding=True, seed=n)
        inputs = [q, k, v, *kw["global_qkv"]]
        weight = torch.randn(BATCH, HEADS, n, DIM)

        def grads(fn, dtype):
            leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
            out = fn(*leaves[:3], window=window, dilation=dilation, global_mask=kw["global_mask"],
                     global_qkv=tuple(leaves[3:]), padding_mask=kw["padding_mask"])
            (out * weight.to(dtype)).sum().backward()
            return [t.grad for t in leaves]

        for got, want in zip(grads(sliding_window_attention, torch.float32), grads(dense_reference, torch.float64)):
            torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0, msg=f"n={n}")


def test_global_rows_use_the_global_projections_and_other_rows_do_not():
    (q, k, v), kw = make_case(12, globals_=True, padding=False, seed=3)
    base = sliding_window_attention(q, k, v, window=4, **kw)
    q_g, k_g, v_g = kw["global_qkv"]
    changed = sliding_window_attention(q, k, v, window=4, **{**kw, "global_qkv": (q_g, k_g, v_g + 1.0)})
    moved = (changed - base).abs().amax(dim=(1, 3)) > 1e-6  # (B, N)
    assert torch.equal(moved, kw["global_mask"])


def test_padding_attends_to_nothing_and_is_attended_by_nothing():
    (q, k, v), kw = make_case(16, globals_=True, padding=True, seed=4)
    pad = kw["padding_mask"]
    out = sliding_window_attention(q, k, v, window=6, dilation=2, **kw)
    assert torch.all(out.masked_select(pad[:, None, :, None]) == 0)
    noise = pad[:, None, :, None] * 100.0
    others = sliding_window_attention(q + noise, k + noise, v + noise, window=6, dilation=2, **kw)
    torch.testing.assert_close(others, out, atol=1e-6, rtol=0)


def test_a_sequence_made_only_of_padding_gives_zeros_and_finite_gradients():
    (q, k, v), kw = make_case(9, globals_=True, padding=False, seed=5)
    pad = torch.zeros(BATCH, 9, dtype=torch.bool)
    pad[1] = True
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = sliding_window_attention(q, k, v, window=4, padding_mask=pad, global_mask=kw["global_mask"])
    out.sum().backward()
    assert torch.all(out[1] == 0)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_bf16_matches_fp32_within_bf16_precision():
    (q, k, v), kw = make_case(40, globals_=True, padding=True, seed=6)
    want = sliding_window_attention(q, k, v, window=8, dilation=2, **kw)
    kw16 = {**kw, "global_qkv": tuple(t.bfloat16() for t in kw["global_qkv"])}
    got = sliding_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=8, dilation=2, **kw16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_bf16_backward_runs_and_gradients_track_fp32():
    (q, k, v), kw = make_case(40, globals_=True, padding=False, seed=7)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        sliding_window_attention(*leaves, window=8, global_mask=kw["global_mask"]).float().square().sum().backward()
        grads[dtype] = [t.grad.float() for t in leaves]
    for g16, g32 in zip(grads[torch.bfloat16], grads[torch.float32]):
        assert torch.isfinite(g16).all()
        torch.testing.assert_close(g16, g32, atol=0.1, rtol=0.05)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_the_recorder_sees_an_n_by_n_matrix_in_dense_attention():
    n = 512
    q = torch.randn(1, 1, n, 8)
    with LargestTensor() as rec:
        (q @ q.transpose(-1, -2)).softmax(-1)
    assert rec.max_numel >= n * n


def test_memory_is_linear_in_n_no_n_by_n_intermediate_forward_or_backward():
    n, window, heads = 4096, 64, 2
    q, k, v = (torch.randn(1, heads, n, 8, requires_grad=True) for _ in range(3))
    gm = torch.zeros(1, n, dtype=torch.bool)
    gm[0, [0, 1000, n - 1]] = True
    pm = torch.zeros(1, n, dtype=torch.bool)
    pm[0, -100:] = True
    with LargestTensor() as rec:
        out = sliding_window_attention(q, k, v, window=window, dilation=2, global_mask=gm, padding_mask=pm)
        out.sum().backward()
    # The band holds heads·N·(c + 2r + G) scores with a block c <= 2r here: at most 2·w per row.
    assert rec.max_numel <= heads * n * (2 * window + 3)
    assert rec.max_numel < n * n // 16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": 5}, "window must be a positive even integer"),
        ({"window": 0}, "window must be a positive even integer"),
        ({"window": -4}, "window must be a positive even integer"),
        ({"window": 4, "dilation": 0}, "dilation must be an integer >= 1"),
        ({"window": 4, "global_mask": torch.zeros(2, 9, dtype=torch.bool)}, r"global_mask must have shape \(B, N\)"),
        ({"window": 4, "padding_mask": torch.zeros(1, 10, dtype=torch.bool)}, r"padding_mask must have shape \(B, N\)"),
        ({"window": 4, "padding_mask": torch.zeros(2, 10)}, "padding_mask must be a bool tensor"),
        ({"window": 4, "global_mask": torch.zeros(2, 10, dtype=torch.bool),
          "global_qkv": (torch.zeros(2, 3, 10, 4),) * 2}, "global_qkv must be three tensors"),
        ({"window": 4, "dropout_p": -0.5}, r"dropout_p must be a probability in \[0, 1\), got -0.5"),
        ({"window": 4, "dropout_p": 1.5}, r"dropout_p must be a probability in \[0, 1\), got 1.5"),
        ({"window": 4, "global_qkv": (torch.zeros(2, 3, 10, 4),) * 3}, "global_qkv was given without global_mask"),
    ],
)
def test_bad_arguments_raise_a_clear_value_error(kwargs, message):
    q = torch.zeros(2, 3, 10, 4)
    with pytest.raises(ValueError, match=message):
        sliding_window_attention(q, q, q, **kwargs)


def test_mismatched_qkv_shapes_raise():
    with pytest.raises(ValueError, match="q, k and v must share one shape"):
        sliding_window_attention(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 9, 4), torch.zeros(1, 2, 8, 4), window=2)


# --- equality with Hugging Face's LongformerSelfAttention -------------------------------------

def hf_pair(hidden: int, heads: int, window: int, seed: int, fold: bool | None = None):
    torch.manual_seed(seed)
    config = transformers.LongformerConfig(hidden_size=hidden, num_attention_heads=heads,
                                           attention_window=[window], attention_probs_dropout_prob=0.0)
    hf = HFSelfAttention(config, layer_id=0).eval()
    for p in hf.parameters():  # HF starts local and global projections differently; make them all distinct
        torch.nn.init.normal_(p, std=0.3)
    ours = LongformerSelfAttention(hidden, heads, window, fold_global_kv=fold).eval()
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def run_hf(hf, x, global_mask, padding_mask):
    # HF's layer API takes the merged additive mask: -10000 padding, 0 local, +10000 global.
    mask = torch.zeros(x.shape[:2])
    mask[global_mask] = 10000.0
    mask[padding_mask] = -10000.0
    return hf(x, attention_mask=mask, is_index_masked=mask < 0, is_index_global_attn=mask > 0,
              is_global_attn=bool((mask > 0).any()))[0]


@pytest.mark.parametrize("fold", [None, True, False], ids=["auto", "folded", "projected"])
@pytest.mark.parametrize(
    "hidden, heads, window, n, global_positions",
    [
        (24, 4, 4, 16, {0: [0], 1: [7, 15]}),  # few globals: auto folds global K/V into the query side
        (8, 4, 6, 18, {0: [0, 3, 4], 1: [17]}),  # G·heads >= hidden: auto projects global K/V
        (16, 2, 8, 24, {}),  # no global token at all
    ],
)
def test_module_equals_hugging_face_longformer_self_attention(hidden, heads, window, n, global_positions, fold):
    hf, ours = hf_pair(hidden, heads, window, seed=n, fold=fold)
    x = torch.randn(2, n, hidden)
    gm = torch.zeros(2, n, dtype=torch.bool)
    for b, positions in global_positions.items():
        gm[b, positions] = True
    pm = torch.zeros(2, n, dtype=torch.bool)
    pm[1, n - window // 2 - 1: n - 1] = True
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = run_hf(hf, x_hf, gm, pm)
    got = ours(x_ours, gm, pm)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    weight = torch.randn_like(want)
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-5, rtol=0)
    for name, p in ours.named_parameters():
        hf_grad = hf.get_parameter(name).grad
        assert (p.grad is None) == (hf_grad is None), name
        if hf_grad is not None:
            torch.testing.assert_close(p.grad, hf_grad, atol=1e-4, rtol=1e-5, msg=name)


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "projected"])
def test_module_equals_the_kernel_on_its_own_projections_with_dilation_and_padding(fold):
    torch.manual_seed(1)
    module = LongformerSelfAttention(12, 3, window=4, dilation=2, fold_global_kv=fold).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 11, 12)
    gm = torch.zeros(2, 11, dtype=torch.bool)
    gm[0, 4] = gm[1, 0] = True
    pm = torch.zeros(2, 11, dtype=torch.bool)
    pm[0, 8:] = True

    def heads(linear):
        return linear(x).view(2, 11, 3, 4).transpose(1, 2)

    want = sliding_window_attention(
        heads(module.query), heads(module.key), heads(module.value), window=4, dilation=2, global_mask=gm,
        global_qkv=(heads(module.query_global), heads(module.key_global), heads(module.value_global)),
        padding_mask=pm,
    ).transpose(1, 2).reshape(2, 11, 12)
    torch.testing.assert_close(module(x, gm, pm), want, atol=1e-5, rtol=0)
