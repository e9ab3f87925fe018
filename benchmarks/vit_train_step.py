"""Training-step throughput of our ViT against Hugging Face's and timm's: CPU or CUDA, eager or compiled.

The one run on a lent GPU (ViT-B/16 at 224, batch 256, bf16 autocast, fused AdamW; 3 to 4 minutes: two
`torch.compile`s of about a minute each, then the variants while they fit in `--budget-s` 230; `wall_s` in
the JSON says how long it took):

    PYTHONPATH=. python benchmarks/vit_train_step.py --device cuda --compile both \
        --variant cudnn-attention --variant bf16-master --json

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

import torch

import mae_step  # this script's folder is on sys.path when it runs
from train_step_models import CLOCKS, DTYPES, build, cpu_info, measure, mm_shapes, profile
from train_step_suite import SUITE_MODELS, VARIANTS, suite


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
