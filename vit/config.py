"""Typed model configs and the paper's named presets.

`ViTConfig` describes one Vision Transformer (plain or hybrid); `preset_config`
turns a name such as "ViT-B/16", "ViT-S/8" or "R50+ViT-B/16" plus keyword
overrides into a validated config. Nothing here builds modules.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass
from typing import Any

POOLS = ("token", "gap")
POS_EMBEDS = ("learned", "learned_2d", "sincos", "none")
ATTN_IMPLS = ("auto", "sdpa", "matmul")

# Width, depth, MLP width, heads: ViT paper Table 1 (B, L, H), DeiT (Ti, S),
# and big_vision's extra sizes (M, g, G).
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "M": (512, 12, 2048, 8),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "H": (1280, 32, 5120, 16),
    "g": (1408, 40, 6144, 16),
    "G": (1664, 48, 8192, 16),
}

# The names `list_models` advertises; any "ViT-<size>/<patch>" also decodes.
PRESET_NAMES: tuple[str, ...] = (
    "ViT-Ti/16",
    "ViT-S/16",
    "ViT-B/16",
    "ViT-B/32",
    "ViT-L/16",
    "ViT-L/32",
    "ViT-H/14",
    "R50+ViT-B/16",
)

_NAME_RE = re.compile(r"^(?P<hybrid>R50\+)?ViT-(?P<variant>[A-Za-z]+/\d+)$")


def positive_int(name: str, value: Any) -> None:
    """Raise `ValueError` naming `name` unless `value` is an int above zero (a bool is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _rate(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


@dataclass
class ResNetStemConfig:
    """BiT-style ResNetV2 stem of a hybrid ViT (paper §3.1).

    Each stage after the first halves the resolution, so the stem's stride is
    `4 * 2**(len(layers) - 1)`: (3, 4, 9) gives R50's first three stages with the
    third stretched to 9 blocks, stride 16 and 1024 output channels.
    """

    layers: tuple[int, ...] = (3, 4, 9)
    width: int = 64

    def __post_init__(self) -> None:
        self.layers = tuple(self.layers)
        if not self.layers:
            raise ValueError("hybrid.layers must name at least one stage, got ()")
        for n in self.layers:
            positive_int("hybrid.layers entries", n)
        positive_int("hybrid.width", self.width)

    @property
    def stride(self) -> int:
        return 4 * 2 ** (len(self.layers) - 1)

    @property
    def out_channels(self) -> int:
        return self.width * 4 * 2 ** (len(self.layers) - 1)


@dataclass
class ViTConfig:
    """Everything that defines a Vision Transformer; validated on construction.

    For a hybrid (`hybrid` set), `patch_size` is measured on the stem's feature map
    (1 for R50+ViT-B/16); `pixel_patch_size` is the size in input pixels.
    """

    image_size: int | tuple[int, int] = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    pool: str = "token"
    class_token: bool | None = None  # None: a class token exactly when pool == "token"
    pos_embed: str = "learned"
    representation_size: int | None = None  # tanh pre-logits layer width; None = none
    dropout: float = 0.0
    attn_dropout: float = 0.0
    drop_path: float = 0.0
    layer_norm_eps: float = 1e-6  # timm and big_vision; Hugging Face uses 1e-12
    qkv_bias: bool = True
    hybrid: ResNetStemConfig | None = None
    attn_impl: str = "auto"

    def __post_init__(self) -> None:
        # Accept the JSON forms too (lists, nested dicts), so ViTConfig(**json) works.
        if isinstance(self.image_size, (list, tuple)):
            self.image_size = tuple(self.image_size)
            if len(self.image_size) != 2:
                raise ValueError(f"image_size must be an int or (height, width), got {self.image_size!r}")
            for s in self.image_size:
                positive_int("image_size", s)
        else:
            positive_int("image_size", self.image_size)
        if isinstance(self.hybrid, dict):
            self.hybrid = ResNetStemConfig(**self.hybrid)
        elif self.hybrid is not None and not isinstance(self.hybrid, ResNetStemConfig):
            raise ValueError(f"hybrid must be a ResNetStemConfig, a dict or None, got {self.hybrid!r}")
        for name in ("patch_size", "in_channels", "embed_dim", "depth", "num_heads", "mlp_dim"):
            positive_int(name, getattr(self, name))
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0 (0 = no head), got {self.num_classes!r}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.class_token is None:
            self.class_token = self.pool == "token"
        if self.pool == "token" and not self.class_token:
            raise ValueError("pool='token' needs class_token=True")
        if self.pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed must be one of {POS_EMBEDS}, got {self.pos_embed!r}")
        if self.pos_embed == "learned_2d" and self.embed_dim % 2:
            raise ValueError(f"pos_embed='learned_2d' needs an even embed_dim, got {self.embed_dim}")
        if self.pos_embed == "sincos" and self.embed_dim % 4:
            raise ValueError(f"pos_embed='sincos' needs embed_dim divisible by 4, got {self.embed_dim}")
        if self.representation_size is not None:
            positive_int("representation_size", self.representation_size)
        _rate("dropout", self.dropout)
        _rate("attn_dropout", self.attn_dropout)
        _rate("drop_path", self.drop_path)
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        h, w = self.image_hw
        p = self.pixel_patch_size
        if h % p or w % p:
            raise ValueError(f"image_size {h}x{w} is not divisible by the patch size {p} (pixels)")

    @property
    def image_hw(self) -> tuple[int, int]:
        s = self.image_size
        return (s, s) if isinstance(s, int) else s

    @property
    def pixel_patch_size(self) -> int:
        """Side of one token's receptive patch in input pixels."""
        return self.patch_size * (self.hybrid.stride if self.hybrid else 1)

    @property
    def grid(self) -> tuple[int, int]:
        """Token grid (rows, cols) at the configured image size."""
        h, w = self.image_hw
        return h // self.pixel_patch_size, w // self.pixel_patch_size

    @property
    def num_patches(self) -> int:
        gh, gw = self.grid
        return gh * gw

    @property
    def patch_dim(self) -> int:
        """Length of one flattened pixel patch, P*P*C, in the `vit.patches` order."""
        return self.pixel_patch_size**2 * self.in_channels

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; `ViTConfig(**d)` rebuilds the same config."""
        return dataclasses.asdict(self)


def field_names(config_cls: type) -> list[str]:
    """The init fields of a config dataclass, for error messages and overrides."""
    return [f.name for f in dataclasses.fields(config_cls) if f.init]


def decode_variant(variant: str) -> dict[str, int]:
    """Parse a big_vision-style variant: "B/16" -> width, depth, mlp, heads, patch.

    The patch part is optional ("L" gives only the sizes).
    """
    size, _, patch = variant.partition("/")
    if size not in VARIANTS:
        raise ValueError(f"unknown ViT size {size!r} in {variant!r}; known sizes: {', '.join(VARIANTS)}")
    embed_dim, depth, mlp_dim, num_heads = VARIANTS[size]
    out = dict(embed_dim=embed_dim, depth=depth, mlp_dim=mlp_dim, num_heads=num_heads)
    if patch:
        if not patch.isdigit() or int(patch) <= 0:
            raise ValueError(f"patch size in {variant!r} must be a positive integer, got {patch!r}")
        out["patch_size"] = int(patch)
    return out


def is_vit_name(name: str) -> bool:
    """True for "ViT-<size>/<patch>" or "R50+ViT-<size>/<patch>" names with a known size."""
    m = _NAME_RE.match(name)
    return m is not None and m["variant"].partition("/")[0] in VARIANTS


def apply_overrides(config_cls: type, base: dict[str, Any], overrides: dict[str, Any], what: str) -> Any:
    """Build `config_cls(**base, **overrides)`, rejecting unknown override names clearly."""
    valid = field_names(config_cls)
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown} for {what}; valid fields: {', '.join(valid)}")
    return config_cls(**{**base, **overrides})


def preset_config(name: str, **overrides: Any) -> ViTConfig:
    """Config for a named ViT such as "ViT-B/16", "ViT-S/8" or "R50+ViT-B/16".

    Every `ViTConfig` field can be overridden by keyword.
    """
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(
            f"unknown ViT preset {name!r}; expected 'ViT-<size>/<patch>' or 'R50+ViT-<size>/<patch>', "
            f"e.g. {', '.join(PRESET_NAMES)}"
        )
    base: dict[str, Any] = decode_variant(m["variant"])
    if m["hybrid"]:
        stem = ResNetStemConfig()
        if base["patch_size"] % stem.stride:
            raise ValueError(f"{name}: a hybrid's patch size must be a multiple of the stem stride {stem.stride}")
        base["patch_size"] //= stem.stride  # measured on the stem's feature map
        base["hybrid"] = stem
    return apply_overrides(ViTConfig, base, overrides, name)


__all__ = [
    "ATTN_IMPLS",
    "POOLS",
    "POS_EMBEDS",
    "PRESET_NAMES",
    "VARIANTS",
    "ResNetStemConfig",
    "ViTConfig",
    "apply_overrides",
    "decode_variant",
    "field_names",
    "is_vit_name",
    "positive_int",
    "preset_config",
]
