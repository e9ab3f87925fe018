"""Longformer attention (Beltagy et al. 2020) as a banded, O(N·w) kernel.

Each token attends to `window / 2` neighbours on each side (the paper's w is the
total window, as in Hugging Face's `attention_window`), optionally dilated;
global tokens attend to everything and are attended by everything; padding is
invisible in both directions.

How the band is computed without an N×N matrix:

1. Dilation d splits the sequence into d interleaved subsequences (token i goes
   to subsequence i mod d at position i // d); a dilated window over the
   sequence is a plain window of radius r = w/2 inside each subsequence.
2. Each subsequence is cut into query blocks of c tokens. Block b only needs the
   keys in [b·c - r, b·c + c + r): a contiguous span of c + 2r keys, taken for
   all blocks at once with `unfold` on the padded keys.
3. The global tokens' keys are appended to every block's span, so one softmax
   covers band and global columns together.
4. Every (block, head) pair is then a small dense attention problem with an
   additive mask (band edges, padding, keys that are global and so already
   appended), which `scaled_dot_product_attention` runs with a fused softmax.

Work and memory are O(N·(c + 2r + G)). Rows of global tokens are computed
separately against every key with their own projections (Q_g, K_g, V_g).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vit.flex_longformer import choose_kernel, flex_band_attention
from vit.seqmatmul import long_times_small, small_times_long

__all__ = [
    "sliding_window_attention",
    "check_window",
    "check_dilation",
    "check_dropout",
    "global_positions",
    "find_globals",
    "local_attention",
    "band_attention",
    "global_rows_attention",
    "scatter_rows",
]

# Query blocks shorter than this make too many tiny matmuls; a block of at
# least this size is used even when the window radius is smaller.
_MIN_BLOCK = 32


def check_window(window: int) -> int:
    """Return the one-sided radius w/2 of a total window, or raise on a bad window."""
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0 or window % 2:
        raise ValueError(
            f"window must be a positive even integer (the total window, w/2 tokens each side), got {window!r}"
        )
    return window // 2


def check_dilation(dilation: int) -> int:
    """Return the dilation, or raise if it is not an integer >= 1."""
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be an integer >= 1, got {dilation!r}")
    return dilation


def check_dropout(name: str, p: float) -> float:
    """Return an attention dropout probability, or raise naming `name` unless 0 <= p < 1."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {p!r}")
    return p


def _check_mask(name: str, mask: torch.Tensor | None, batch: int, length: int) -> None:
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = {name.split('_')[0]}), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape (B, N) = {(batch, length)}, got {tuple(mask.shape)}")


def global_positions(global_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the global tokens of each sequence, left-aligned.

    Returns `(pos, valid)`, both `(B, G)` with G the largest count in the batch:
    `pos[b, g]` is the g-th global position of sequence b (in order) and
    `valid[b, g]` says whether that slot is real or filler for shorter rows (filler slots
    hold other positions of that row, so all of a row's positions are distinct).
    """
    counts = global_mask.sum(dim=1)
    num = int(counts.max()) if global_mask.numel() else 0
    # A stable sort on "not global" moves global positions to the front in order.
    order = torch.argsort((~global_mask).to(torch.int8), dim=1, stable=True)
    pos = order[:, :num]
    valid = torch.arange(num, device=global_mask.device)[None, :] < counts[:, None]
    return pos, valid


def find_globals(global_mask: torch.Tensor | None, not_pad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """`(is_global, pos, valid)` for the tokens global and not padding (see `global_positions`),
    or three Nones when there are none. Costs one device sync (the count)."""
    if global_mask is None:
        return None, None, None
    is_global = global_mask & not_pad
    pos, valid = global_positions(is_global)
    return (None, None, None) if pos.shape[1] == 0 else (is_global, pos, valid)


def _mask_value(dtype: torch.dtype) -> float:
    # A finite "minus infinity": a row with every key masked then gets a uniform
    # (later discarded) distribution instead of NaN, in forward and backward.
    return torch.finfo(dtype).min


def _block_size(radius: int, length: int) -> int:
    return max(1, min(max(radius, _MIN_BLOCK), length))


def _key_spans(k: torch.Tensor, v: torch.Tensor, key_ok: torch.Tensor, *, r: int, c: int, d: int, nb: int,
               total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query block's keys and values `(B, d, nb, H, span, D)` and which it may use `(B, d, nb, c, span)`.

    Pads r positions (per subsequence) on both sides, then takes each block's span of c + 2r keys.
    """
    bsz, n, heads, dim = k.shape
    span = c + 2 * r

    def spans(x: torch.Tensor) -> torch.Tensor:  # (B, nb, d, H, D, span) -> (B, d, nb, H, span, D)
        x = F.pad(x, (0, 0, 0, 0, r * d, total - n + r * d)).view(bsz, nb * c + 2 * r, d, heads, dim)
        return x.unfold(1, span, c).permute(0, 2, 1, 3, 5, 4)

    ok = F.pad(key_ok, (r * d, total - n + r * d), value=False).view(bsz, nb * c + 2 * r, d)
    ok = ok.unfold(1, span, c).permute(0, 2, 1, 3)  # (B, d, nb, span)
    offset = torch.arange(span, device=k.device)[None, :] - r - torch.arange(c, device=k.device)[:, None]
    return spans(k), spans(v), (offset.abs() <= r) & ok[:, :, :, None, :]


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    radius: int,
    dilation: int,
    key_ok: torch.Tensor,
    global_k: torch.Tensor | None = None,
    global_v: torch.Tensor | None = None,
    global_ok: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Sliding-window attention of every row, plus columns for appended global keys.

    Sequence-major layout: q, k, v are `(B, N, H, D)`; `key_ok` `(B, N)` says
    which keys the band may use (not padding, not global). `global_k/global_v`
    `(B, G, H, D)` are extra keys every query sees, `global_ok` `(B, G)` marks
    the real ones. Returns `(B, N, H, D)`; rows of padding are not zeroed here.
    """
    bsz, n, heads, dim = q.shape
    if q.numel() == 0:  # nothing to attend (N = 0 or B = 0)
        return q.new_zeros(q.shape)
    d = dilation
    m = -(-n // d)  # length of each interleaved subsequence
    r = min(radius, max(m - 1, 0))  # a radius past the sequence adds nothing
    c = _block_size(r, m)
    nb = -(-m // c)
    total = nb * c * d

    # Queries: (B, nb, c, d, H, D) -> (B·d·nb, H, c, D).
    qs = F.pad(q, (0, 0, 0, 0, 0, total - n)).view(bsz, nb, c, d, heads, dim)
    qs = qs.permute(0, 3, 1, 4, 2, 5).reshape(bsz * d * nb, heads, c, dim)
    ks, vs, allowed = _key_spans(k, v, key_ok, r=r, c=c, d=d, nb=nb, total=total)

    num_global = 0 if global_k is None else global_k.shape[1]
    if num_global:
        expand = (bsz, d, nb, heads, num_global, dim)
        ks = torch.cat([ks, global_k.permute(0, 2, 1, 3)[:, None, None].expand(expand)], dim=4)
        vs = torch.cat([vs, global_v.permute(0, 2, 1, 3)[:, None, None].expand(expand)], dim=4)
        g_ok = global_ok[:, None, None, None, :].expand(bsz, d, nb, c, num_global)
        allowed = torch.cat([allowed, g_ok], dim=4)
    keys = allowed.shape[-1]
    ks = ks.reshape(bsz * d * nb, heads, keys, dim)
    vs = vs.reshape(bsz * d * nb, heads, keys, dim)
    bias = torch.full(allowed.shape, _mask_value(q.dtype), dtype=q.dtype, device=q.device).masked_fill_(allowed, 0.0)
    bias = bias.view(bsz * d * nb, 1, c, keys)

    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    # (B, d, nb, H, c, D) -> (B, nb, c, d, H, D): back to sequence order.
    out = out.view(bsz, d, nb, heads, c, dim).permute(0, 2, 4, 1, 3, 5).reshape(bsz, total, heads, dim)
    return out[:, :n]


def global_rows_attention(
    q_g: torch.Tensor,
    k_g: torch.Tensor,
    v_g: torch.Tensor,
    *,
    key_ok: torch.Tensor,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention of a few global query rows over every key.

    q_g `(B, G, H, D)`, k_g/v_g `(B, N, H, D)`, key_ok `(B, N)` (False = padding).
    Returns the output `(B, G, H, D)` and the probabilities `(B, H, G, N)` (before
    dropout), which are small since G is.
    """
    scale = q_g.shape[-1] ** -0.5 if scale is None else scale
    # Softmax in at least fp32; these rows are few, so this is cheap.
    acc = torch.promote_types(q_g.dtype, torch.float32)
    # Both products reduce over N (forward or backward): `vit.seqmatmul` splits them along N.
    scores = long_times_small(k_g.transpose(1, 2), q_g.permute(0, 2, 3, 1)).transpose(-1, -2)
    scores = scores.to(acc) * scale
    scores = scores.masked_fill(~key_ok[:, None, None, :], _mask_value(acc))
    probs = scores.softmax(dim=-1)
    dropped = F.dropout(probs, p=dropout_p, training=training).to(v_g.dtype)
    out = small_times_long(dropped, v_g.transpose(1, 2)).transpose(1, 2)
    return out, probs


def scatter_rows(out: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Write `rows[b, g]` over `out[b, pos[b, g]]` where `valid[b, g]` (out-of-place).

    Slots that are not valid write back what is there: `global_positions` gives each sequence
    distinct positions, so no write collides, and no device sync is needed to drop them."""
    batch = torch.arange(out.shape[0], device=out.device)[:, None]
    keep = valid.reshape(*valid.shape, *(1,) * (rows.dim() - 2))
    return out.index_put((batch.expand_as(pos), pos), torch.where(keep, rows.to(out.dtype), out[batch, pos]))


def band_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    radius: int,
    dilation: int,
    padding_mask: torch.Tensor | None,
    is_global: torch.Tensor | None,
    global_pos: torch.Tensor | None,
    global_valid: torch.Tensor | None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Every row's band plus the global keys, `(B, N, H, D)` in and out, on the kernel that
    `choose_kernel` picks. `padding_mask` (B, N) is True at padding (None: no padding); `is_global`
    (B, N) and `global_pos`/`global_valid` (from `global_positions`) are None when no token is
    global. Rows of global and padding tokens are not final."""
    not_pad = None if padding_mask is None else ~padding_mask
    if choose_kernel(kernel, q.device, dropout_p) == "flex":
        out = flex_band_attention(*(t.transpose(1, 2) for t in (q, k, v)), radius=radius, dilation=dilation,
                                  not_pad=not_pad, global_pos=global_pos, global_valid=global_valid, scale=scale)
        return out.transpose(1, 2)
    if not_pad is None:
        not_pad = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
    if is_global is None:
        return local_attention(q, k, v, radius=radius, dilation=dilation, key_ok=not_pad, dropout_p=dropout_p,
                               scale=scale)
    # The banded kernel appends the global keys to every block, so the band itself skips them.
    batch = torch.arange(q.shape[0], device=q.device)[:, None]
    return local_attention(q, k, v, radius=radius, dilation=dilation, key_ok=not_pad & ~is_global,
                           global_k=k[batch, global_pos], global_v=v[batch, global_pos], global_ok=global_valid,
                           dropout_p=dropout_p, scale=scale)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, global_mask: torch.Tensor | None,
                  global_qkv: tuple[torch.Tensor, ...] | None, padding_mask: torch.Tensor | None) -> None:
    """One-line ValueErrors for shapes `sliding_window_attention` cannot use."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k and v must share one shape (B, heads, N, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    bsz, _, n, _ = q.shape
    _check_mask("global_mask", global_mask, bsz, n)
    _check_mask("padding_mask", padding_mask, bsz, n)
    if global_qkv is not None and global_mask is None:
        raise ValueError("global_qkv was given without global_mask: it is only read at the rows global_mask marks")
    if global_qkv is not None:
        if len(global_qkv) != 3 or any(t.shape != q.shape for t in global_qkv):
            raise ValueError(
                f"global_qkv must be three tensors shaped like q {tuple(q.shape)}, got "
                f"{[tuple(t.shape) for t in global_qkv]}"
            )


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    dilation: int = 1,
    global_mask: torch.Tensor | None = None,
    global_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Longformer attention on `(B, heads, N, head_dim)` tensors, in O(N·window).

    - Token i attends to i + dilation·j for j in [-window/2, window/2].
    - `global_mask` (B, N), True = global: that token attends to every token and
      every token attends to it. Its row uses `global_qkv = (q_g, k_g, v_g)`
      (each `(B, heads, N, head_dim)`; only q_g's global rows are read) if given,
      else q, k, v. Other rows see a global token through its ordinary k and v.
    - `padding_mask` (B, N), True = padding: it attends to nothing (its output is
      zero) and nothing attends to it. Padding wins over global.
    - `dropout_p` is applied to the attention probabilities (pass 0 in eval).
    Scores are scaled by `scale` (default 1/sqrt(head_dim)).
    - `kernel`: "banded" (this module's blocks), "flex" (`vit.flex_longformer`, block-sparse
      FlexAttention; no dropout) or "auto" (flex on CUDA without dropout, else banded).
    """
    radius = check_window(window)
    dilation = check_dilation(dilation)
    check_dropout("dropout_p", dropout_p)
    _check_inputs(q, k, v, global_mask, global_qkv, padding_mask)
    bsz, _, n, _ = q.shape

    # Work sequence-major, (B, N, H, D): blocks then need no transposes of their own.
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    not_pad = torch.ones(bsz, n, dtype=torch.bool, device=q.device) if padding_mask is None else ~padding_mask
    is_global, pos, valid = find_globals(global_mask, not_pad)
    out = band_attention(qs, ks, vs, radius=radius, dilation=dilation, padding_mask=padding_mask, is_global=is_global,
                         global_pos=pos, global_valid=valid, dropout_p=dropout_p, scale=scale, kernel=kernel)
    if is_global is not None:
        batch = torch.arange(bsz, device=q.device)[:, None]
        gq, gk, gv = (qs, ks, vs) if global_qkv is None else (t.transpose(1, 2) for t in global_qkv)
        rows, _ = global_rows_attention(gq[batch, pos], gk, gv, key_ok=not_pad, dropout_p=dropout_p,
                                        training=dropout_p > 0, scale=scale)
        out = scatter_rows(out, rows, pos, valid)
    if padding_mask is not None:
        out = out * not_pad[:, :, None, None].to(out.dtype)
    return out.transpose(1, 2)
