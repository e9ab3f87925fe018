"""The GPU mode of `longformer_attention.py`: Longformer attention alone, forward + backward, bf16.

    python benchmarks/longformer_attention.py --device cuda        (about 2 minutes on one H200)

Imports only torch and `vit` (the GPU machine has neither Ray nor MLflow). 12 heads of 64, window 512
(256 each side), batch 1; q, k, v are given, so no projections are timed. Rows at each N:

- ours_banded_d1 / ours_banded_d1_g: `sliding_window_attention(kernel="banded")`, dilation 1,
                     without / with 4 global tokens (the first, last and two between)
- ours_flex_d1:      the same call with `kernel="flex"`, dilation 1, no globals
- ours_flex_d1_g / ours_flex_d2_g: the same call with `kernel="flex"`, dilation 1 / 2, the globals
                     (the default `GLOBAL_KEYS = "merge"`: band by FlexAttention, global keys merged
                     by logsumexp)
- ours_flex_d1_g_prefix: ours_flex_d1_g with `GLOBAL_KEYS = "prefix"`: the global keys as a key block
                     in front, one copy per `GLOBAL_GROUP` query blocks
- plain_flex_swa:    `flex_attention` with a plain sliding-window block mask (|i - j| <= 256): no
                     dilation, no globals, no padding (the usual FlexAttention example)
- dense_sdpa_flash:  full `scaled_dot_product_attention` on the flash backend

Time: median of `--reps` passes measured with CUDA events, the rows taking turns after a warm-up
(which also compiles FlexAttention for each shape). Memory: `torch.cuda.max_memory_allocated`
over one pass, reset before it; q, k, v and the output gradient (shared by all rows) are included.
A row that fails (out of memory, say) is reported with its error; the others still run. Also: the
largest absolute and relative difference of ours_flex (each `GLOBAL_KEYS` layout) from ours_banded,
both bf16, at N = 4096 with global tokens and padding, for the output and for dq.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

HEADS, DIM, WINDOW, NUM_GLOBALS = 12, 64, 512, 4
ROWS = ("ours_banded_d1", "ours_banded_d1_g", "ours_flex_d1", "ours_flex_d1_g", "ours_flex_d1_g_prefix",
        "ours_flex_d2_g", "plain_flex_swa", "dense_sdpa_flash")


def _inputs(n: int, batch: int = 1, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, grad = (torch.randn(batch, HEADS, n, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
                     for _ in range(4))
    global_mask = torch.zeros(batch, n, dtype=torch.bool, device="cuda")
    global_mask[:, [0, n // 3, 2 * n // 3, n - 1][:NUM_GLOBALS]] = True
    return [t.requires_grad_() for t in (q, k, v)], grad, global_mask


def _forward(name: str, q, k, v, global_mask):
    """The forward of one row, as a closure over its inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vit.attention import sliding_window_attention
    from vit.flex_longformer import GLOBAL_GROUP, _cached_block_mask, _compiled_flex  # deferred: the kernel's cache

    if name == "ours_flex_d1_g_prefix":
        return _with_global_keys("prefix", _forward("ours_flex_d1_g", q, k, v, global_mask))
    if name.startswith("ours_"):
        kernel, dilation = name.split("_")[1], int(name.split("_d")[1][0])
        globals_ = global_mask if name.endswith("_g") else None
        return lambda: sliding_window_attention(q, k, v, window=WINDOW, dilation=dilation, global_mask=globals_,
                                                kernel=kernel)
    if name == "plain_flex_swa":
        import copy

        radius, n = WINDOW // 2, q.shape[2]
        block_mask = copy.copy(_cached_block_mask(n, radius, 1, 0, GLOBAL_GROUP, q.device))
        block_mask.mask_mod = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= radius
        compiled = _compiled_flex()
        return lambda: compiled(q, k, v, block_mask=block_mask)
    if name == "dense_sdpa_flash":
        def dense():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        return dense
    raise ValueError(f"unknown row {name!r}; choose from {ROWS}")


def _with_global_keys(layout: str, forward):
    """`forward` run with `vit.flex_longformer.GLOBAL_KEYS = layout` (the backward reuses what it made)."""
    from vit import flex_longformer

    def run():
        saved, flex_longformer.GLOBAL_KEYS = flex_longformer.GLOBAL_KEYS, layout
        try:
            return forward()
        finally:
            flex_longformer.GLOBAL_KEYS = saved
    return run


def _step(forward, inputs, grad):
    def step():
        for t in inputs:
            t.grad = None
        forward().backward(grad)
    return step


def _time_one_n(n: int, reps: int, deadline: float) -> list[dict]:
    """All rows at one N: warm-up (and compile) each, one measured pass for memory, then `reps`
    passes taking turns, timed with CUDA events."""
    import torch

    inputs, grad, global_mask = _inputs(n)
    steps, rows = {}, {}
    for name in ROWS:
        rows[name] = {"row": name, "n": n}
        if time.monotonic() > deadline:
            rows[name]["error"] = "skipped: the run's time budget was spent"
            continue
        try:
            step = _step(_forward(name, *inputs, global_mask), inputs, grad)
            step()  # warm-up (compiles FlexAttention for this shape)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            rows[name]["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            steps[name] = step
        except Exception as err:  # noqa: BLE001  (one row failing, e.g. out of memory, must not stop the others)
            rows[name]["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            torch.cuda.empty_cache()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    for name, t in times.items():
        rows[name]["median_ms"] = round(statistics.median(t), 3)
        rows[name]["min_ms"] = round(min(t), 3)
    return list(rows.values())


def _agreement(n: int = 4096) -> dict:
    """Largest |flex - banded| (and relative to the largest |banded|), bf16, globals and padding."""
    import torch

    from vit.attention import sliding_window_attention

    # Batch 1, as in the timed rows, so that the compiled kernels are shared with them.
    (q, k, v), grad, global_mask = _inputs(n, seed=1)
    padding = torch.zeros(1, n, dtype=torch.bool, device="cuda")
    padding[0, n - n // 5:] = True  # a padded tail
    padding[0, n // 2: n // 2 + 300] = True  # a padded run in the middle
    out = {}
    for dilation in (1, 2):
        results = {}
        for kernel, layout in (("banded", "merge"), ("flex", "merge"), ("flex", "prefix")):
            for t in (q, k, v):
                t.grad = None
            y = _with_global_keys(layout, lambda: sliding_window_attention(
                q, k, v, window=WINDOW, dilation=dilation, global_mask=global_mask, padding_mask=padding,
                kernel=kernel))()
            y.backward(grad)
            results[kernel if kernel == "banded" else layout] = (y.detach().float(), q.grad.float())
        for layout in ("merge", "prefix"):
            for what, i in (("out", 0), ("dq", 1)):
                ref, got = results["banded"][i], results[layout][i]
                diff = (got - ref).abs().max().item()
                out[f"d{dilation}_{layout}_{what}"] = {"max_abs": round(diff, 5),
                                                       "max_rel": round(diff / ref.abs().max().item(), 5)}
    return out


def _profile(name: str, n: int, top: int = 12) -> dict:
    """Where one pass of a row spends GPU time: its `top` kernels by total time (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    inputs, grad, global_mask = _inputs(n)
    step = _step(_forward(name, *inputs, global_mask), inputs, grad)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {"row": name, "n": n, "gpu_ms_total": round(sum(e.self_device_time_total for e in events) / 1e3, 3),
            "top_kernels": [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 3), "calls": e.count}
                            for e in events[:top]]}


def main(lengths: list[int], reps: int, budget_s: float) -> None:
    """Print a short table (stderr) and one JSON object (stdout)."""
    import torch
    import torch._dynamo

    # One compiled kernel per shape and mask: more than dynamo's default of 8 entries in one run.
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 256),
                        ("accumulated_cache_size_limit", 256)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    started = time.monotonic()
    deadline = started + budget_s
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "config": {"dtype": "bfloat16", "batch": 1, "heads": HEADS, "head_dim": DIM, "window": WINDOW,
                               "global_tokens": NUM_GLOBALS, "pass": "forward + backward of attention alone",
                               "time": f"median of {reps} passes, CUDA events, rows taking turns",
                               "memory": "max_memory_allocated over one pass, inputs included"}}
    try:
        result["flex_vs_banded_bf16_4096"] = _agreement()
    except Exception as err:  # noqa: BLE001
        result["flex_vs_banded_bf16_4096"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    rows = []
    for n in sorted(lengths, reverse=True):  # the longest first: if time runs short, short N go
        rows = _time_one_n(n, reps, deadline) + rows
        torch.cuda.empty_cache()
    result["rows"] = rows
    for key, row in (("profile", "ours_flex_d1_g"), ("profile_prefix", "ours_flex_d1_g_prefix")):
        if key != "profile" and time.monotonic() > deadline + 15:  # the JSON must come out within the caller's limit
            result[key] = {"error": "skipped: the run's time budget was spent"}
            continue
        try:
            result[key] = _profile(row, max(lengths))
        except Exception as err:  # noqa: BLE001
            result[key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    result["wall_s"] = round(time.monotonic() - started, 1)
    print(f"{'row':<22} {'N':>6} {'median ms':>10} {'peak MiB':>9}", file=sys.stderr)
    for r in rows:
        print(f"{r['row']:<22} {r['n']:>6} {r.get('median_ms', '-'):>10} {r.get('peak_mib', '-'):>9} "
              f"{r.get('error', '')}", file=sys.stderr)
    for profiled in (result["profile"], result["profile_prefix"]):
        for kernel in profiled.get("top_kernels", []):
            print(f"  profile {profiled['row']} N={profiled['n']}: {kernel['ms']:>8} ms "
                  f"x{kernel['calls']:<3} {kernel['name']}", file=sys.stderr)
    print(json.dumps(result))
