"""Video Transformer Network (Neimark et al. 2021): a 2-D backbone per frame, a Longformer across time.

A video `(B, T, C, H, W)` is run through the spatial backbone as `(B·T, C, H, W)`;
each frame's pooled feature becomes one temporal token, a [CLS] token with
global attention is prepended, a Longformer encoder mixes the tokens, and the
[CLS] output goes to an MLP head (LN → Linear → GELU → Dropout → Linear).

Three ways to run a long video, all giving the same logits for the same frames:
end to end (`forward`), the backbone over chunks of frames (`forward(...,
chunk_size=k)`), or per-frame features computed beforehand
(`frame_features`, then `forward_features_from_frames`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from vit.config import positive_int
from vit.longformer import LongformerConfig, LongformerEncoder
from vit.registry import create_model, register_model
from vit.weights import register_arch

TEMPORAL_POS_EMBEDS = ("learned", "sincos", "none")

__all__ = ["TEMPORAL_POS_EMBEDS", "VTN", "VTNConfig", "VTN_PRESETS", "create_vtn", "multiview_clip_indices",
           "sample_frame_indices", "sincos_1d"]


@dataclass
class VTNConfig:
    """Everything that defines a VTN. `hidden_size`/`ffn_size` default to the backbone's
    `num_features` and 4× that (768/3072 for ViT-B)."""

    backbone: str = "ViT-B/16"
    backbone_overrides: dict[str, Any] = field(default_factory=dict)
    freeze_backbone: bool = False
    num_classes: int = 400
    num_frames: int = 16  # frames per clip (training clips and multi-view clips)
    window: int | list[int] = 32
    dilation: int | list[int] = 1
    depth: int = 3
    num_heads: int = 12
    hidden_size: int | None = None
    ffn_size: int | None = None
    temporal_pos_embed: str = "learned"
    max_frames: int = 1024  # size of the learned table: frame indices must stay below it
    dropout: float = 0.0
    attn_dropout: float = 0.1
    head_hidden: int | None = None  # width of the MLP head's hidden layer; default hidden_size
    head_dropout: float = 0.5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if not isinstance(self.backbone, str) or not self.backbone:
            raise ValueError(f"backbone must be a model name such as 'ViT-B/16', got {self.backbone!r}")
        if not isinstance(self.backbone_overrides, dict):
            raise ValueError(f"backbone_overrides must be a dict, got {self.backbone_overrides!r}")
        for name in ("num_classes", "num_frames", "depth", "num_heads", "max_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("hidden_size", "ffn_size", "head_hidden"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None (derived), got {value!r}")
        if self.temporal_pos_embed not in TEMPORAL_POS_EMBEDS:
            raise ValueError(
                f"temporal_pos_embed must be one of {TEMPORAL_POS_EMBEDS}, got {self.temporal_pos_embed!r}"
            )
        for name in ("dropout", "attn_dropout", "head_dropout"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; `VTNConfig(**d)` rebuilds the same config."""
        return dataclasses.asdict(self)


# Name -> VTNConfig fields. The paper's model is ViT-B-VTN; R50's 2048 features need 16 heads.
VTN_PRESETS: dict[str, dict[str, Any]] = {
    "ViT-B-VTN": {"backbone": "ViT-B/16"},
    "ViT-S-VTN": {"backbone": "ViT-S/16"},
    "ViT-Ti-VTN": {"backbone": "ViT-Ti/16"},
    "R50+ViT-B-VTN": {"backbone": "R50+ViT-B/16"},
    "ResNet-50-VTN": {"backbone": "ResNet-50", "num_heads": 16},
}


def create_vtn(name: str, **overrides: Any) -> VTN:
    """Build a preset VTN, e.g. `create_vtn("ViT-B-VTN", num_classes=400)`; any VTNConfig field overrides."""
    if name not in VTN_PRESETS:
        raise ValueError(f"unknown VTN preset {name!r}; known: {', '.join(VTN_PRESETS)}")
    valid = {f.name for f in dataclasses.fields(VTNConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown} for {name}; valid fields: {', '.join(sorted(valid))}")
    return VTN(VTNConfig(**{**VTN_PRESETS[name], **overrides}))


def sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed sine-cosine embeddings of (possibly fractional) positions: `(..., dim)`, dim even."""
    if dim % 2:
        raise ValueError(f"sin-cos position embeddings need an even width, got {dim}")
    exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
    freqs = torch.exp(exponents * -math.log(10000.0))
    angles = positions.to(torch.float32)[..., None] * freqs
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)


def sample_frame_indices(total: int, count: int) -> torch.Tensor:
    """`count` frame indices spread uniformly over a video of `total` frames.

    A video shorter than `count` repeats frames (nearest-neighbour resampling)
    rather than failing.
    """
    if total < 1:
        raise ValueError(f"the video has no frames (got {total})")
    if count < 1:
        raise ValueError(f"the number of frames to sample must be positive, got {count}")
    # Centres of `count` equal segments of the video, so short videos repeat evenly.
    return ((torch.arange(count, dtype=torch.float64) + 0.5) * total / count).floor().long().clamp_(max=total - 1)


def multiview_clip_indices(total: int, clips: int, length: int, stride: int = 1) -> list[torch.Tensor]:
    """The frame indices of `predict_multiview`'s `clips` clips of `length` frames `stride` apart.

    Clips start at evenly spaced points of a `total`-frame video; a video too short
    for one clip gives every clip as the whole video resampled to `length` frames.
    """
    span = (length - 1) * stride + 1
    if total < span:
        return [sample_frame_indices(total, length)] * clips
    return [torch.arange(s, s + span, stride) for s in _crop_offsets(total, span, clips)]


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    # Inference modes always predict without dropout, then restore the caller's mode.
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _crop_offsets(size: int, crop: int, count: int) -> list[int]:
    if count == 1:
        return [(size - crop) // 2]
    return [round(i * (size - crop) / (count - 1)) for i in range(count)]


class VTN(nn.Module):
    """Video classifier: per-frame 2-D backbone, temporal Longformer, [CLS] → MLP head."""

    def __init__(self, config: VTNConfig) -> None:
        super().__init__()
        self.config = c = config
        self.backbone = self._build_backbone(c)
        features = self.backbone.num_features
        hidden = c.hidden_size or features
        if hidden % c.num_heads:
            raise ValueError(
                f"VTN hidden size {hidden} (from backbone {c.backbone!r} unless given) is not divisible by "
                f"num_heads {c.num_heads}; set num_heads or hidden_size"
            )
        if c.temporal_pos_embed == "sincos" and hidden % 2:
            raise ValueError(f"temporal_pos_embed='sincos' needs an even hidden size, got {hidden}")
        self.hidden_size = hidden
        self.encoder_config = LongformerConfig(
            hidden_size=hidden, num_heads=c.num_heads, depth=c.depth, ffn_size=c.ffn_size or 4 * hidden,
            window=c.window, dilation=c.dilation, attn_dropout=c.attn_dropout, dropout=c.dropout,
            init_std=c.init_std,
        )
        # Frame features enter the encoder through a projection only when the widths differ.
        self.frame_proj = nn.Linear(features, hidden) if features != hidden else nn.Identity()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embed = nn.Embedding(c.max_frames, hidden) if c.temporal_pos_embed == "learned" else None
        self.encoder = LongformerEncoder(self.encoder_config)
        head_hidden = c.head_hidden or hidden
        self.head = nn.Sequential(
            nn.LayerNorm(hidden), nn.Linear(hidden, head_hidden), nn.GELU(), nn.Dropout(c.head_dropout),
            nn.Linear(head_hidden, c.num_classes),
        )
        for module in (self.frame_proj, self.head):
            for m in module.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=c.init_std)
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.cls_token, std=c.init_std)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed.weight, std=c.init_std)
        if c.freeze_backbone:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    @staticmethod
    def _build_backbone(c: VTNConfig) -> nn.Module:
        if c.backbone in VTN_PRESETS:
            raise ValueError(f"VTN backbone {c.backbone!r} is a video model, not a 2-D image model")
        try:
            backbone = create_model(c.backbone, **{**c.backbone_overrides, "num_classes": 0})
        except ValueError as e:
            raise ValueError(f"VTN backbone {c.backbone!r}: {e}") from None
        if not hasattr(backbone, "pooled_features") or not isinstance(getattr(backbone, "num_features", None), int):
            raise ValueError(f"VTN backbone {c.backbone!r} is not a 2-D image model with pooled_features/num_features")
        return backbone

    def train(self, mode: bool = True) -> VTN:
        """Like `nn.Module.train`, but a frozen backbone stays in eval mode (BatchNorm statistics too)."""
        super().train(mode)
        if self.config.freeze_backbone:
            self.backbone.eval()
        return self

    # --- the three execution paths ----------------------------------------------------------

    def frame_features(self, video: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        """Per-frame backbone features `(B, T, num_features)` of a video `(B, T, C, H, W)`.

        Frames go through the backbone as one `(B·T, C, H, W)` batch, or `chunk_size`
        frames at a time to bound the backbone's memory.
        """
        if video.dim() != 5:
            raise ValueError(f"expected a video (B, T, C, H, W), got shape {tuple(video.shape)}")
        bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        if chunk_size is not None and bad_chunk:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        bsz, frames = video.shape[:2]
        if frames == 0:
            raise ValueError(f"the video has no frames: got shape {tuple(video.shape)}")
        flat = video.reshape(bsz * frames, *video.shape[2:])
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.config.freeze_backbone):
            if chunk_size is None:
                feats = self.backbone.pooled_features(flat)
            else:
                feats = torch.cat([self.backbone.pooled_features(part) for part in flat.split(chunk_size)])
        return feats.view(bsz, frames, self.backbone.num_features)  # not -1: ambiguous for an empty batch

    def forward_features_from_frames(
        self,
        frame_features: torch.Tensor,
        frame_indices: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        return_attention: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits `(B, num_classes)` from per-frame features `(B, T, num_features)`.

        `frame_indices` `(T,)` or `(B, T)`: each frame's index in the whole video
        (default 0..T-1), which the temporal position embedding encodes.
        `padding_mask` `(B, T)`: True for filler frames of shorter videos.
        With `return_attention`, also the [CLS] token's attention `(B, depth, heads, 1 + T)`
        over [CLS] (column 0) and the frames; each row sums to 1.
        """
        if frame_features.dim() != 3 or frame_features.shape[-1] != self.backbone.num_features:
            raise ValueError(
                f"expected frame features (B, T, {self.backbone.num_features}), got {tuple(frame_features.shape)}"
            )
        bsz, frames = frame_features.shape[:2]
        tokens = self.frame_proj(frame_features)
        tokens = tokens + self._position_embedding(frame_indices, bsz, frames, tokens)
        x = torch.cat([self.cls_token.expand(bsz, -1, -1).to(tokens.dtype), tokens], dim=1)
        global_mask = torch.zeros(bsz, frames + 1, dtype=torch.bool, device=x.device)
        global_mask[:, 0] = True
        if padding_mask is not None:
            if padding_mask.dtype != torch.bool or tuple(padding_mask.shape) != (bsz, frames):
                raise ValueError(f"padding_mask must be a bool tensor of shape {(bsz, frames)}, got "
                                 f"{padding_mask.dtype} {tuple(padding_mask.shape)}")
            padding_mask = torch.cat([padding_mask.new_zeros(bsz, 1), padding_mask], dim=1)
        x, maps = self.encoder(x, global_mask, padding_mask, return_global_attention=True)
        logits = self.head(x[:, 0])
        if not return_attention:
            return logits
        return logits, torch.stack([m[:, :, 0] for m in maps], dim=1)

    def forward(
        self,
        video: torch.Tensor,
        frame_indices: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        return_attention: bool = False,
        chunk_size: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits `(B, num_classes)` of a video `(B, T, C, H, W)`; see `forward_features_from_frames`."""
        return self.forward_features_from_frames(self.frame_features(video, chunk_size), frame_indices,
                                                 padding_mask, return_attention)

    def _position_embedding(self, frame_indices: torch.Tensor | None, bsz: int, frames: int,
                            like: torch.Tensor) -> torch.Tensor:
        if frame_indices is None:
            frame_indices = torch.arange(frames, device=like.device)
        frame_indices = torch.as_tensor(frame_indices, device=like.device)
        if frame_indices.shape not in ((frames,), (bsz, frames)):
            raise ValueError(f"frame_indices must have shape ({frames},) or ({bsz}, {frames}), "
                             f"got {tuple(frame_indices.shape)}")
        kind = self.config.temporal_pos_embed
        if kind == "none":
            return like.new_zeros(())
        if frame_indices.dtype.is_floating_point or frame_indices.dtype == torch.bool:
            raise ValueError(f"frame_indices must be integers, got dtype {frame_indices.dtype}")
        if frame_indices.numel() and (
            int(frame_indices.min()) < 0
            or (kind == "learned" and int(frame_indices.max()) >= self.config.max_frames)
        ):
            raise ValueError(
                f"frame_indices must lie in [0, max_frames={self.config.max_frames}) for the learned temporal "
                f"embedding, got [{int(frame_indices.min())}, {int(frame_indices.max())}]"
            )
        if kind == "learned":
            return self.pos_embed(frame_indices).to(like.dtype)
        return sincos_1d(frame_indices, self.hidden_size).to(like.dtype)

    # --- inference modes ---------------------------------------------------------------------

    @torch.no_grad()
    def predict_full_video(self, video: torch.Tensor, num_frames: int = 250,
                           chunk_size: int | None = None) -> torch.Tensor:
        """Class probabilities `(B, num_classes)` from `num_frames` frames spread over the whole video.

        `video` is `(B, T, C, H, W)` (or `(T, C, H, W)`); a video with fewer than
        `num_frames` frames is resampled with repetition. Each frame keeps its index
        in the video for the position embedding.
        """
        video = self._batched(video)
        idx = sample_frame_indices(video.shape[1], num_frames).to(video.device)
        with _eval_mode(self):
            logits = self(video[:, idx], frame_indices=idx, chunk_size=chunk_size)
        return logits.float().softmax(dim=-1)

    @torch.no_grad()
    def predict_multiview(self, video: torch.Tensor, clips: int = 10, crops: int = 3,
                          clip_frames: int | None = None, frame_stride: int = 1, crop_size: int | None = None,
                          chunk_size: int | None = None) -> torch.Tensor:
        """Class probabilities `(B, num_classes)`: softmax averaged over `clips × crops` views.

        Clips of `clip_frames` (None: `num_frames`) frames, `frame_stride` apart, start at
        evenly spaced points of the video (a short video repeats frames); crops of
        `crop_size` (None: the shorter side) are spread along the longer side.
        """
        video = self._batched(video)
        for name, value in (("clips", clips), ("crops", crops), ("frame_stride", frame_stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("clip_frames", clip_frames), ("crop_size", crop_size)):
            if value is not None:  # None is the default; 0 is refused, not read as one
                positive_int(name, value)
        bsz, total, _, height, width = video.shape
        length = self.config.num_frames if clip_frames is None else clip_frames
        crop = min(height, width) if crop_size is None else crop_size
        if crop > min(height, width):
            raise ValueError(f"crop_size {crop} is larger than the frames ({height}x{width})")
        clip_idx = multiview_clip_indices(total, clips, length, frame_stride)
        tall = height >= width
        offsets = _crop_offsets(height if tall else width, crop, crops)
        across = (width if tall else height) - crop
        views, indices = [], []
        for idx in clip_idx:
            idx = idx.to(video.device)
            clip = video[:, idx]
            for off in offsets:
                top, left = (off, across // 2) if tall else (across // 2, off)
                views.append(clip[..., top:top + crop, left:left + crop])
                indices.append(idx.expand(bsz, -1))
        # All views in one batch: (views·B, T, C, crop, crop).
        with _eval_mode(self):
            logits = self(torch.cat(views), frame_indices=torch.cat(indices), chunk_size=chunk_size)
        return logits.float().softmax(dim=-1).view(len(views), bsz, -1).mean(dim=0)

    @staticmethod
    def _batched(video: torch.Tensor) -> torch.Tensor:
        if video.dim() == 4:
            video = video[None]
        if video.dim() != 5:
            raise ValueError(f"expected a video (T, C, H, W) or (B, T, C, H, W), got shape {tuple(video.shape)}")
        return video


def _register() -> None:
    """Make the presets available to `vit.create_model` and VTNs to `vit.save_checkpoint`."""
    register_arch("vtn", VTNConfig, VTN)
    for name in VTN_PRESETS:
        register_model(name, functools.partial(create_vtn, name))


_register()
