"""The Vision Transformer of Dosovitskiy et al. (2021), plain and hybrid.

Parameter names follow timm's `VisionTransformer` (`patch_embed.proj`, `cls_token`,
`pos_embed`, `blocks.{i}.attn.qkv`, ...) so published weights map with little
renaming; the patch projection is a Linear over patches in `vit.patches` order.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from vit.config import ViTConfig
from vit.patches import patchify, unpatchify
from vit.pos_embed import check_grid, resample_1d, resample_pos_embed, sincos_2d
from vit.resnet import ResNetV2Stem, zero_head

# Token counts up to which the plain matmul attention beats SDPA on CPU in
# bf16/fp16 (torch 2.13, Zen4 with avx512_bf16; SDPA/matmul time measured
# alternating in one process). Forward+backward: 2.0x at 197 tokens, 1.5x at
# 577, even at 1025, SDPA ahead at 2049. Forward only: 1.8x at 100, about even
# at 197-257. In fp32, and on GPUs, SDPA wins everywhere.
_CPU_LOWP_MATMUL_MAX_TOKENS_TRAIN = 1024
_CPU_LOWP_MATMUL_MAX_TOKENS_INFER = 256


def pick_attention(device_type: str, dtype: torch.dtype, tokens: int, training: bool) -> str:
    """The faster attention path, "matmul" or "sdpa", for these inputs (the 'auto' rule)."""
    if device_type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    limit = _CPU_LOWP_MATMUL_MAX_TOKENS_TRAIN if training else _CPU_LOWP_MATMUL_MAX_TOKENS_INFER
    return "matmul" if tokens <= limit else "sdpa"


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample while training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        dim = config.embed_dim
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.scale = self.head_dim**-0.5
        self.impl = config.attn_impl
        self.qkv = nn.Linear(dim, 3 * dim, bias=config.qkv_bias)
        self.attn_drop_p = config.attn_dropout
        self.attn_drop = nn.Dropout(config.attn_dropout)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t, d = x.shape
        # Split along the q/k/v axis, then transpose each: backward then stacks the three
        # gradients straight into the qkv layout, with no permuted copy after the stack.
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(2))
        impl = self.impl
        if impl == "auto":
            impl = pick_attention(q.device.type, q.dtype, t, q.requires_grad)
        weights = None
        if need_weights or impl == "matmul":
            attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            if need_weights:
                weights = attn
            x = self.attn_drop(attn) @ v
        else:
            p = self.attn_drop_p if self.training else 0.0
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.scale)
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, t, d)))
        return x, weights


class Mlp(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(config.dropout)
        self.fc2 = nn.Linear(config.mlp_dim, config.embed_dim)
        self.drop2 = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LN encoder block: x + MSA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: ViTConfig, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.mlp = Mlp(config)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, weights = self.attn(self.norm1(x), need_weights)
        x = x + self.drop_path(a)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x, weights


class PatchEmbed(nn.Module):
    """Tokens from images: a Linear over flattened P×P×C patches (of pixels, or of hybrid-stem features)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.backbone = ResNetV2Stem(config.hybrid, config.in_channels) if config.hybrid else None
        channels = config.hybrid.out_channels if config.hybrid else config.in_channels
        self.proj = nn.Linear(config.patch_size**2 * channels, config.embed_dim)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = images if self.backbone is None else self.backbone(images)
        p = self.patch_size
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        return self.proj(patchify(x, p)), grid


class VisionTransformer(nn.Module):
    """ViT classifier over images `(B, C, H, W)` or patch sequences `(B, N, P*P*C)`.

    Inputs are float and already normalised. Another input size than the
    configured one works: learned position embeddings are resampled on the fly.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        dim = c.embed_dim
        self.num_prefix_tokens = 1 if c.class_token else 0
        self.num_features = c.representation_size or dim
        self.patch_embed = PatchEmbed(c)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if c.class_token else None
        gh, gw = c.grid
        if c.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + gh * gw, dim))
        elif c.pos_embed == "learned_2d":
            # Paper's 2-D variant: D/2 channels learned per row, D/2 per column.
            self.pos_embed_row = nn.Parameter(torch.zeros(gh, dim // 2))
            self.pos_embed_col = nn.Parameter(torch.zeros(gw, dim // 2))
        elif c.pos_embed == "sincos":
            self.register_buffer("pos_embed", self._with_prefix(sincos_2d((gh, gw), dim)), persistent=False)
        self.pos_drop = nn.Dropout(c.dropout)
        rates = [c.drop_path * i / max(c.depth - 1, 1) for i in range(c.depth)]
        self.blocks = nn.ModuleList(Block(c, r) for r in rates)
        self.norm = nn.LayerNorm(dim, eps=c.layer_norm_eps)
        self.pre_logits = nn.Linear(dim, c.representation_size) if c.representation_size else None
        self.head = nn.Linear(self.num_features, c.num_classes) if c.num_classes else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for name in ("pos_embed", "pos_embed_row", "pos_embed_col"):
            p = getattr(self, name, None)
            if isinstance(p, nn.Parameter):
                nn.init.trunc_normal_(p, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    # --- position embeddings -------------------------------------------------------------

    def _with_prefix(self, table: torch.Tensor) -> torch.Tensor:
        """(N, D) patch table -> (1, prefix + N, D), prefix rows zero (no class-token position)."""
        if self.num_prefix_tokens:
            table = torch.cat([table.new_zeros(self.num_prefix_tokens, table.shape[1]), table])
        return table.unsqueeze(0)

    def position_embeddings(self, grid: tuple[int, int]) -> torch.Tensor | None:
        """The `(1, prefix + gh*gw, D)` table added to the tokens for a `grid`, or None."""
        kind, base = self.config.pos_embed, self.config.grid
        if kind == "learned":
            if grid == base:
                return self.pos_embed
            return resample_pos_embed(self.pos_embed, grid, self.num_prefix_tokens, old_grid=base)
        if kind == "learned_2d":
            rows = resample_1d(self.pos_embed_row, grid[0])
            cols = resample_1d(self.pos_embed_col, grid[1])
            half = rows.shape[1]
            table = torch.cat(
                [rows[:, None].expand(-1, grid[1], half), cols[None].expand(grid[0], -1, half)], dim=-1
            )
            return self._with_prefix(table.reshape(grid[0] * grid[1], 2 * half))
        if kind == "sincos":
            if grid == base:
                return self.pos_embed
            fixed = self.pos_embed
            return self._with_prefix(sincos_2d(grid, fixed.shape[-1], dtype=fixed.dtype, device=fixed.device))
        return None

    # --- input handling ------------------------------------------------------------------

    def _tokens(
        self, x: torch.Tensor, grid: tuple[int, int] | None
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """Embed images or patch sequences into `(B, N, D)` tokens; checks shapes first."""
        c = self.config
        p = c.pixel_patch_size
        if not torch.is_floating_point(x):
            raise ValueError(f"expected a float tensor (normalised pixels), got dtype {x.dtype}")
        if x.ndim == 4:
            if x.shape[1] != c.in_channels:
                raise ValueError(
                    f"expected images (B, {c.in_channels}, H, W) with {c.in_channels} channels, "
                    f"got shape {tuple(x.shape)}"
                )
            h, w = x.shape[-2:]
            if h % p or w % p:
                raise ValueError(f"expected image sides divisible by the patch size {p}, got {h}x{w}")
            if not h or not w:  # 0 divides evenly but holds no patch
                raise ValueError(f"expected an image of at least one {p}x{p} patch, got {h}x{w}")
            return self.patch_embed(x)
        if x.ndim == 3:
            n, d = x.shape[1:]
            if d != c.patch_dim:
                raise ValueError(
                    f"expected patches of length {c.patch_dim} ({p}*{p}*{c.in_channels}), got {d} "
                    f"in shape {tuple(x.shape)}"
                )
            if grid is None:
                if n != c.num_patches:
                    raise ValueError(
                        f"expected {c.num_patches} patches (a {c.grid[0]}x{c.grid[1]} grid), got {n}; "
                        "pass grid=(rows, cols) for another size"
                    )
                grid = c.grid
            else:
                grid = check_grid("grid", grid)
                if grid[0] * grid[1] != n:
                    raise ValueError(f"grid {grid[0]}x{grid[1]} needs {grid[0] * grid[1]} patches, got {n}")
            if self.patch_embed.backbone is not None:  # the hybrid's stem needs pixels in place
                return self.patch_embed(unpatchify(x, p, grid, c.in_channels))
            return self.patch_embed.proj(x), tuple(grid)
        raise ValueError(
            f"expected images (B, C, H, W) or patch sequences (B, N, P*P*C), got shape {tuple(x.shape)}"
        )

    # --- forward passes ------------------------------------------------------------------

    def _encode(
        self, x: torch.Tensor, grid: tuple[int, int] | None, need_weights: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x, grid = self._tokens(x, grid)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos = self.position_embeddings(grid)
        if pos is not None:
            x = x + pos
        x = self.pos_drop(x)
        attentions = []
        for block in self.blocks:
            x, weights = block(x, need_weights)
            if need_weights:
                attentions.append(weights)
        return self.norm(x), attentions

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, 0] if self.config.pool == "token" else x[:, self.num_prefix_tokens :].mean(dim=1)
        if self.pre_logits is not None:
            x = torch.tanh(self.pre_logits(x))
        return x

    def forward_features(self, x: torch.Tensor, *, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """All tokens after the final LayerNorm, `(B, prefix + N, embed_dim)`."""
        return self._encode(x, grid, False)[0]

    def pooled_features(self, x: torch.Tensor, *, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """The pre-head representation, `(B, num_features)`: pooled, then the tanh layer if any."""
        return self._pool(self.forward_features(x, grid=grid))

    def forward(
        self, x: torch.Tensor, return_attention: bool = False, *, grid: tuple[int, int] | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits `(B, num_classes)`; with `return_attention`, also each layer's `(B, heads, T, T)` weights.

        `grid` gives the token grid of a patch sequence whose length differs from the configured one.
        """
        tokens, attentions = self._encode(x, grid, return_attention)
        logits = self.head(self._pool(tokens))
        return (logits, attentions) if return_attention else logits

    def replace_head(self, num_classes: int) -> None:
        """Swap in a zero-initialised head for `num_classes` (paper §3.2); 0 removes the head."""
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {num_classes!r}")
        self.config = dataclasses.replace(self.config, num_classes=num_classes)
        self.head = zero_head(self.num_features, num_classes, like=self.norm.weight)


__all__ = ["Attention", "Block", "PatchEmbed", "VisionTransformer", "pick_attention"]
