"""Specification of the FlexAttention kernel (`vit.flex_longformer`) of Longformer attention.

On CPU, FlexAttention runs its unfused reference, forward only (it refuses backward there), and it
evaluates the mask_mod everywhere. So outputs are checked here, in fp32 and bf16, and the block
mask is checked on its own: the CUDA kernel skips the mask_mod in full blocks and every block the
mask leaves out, so the block mask alone must already describe the band exactly. Gradients of the
flex kernel are compared with the banded kernel on a GPU by `benchmarks/longformer_attention.py
--device cuda`; the merge of the band with the global keys (the default layout) is checked here with
gradients, from a band computed by definition. Both layouts of the global keys (`global_keys`) meet
the output checks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from tests.test_longformer_attention import dense_reference, hf_pair, make_case, run_hf
from vit.attention import global_positions, sliding_window_attention
from vit import flex_longformer
from vit.flex_longformer import BLOCK, GLOBAL_GROUP, band_block_mask, choose_kernel, from_classes, to_classes
from vit.longformer import LongformerSelfAttention

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

@pytest.fixture(params=["merge", "prefix"])
def global_keys(request, monkeypatch):
    """Each layout of the global keys (`GLOBAL_KEYS`)."""
    monkeypatch.setattr(flex_longformer, "GLOBAL_KEYS", request.param)
    return request.param


@pytest.mark.parametrize("dilation", [1, 2, 3])
def test_flex_output_equals_dense_masked_reference_with_globals_and_padding(dilation, global_keys):
    # 30 tokens: one block; 300: three blocks, with a band of partial and full blocks.
    for n, window in ((30, 4), (300, 64)):
        for seed, case in enumerate([{"globals_": False, "padding": False}, {"globals_": True, "padding": True}]):
            (q, k, v), kw = make_case(n, seed=seed, **case)
            got = sliding_window_attention(q, k, v, window=window, dilation=dilation, kernel="flex", **kw)
            want = dense_reference(q, k, v, window=window, dilation=dilation, **kw)
            torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0, msg=f"n={n} {sorted(kw)}")


def test_flex_in_bf16_matches_the_fp32_reference_within_bf16_precision(global_keys):
    (q, k, v), kw = make_case(300, globals_=True, padding=True, seed=6)
    want = dense_reference(q, k, v, window=64, dilation=2, **kw).float()
    kw16 = {**kw, "global_qkv": tuple(t.bfloat16() for t in kw["global_qkv"])}
    got = sliding_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=64, dilation=2, kernel="flex",
                                   **kw16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


# bf16: the projections round too; both kernels differ from Hugging Face's fp32 by about 1% of the largest output.
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_flex_module_equals_hugging_face_longformer_self_attention(dtype, tolerance, global_keys):
    n, hidden, heads, window = 384, 24, 4, 64  # Hugging Face needs N to be a multiple of 2·window
    hf, ours = hf_pair(hidden, heads, window, seed=3)
    ours.kernel = "flex"
    x = torch.randn(2, n, hidden, generator=torch.Generator().manual_seed(0))
    gm = torch.zeros(2, n, dtype=torch.bool)
    gm[0, [0, 200]] = gm[1, 383] = True
    pm = torch.zeros(2, n, dtype=torch.bool)
    pm[1, 250:383] = True  # a padded run, wider than a block, up to the global token at 383
    with torch.no_grad():
        want = run_hf(hf, x, gm, pm)
        got = ours.to(dtype)(x.to(dtype), gm, pm)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tolerance * want.abs().max().item(), rtol=tolerance)


def _effective_mask(block_mask: BlockMask, batch: int) -> torch.Tensor:
    """What a block-sparse kernel computes with: full blocks entirely, partial blocks through the
    mask_mod, nothing elsewhere. `(B, Lq, Lk)` bool."""
    q_len, kv_len = block_mask.seq_lengths
    partial_or_full = block_mask.to_dense().bool()
    full = BlockMask.from_kv_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                    BLOCK_SIZE=BLOCK).to_dense().bool()

    def spread(blocks):  # (B', 1, Qb, Kb) -> (B, Lq, Lk)
        return blocks[:, 0].repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2).expand(batch, -1, -1)

    mod = block_mask.mask_mod(torch.arange(batch)[:, None, None], 0, torch.arange(q_len)[None, :, None],
                              torch.arange(kv_len)[None, None, :])
    return spread(full) | (spread(partial_or_full) & ~spread(full) & mod)


def _token_order(mask: torch.Tensor, n: int, dilation: int, keys_too: bool) -> torch.Tensor:
    """`(B, Lq, Lk)` over regrouped slots -> token order on the query axis (and the key axis)."""
    out = from_classes(mask[:, None].float(), n, dilation)[:, 0]
    if keys_too:
        out = from_classes(out.transpose(1, 2)[:, None], n, dilation)[:, 0].transpose(1, 2)
    return out.int()


@pytest.mark.parametrize("group", [1, GLOBAL_GROUP])  # 1: a copy of the global keys per query block
@pytest.mark.parametrize("n, radius, dilation", [(300, 2, 1), (300, 64, 1), (500, 130, 2), (400, 20, 3)])
def test_the_block_mask_alone_gives_each_query_its_band_and_the_global_keys_once(n, radius, dilation, group,
                                                                                 monkeypatch):
    monkeypatch.setattr(flex_longformer, "GLOBAL_GROUP", group)
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[0, n - 90:] = True
    pad[1, 100:260] = True  # wider than a block: a whole full block of keys becomes padding
    is_global = torch.zeros(2, n, dtype=torch.bool)
    is_global[0, [0, 5, 150]] = is_global[1, n - 1] = True  # some inside each other's band
    pos, valid = global_positions(is_global)
    prefix_pos, prefix_ok = F.pad(pos, (0, BLOCK - pos.shape[1])), F.pad(valid, (0, BLOCK - pos.shape[1]))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    band = ((j - i).abs() <= radius * dilation) & ((j - i) % dilation == 0)
    for padding in (None, pad):
        not_pad = torch.ones(2, n, dtype=torch.bool) if padding is None else ~padding
        key_ok = to_classes(not_pad[:, None, :, None], dilation)[:, 0, :, 0]
        block_mask = band_block_mask(n, radius, dilation, key_ok, padding is not None, prefix_pos, prefix_ok)
        seen = _effective_mask(block_mask, 2)  # (B, slots, copies x BLOCK global slots + slots)
        lead = seen.shape[2] - seen.shape[1]
        times = _token_order(seen[:, :, lead:], n, dilation, keys_too=True)
        every_copy = seen[:, :, :lead].unflatten(2, (lead // BLOCK, BLOCK)).sum(2)
        global_slots = _token_order(every_copy, n, dilation, keys_too=False)
        times.scatter_add_(2, prefix_pos[:, None, :].expand(-1, n, -1), global_slots)
        want = (band[None] | is_global[:, None, :]) & not_pad[:, None, :]
        assert torch.equal(times, want.int())  # every key it should see exactly once, no other


def test_no_block_of_the_global_keys_is_met_by_more_query_blocks_than_one_group():
    # The backward walks each key block's query blocks in one program: one shared global block would
    # make that program walk all N/128 of them.
    n = 4096
    is_global = torch.zeros(1, n, dtype=torch.bool)
    is_global[0, [0, n // 2, n - 1]] = True
    pos, valid = global_positions(is_global)
    prefix_pos, prefix_ok = F.pad(pos, (0, BLOCK - pos.shape[1])), F.pad(valid, (0, BLOCK - pos.shape[1]))
    blocks = band_block_mask(n, 256, 1, torch.ones(1, n, dtype=torch.bool), False, prefix_pos, prefix_ok).to_dense()
    lead = blocks[0, 0, :, : blocks.shape[-1] - blocks.shape[-2]]  # (query blocks, global-key blocks)
    assert lead.shape[1] == n // BLOCK // GLOBAL_GROUP
    assert lead.sum(0).max() == GLOBAL_GROUP and torch.equal(lead.sum(1), torch.ones(n // BLOCK, dtype=lead.dtype))


def test_flex_output_with_a_copy_of_the_global_keys_per_query_block_equals_the_dense_reference(monkeypatch):
    monkeypatch.setattr(flex_longformer, "GLOBAL_KEYS", "prefix")
    monkeypatch.setattr(flex_longformer, "GLOBAL_GROUP", 1)
    (q, k, v), kw = make_case(300, globals_=True, padding=True, seed=4)
    got = sliding_window_attention(q, k, v, window=64, dilation=2, kernel="flex", **kw)
    torch.testing.assert_close(got, dense_reference(q, k, v, window=64, dilation=2, **kw).float(), atol=1e-5, rtol=0)


def _dense_band(q, k, v, radius, dilation, key_ok):
    """The band alone by definition: output and logsumexp of each row (every row here has a key)."""
    offset = torch.arange(q.shape[2])[None, :] - torch.arange(q.shape[2])[:, None]
    band = (offset.abs() <= radius * dilation) & (offset % dilation == 0)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~(band & key_ok[:, None, :])[:, None], -torch.inf)
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def test_merging_the_global_keys_by_logsumexp_has_the_gradients_of_one_softmax_over_band_and_globals():
    # The CUDA kernel's band output and logsumexp get gradients through this merge; CPU FlexAttention
    # has no backward, so the band comes from its definition here.
    n, window, dilation = 300, 64, 2
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pm = torch.zeros(2, n, dtype=torch.bool)
    pm[1, 100:110] = True
    gm = torch.zeros(2, n, dtype=torch.bool)
    gm[0, [0, 40, 150, 299]] = gm[1, [5, 105, 200]] = True  # 40: inside some bands; 105: padding, not global
    pos, valid = global_positions(gm & ~pm)
    band_out, band_lse = _dense_band(q, k, v, window // 2, dilation, ~pm)
    meets = flex_longformer.outside_band(n, window // 2, dilation, pos, valid)
    got = flex_longformer.merge_global_keys(band_out, band_lse, q, k, v, pos, meets, 8 ** -0.5)
    want = dense_reference(q, k, v, window=window, dilation=dilation, global_mask=gm, padding_mask=pm)
    rows = (~(pm | gm))[:, None, :, None]  # global and padding rows are the caller's
    weight = torch.randn(got.shape, generator=g, dtype=torch.float64) * rows
    torch.testing.assert_close(got * rows, want * rows)
    for got_grad, want_grad in zip(torch.autograd.grad((got * weight).sum(), (q, k, v)),
                                   torch.autograd.grad((want * weight).sum(), (q, k, v))):
        torch.testing.assert_close(got_grad, want_grad)


def test_a_row_that_meets_no_key_merges_to_zero_with_finite_gradients():
    # A padding row in a long padded run: its band is empty (logsumexp -inf) and it meets no global key.
    q, k, v = (torch.randn(1, 1, 2, 4, requires_grad=True) for _ in range(3))
    band_out = torch.zeros(1, 1, 2, 4, requires_grad=True)
    band_lse = torch.tensor([[[-torch.inf, 0.3]]], requires_grad=True)
    meets = torch.tensor([[[False], [False]]])
    out = flex_longformer.merge_global_keys(band_out, band_lse, q, k, v, torch.tensor([[1]]), meets, 0.5)
    assert torch.equal(out[0, 0, 0], torch.zeros(4))
    grads = torch.autograd.grad(out.square().sum() + out.sum(), (band_out, band_lse, q, k, v))
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_the_block_mask_keeps_only_blocks_near_the_diagonal():
    n, radius = 4096, 256
    key_ok = torch.ones(1, n, dtype=torch.bool)
    blocks = band_block_mask(n, radius, 2, key_ok, padding=False).to_dense()
    q_block, k_block = blocks[0, 0].nonzero(as_tuple=True)
    assert (q_block - k_block).abs().max() <= -(-radius // BLOCK)
    assert blocks.sum() <= (n // BLOCK) * (2 * -(-radius // BLOCK) + 1)


def test_the_block_mask_of_one_shape_is_built_once():
    key_ok = torch.ones(1, 1024, dtype=torch.bool)
    first = band_block_mask(1000, 16, 2, key_ok, padding=False)
    second = band_block_mask(1000, 16, 2, key_ok, padding=False)
    assert first.kv_indices is second.kv_indices


def test_auto_runs_flex_on_cuda_and_the_banded_kernel_on_cpu_or_with_dropout():
    assert choose_kernel("auto", torch.device("cpu"), 0.0) == "banded"
    assert choose_kernel("auto", torch.device("cuda"), 0.0) == "flex"
    assert choose_kernel("auto", torch.device("cuda"), 0.1) == "banded"
    assert choose_kernel("flex", torch.device("cpu"), 0.0) == "flex"


@pytest.mark.parametrize("call, message", [
    (lambda: choose_kernel("flex", torch.device("cuda"), 0.1), "kernel 'flex' has no attention dropout"),
    (lambda: choose_kernel("fast", torch.device("cpu"), 0.0), "kernel must be one of"),
    (lambda: LongformerSelfAttention(8, 2, 4, kernel="fast"), "kernel must be one of"),
])
def test_a_bad_kernel_choice_raises_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """The CUDA path's compiled kernel on CPU: the aot_eager backend traces and guards as inductor
    would, without building C++; dynamo raises at its recompile limit instead of silently running
    the unfused N×N reference."""
    torch._dynamo.reset()
    flex_longformer._compiled_flex.cache_clear()
    monkeypatch.setattr(flex_longformer, "_static_shapes", {})
    monkeypatch.setattr(flex_longformer, "_flex", functools.partial(flex_longformer._flex, backend="aot_eager"))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    flex_longformer._compiled_flex.cache_clear()
    torch._dynamo.reset()


def _flex_equals_dense(n, batch, window, dilation, globals_, padding, seed=0):
    (q, k, v), kw = make_case(n, globals_=globals_, padding=padding, seed=seed)
    q, k, v = q[:batch], k[:batch], v[:batch]
    kw = {name: (tuple(t[:batch] for t in x) if isinstance(x, tuple) else x[:batch]) for name, x in kw.items()}
    got = sliding_window_attention(q, k, v, window=window, dilation=dilation, kernel="flex", **kw)
    want = dense_reference(q, k, v, window=window, dilation=dilation, **kw)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0, msg=f"n={n} batch={batch} window={window}")


def test_the_compiled_kernel_takes_new_lengths_and_windows_without_reaching_dynamos_limit(compiled_on_cpu):
    # 16 lengths of 2 to 17 query blocks, one kind of call: STATIC_SHAPES static kernels, then one dynamic
    # kernel that must serve the other 10 without a recompile each (past 8, dynamo would raise here).
    for i, n in enumerate(range(130, 130 + 16 * 128, 128)):
        _flex_equals_dense(n, batch=2, window=(4, 16, 64)[i % 3], dilation=2, globals_=True, padding=True)


def test_each_kind_of_call_has_its_own_compiled_kernel_so_mixing_them_keeps_every_one_fused(compiled_on_cpu):
    # Dilation, padding and global keys change the mask_mod's code: 8 kinds, each at two batch sizes.
    for dilation in (1, 2):
        for globals_ in (False, True):
            for padding in (False, True):
                for batch in (1, 2):
                    _flex_equals_dense(300, batch, 16, dilation, globals_, padding)


def test_the_compiled_kernel_is_one_graph_so_it_never_falls_back_to_the_unfused_reference(compiled_on_cpu,
                                                                                          global_keys):
    counters = torch._dynamo.utils.counters
    counters.clear()
    _flex_equals_dense(300, 2, 16, 2, globals_=True, padding=True)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


def test_a_kinds_first_shapes_get_static_kernels_and_later_ones_share_a_dynamic_one(monkeypatch):
    monkeypatch.setattr(flex_longformer, "_static_shapes", {})
    variant, cpu = (False,) * 6, torch.device("cpu")
    picks = [flex_longformer._flex(cpu, variant, (1, 2, 128 * i, 8, 128 * i), backend="aot_eager") for i in range(1, 9)]
    static = flex_longformer._compiled_flex(variant, False, "aot_eager")
    dynamic = flex_longformer._compiled_flex(variant, True, "aot_eager")
    assert picks == [static] * flex_longformer.STATIC_SHAPES + [dynamic] * (8 - flex_longformer.STATIC_SHAPES)
    assert flex_longformer._flex(cpu, variant, (1, 2, 128, 8, 128), backend="aot_eager") is static  # seen before
