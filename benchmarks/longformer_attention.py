"""Forward+backward time and peak memory of three self-attention modules against N.

    python benchmarks/longformer_attention.py --json [--plot docs/longformer_scaling.png]
    python benchmarks/longformer_attention.py --device cuda     (GPU mode: see longformer_cuda.py)

- ours:  `vit.longformer.LongformerSelfAttention` (banded kernel; global K/V folded, see its docstring)
- ours_projected: the same module forced to project K_g and V_g over the whole sequence, as HF does
- hf:    Hugging Face's `LongformerSelfAttention`, same weights, same window
- dense: the same Q/K/V projections and full `scaled_dot_product_attention`

All include their projections (Q, K, V and, for the Longformer modules, the
global ones). Hidden 768, 12 heads, window 256, token 0 global, batch 1.

Time: the median and the fastest of `--reps` passes after a warm-up (ratios use medians); all implementations at one N
run in one process taking turns, so load from elsewhere hits them alike (the
ratios are what to trust on a shared machine). Memory: each row in a fresh
process, its peak resident set (VmHWM, reset through /proc/self/clear_refs)
during one pass minus its resident set just before: everything the pass
allocates (activations, saved tensors, gradients, scratch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, HEADS, WINDOW = 768, 12, 256
IMPLS = ("ours", "ours_projected", "hf", "dense")
DEFAULT_LENGTHS, DEFAULT_REPS = [1024, 4096, 16384], 3
# A fixed mmap threshold turns off glibc's adaptive one, so every tensor of 64 KiB or more
# is its own mapping, returned to the OS when freed: RSS then follows live tensors, and
# memory freed by the warm-up cannot hide the measured pass's allocations.
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
PLAN = [("ours", "float32"), ("ours", "bfloat16"), ("ours_projected", "float32"), ("hf", "float32"),
        ("dense", "float32")]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _build(impl: str, dtype_name: str, n: int):
    import torch
    import torch.nn.functional as F
    from transformers import LongformerConfig as HFConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention as HFSelfAttention

    from vit.longformer import LongformerSelfAttention

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    hf = HFSelfAttention(HFConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, attention_window=[WINDOW],
                                  attention_probs_dropout_prob=0.0), layer_id=0)
    x = torch.randn(1, n, HIDDEN, dtype=dtype, requires_grad=True)
    is_global = torch.zeros(1, n, dtype=torch.bool)
    is_global[0, 0] = True

    if impl in ("ours", "ours_projected"):
        module = LongformerSelfAttention(HIDDEN, HEADS, WINDOW, fold_global_kv=None if impl == "ours" else False)
        module.load_state_dict(hf.state_dict())
        module = module.to(dtype)
        return module, lambda: module(x, is_global)
    if impl == "hf":
        mask = is_global.to(dtype) * 10000.0  # HF's layer API: +10000 global, 0 local, -10000 padding
        hf = hf.to(dtype)
        return hf, lambda: hf(x, attention_mask=mask, is_index_masked=mask < 0, is_index_global_attn=mask > 0,
                              is_global_attn=True)[0]
    if impl == "dense":
        projections = torch.nn.ModuleList([hf.query, hf.key, hf.value]).to(dtype)

        def dense():
            q, k, v = (p(x).view(1, n, HEADS, -1).transpose(1, 2) for p in projections)
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, n, HIDDEN)

        return projections, dense
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def _stepper(impl: str, dtype_name: str, n: int):
    """A function running one forward+backward pass (parameter gradients cleared first)."""
    import torch

    module, forward = _build(impl, dtype_name, n)
    grad_out = None

    def step() -> None:
        nonlocal grad_out
        for p in module.parameters():
            p.grad = None
        out = forward()
        if grad_out is None:
            grad_out = torch.randn_like(out)
        out.backward(grad_out)

    return module, step


def memory_row(impl: str, dtype_name: str, n: int) -> dict:
    """Peak memory of one pass of one implementation, measured in this (fresh) process."""
    module, step = _stepper(impl, dtype_name, n)
    step()  # warm-up; also allocates the output gradient outside the measured pass
    for p in module.parameters():
        p.grad = None
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    peak = _rss_kib("VmHWM")
    return {"impl": impl, "dtype": dtype_name, "n": n, "peak_mem_mib": round((peak - before) / 1024, 1)}


def time_rows(plan: list[tuple[str, str]], n: int, reps: int) -> list[dict]:
    """Pass times of every implementation at one N, the implementations taking turns
    in one process so that load from elsewhere on the machine hits them all alike."""
    import torch

    steps = {key: _stepper(*key, n)[1] for key in plan}
    for step in steps.values():
        step()  # warm-up
    times: dict[tuple[str, str], list[float]] = {key: [] for key in plan}
    for _ in range(reps):
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    return [{"impl": impl, "dtype": dtype_name, "n": n, "time_s": round(min(t), 4),
             "median_s": round(statistics.median(t), 4), "times_s": [round(x, 4) for x in t],
             "threads": torch.get_num_threads()}
            for (impl, dtype_name), t in times.items()]


def run_script(script: str, args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[object | None, str]:
    """The JSON that `python script *args` prints last, or None and why it gave none (also for other benchmarks)."""
    cmd = [sys.executable, script, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout:.0f} s"
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()
        return None, "killed (out of memory?)" if done.returncode < 0 or not tail else f"failed: {tail[-1]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), ""


def _dense_fits(n: int) -> tuple[bool, str]:
    """Whether the dense module fits in free memory. On CPU, `scaled_dot_product_attention`
    runs a flash kernel that never holds the N×N scores, so what it needs is O(N):
    about 16 (N, hidden) fp32 tensors (projections, q/k/v, output and their gradients)."""
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    need = 16 * n * HIDDEN * 4
    if need > 0.8 * free:
        return False, f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return True, ""


def _summary(rows: list[dict]) -> dict:
    def time_of(impl, n, dtype="float32"):  # medians: the ratios quoted are of typical passes
        return next((r.get("median_s") for r in rows if (r["impl"], r["n"], r["dtype"]) == (impl, n, dtype)), None)

    def mem_of(impl, n, dtype="float32"):
        return next((r.get("peak_mem_mib") for r in rows if (r["impl"], r["n"], r["dtype"]) == (impl, n, dtype)), None)

    out = {}
    ours, hf, dense = time_of("ours", 4096), time_of("hf", 4096), time_of("dense", 4096)
    if ours and hf:
        out["speedup_vs_hf_4096"] = round(hf / ours, 2)
    if mem_of("ours", 4096) and mem_of("hf", 4096):
        out["memory_ratio_vs_hf_4096"] = round(mem_of("ours", 4096) / mem_of("hf", 4096), 3)
    if ours and dense:
        out["speedup_vs_dense_4096"] = round(dense / ours, 2)
    ns = sorted({r["n"] for r in rows})
    if len(ns) > 1:
        growth = {}
        for impl in IMPLS:
            t0, t1 = time_of(impl, ns[0]), time_of(impl, ns[-1])
            m0, m1 = mem_of(impl, ns[0]), mem_of(impl, ns[-1])
            if t0 and t1:
                growth[impl] = {"time": round(t1 / t0, 2), "memory": round(m1 / m0, 2) if m0 and m1 else None}
        out[f"growth_{ns[0]}_to_{ns[-1]}"] = {"n_ratio": ns[-1] / ns[0], **growth}
    return out


def plot(rows: list[dict], path: str) -> None:
    """Time and peak memory against N, log-log, one line per implementation and dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r, ax_m) = plt.subplots(1, 3, figsize=(15, 4.2))
    series = sorted({(r["impl"], r["dtype"]) for r in rows if "time_s" in r})
    for impl, dtype in series:
        pts = sorted((r["n"], r["time_s"], r["peak_mem_mib"]) for r in rows
                     if (r["impl"], r["dtype"]) == (impl, dtype) and "time_s" in r)
        label = impl if dtype == "float32" else f"{impl} ({dtype})"
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax_m.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        # Ratios come from implementations timed in turns, so they hold even when load varies between N.
        hf = {r["n"]: r["time_s"] for r in rows if r["impl"] == "hf" and "time_s" in r}
        rel = [(n, t / hf[n]) for n, t, _ in pts if n in hf]
        ax_r.plot([p[0] for p in rel], [p[1] for p in rel], marker="o", label=label)
    for ax, ylabel in ((ax_t, "forward + backward time (s)"), (ax_r, "time relative to Hugging Face"),
                       (ax_m, "peak memory increase (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"Longformer self-attention, hidden {HIDDEN}, {HEADS} heads, window {WINDOW}, 1 global token")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: attention alone in bf16 on a GPU (see longformer_cuda.py)")
    parser.add_argument("--budget-s", type=float, default=140.0, help="cuda: rows not started by then are skipped")
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of time and memory against N")
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS,
                        help="sequence lengths (cuda default: 4096 16384 65536)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS,
                        help="timed passes per row (fastest and median reported; cuda default: 10)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a row is given up")
    parser.add_argument("--replot", metavar="JSON", help="only redraw --plot from a saved --json result")
    parser.add_argument("--memory-row", nargs=3, metavar=("IMPL", "DTYPE", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--time-rows", nargs="+", metavar="N IMPL:DTYPE", help=argparse.SUPPRESS)
    return parser, parser.parse_args()


def measure_lengths(args: argparse.Namespace) -> list[dict]:
    """Every row at every N: memory in a fresh process per row, then the times in one process per N."""
    rows = []
    for n in args.lengths:
        fits, why = _dense_fits(n)
        plan = [key for key in PLAN if fits or key[0] != "dense"]
        skipped = [] if fits else [{"impl": "dense", "dtype": "float32", "n": n, "skipped": f"cannot fit: {why}"}]
        by_key = {}
        for impl, dtype_name in plan:
            mem, why = run_script(__file__, ["--memory-row", impl, dtype_name, str(n)], args.timeout, MEASURE_ENV)
            by_key[(impl, dtype_name)] = mem or {"impl": impl, "dtype": dtype_name, "n": n, "skipped": why}
        # Long sequences get fewer repetitions so the whole run stays within minutes.
        reps = args.reps if n <= 4096 else max(1, args.reps - 1)
        timed_plan = [key for key in plan if "skipped" not in by_key[key]]
        timed, why = run_script(__file__, ["--time-rows", str(n), *(f"{i}:{d}" for i, d in timed_plan), "--reps", str(reps)],
                                 args.timeout * 3)
        for row in timed or []:
            by_key[(row["impl"], row["dtype"])].update(row)
        for key in timed_plan:
            if "time_s" not in by_key[key]:
                by_key[key]["skipped"] = f"timing {why}"
        rows += list(by_key.values()) + skipped
        if not args.json:
            for row in list(by_key.values()) + skipped:
                print(row, flush=True)
    return rows


def main() -> None:
    parser, args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.device == "cuda":
        from longformer_cuda import main as cuda_main

        cuda_main(args.lengths if args.lengths != DEFAULT_LENGTHS else [4096, 16384, 65536],
                  args.reps if args.reps != DEFAULT_REPS else 10, args.budget_s)
        return
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot PATH")
        plot(json.loads(Path(args.replot).read_text())["rows"], args.plot)
        return
    if args.memory_row:
        impl, dtype_name, n = args.memory_row
        print(json.dumps(memory_row(impl, dtype_name, int(n))))
        return
    if args.time_rows:
        plan = [tuple(key.split(":")) for key in args.time_rows[1:]]
        print(json.dumps(time_rows(plan, int(args.time_rows[0]), args.reps)))
        return

    rows = measure_lengths(args)
    result = {
        "config": {"hidden": HIDDEN, "heads": HEADS, "window": WINDOW, "global_tokens": 1, "batch": 1,
                   "pass": "forward + backward, projections included",
                   "time": "fastest of the timed passes after a warm-up (the least disturbed by other load), "
                           "implementations taking turns in one process, seconds",
                   "memory": "peak RSS increase during one pass in a fresh process (VmHWM - VmRSS, "
                             "MALLOC_MMAP_THRESHOLD_=65536), MiB"},
        "rows": rows,
        **_summary(rows),
    }
    if args.plot:
        plot(rows, args.plot)
        result["plot"] = args.plot
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
