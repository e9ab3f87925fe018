"""Training-step throughput of our ViT against Hugging Face's and timm's: CPU or CUDA, eager or compiled.

The one run on a lent GPU (ViT-B/16 at 224, batch 256, bf16 autocast, fused AdamW; 3 to 4 minutes: two
`torch.compile`s of about a minute each, then the variants while they fit in `--budget-s` 230; `wall_s` in
the JSON says how long it took):

    PYTHONPATH=. python benchmarks/vit_train_step.py --device cuda --compile both \
        --variant cudnn-attention --variant cudagraphs --json

It prints img/s and MFU of ours and timm's `vit_base_patch16_224` (each eager and compiled), Hugging Face's
ViT (eager), the measured bf16 matmul peak and the ratio ours/timm compiled. `--variant NAME` (repeatable)
adds one more compiled entry of our model per idea to judge on the GPU (see VARIANTS; each costs one more
compile and is skipped, with a note in the JSON, when it would end the run past `--budget-s`). The slow
`autotune` variant wants a run of its own: `--compile only --models ours,timm --variant autotune --budget-s 550`.

The MAE step's cost against a supervised step of the same ViT-B/16 (batch 256, bf16, eager; under
a minute; see benchmarks/mae_step.py):

    PYTHONPATH=. python benchmarks/vit_train_step.py --objective mae --device cuda --json

On CPU (fp32 and bf16 against Hugging Face's ViT, as before):

    python benchmarks/vit_train_step.py --json
    python benchmarks/vit_train_step.py --model ViT-Ti/16 --batch 8 --steps 3 --warmup 1 --dtypes bf16
    python benchmarks/vit_train_step.py --profile bf16 --batch 8 --threads 1   # where the time goes, per op
    python benchmarks/vit_train_step.py --compile both --model ViT-Ti/16 --batch 8 --steps 3 --warmup 2 --json

The last runs the GPU suite's code on CPU (bf16 autocast): what to try before a device is lent.

A step is the same for every model: forward, cross-entropy, backward, AdamW step
(`zero_grad(set_to_none=True)`, `fused=True`, one optimizer setting for all), under
`torch.autocast(device, dtype=torch.bfloat16)` for bf16 and plain fp32 otherwise.
The reference is `transformers.ViTForImageClassification` built locally from a
`transformers.ViTConfig` equal to ours, with attention implementation "sdpa"
(its default, set explicitly). In the CPU comparison its random weights are copied
into our model through `vit.load_pretrained`, and the fp32 logits are checked to agree.
timm's model is `timm.models.vision_transformer.VisionTransformer` with our config's
dims, built locally with random weights (for ViT-B/16 that is `vit_base_patch16_224`).
Compiled entries are `torch.compile(model)` in its default mode unless a variant says
otherwise; the loss and the optimizer step stay outside the compiled model for all.

Timing: after warm-up, the models take turns (the first mover changes each round)
in one process. On CPU there is one `torch.mm` sample per model matmul shape in every
round, so load from elsewhere on a shared machine hits all alike; on CUDA each step
is timed with CUDA events between synchronisations, and every round also times two
bf16 `torch.mm`s of 8192^3 on random data, whose median is the peak. Images/s are
medians over rounds; a ratio is the median of the per-round ratios (the other
model's step time / ours, measured back to back). MFU = achieved training FLOP/s
(3 x forward, 2 FLOPs per MAC) over the measured matmul peak. On a busy shared
machine, `--threads 1 --clock cpu` counts only this process's CPU time and gives
far steadier CPU figures.

Imports: torch, `vit` (plain torch and safetensors), transformers, and timm when
installed; nothing of `pipelines`, so it runs where only those are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mae_step  # this script's folder is on sys.path when it runs

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


def make_step(model: nn.Module, is_hf: bool, dtype: torch.dtype, images, labels,
              call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> Callable[[], None]:
    """One training step of `model` (maybe compiled) as a closure; the optimizer is the same kind for all.

    `call` runs the model on the images (default: ours, or HF's with `is_hf`); autocast is on the
    images' device.
    """
    call = call or (call_hf if is_hf else call_images)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.05, fused=True)
    device_type = images.device.type

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = call(model, images)
            loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        opt.step()

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


# --- the suite: ours, timm's and HF's ViT, eager and compiled, on CPU or CUDA -------------------

SUITE_MODELS = ("ours", "timm", "hf")
COMPILABLE = ("ours", "timm")  # HF's ViT stays the eager reference
# More compiled entries of our model, one idea each to judge on the GPU: the same model, FLOPs and bf16
# autocast. "mode" is torch.compile's; "sdpa" pins the attention kernel for the whole step.
VARIANTS: dict[str, dict[str, str]] = {
    "cudagraphs": {"mode": "reduce-overhead"},  # CUDA graphs: no launch gaps between the step's kernels
    "autotune": {"mode": "max-autotune-no-cudagraphs"},  # GEMMs autotuned; Triton ones fuse bias/GELU; slow
    "cudnn-attention": {"sdpa": "cudnn"},  # cuDNN's fused attention (Hopper kernels) instead of flash
}
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION"}


@dataclass
class Entry:
    """One model under test in the suite: what the JSON says about it, its model, and its step once warm."""

    name: str
    kind: str  # "ours", "timm" or "hf"
    compiled: bool
    variant: str | None = None
    info: dict[str, object] = field(default_factory=dict)
    model: nn.Module | None = None
    step: Callable[[], None] | None = None


def suite_entries(models: list[str], compile_choice: str, variants: list[str]) -> list[Entry]:
    """The entries to run: each model eager and/or compiled as `--compile` says, then our variants."""
    entries = []
    for kind in models:
        if compile_choice != "only" or kind not in COMPILABLE:
            entries.append(Entry(kind, kind, False))
        if compile_choice != "none" and kind in COMPILABLE:
            entries.append(Entry(f"{kind}_compiled", kind, True))
    if "ours" in models:
        entries += [Entry(f"ours_compiled[{v}]", "ours", True, v) for v in variants]
    return entries


def suite_model(kind: str, config, num_classes: int) -> nn.Module:
    """A fresh model of `kind` with `config`'s dims and seeded random weights."""
    import vit

    torch.manual_seed(0)
    if kind == "ours":
        return vit.VisionTransformer(config)
    return timm_reference(config, num_classes) if kind == "timm" else hf_reference(config, num_classes)


def failure(err: BaseException) -> str:
    """One line for the JSON: the error's type and the first line of its message."""
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first}"[:500]


def step_timer(device: torch.device, clock: Callable[[], float]) -> Callable[[Callable[[], None]], float]:
    """Seconds of one call: CUDA events between synchronisations on CUDA, else `clock`."""
    if device.type != "cuda":
        def timed(fn: Callable[[], None]) -> float:
            t0 = clock()
            fn()
            return clock() - t0
        return timed

    def timed_cuda(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return timed_cuda


def peak_sampler(device: torch.device, size: int, timed) -> Callable[[], float]:
    """A closure timing one bf16 `size`^3 `torch.mm` on random data and returning its TFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(3):  # the first call allocates and picks the kernel; then the clocks ramp up
        torch.mm(a, b, out=out)
    return lambda: 2 * size**3 / timed(lambda: torch.mm(a, b, out=out)) / 1e12


def graph_breaks(entry: Entry, images: torch.Tensor) -> dict[str, object]:
    """What dynamo makes of the model's forward under bf16 autocast: graphs, breaks and their first reasons.

    `torch._dynamo.explain` resets dynamo, so this runs before anything is compiled.
    """
    call = call_hf if entry.kind == "hf" else call_images
    try:
        with torch.autocast(images.device.type, dtype=torch.bfloat16):
            out = torch._dynamo.explain(call)(entry.model, images)
    except Exception as err:  # a look that fails leaves the entry to be measured all the same
        return {"graph_breaks_error": failure(err)}
    return {"graphs": out.graph_count, "graph_breaks": out.graph_break_count,
            "break_reasons": [str(r.reason)[:200] for r in out.break_reasons[:3]]}


def build_entry(entry: Entry, config, num_classes: int, images: torch.Tensor, explained: set[str]) -> None:
    """Build `entry`'s model on the device; a compiled kind's graph breaks are looked at once, first."""
    try:
        entry.model = suite_model(entry.kind, config, num_classes).to(images.device).train()
        if entry.compiled and entry.kind not in explained:
            explained.add(entry.kind)
            entry.info.update(graph_breaks(entry, images))
    except Exception as err:  # one model failing must not stop the others
        entry.info["error"] = failure(err)
        entry.model = None


def pin_sdpa(step: Callable[[], None], backend: str) -> Callable[[], None]:
    """`step` with scaled_dot_product_attention restricted to one kernel (tracing included)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, SDPA_BACKENDS[backend])

    def pinned() -> None:
        with sdpa_kernel([chosen]):
            step()

    return pinned


def warm_entry(entry: Entry, images, labels, warmup: int, timed) -> None:
    """Compile (when asked) and warm up `entry`: its first step (the compile) is timed apart, then `warmup`."""
    options = VARIANTS.get(entry.variant or "", {})
    try:
        model = entry.model
        if entry.compiled:
            entry.info["compile_mode"] = options.get("mode", "default")
            # Dynamo reuses a graph compiled for an equal backend, and the pinned attention kernel is chosen
            # while tracing: dynamic=False (the same as the default for these fixed shapes) makes the backend
            # unequal to the plain entry's, so the pinned entry is traced afresh under its kernel.
            model = torch.compile(model, mode=options.get("mode"), dynamic=False if "sdpa" in options else None)
        step = make_step(model, entry.kind == "hf", torch.bfloat16, images, labels)
        if "sdpa" in options:
            step = pin_sdpa(step, options["sdpa"])
        entry.info["first_step_s"] = round(timed(step), 3)
        for _ in range(warmup):
            entry.info["warm_step_s"] = timed(step)
        entry.step = step
    except Exception as err:  # e.g. a compile that fails on this stack: the others still run
        entry.info["error"] = failure(err)
        entry.model = None
        if images.is_cuda:
            torch.cuda.empty_cache()


def run_rounds(entries: list[Entry], steps: int, timed, peak) -> tuple[dict[str, list[float]], list[float]]:
    """Step times per entry and matmul peak samples, one step of every entry per round, first mover rotating."""
    times: dict[str, list[float]] = {e.name: [] for e in entries}
    peaks: list[float] = []
    for i in range(steps):
        k = i % len(entries)
        for e in entries[k:] + entries[:k]:
            times[e.name].append(timed(e.step))
        peaks += [peak(), peak()]
    return times, peaks


def ratio(times: dict[str, list[float]], ours: str, other: str) -> dict[str, object] | None:
    """Median and range of the per-round speed ratio `ours` / `other` (the other's step time over ours)."""
    if not times.get(ours) or not times.get(other):
        return None
    r = [o / u for u, o in zip(times[ours], times[other])]
    return {"median": statistics.median(r), "range": [min(r), max(r)]}


def suite_ratios(times: dict[str, list[float]], variants: list[str]) -> dict[str, object]:
    """The comparisons the issue asks for, among the entries that ran."""
    pairs = [("ours_compiled", "timm_compiled"), ("ours", "timm"), ("ours", "hf"), ("ours_compiled", "ours"),
             ("timm_compiled", "timm")] + [(f"ours_compiled[{v}]", "timm_compiled") for v in variants]
    out = {f"{a}/{b}": ratio(times, a, b) for a, b in pairs}
    return {k: v for k, v in out.items() if v is not None}


def suite_stats(entries: list[Entry], times, batch: int, train_flops: float, peak: float) -> dict[str, object]:
    """Per entry: img/s (median, range), median step ms, MFU, and what building and warming it said."""
    out: dict[str, object] = {}
    for e in entries:
        t = times.get(e.name)
        if t:
            img_s = batch / statistics.median(t)
            e.info.update(img_s=img_s, img_s_range=[batch / max(t), batch / min(t)],
                          step_ms=1e3 * statistics.median(t), mfu=img_s * train_flops / (peak * 1e12))
        e.info.pop("warm_step_s", None)
        out[e.name] = e.info
    return out


def versions(device: torch.device) -> dict[str, object]:
    """Library versions, and the accelerator's name where there is one."""
    out: dict[str, object] = {"torch": torch.__version__}
    for name in ("transformers", "timm"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    if device.type == "cuda":
        out.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return out


def warm_all(entries: list[Entry], images, labels, args, timed, t_start: float) -> None:
    """Warm every built entry; a variant is skipped (with a note) when its compile would break `--budget-s`."""
    for e in entries:
        if e.model is None:
            continue
        ready = [x for x in entries if x.step is not None]
        compile_s = max([float(x.info["first_step_s"]) for x in ready if x.compiled] or [60.0])
        rounds_s = args.steps * (sum(float(x.info["warm_step_s"]) for x in ready if "warm_step_s" in x.info) + 0.1)
        if e.variant and time.perf_counter() - t_start + compile_s + rounds_s > args.budget_s:
            e.info["skipped"] = f"its compile (~{compile_s:.0f} s) would run past --budget-s {args.budget_s:.0f}"
            e.model = None
            continue
        print(f"[vit_train_step] warming {e.name} ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
        warm_entry(e, images, labels, args.warmup, timed)


def suite(args: argparse.Namespace) -> dict[str, object]:
    """Ours, timm's and HF's ViT, eager and compiled as asked, on `args.device`: one JSON-able dict."""
    import vit

    t_start = time.perf_counter()
    device = torch.device(args.device)
    config = vit.create_model(args.model, image_size=args.image_size, num_classes=args.num_classes).config
    check_plain(args.model, config)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(args.batch, config.in_channels, args.image_size, args.image_size, generator=g).to(device)
    labels = torch.randint(0, args.num_classes, (args.batch,), generator=g).to(device)
    entries = suite_entries(args.models, args.compile, args.variant)
    timed = step_timer(device, CLOCKS[args.clock])
    explained: set[str] = set()
    for e in entries:
        build_entry(e, config, args.num_classes, images, explained)
    warm_all(entries, images, labels, args, timed, t_start)
    ready = [e for e in entries if e.step is not None]
    peak = peak_sampler(device, args.peak_size, timed)
    times, peaks = run_rounds(ready, args.steps, timed, peak) if ready else ({}, [peak()])
    peak_tflops = statistics.median(peaks)
    macs = forward_macs(config)
    result: dict[str, object] = {
        "device": str(device), **versions(device), "model": args.model, "batch": args.batch,
        "image_size": args.image_size, "tokens": config.num_patches + 1, "autocast": "bf16",
        "optimizer": "torch.optim.AdamW(fused=True), every model",
        "compiled_with": "torch.compile(model), default mode unless an entry says otherwise",
        "steps": args.steps, "warmup": args.warmup, "forward_gmacs_per_image": macs / 1e9,
        "train_gflop_per_image": 6 * macs / 1e9, "mm_peak_tflops": peak_tflops,
        "mm_peak_tflops_range": [min(peaks), max(peaks)], "mm_peak_shape": f"{args.peak_size}^3 bf16",
    }
    if device.type == "cpu":
        result.update(threads=torch.get_num_threads(), clock=args.clock, **cpu_info())
    result["models"] = suite_stats(entries, times, args.batch, 6 * macs, peak_tflops)
    result["ratios"] = suite_ratios(times, args.variant)
    result["ratio_ours_to_timm_compiled"] = (result["ratios"].get("ours_compiled/timm_compiled") or {}).get("median")
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


# --- command line -------------------------------------------------------------------------

# (CPU comparison, suite on CPU, suite on CUDA): ViT-B/16 at batch 256 fits a 4-minute run on an H200.
DEFAULTS = {"model": ("ViT-S/16", "ViT-S/16", "ViT-B/16"), "batch": (32, 32, 256), "steps": (6, 6, 30),
            "warmup": (2, 2, 3), "peak_size": (2048, 2048, 8192)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objective", choices=("supervised", "mae"), default="supervised",
                   help="mae: an MAE step against a supervised step of the same model (see benchmarks/mae_step.py)")
    mae_step.add_arguments(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda runs the suite (ours, timm, HF) in bf16 autocast")
    p.add_argument("--compile", nargs="?", const="both", default="none", choices=("none", "both", "only"),
                   help="torch.compile ours and timm's model: 'both' (the default of a bare --compile) keeps "
                        "their eager entries too, 'only' drops them; any value but none runs the suite")
    p.add_argument("--variant", action="append", default=[], choices=tuple(VARIANTS),
                   help="one more compiled entry of our model per idea (repeatable): " + ", ".join(VARIANTS))
    p.add_argument("--models", default=",".join(SUITE_MODELS),
                   help="the suite's models, comma-separated, from: " + ", ".join(SUITE_MODELS))
    p.add_argument("--budget-s", type=float, default=230.0,
                   help="the suite skips a variant whose compile would end the run past this many seconds")
    p.add_argument("--peak-size", type=int, help="side of the square bf16 matmul that measures the suite's peak")
    p.add_argument("--model", help="a plain ViT preset name, e.g. ViT-S/16 (default: ViT-B/16 on cuda)")
    p.add_argument("--batch", type=int)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--steps", type=int, help="timed rounds (one step of each model per round)")
    p.add_argument("--warmup", type=int, help="untimed rounds first (the suite: after each model's first step)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from: " + ", ".join(DTYPES)
                   + " (the CPU comparison; the suite runs bf16 autocast)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all CPUs)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall: elapsed time; cpu: this thread's CPU time (needs --threads 1), which time "
                        "taken by other processes on a shared machine does not inflate")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--profile", metavar="DTYPE",
                   help="print per-op time of both models in DTYPE over --steps steps, and exit")
    args = p.parse_args(argv)
    args.suite = args.device == "cuda" or args.compile != "none" or bool(args.variant)
    column = 2 if args.device == "cuda" else int(args.suite)
    for name, values in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[column])
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad combinations in one line each (argparse exits with it)."""
    if args.objective == "mae" and (args.compile == "both" or args.variant or args.profile):
        p.error("--objective mae times all its steps eager, or with --compile only all compiled: "
                "drop --compile both, --variant and --profile")
    if args.objective == "mae" and args.device == "cuda":
        args.dtypes = "bf16"  # on CUDA, as the suite, bf16 autocast only
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes + ([args.profile] if args.profile else []):
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in SUITE_MODELS:
            p.error(f"unknown model {m!r} in --models; choose from {', '.join(SUITE_MODELS)}")
    for name in ("batch", "image_size", "num_classes", "steps", "threads", "peak_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu counts one thread's CPU time: it needs --threads 1")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.suite and args.profile:
        p.error("--profile is for the CPU comparison: drop --device cuda, --compile and --variant")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")


def cpu_comparison(args: argparse.Namespace) -> dict[str, object] | None:
    """Ours against HF's ViT on CPU in each of `args.dtypes`, or the per-op profile."""
    import transformers

    from vit.model import pick_attention

    setup = build(args.model, args.batch, args.image_size, args.num_classes)
    if args.profile:
        profile(setup, DTYPES[args.profile], args.steps)
        return None
    config = setup.ours.config
    result: dict[str, object] = {
        "model": args.model, "batch": args.batch, "image_size": args.image_size, "tokens": setup.tokens,
        "threads": torch.get_num_threads(), "clock": args.clock, **cpu_info(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "reference": "transformers.ViTForImageClassification", "reference_attn_implementation": "sdpa",
        "optimizer": "torch.optim.AdamW(fused=True), both models",
        "steps": args.steps, "warmup": args.warmup,
        "forward_gmacs_per_image": setup.macs_per_image / 1e9,
        "fp32_logits_max_abs_diff": setup.logits_max_abs_diff,
    }
    shapes = mm_shapes(config, args.batch)
    for name in args.dtypes:
        dtype = DTYPES[name]
        result[f"ours_attention_path_{name}"] = (
            config.attn_impl if config.attn_impl != "auto" else pick_attention("cpu", dtype, setup.tokens, True)
        )
        for key, value in measure(setup, dtype, shapes, args.steps, args.warmup, CLOCKS[args.clock]).items():
            result[f"{key}_{name}"] = value
    return result


def main(argv: list[str] | None = None) -> dict[str, object] | None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.objective == "mae":
        result = mae_step.run(args, DTYPES, CLOCKS[args.clock])
    else:
        result = suite(args) if args.suite else cpu_comparison(args)
    if result is None:
        return None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    return result


if __name__ == "__main__":
    main()
