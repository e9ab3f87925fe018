"""ResNets: the BiT-style stem of the hybrid ViT, and a plain ResNet-50 baseline.

`ResNetV2Stem` follows the paper's hybrid (§3.1) and timm's `vit_base_r50_s16_224`:
weight-standardised convolutions, GroupNorm, TF-style "same" padding, and the
stages of R50 with stage 4 dropped and stage 3 stretched to 9 blocks. Parameter
names match timm's `patch_embed.backbone.*` so its weights load by name.

`ResNet` is the torchvision-style (BatchNorm, post-activation) classifier,
written here because torchvision is not a dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vit.config import ResNetStemConfig, positive_int, apply_overrides


def _same_pad(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF "same" padding (left, right) for one spatial dimension."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class StdConv2dSame(nn.Conv2d):
    """Conv2d with weight standardisation (BiT) and TF "same" padding."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, eps: float = 1e-8) -> None:
        super().__init__(cin, cout, kernel, stride=stride, padding=0, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s = self.kernel_size[0], self.stride[0]
        if k > 1 or s > 1:
            (t, b), (l, r) = _same_pad(x.shape[-2], k, s), _same_pad(x.shape[-1], k, s)
            if t or b or l or r:
                x = F.pad(x, (l, r, t, b))
        w = self.weight
        var, mean = torch.var_mean(w, dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) * torch.rsqrt(var + self.eps)
        return F.conv2d(x, w, None, self.stride)


class GroupNormAct(nn.GroupNorm):
    """GroupNorm(32) optionally followed by ReLU (timm's naming: one module, `.weight`/`.bias`)."""

    def __init__(self, channels: int, act: bool = True) -> None:
        super().__init__(min(32, channels), channels, eps=1e-5)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return F.relu(x, inplace=True) if self.act else x


class _Downsample(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv = StdConv2dSame(cin, cout, 1, stride)
        self.norm = GroupNormAct(cout, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class BottleneckV2(nn.Module):
    """Post-activation bottleneck with weight-standardised convs; stride on the 3x3."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * 4
        self.downsample = _Downsample(cin, cout, stride) if stride != 1 or cin != cout else None
        self.conv1 = StdConv2dSame(cin, mid, 1)
        self.norm1 = GroupNormAct(mid)
        self.conv2 = StdConv2dSame(mid, mid, 3, stride)
        self.norm2 = GroupNormAct(mid)
        self.conv3 = StdConv2dSame(mid, cout, 1)
        self.norm3 = GroupNormAct(cout, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.norm1(self.conv1(x))
        x = self.norm2(self.conv2(x))
        x = self.norm3(self.conv3(x))
        return F.relu(x + shortcut, inplace=True)


class _StemIn(nn.Module):
    def __init__(self, cin: int, width: int) -> None:
        super().__init__()
        self.conv = StdConv2dSame(cin, width, 7, 2)
        self.norm = GroupNormAct(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv(x))
        (t, b), (l, r) = _same_pad(x.shape[-2], 3, 2), _same_pad(x.shape[-1], 3, 2)
        x = F.pad(x, (l, r, t, b), value=float("-inf"))
        return F.max_pool2d(x, 3, 2)


class _Stage(nn.Module):
    def __init__(self, cin: int, mid: int, depth: int, stride: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[BottleneckV2(cin if i == 0 else mid * 4, mid, stride if i == 0 else 1) for i in range(depth)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ResNetV2Stem(nn.Module):
    """Feature extractor of the hybrid: `(B, C, H, W)` -> `(B, out_channels, H/stride, W/stride)`."""

    def __init__(self, config: ResNetStemConfig, in_channels: int = 3) -> None:
        super().__init__()
        self.config = config
        self.stride = config.stride
        self.out_channels = config.out_channels
        self.stem = _StemIn(in_channels, config.width)
        stages, cin = [], config.width
        for i, depth in enumerate(config.layers):
            mid = config.width * 2**i
            stages.append(_Stage(cin, mid, depth, 1 if i == 0 else 2))
            cin = mid * 4
        self.stages = nn.Sequential(*stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


# --- plain ResNet-50 (torchvision layout) ------------------------------------------------


@dataclass
class ResNetConfig:
    """A torchvision-style bottleneck ResNet; the defaults are ResNet-50."""

    num_classes: int = 1000
    in_channels: int = 3
    layers: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    image_size: int = 224  # informational: the net is fully convolutional

    def __post_init__(self) -> None:
        self.layers = tuple(self.layers)
        if not self.layers:
            raise ValueError("layers must name at least one stage, got ()")
        for n in self.layers:
            positive_int("layers entries", n)
        positive_int("width", self.width)
        positive_int("in_channels", self.in_channels)
        positive_int("image_size", self.image_size)
        if not isinstance(self.num_classes, int) or self.num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0 (0 = no head), got {self.num_classes!r}")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("num_classes", "in_channels", "layers", "width", "image_size")}


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (stride on the 3x3 conv)."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * 4
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.bn1(self.conv1(x)), inplace=True)
        x = F.relu(self.bn2(self.conv2(x)), inplace=True)
        x = self.bn3(self.conv3(x))
        return F.relu(x + shortcut, inplace=True)


class ResNet(nn.Module):
    """Image classifier; `pooled_features` gives the globally pooled `(B, num_features)` vector."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.conv1 = nn.Conv2d(config.in_channels, w, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        cin = w
        for i, depth in enumerate(config.layers):
            mid = w * 2**i
            stride = 1 if i == 0 else 2
            blocks = [Bottleneck(cin if j == 0 else mid * 4, mid, stride if j == 0 else 1) for j in range(depth)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
            cin = mid * 4
        self.num_features = cin
        self.fc = nn.Linear(cin, config.num_classes) if config.num_classes else nn.Identity()
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _check(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != self.config.in_channels:
            raise ValueError(
                f"expected images of shape (B, {self.config.in_channels}, H, W), got shape {tuple(x.shape)}"
            )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's feature map, `(B, num_features, H/32, W/32)`."""
        self._check(x)
        x = F.relu(self.bn1(self.conv1(x)), inplace=True)
        x = F.max_pool2d(x, 3, 2, padding=1)
        for i in range(len(self.config.layers)):
            x = getattr(self, f"layer{i + 1}")(x)
        return x

    def pooled_features(self, x: torch.Tensor) -> torch.Tensor:
        """Global-average-pooled features, `(B, num_features)`."""
        return self.forward_features(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pooled_features(x))

    def replace_head(self, num_classes: int) -> None:
        """Swap in a zero-initialised classifier for `num_classes` (0 removes it)."""
        self.config = ResNetConfig(**{**self.config.to_dict(), "num_classes": num_classes})
        self.fc = zero_head(self.num_features, num_classes, like=self.conv1.weight)


def zero_head(in_features: int, num_classes: int, like: torch.Tensor) -> nn.Module:
    """A classifier with zero weights and bias (paper §3.2), on `like`'s device and dtype."""
    if num_classes == 0:
        return nn.Identity()
    head = nn.Linear(in_features, num_classes, device=like.device, dtype=like.dtype)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def resnet50(num_classes: int = 1000, **overrides: Any) -> ResNet:
    """The torchvision-layout ResNet-50 (25.6 M parameters at 1000 classes); fields overridable."""
    return ResNet(apply_overrides(ResNetConfig, {"num_classes": num_classes}, overrides, "ResNet-50"))


__all__ = ["ResNet", "ResNetConfig", "ResNetV2Stem", "StdConv2dSame", "resnet50", "zero_head"]
