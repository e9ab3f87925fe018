"""`vit_train_step.py`'s suite: ours, timm's and Hugging Face's ViT, eager and compiled, on CPU or CUDA, with
the measured bf16 matmul peak and each model's MFU (see that script's docstring for how it is timed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from train_step_models import (CLOCKS, call_hf, call_images, check_plain, cpu_info, forward_macs, hf_reference,
                               make_bf16_master_step, make_step, timm_reference)

SUITE_MODELS = ("ours", "timm", "hf")
COMPILABLE = ("ours", "timm")  # HF's ViT stays the eager reference
# More compiled entries of our model, one idea each to judge on the GPU: the same model, FLOPs and bf16
# autocast. "mode" is torch.compile's; "sdpa" pins the attention kernel for the whole step.
VARIANTS: dict[str, dict[str, str]] = {
    "cudagraphs": {"mode": "reduce-overhead"},  # CUDA graphs: no launch gaps between the step's kernels
    "autotune": {"mode": "max-autotune-no-cudagraphs"},  # GEMMs autotuned; Triton ones fuse bias/GELU; slow
    "cudnn-attention": {"sdpa": "cudnn"},  # cuDNN's fused attention (Hopper kernels) instead of flash
    # bf16 weights and activations, fp32 masters in AdamW: the fp32 residual stream and LayerNorms autocast
    # keeps are what the compiled step spends outside the matmuls.
    "bf16-master": {"params": "bf16"},
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
        if options.get("params") == "bf16":  # casts entry.model, which `model` compiles, before its first call
            step = make_bf16_master_step(model, images, labels)
        else:
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
