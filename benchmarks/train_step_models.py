"""The pieces of `vit_train_step.py`'s CPU comparison, which its suite builds on: the machine's CPU, the
FLOP count, the reference models (Hugging Face's and timm's ViT with our config's dims), one training step,
the CPU timing loop with its matmul samples, and the per-op profile.

Imports: torch, `vit`, transformers, and timm when installed; nothing of `pipelines`.
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Setup:
    """The pair of models under test and one batch of inputs."""

    ours: nn.Module
    reference: nn.Module
    images: torch.Tensor
    labels: torch.Tensor
    macs_per_image: int
    tokens: int
    logits_max_abs_diff: float


# --- machine ------------------------------------------------------------------------------


def cpu_info() -> dict[str, object]:
    """CPU model name and the matrix/bf16 features the kernels can use."""
    name, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if name != "unknown" and flags:
                    break
    except OSError:  # not Linux: leave the flags unknown
        pass
    return {
        "cpu_model": name,
        "cpu_amx_bf16": "amx_bf16" in flags,
        "cpu_avx512_bf16": "avx512_bf16" in flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


# --- models -------------------------------------------------------------------------------


def forward_macs(config) -> int:
    """Multiply-accumulates of one image's forward pass (Linears, attention matmuls, patch embedding)."""
    gh, gw = config.grid
    n = gh * gw
    t = n + (1 if config.class_token else 0)
    d, m = config.embed_dim, config.mlp_dim
    block = t * d * 3 * d + 2 * t * t * d + t * d * d + 2 * t * d * m
    head = d * config.num_classes + (d * config.representation_size if config.representation_size else 0)
    return n * config.patch_dim * d + config.depth * block + head


def hf_reference(config, num_classes: int) -> nn.Module:
    """Hugging Face's ViT with our config's dims, random weights, attention implementation "sdpa"."""
    import transformers
    from transformers import ViTConfig as HFViTConfig
    from transformers import ViTForImageClassification

    c = config
    hf_config = HFViTConfig(
        hidden_size=c.embed_dim, num_hidden_layers=c.depth, num_attention_heads=c.num_heads,
        intermediate_size=c.mlp_dim, hidden_act="gelu", image_size=c.image_size, patch_size=c.patch_size,
        num_channels=c.in_channels, num_labels=num_classes, layer_norm_eps=c.layer_norm_eps,
        qkv_bias=c.qkv_bias, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    transformers.utils.logging.disable_progress_bar()
    reference = ViTForImageClassification(hf_config)
    reference.set_attn_implementation("sdpa")  # HF's default, set so the comparison is pinned
    return reference


def timm_reference(config, num_classes: int) -> nn.Module:
    """timm's VisionTransformer with our config's dims and random weights (no download)."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    c = config
    return TimmViT(
        img_size=c.image_size, patch_size=c.patch_size, in_chans=c.in_channels, num_classes=num_classes,
        embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads, mlp_ratio=c.mlp_dim / c.embed_dim,
        qkv_bias=c.qkv_bias, class_token=True, global_pool="token",
    )


def check_plain(model_name: str, config) -> None:
    """The references cover plain class-token ViTs only; anything else is refused in one line."""
    c = config
    if c.hybrid is not None or c.pool != "token" or c.pos_embed != "learned" or c.representation_size:
        raise ValueError(f"--model {model_name!r}: the references only cover plain class-token ViTs")


def build(model_name: str, batch: int, image_size: int, num_classes: int) -> Setup:
    """Our model and an equal HF model with identical weights (copied HF -> ours)."""
    import vit

    ours = vit.create_model(model_name, image_size=image_size, num_classes=num_classes)
    c = ours.config
    check_plain(model_name, c)
    torch.manual_seed(0)
    reference = hf_reference(c, num_classes)
    with tempfile.TemporaryDirectory() as d:
        reference.save_pretrained(d)
        vit.load_pretrained(ours, d)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, c.in_channels, image_size, image_size, generator=g)
    labels = torch.randint(0, num_classes, (batch,), generator=g)
    ours.eval()
    reference.eval()
    with torch.no_grad():
        probe = images[:2]
        diff = (ours(probe) - reference(pixel_values=probe).logits).abs().max().item()
    ours.train()
    reference.train()
    if diff > 1e-4:
        print(f"warning: fp32 logits differ by {diff:.2e} between the two models", file=sys.stderr)
    return Setup(ours, reference, images, labels, forward_macs(c), c.num_patches + 1, diff)


def call_images(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Logits of ours or timm's model."""
    return model(images)


def call_hf(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Logits of Hugging Face's model."""
    return model(pixel_values=images).logits


def adamw(params) -> torch.optim.Optimizer:
    """The one optimizer setting every benchmarked step uses."""
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.05, fused=True)


def make_step(model: nn.Module, is_hf: bool, dtype: torch.dtype, images, labels,
              call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> Callable[[], None]:
    """One training step of `model` (maybe compiled) as a closure; the optimizer is the same kind for all.

    `call` runs the model on the images (default: ours, or HF's with `is_hf`); autocast is on the
    images' device.
    """
    call = call or (call_hf if is_hf else call_images)
    opt = adamw(model.parameters())
    device_type = images.device.type

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = call(model, images)
            loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        opt.step()

    return step


def make_bf16_master_step(model: nn.Module, images, labels) -> Callable[[], None]:
    """One training step of a model whose weights are bf16, with an fp32 master copy in the optimizer.

    No autocast: the residual stream, LayerNorms and weight reads run in bf16 (half the bytes of the
    fp32 ones autocast keeps), while AdamW updates fp32 masters, copied back after each step.
    Call with `model`'s weights still fp32 (the masters start from them); it casts the model.
    """
    master = [p.detach().float().clone() for p in model.parameters()]
    for m in master:
        m.grad = torch.zeros_like(m)
    model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = adamw(master)
    images = images.to(torch.bfloat16)

    def step() -> None:
        for p in params:
            p.grad = None
        loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
        torch._foreach_copy_([m.grad for m in master], [p.grad for p in params])
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, master)

    return step


# --- timing -------------------------------------------------------------------------------


def mm_shapes(config, batch: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's Linears at this batch: qkv, attention out, fc1, fc2."""
    rows = batch * (config.num_patches + 1)
    d, m = config.embed_dim, config.mlp_dim
    return [(rows, d, 3 * d), (rows, d, d), (rows, d, m), (rows, m, d)]


def make_mm(shape: tuple[int, int, int], dtype: torch.dtype, clock: Callable[[], float]) -> Callable[[], float]:
    """A closure timing one `x @ w.T` (how nn.Linear multiplies) and returning its TFLOP/s."""
    m, k, n = shape
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    torch.mm(x, w.t())  # first call allocates and picks the kernel

    def sample() -> float:
        t0 = clock()
        torch.mm(x, w.t())
        return 2 * m * k * n / (clock() - t0) / 1e12

    return sample


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def measure(
    setup: Setup, dtype: torch.dtype, shapes, steps: int, warmup: int, clock: Callable[[], float]
) -> dict[str, object]:
    """Median step times of both models and the mm peak, taking turns round by round."""
    ours = make_step(setup.ours, False, dtype, setup.images, setup.labels)
    ref = make_step(setup.reference, True, dtype, setup.images, setup.labels)
    mms = [make_mm(s, dtype, clock) for s in shapes]

    def timed(fn: Callable[[], None]) -> float:
        t0 = clock()
        fn()
        return clock() - t0

    for _ in range(warmup):
        ours()
        ref()
    t_ours: list[float] = []
    t_ref: list[float] = []
    tflops: list[list[float]] = [[] for _ in mms]
    for i in range(steps):
        pair = [(ours, t_ours), (ref, t_ref)]
        for fn, times in pair if i % 2 == 0 else pair[::-1]:
            times.append(timed(fn))
        for samples, mm in zip(tflops, mms):
            samples.append(mm())
    b = setup.images.shape[0]
    per_shape = [statistics.median(s) for s in tflops]
    peak = max(per_shape)
    ours_img_s = b / statistics.median(t_ours)
    ref_img_s = b / statistics.median(t_ref)
    # The ratio of each round's adjacent pair, so slow spells from other load cancel out.
    ratios = [r / o for o, r in zip(t_ours, t_ref)]
    train_flops = 6 * setup.macs_per_image  # forward + backward (2x forward), 2 FLOPs per MAC
    return {
        "ours_img_s": ours_img_s,
        "reference_img_s": ref_img_s,
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "mfu": ours_img_s * train_flops / (peak * 1e12),
        "reference_mfu": ref_img_s * train_flops / (peak * 1e12),
        "mm_peak_tflops": peak,
        "mm_tflops_by_shape": {f"{m}x{k}x{n}": round(v, 4) for (m, k, n), v in zip(shapes, per_shape)},
        "ours_img_s_range": [b / max(t_ours), b / min(t_ours)],
        "reference_img_s_range": [b / max(t_ref), b / min(t_ref)],
    }


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def profile(setup: Setup, dtype: torch.dtype, steps: int, rows: int = 20) -> None:
    """Print where a step's time goes, per op, for both models side by side.

    The models take turns, one profiler session per step; each op's time is, per
    input shape, its median self time per call times its calls per step, summed over
    shapes, so a spell of load from elsewhere during one step does not land on one op. Profiler times are
    elapsed time: on a busy machine read the split, not the totals.
    """
    from torch.profiler import ProfilerActivity, profile as torch_profile

    runs = {
        "ours": make_step(setup.ours, False, dtype, setup.images, setup.labels),
        "reference": make_step(setup.reference, True, dtype, setup.images, setup.labels),
    }
    for step in runs.values():
        step()
    # Keyed by op and input shapes: one op's calls differ by shape (a fused qkv against three
    # projections), and a median over mixed shapes times the call count misstates the op's total.
    samples: dict[str, dict[tuple[str, str], list[float]]] = {name: {} for name in runs}
    for i in range(steps):
        for name in runs if i % 2 == 0 else reversed(list(runs)):
            with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                runs[name]()
            for event in prof.events():
                key = (event.name, str(event.input_shapes))
                samples[name].setdefault(key, []).append(event.self_cpu_time_total / 1e3)
    per_step: dict[str, dict[str, float]] = {name: {} for name in runs}
    for name, calls in samples.items():
        for (op, _), v in calls.items():
            per_step[name][op] = per_step[name].get(op, 0.0) + statistics.median(v) * len(v) / steps
    totals = {name: sum(ops.values()) for name, ops in per_step.items()}
    ops = sorted(set(per_step["ours"]) | set(per_step["reference"]),
                 key=lambda op: -max(per_step["ours"].get(op, 0.0), per_step["reference"].get(op, 0.0)))
    batch = setup.images.shape[0]
    out = [f"{dtype}, batch {batch}: ms per step (median per call x calls), over {steps} steps each",
           f"{'op':56s} {'ours':>9s} {'reference':>9s}"]
    for op in ops[:rows]:
        out.append(f"{op[:56]:56s} {per_step['ours'].get(op, 0.0):9.1f} {per_step['reference'].get(op, 0.0):9.1f}")
    gemm = {name: sum(t for op, t in d.items() if op in GEMM_OPS) for name, d in per_step.items()}
    attn = {name: sum(t for op, t in d.items() if "scaled_dot_product" in op or "softmax" in op)
            for name, d in per_step.items()}
    for label, part in (("GEMMs (mm, addmm, bmm)", gemm), ("attention kernels + softmax", attn)):
        out.append(f"{label:50s} " + " ".join(f"{part[n]:7.0f} {100 * part[n] / totals[n]:2.0f}%" for n in runs))
    out.append(f"{'total':56s} {totals['ours']:9.1f} {totals['reference']:9.1f}")
    print("\n".join(out))
