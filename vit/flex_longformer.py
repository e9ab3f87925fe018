"""Longformer's band on FlexAttention: a block-sparse kernel for the sliding window (the CUDA path).

Computes what `vit.attention.local_attention` computes for every row (band + global keys, padding
hidden), on `(B, heads, N, head_dim)` tensors:

1. Dilation d: query i only meets keys j with i ≡ j (mod d). Regrouping the sequence by residue
   class (token i goes to slot (i mod d)·m + i // d, m = ceil(N / d)) makes each class a plain,
   undilated window of radius r, so the block mask is as sparse as an undilated one.
2. Band pass: `flex_attention` over the regrouped sequence with a block mask (kept per
   (N, r, d, device)) and a mask_mod for class edges and padding; it also returns the logsumexp.
3. Global keys: every query against the G global keys outside its own band (N·G scores, small).
4. The two softmaxes merge exactly through their logsumexps: with w = σ(l_band - l_global),
   out = w·o_band + (1 - w)·P_global·V_global.

FlexAttention has no attention dropout: this path is only taken when dropout is off. On CUDA the
kernel is `torch.compile(flex_attention, dynamic=False)`, compiled once per shape; elsewhere the
unfused reference (for tests).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from vit.seqmatmul import long_times_small

__all__ = ["BLOCK", "KERNELS", "check_kernel", "choose_kernel", "flex_band_attention", "band_block_mask", "to_classes",
           "from_classes"]

BLOCK = 128  # FlexAttention's sparse block: query and key tiles of 128 tokens
KERNELS = ("auto", "banded", "flex")


def check_kernel(kernel: str) -> str:
    """Return the kernel name, or raise if it is not one of `KERNELS`."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def choose_kernel(kernel: str, device: torch.device, dropout_p: float) -> str:
    """"banded" or "flex" for a requested kernel: "auto" takes flex on CUDA when attention dropout is
    off (FlexAttention has none), the banded kernel otherwise."""
    check_kernel(kernel)
    if kernel == "flex" and dropout_p > 0:
        raise ValueError(f"kernel 'flex' has no attention dropout; got dropout_p={dropout_p} (use 'banded' or 'auto')")
    if kernel == "auto":
        return "flex" if device.type == "cuda" and dropout_p == 0 else "banded"
    return kernel


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _flex(device: torch.device):
    # Compiling for CPU builds a C++ kernel for minutes; CPU only runs this path in tests.
    return _compiled_flex() if device.type == "cuda" else flex_attention


def _layout(n: int, dilation: int) -> tuple[int, int]:
    """(m, padded length): each class holds m slots, the whole is padded to whole blocks."""
    m = -(-n // dilation)
    return m, -(-(m * dilation) // BLOCK) * BLOCK


def to_classes(x: torch.Tensor, dilation: int) -> torch.Tensor:
    """`(B, H, N, D)` -> `(B, H, padded, D)`, token i at slot (i mod d)·m + i // d (filler slots zero)."""
    bsz, heads, n, dim = x.shape
    m, padded = _layout(n, dilation)
    if dilation > 1:
        x = F.pad(x, (0, 0, 0, m * dilation - n)).view(bsz, heads, m, dilation, dim)
        x = x.transpose(2, 3).reshape(bsz, heads, m * dilation, dim)
    return F.pad(x, (0, 0, 0, padded - x.shape[2])) if padded > x.shape[2] else x


def from_classes(x: torch.Tensor, n: int, dilation: int) -> torch.Tensor:
    """Inverse of `to_classes`: `(B, H, padded, D)` -> `(B, H, N, D)`."""
    bsz, heads, _, dim = x.shape
    m, _ = _layout(n, dilation)
    if dilation > 1:
        x = x[:, :, : m * dilation].view(bsz, heads, dilation, m, dim).transpose(2, 3)
        x = x.reshape(bsz, heads, m * dilation, dim)
    return x[:, :, :n]


def _original_index(slots: torch.Tensor, m: int, dilation: int) -> torch.Tensor:
    return (slots % m) * dilation + slots // m


def _band_mask_mod(key_ok: torch.Tensor, m: int, radius: int):
    """Same class, within the radius, and a usable key (`key_ok` (B, padded), regrouped)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // m == kv_idx // m) & ((q_idx - kv_idx).abs() <= radius) & key_ok[b, kv_idx]

    return mask_mod


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block map `(..., Qb, Kb)` bool -> (count, indices listed first) as FlexAttention stores them."""
    counts = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32)


@functools.lru_cache(maxsize=64)
def _band_blocks(n: int, radius: int, dilation: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query block, key block) pairs are partly (`partial`) or wholly (`full`) in the band,
    `(Qb, Kb)` bool each, ignoring padding. Only the 2·ceil(r/128)+1 blocks around the diagonal
    are evaluated, so this costs O(N·r), never O(N²)."""
    m, padded = _layout(n, dilation)
    nb = padded // BLOCK
    side = -(-radius // BLOCK)
    q_blocks = torch.arange(nb, device=device)
    k_blocks = q_blocks[:, None] + torch.arange(-side, side + 1, device=device)  # (Qb, S)
    inside = (k_blocks >= 0) & (k_blocks < nb)
    t = torch.arange(BLOCK, device=device)
    q_idx = (q_blocks * BLOCK)[:, None, None, None] + t[:, None]  # (Qb, 1, BLOCK, 1)
    kv_idx = (k_blocks.clamp(0, nb - 1) * BLOCK)[:, :, None, None] + t  # (Qb, S, 1, BLOCK)
    key_real = (kv_idx < m * dilation) & (_original_index(kv_idx, m, dilation) < n)
    allowed = (q_idx // m == kv_idx // m) & ((q_idx - kv_idx).abs() <= radius) & key_real
    some, every = allowed.flatten(2).any(-1) & inside, allowed.flatten(2).all(-1) & inside
    rows = q_blocks[:, None].expand_as(k_blocks)[inside]
    partial = torch.zeros(nb, nb, dtype=torch.bool, device=device)
    full = torch.zeros(nb, nb, dtype=torch.bool, device=device)
    partial[rows, k_blocks[inside]] = (some & ~every)[inside]
    full[rows, k_blocks[inside]] = every[inside]
    return partial, full


@functools.lru_cache(maxsize=64)
def _cached_block_mask(n: int, radius: int, dilation: int, device: torch.device) -> BlockMask:
    partial, full = _band_blocks(n, radius, dilation, device)
    padded = partial.shape[-1] * BLOCK
    return BlockMask.from_kv_blocks(*(t[None, None] for t in _ordered(partial)),
                                    *(t[None, None] for t in _ordered(full)),
                                    BLOCK_SIZE=BLOCK, seq_lengths=(padded, padded))


def band_block_mask(n: int, radius: int, dilation: int, key_ok: torch.Tensor,
                    padding: bool) -> BlockMask:
    """The band's BlockMask over the regrouped sequence; `key_ok` `(B, padded)` says which slots are
    real, unpadded keys. Without padding the block structure is cached; with it, key blocks holding
    padding are demoted from full to partial for that sequence, so the mask_mod sees them."""
    if not padding:
        block_mask = copy.copy(_cached_block_mask(n, radius, dilation, key_ok.device))
    else:
        partial, full = _band_blocks(n, radius, dilation, key_ok.device)
        dirty = ~key_ok.reshape(key_ok.shape[0], 1, -1, BLOCK).all(-1)  # (B, 1, Kb)
        full_b = full & ~dirty
        partial_b = partial | (full & dirty)
        block_mask = BlockMask.from_kv_blocks(*(t[:, None] for t in _ordered(partial_b)),
                                              *(t[:, None] for t in _ordered(full_b)),
                                              BLOCK_SIZE=BLOCK, seq_lengths=(key_ok.shape[1],) * 2)
    block_mask.mask_mod = _band_mask_mod(key_ok, _layout(n, dilation)[0], radius)
    return block_mask


def _global_keys_pass(qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pos: torch.Tensor,
                      valid: torch.Tensor, radius: int, dilation: int, n: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the regrouped queries against the global keys outside their band: returns the
    probabilities `(B, H, padded, G)` and their logsumexp `(B, H, padded)` (at least fp32)."""
    m, padded = _layout(n, dilation)
    batch = torch.arange(k.shape[0], device=k.device)[:, None]
    k_g = k[batch, :, pos].transpose(1, 2)  # (B, H, G, D)
    origin = _original_index(torch.arange(padded, device=k.device), m, dilation)
    offset = origin[None, :, None] - pos[:, None, :]  # (B, padded, G)
    in_band = (offset.abs() <= radius * dilation) & (offset % dilation == 0)
    usable = valid[:, None, :] & ~in_band
    acc = torch.promote_types(qc.dtype, torch.float32)  # softmax in at least fp32
    scores = long_times_small(qc, k_g.transpose(-1, -2)).to(acc) * scale
    scores = scores.masked_fill(~usable[:, None], torch.finfo(acc).min)
    return scores.softmax(-1), scores.logsumexp(-1)


def flex_band_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    radius: int,
    dilation: int,
    not_pad: torch.Tensor | None,
    global_pos: torch.Tensor | None = None,
    global_valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Every row's band + global-key attention, `(B, H, N, D)` in and out.

    `not_pad` `(B, N)`: False hides a key (None: no padding). `global_pos`/`global_valid` `(B, G)` (from
    `vit.attention.global_positions`): the global keys every query sees besides its band. Rows of
    global or padding tokens come out finite but meaningless: the caller overwrites or zeroes them.
    """
    bsz, _, n, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    m, padded = _layout(n, dilation)
    radius = min(radius, max(m - 1, 0))  # a radius past the sequence adds nothing
    padding = not_pad is not None
    qc, kc, vc = (to_classes(t, dilation) for t in (q, k, v))
    if not_pad is None:
        not_pad = torch.ones(bsz, n, dtype=torch.bool, device=q.device)
    key_ok = to_classes(not_pad[:, None, :, None], dilation)[:, 0, :, 0]
    block_mask = band_block_mask(n, radius, dilation, key_ok, padding=padding)
    attend = _flex(q.device)
    has_globals = global_pos is not None and global_pos.shape[1] > 0
    if not has_globals:
        out = attend(qc, kc, vc, block_mask=block_mask, scale=scale)
        return from_classes(out, n, dilation)
    out, aux = attend(qc, kc, vc, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
    probs, lse_global = _global_keys_pass(qc, k, v, pos=global_pos, valid=global_valid, radius=radius,
                                          dilation=dilation, n=n, scale=scale)
    # A row whose band is all padding has lse -inf; a finite floor keeps the merge (and its gradient) NaN-free.
    lse_band = aux.lse.to(lse_global.dtype).clamp(min=torch.finfo(lse_global.dtype).min)
    w = torch.sigmoid(lse_band - lse_global)[..., None]  # (B, H, padded, 1)
    batch = torch.arange(bsz, device=q.device)[:, None]
    v_g = v[batch, :, global_pos].transpose(1, 2)  # (B, H, G, D)
    merged = long_times_small((probs * (1 - w)).to(v.dtype), v_g)
    merged.addcmul_(out, w.to(out.dtype))  # in place: no second N-sized buffer
    return from_classes(merged, n, dilation)
