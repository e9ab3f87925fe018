"""Longformer's band on FlexAttention: a block-sparse kernel for the sliding window (the CUDA path).

Computes what `vit.attention.local_attention` computes for every row (band + global keys, padding
hidden), on `(B, heads, N, head_dim)` tensors:

1. Dilation d: query i only meets keys j with i ≡ j (mod d). Regrouping the sequence by residue
   class (token i goes to slot (i mod d)·m + i // d, m = ceil(N / d)) makes each class a plain,
   undilated window of radius r, so the block mask is as sparse as an undilated one.
2. The G global keys, which every query meets besides its band, are laid out by `GLOBAL_KEYS`:
   - "merge" (the default): FlexAttention computes the band alone and returns its logsumexp; every
     query's scores over the G global keys outside its band are a small dense product (N × G), and
     the two parts are merged by their logsumexps, exactly as one softmax over both. The kernel keeps
     the band's simple mask_mod, and the global part is a few memory-bound passes.
   - "prefix": the global keys go in front of the regrouped keys, zero-padded to one block: one extra
     key block per query block, where the mask_mod keeps the global keys outside the query's own band.
     The prefix is repeated, one copy per `GLOBAL_GROUP` query blocks, each group meeting only its
     own copy. A single shared copy measured 5× the band's time at N = 65,536 on an H200; the likely
     cause is the backward's dK/dV pass, which walks each key block's query blocks in one program: all
     N/128 of them for a shared block. The copies' gradients add up through the repeat.
   Which is faster on a GPU is measured by `benchmarks/longformer_attention.py --device cuda`.
3. One `flex_attention` call: the block structure is built once per (N, r, d, prefix, group, device) and
   cached; padding only demotes the key blocks that hold it from full to partial, per call, and
   the mask_mod checks class edges, the radius, padding (and, with a prefix, the global slots).

FlexAttention has no attention dropout: this path is only taken when dropout is off. On CUDA the
kernel is `flex_attention` compiled per variant (`_compiled_flex`), its ints passed as tensors: a
static kernel for each of a variant's first `STATIC_SHAPES` shapes, then one for dynamic shapes, so
new lengths never exhaust dynamo's recompile limit; elsewhere the unfused reference (for tests).
"""

from __future__ import annotations

import copy
import functools
import types

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from vit.seqmatmul import long_times_small

try:  # torch >= 2.9 asks for the logsumexp this way; older releases by return_lse
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - depends on the installed torch
    AuxRequest = None

__all__ = ["BLOCK", "GLOBAL_GROUP", "GLOBAL_KEYS", "KERNELS", "check_kernel", "choose_kernel", "flex_band_attention",
           "band_block_mask", "merge_global_keys", "outside_band", "to_classes", "from_classes"]

BLOCK = 128  # FlexAttention's sparse block: query and key tiles of 128 tokens
# Query blocks that share one copy of the global-key prefix: about as many as meet one band key block
# (window 512: 5), so no key block's backward program walks many more query blocks than another's.
GLOBAL_GROUP = 8
# How the flex kernel meets the global keys: "merge" or "prefix" (see the module's docstring).
GLOBAL_KEYS = "merge"
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


def _call_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: BlockMask | None = None,
               scale: float | None = None, lse: bool = False):
    """`flex_attention`'s output, or (output, logsumexp `(B, H, N)` fp32) when `lse`."""
    if not lse:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    if AuxRequest is None:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_lse=True)
    out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
    return out, aux.lse


# Shapes per kind of call that get a kernel of their own (static shapes: the fastest); later shapes share
# one compiled for dynamic shapes. A training run or a benchmark sees a few; evaluation on varied lengths
# more. Below dynamo's 8 entries per code object, with room for a recompile of another cause.
STATIC_SHAPES = 6
_static_shapes: dict[tuple[bool, ...], set[tuple[int, ...]]] = {}


@functools.cache
def _compiled_flex(variant: tuple[bool, ...] = (), dynamic: bool = False, backend: str = "inductor"):
    """`flex_attention` compiled for one variant of `flex_band_attention`'s calls, for static or dynamic shapes.

    Dynamo keeps its compiled entries, and its limit of 8 (past which it silently runs the unfused
    reference that materialises N×N scores), per code object: each (variant, dynamic) gets its own copy
    of `_call_flex`'s code, so none shares another's budget."""
    name = "_flex_" + "".join("1" if flag else "0" for flag in variant) + ("_dynamic" if dynamic else "")
    fn = types.FunctionType(_call_flex.__code__.replace(co_name=name), _call_flex.__globals__, name)
    fn.__kwdefaults__, fn.__qualname__ = _call_flex.__kwdefaults__, name
    # fullgraph: a graph break would fall back to the unfused N×N reference without a word
    return torch.compile(fn, dynamic=dynamic, backend=backend, fullgraph=True)


def _flex(device: torch.device, variant: tuple[bool, ...], shape: tuple[int, ...], backend: str = "inductor"):
    """The kernel for one call: on CUDA a static one for the first `STATIC_SHAPES` shapes of its variant,
    then the variant's dynamic one; elsewhere the unfused reference (compiling for CPU builds a C++ kernel
    for minutes, and CPU only runs this path in tests)."""
    if device.type != "cuda" and backend == "inductor":
        return _call_flex
    seen = _static_shapes.setdefault(variant, set())
    if shape in seen or len(seen) < STATIC_SHAPES:
        seen.add(shape)
        return _compiled_flex(variant, False, backend)
    return _compiled_flex(variant, True, backend)


def _layout(n: int, dilation: int) -> tuple[int, int]:
    """(m, padded length): each class holds m slots, the whole is padded to whole blocks."""
    m = -(-n // dilation)
    return m, -(-(m * dilation) // BLOCK) * BLOCK


def to_classes(x: torch.Tensor, dilation: int) -> torch.Tensor:
    """`(B, H, N, D)` -> `(B, H, padded, D)`, token i at slot (i mod d)·m + i // d (filler slots zero)."""
    bsz, heads, n, dim = x.shape
    m, padded = _layout(n, dilation)
    if dilation > 1:
        if m * dilation > n:
            x = F.pad(x, (0, 0, 0, m * dilation - n))
        x = x.unflatten(2, (m, dilation)).transpose(2, 3).reshape(bsz, heads, m * dilation, dim)
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


def _copies(query_blocks: int, group: int) -> int:
    """How many copies of the global-key prefix: one per `group` query blocks."""
    return -(-query_blocks // group)


@functools.lru_cache(maxsize=256)
def _ints(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # The mask_mod's ints as one int32 tensor (the index dtype): dynamo lifts a tensor to a graph
    # input instead of guarding on its value. One tensor: several, equal ones shared by this cache,
    # would add guards on which of them alias.
    return torch.tensor(values, dtype=torch.int32, device=device)


def _mask_mod(key_ok: torch.Tensor | None, n: int, radius: int, dilation: int, prefix: int,
              global_pos: torch.Tensor | None, global_ok: torch.Tensor | None, group: int, device: torch.device):
    """Key slots [0, copies·prefix) hold the copies of the global keys (`global_pos`/`global_ok`
    `(B, prefix)`): a query takes those of its group's copy outside its band. Slots past them are the
    regrouped sequence: same class, within the radius, and a usable key (`key_ok` `(B, padded)`; None:
    no padding, so only the layout's filler slots are unusable).

    Besides tensors the closures read only whether there is dilation, padding and a prefix (part of
    `flex_band_attention`'s variant) and `group`, so one compiled kernel serves every length and radius."""
    m, padded = _layout(n, dilation)
    dilated, span = dilation > 1, BLOCK * group
    ints = _ints((n, m, radius, dilation, radius * dilation, prefix, _copies(padded // BLOCK, group) * prefix),
                 device)

    # A gather per score is what made this kernel several times slower than a plain band on an H200:
    # without padding, which slots are real keys is arithmetic (undilated: the first n).
    def band(b, q_idx, j, n_, m_, r_, d_):
        near = (q_idx - j).abs() <= r_
        if dilated:
            near = near & (q_idx // m_ == j // m_)
        if key_ok is not None:
            return near & key_ok[b, j]
        return near & ((j < m_ * d_) & (_original_index(j, m_, d_) < n_) if dilated else j < n_)

    if not prefix:
        return lambda b, h, q_idx, kv_idx: band(b, q_idx, kv_idx, *ints[:4].unbind())

    def mask_mod(b, h, q_idx, kv_idx):
        n_, m_, r_, d_, rd_, prefix_, lead_ = ints.unbind()
        # Both branches are evaluated: clamped indices keep the unused one in bounds.
        g = torch.minimum(kv_idx, lead_ - 1) % prefix_
        own_copy = kv_idx // prefix_ == q_idx // span
        # Undilated, slot = token for every real query (filler rows are discarded).
        token = (q_idx % m_) * d_ + q_idx // m_ if dilated else q_idx
        offset = (token - global_pos[b, g]).abs()
        outside = (offset > rd_) | (offset % d_ != 0) if dilated else offset > rd_
        return torch.where(kv_idx < lead_, own_copy & global_ok[b, g] & outside,
                           band(b, q_idx, torch.clamp(kv_idx - lead_, min=0), n_, m_, r_, d_))

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


def _with_prefix(partial: torch.Tensor, full: torch.Tensor, prefix: int,
                 group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepend the copies of the global-key blocks: each query block's group meets its own copy's
    blocks, as partial blocks (the mask_mod picks the keys)."""
    if not prefix:
        return partial, full
    q_blocks, per_copy = partial.shape[-2], prefix // BLOCK
    copy_of_block = torch.arange(_copies(q_blocks, group) * per_copy, device=partial.device) // per_copy
    lead = copy_of_block[None, :] == (torch.arange(q_blocks, device=partial.device) // group)[:, None]
    lead = lead.expand(*partial.shape[:-1], -1)
    return torch.cat([lead, partial], -1), torch.cat([torch.zeros_like(lead), full], -1)


@functools.lru_cache(maxsize=64)
def _cached_block_mask(n: int, radius: int, dilation: int, prefix: int, group: int, device: torch.device) -> BlockMask:
    partial, full = _with_prefix(*_band_blocks(n, radius, dilation, device), prefix, group)
    return BlockMask.from_kv_blocks(*(t[None, None] for t in _ordered(partial)),
                                    *(t[None, None] for t in _ordered(full)),
                                    BLOCK_SIZE=BLOCK, seq_lengths=(partial.shape[0] * BLOCK, partial.shape[1] * BLOCK))


def band_block_mask(n: int, radius: int, dilation: int, key_ok: torch.Tensor, padding: bool,
                    global_pos: torch.Tensor | None = None, global_ok: torch.Tensor | None = None) -> BlockMask:
    """The BlockMask over [copies of the global keys, regrouped sequence]: `key_ok` `(B, padded)` says
    which regrouped slots are real, unpadded keys; `global_pos`/`global_ok` `(B, prefix)` (a whole
    number of blocks, None: no global keys) which global keys each sequence has; the prefix stands
    once per `GLOBAL_GROUP` query blocks. Without padding the block structure is cached per shape;
    with it, key blocks holding padding are demoted from full to partial for that sequence, so the
    mask_mod sees them."""
    prefix, group = 0 if global_pos is None else global_pos.shape[1], GLOBAL_GROUP
    if not padding:
        block_mask = copy.copy(_cached_block_mask(n, radius, dilation, prefix, group, key_ok.device))
    else:
        partial, full = _band_blocks(n, radius, dilation, key_ok.device)
        dirty = ~key_ok.reshape(key_ok.shape[0], 1, -1, BLOCK).all(-1)  # (B, 1, Kb)
        partial, full = _with_prefix(partial | (full & dirty), full & ~dirty, prefix, group)
        block_mask = BlockMask.from_kv_blocks(*(t[:, None] for t in _ordered(partial)),
                                              *(t[:, None] for t in _ordered(full)), BLOCK_SIZE=BLOCK,
                                              seq_lengths=(key_ok.shape[1], partial.shape[-1] * BLOCK))
    block_mask.mask_mod = _mask_mod(key_ok if padding else None, n, radius, dilation, prefix, global_pos, global_ok,
                                    group, key_ok.device)
    return block_mask


def _global_prefix(x: torch.Tensor, xc: torch.Tensor, pos: torch.Tensor, copies: int) -> torch.Tensor:
    """[`copies` × the global tokens' rows of x `(B, H, N, D)`, zero-padded to whole blocks; xc]."""
    batch = torch.arange(x.shape[0], device=x.device)[:, None]
    rows = x[batch, :, pos].transpose(1, 2)  # (B, H, G, D)
    return torch.cat([F.pad(rows, (0, 0, 0, -pos.shape[1] % BLOCK)).repeat(1, 1, copies, 1), xc], dim=2)


def _prefix_layout(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, global_pos: torch.Tensor,
                   global_valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The "prefix" layout: (keys, values, prefix positions, prefix validity), the prefix padded to a block."""
    copies = _copies(kc.shape[2] // BLOCK, GLOBAL_GROUP)
    kc, vc = (_global_prefix(t, tc, global_pos, copies) for t, tc in ((k, kc), (v, vc)))
    extra = -global_pos.shape[1] % BLOCK
    return kc, vc, F.pad(global_pos, (0, extra)), F.pad(global_valid, (0, extra), value=False)


def outside_band(n: int, radius: int, dilation: int, global_pos: torch.Tensor,
                 global_ok: torch.Tensor) -> torch.Tensor:
    """`(B, N, G)`: whether query i meets global key g besides its band, i.e. g is real and outside
    i's band (inside it, the band already holds that key)."""
    offset = (torch.arange(n, device=global_pos.device)[None, :, None] - global_pos[:, None, :]).abs()
    outside = (offset > radius * dilation) | (offset % dilation != 0)
    return outside & global_ok[:, None, :]


def merge_global_keys(band_out: torch.Tensor, band_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, global_pos: torch.Tensor, meets: torch.Tensor, scale: float) -> torch.Tensor:
    """One softmax over each query's band and the global keys it `meets` `(B, N, G)`, from the band's
    normalised output `(B, H, N, D)` and logsumexp `(B, H, N)` and the global keys' scores.

    Both parts are rescaled to a common maximum `c` (a constant to autograd: the result does not depend
    on it), so rows without any key (padding) come out zero, with finite gradients, never NaN."""
    acc = torch.promote_types(q.dtype, torch.float32)  # the merge in at least fp32
    batch = torch.arange(q.shape[0], device=q.device)[:, None]
    k_g, v_g = (t[batch, :, global_pos].transpose(1, 2) for t in (k, v))  # (B, H, G, D)
    # Both products are long (N) times small (G): `vit.seqmatmul` splits their N-reductions. In bf16 the
    # scores round to bf16 before the fp32 softmax, as in `vit.attention.global_rows_attention`.
    scores = long_times_small(q, k_g.transpose(-1, -2)).to(acc) * scale  # (B, H, N, G)
    scores = scores.masked_fill(~meets[:, None], float("-inf"))
    band_lse = band_lse.to(acc)
    c = torch.maximum(band_lse, scores.amax(-1)).detach()
    c = torch.where(torch.isinf(c), torch.zeros_like(c), c)
    w_band, w_keys = torch.exp(band_lse - c), torch.exp(scores - c[..., None])
    den = w_band + w_keys.sum(-1)
    den = torch.where(den > 0, den, torch.ones_like(den))
    # Weights in fp32, the (N, D)-sized products in the inputs' dtype: no fp32 copy of the output is
    # made or kept for the backward. In place: the product saves its inputs, not its result.
    out = band_out * (w_band / den)[..., None].to(band_out.dtype)
    return out.add_(long_times_small((w_keys / den[..., None]).to(v_g.dtype), v_g))


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
    bsz, _, n, _ = q.shape
    m, padded = _layout(n, dilation)
    radius = min(radius, max(m - 1, 0))  # a radius past the sequence adds nothing
    padding = not_pad is not None
    qc, kc, vc = (to_classes(t, dilation) for t in (q, k, v))
    if not_pad is None:
        not_pad = torch.ones(bsz, n, dtype=torch.bool, device=q.device)
    key_ok = to_classes(not_pad[:, None, :, None], dilation)[:, 0, :, 0]
    layout = None if global_pos is None or global_pos.shape[1] == 0 else GLOBAL_KEYS
    if layout not in (None, "merge", "prefix"):
        raise ValueError(f"GLOBAL_KEYS must be 'merge' or 'prefix', got {layout!r}")
    prefix_pos = prefix_ok = None
    if layout == "prefix":
        kc, vc, prefix_pos, prefix_ok = _prefix_layout(k, v, kc, vc, global_pos, global_valid)
    block_mask = band_block_mask(n, radius, dilation, key_ok, padding, prefix_pos, prefix_ok)
    # The mask_mod's code paths, the kernel's outputs, the sizes dynamo specializes when they are 1 (batch,
    # query blocks), and grad mode (dynamo guards on it: training and evaluation would share one budget).
    variant = (dilation > 1, padding, layout == "prefix", layout == "merge", bsz == 1, padded == BLOCK,
               torch.is_grad_enabled())
    kernel = _flex(q.device, variant, (*qc.shape, kc.shape[2]))
    if layout != "merge":
        return from_classes(kernel(qc, kc, vc, block_mask=block_mask, scale=scale), n, dilation)
    out, lse = kernel(qc, kc, vc, block_mask=block_mask, scale=scale, lse=True)
    out, lse = from_classes(out, n, dilation), from_classes(lse[..., None], n, dilation)[..., 0]
    meets = outside_band(n, radius, dilation, global_pos, global_valid)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return merge_global_keys(out, lse, q, k, v, global_pos, meets, scale)
