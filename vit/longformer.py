"""Longformer encoder: pre-LN layers of sliding-window + global attention and an MLP.

`LongformerSelfAttention` keeps Hugging Face's parameter names (`query`, `key`,
`value`, `query_global`, `key_global`, `value_global`), so weights load across.
The global projections start as copies of the local ones, as in the paper.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vit.attention import (
    band_attention,
    check_dilation,
    check_dropout,
    check_window,
    find_globals,
    global_rows_attention,
    scatter_rows,
)
from vit.flex_longformer import check_kernel
from vit.seqmatmul import long_times_small, small_times_long

__all__ = ["LongformerConfig", "LongformerSelfAttention", "LongformerLayer", "LongformerEncoder"]


def _per_layer(name: str, value: int | list[int] | tuple[int, ...], depth: int) -> list[int]:
    # A string or float is refused here, not split into characters or failing in list().
    values = [value] * depth if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if values is None or len(values) != depth:
        raise ValueError(f"{name} must be one int or a list of {depth} (one per layer), got {value!r}")
    return values


@dataclass
class LongformerConfig:
    """Shape of a Longformer encoder. `window`/`dilation`: one value or one per layer."""

    hidden_size: int = 768
    num_heads: int = 12
    depth: int = 3
    ffn_size: int = 3072
    window: int | list[int] = 32
    dilation: int | list[int] = 1
    attn_dropout: float = 0.1
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6
    init_std: float = 0.02
    kernel: str = "auto"
    windows: list[int] = field(init=False, repr=False)
    dilations: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.num_heads < 1 or self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a positive multiple of num_heads {self.num_heads}"
            )
        if self.ffn_size < 1:
            raise ValueError(f"ffn_size must be positive, got {self.ffn_size}")
        for name in ("attn_dropout", "dropout"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate!r}")
        self.windows = _per_layer("window", self.window, self.depth)
        self.dilations = _per_layer("dilation", self.dilation, self.depth)
        for w in self.windows:
            check_window(w)
        for d in self.dilations:
            check_dilation(d)
        check_kernel(self.kernel)


class LongformerSelfAttention(nn.Module):
    """Q/K/V projections + Longformer attention, `(B, N, C) -> (B, N, C)` (no output projection).

    Global rows use `query_global`, `key_global`, `value_global`. When the
    global tokens are few (G·heads < C), K_g and V_g are never formed over the
    whole sequence: q_g·K_gᵀ = (q_g·W_k)·Xᵀ + q_g·b_k and P·V_g = (P·X)·W_vᵀ + b_v·ΣP,
    which is exact and costs O(G·N·C) instead of O(N·C²). `fold_global_kv`
    forces that choice (True/False) instead of deciding by size (None).

    `kernel` picks the band's kernel (see `vit.attention.sliding_window_attention`): "auto" runs
    block-sparse FlexAttention on CUDA when attention dropout is off (eval, or `attn_dropout=0`).
    """

    def __init__(self, hidden_size: int, num_heads: int, window: int, dilation: int = 1,
                 attn_dropout: float = 0.0, fold_global_kv: bool | None = None, kernel: str = "auto") -> None:
        super().__init__()
        if num_heads < 1 or hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} must be a positive multiple of num_heads {num_heads}")
        self.radius = check_window(window)
        self.window = window
        self.dilation = check_dilation(dilation)
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.attn_dropout = check_dropout("attn_dropout", attn_dropout)
        self.fold_global_kv = fold_global_kv
        self.kernel = check_kernel(kernel)
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.query_global = nn.Linear(hidden_size, hidden_size)
        self.key_global = nn.Linear(hidden_size, hidden_size)
        self.value_global = nn.Linear(hidden_size, hidden_size)
        self.copy_local_to_global()

    @torch.no_grad()
    def copy_local_to_global(self) -> None:
        """Initialise the global projections from the local ones (the paper's recipe)."""
        for local, glob in ((self.query, self.query_global), (self.key, self.key_global),
                            (self.value, self.value_global)):
            glob.weight.copy_(local.weight)
            glob.bias.copy_(local.bias)

    def forward(
        self,
        x: torch.Tensor,
        global_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        return_global_attention: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """x `(B, N, C)`; masks `(B, N)` bool. With `return_global_attention`, also the
        probabilities of the global rows, `(B, heads, G, N)` with G = most global
        tokens in a sequence, in position order (None when there are none)."""
        if x.dim() != 3 or x.shape[-1] != self.query.in_features:
            raise ValueError(f"expected tokens (B, N, {self.query.in_features}), got {tuple(x.shape)}")
        bsz, n, width = x.shape
        for name, mask in (("global_mask", global_mask), ("padding_mask", padding_mask)):
            if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (bsz, n)):
                raise ValueError(f"{name} must be a bool tensor of shape {(bsz, n)}, got "
                                 f"{mask.dtype} {tuple(mask.shape)}")
        heads, dim = self.num_heads, self.head_dim
        # One matmul for the three local projections.
        weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
        bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
        q, k, v = F.linear(x, weight, bias).view(bsz, n, 3, heads, dim).unbind(dim=2)
        p = self.attn_dropout if self.training else 0.0

        not_pad = torch.ones(bsz, n, dtype=torch.bool, device=x.device) if padding_mask is None else ~padding_mask
        is_global, pos, valid = find_globals(global_mask, not_pad)
        probs = None
        out = band_attention(q, k, v, radius=self.radius, dilation=self.dilation, padding_mask=padding_mask,
                             is_global=is_global, global_pos=pos, global_valid=valid, dropout_p=p,
                             kernel=self.kernel)
        if is_global is not None:
            batch = torch.arange(bsz, device=x.device)[:, None]
            q_g = self.query_global(x[batch, pos]).view(bsz, -1, heads, dim)
            fold = q_g.shape[1] * heads < width if self.fold_global_kv is None else self.fold_global_kv
            if fold:
                rows, probs = self._global_rows_folded(q_g, x, not_pad)
            else:
                k_g = self.key_global(x).view(bsz, n, heads, dim)
                v_g = self.value_global(x).view(bsz, n, heads, dim)
                rows, probs = global_rows_attention(q_g, k_g, v_g, key_ok=not_pad, dropout_p=p,
                                                    training=self.training)
            out = scatter_rows(out, rows, pos, valid)
        if padding_mask is not None:
            out = out * not_pad[:, :, None, None].to(out.dtype)
        out = out.reshape(bsz, n, width)
        return (out, probs) if return_global_attention else out

    def _global_rows_folded(self, q_g: torch.Tensor, x: torch.Tensor,
                            key_ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads, dim, width = self.num_heads, self.head_dim, x.shape[-1]
        w_k = self.key_global.weight.view(heads, dim, width)
        w_v = self.value_global.weight.view(heads, dim, width)
        bsz, num_global = q_g.shape[:2]
        acc = torch.promote_types(x.dtype, torch.float32)
        q_k = torch.einsum("bghd,hdc->bhgc", q_g, w_k).reshape(bsz, heads * num_global, width)
        q_b = torch.einsum("bghd,hd->bhg", q_g, self.key_global.bias.view(heads, dim))
        # (B, H·G, C) @ (B, C, N) and (B, H·G, N) @ (B, N, C), split along N (`vit.seqmatmul`);
        # x is never copied per head.
        scores = long_times_small(x, q_k.transpose(1, 2)).transpose(1, 2).view(bsz, heads, num_global, -1)
        scores = (scores.to(acc) + q_b[..., None].to(acc)) * dim**-0.5
        scores = scores.masked_fill(~key_ok[:, None, None, :], torch.finfo(acc).min)
        probs = scores.softmax(dim=-1)
        dropped = F.dropout(probs, p=self.attn_dropout, training=self.training)
        p_x = small_times_long(dropped.to(x.dtype).view(bsz, heads * num_global, -1), x)
        rows = torch.einsum("bhgc,hdc->bghd", p_x.view(bsz, heads, num_global, width), w_v)
        rows = rows + dropped.sum(-1).transpose(1, 2)[..., None].to(x.dtype) * self.value_global.bias.view(heads, dim)
        return rows, probs


class LongformerLayer(nn.Module):
    """Pre-LN block: x + proj(attn(LN(x))), then x + MLP(LN(x))."""

    def __init__(self, config: LongformerConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.attn = LongformerSelfAttention(c.hidden_size, c.num_heads, c.windows[layer], c.dilations[layer],
                                            c.attn_dropout, kernel=c.kernel)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(c.hidden_size, c.ffn_size), nn.GELU(), nn.Dropout(c.dropout),
            nn.Linear(c.ffn_size, c.hidden_size),
        )
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, global_mask: torch.Tensor | None = None,
                padding_mask: torch.Tensor | None = None,
                return_global_attention: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        a, probs = self.attn(self.norm1(x), global_mask, padding_mask, return_global_attention=True)
        x = x + self.drop(self.proj(a))
        x = x + self.drop(self.mlp(self.norm2(x)))
        return (x, probs) if return_global_attention else x


class LongformerEncoder(nn.Module):
    """A stack of `LongformerLayer`s and a final LayerNorm over `(B, N, C)` tokens."""

    def __init__(self, config: LongformerConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(LongformerLayer(config, i) for i in range(config.depth))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.apply(self._init_weights)
        for layer in self.layers:
            layer.attn.copy_local_to_global()

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=self.config.init_std)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, global_mask: torch.Tensor | None = None,
                padding_mask: torch.Tensor | None = None,
                return_global_attention: bool = False) -> torch.Tensor | tuple[torch.Tensor, list]:
        """x `(B, N, hidden)` -> `(B, N, hidden)`. With `return_global_attention`, also a
        list (one per layer) of global-row probabilities `(B, heads, G, N)` or None."""
        if x.dim() != 3 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"expected tokens (B, N, {self.config.hidden_size}), got {tuple(x.shape)}")
        maps = []
        for layer in self.layers:
            x, probs = layer(x, global_mask, padding_mask, return_global_attention=True)
            maps.append(probs)
        x = self.norm(x)
        return (x, maps) if return_global_attention else x
