"""`vit_train_step.py --objective mae`: an MAE training step against a supervised one on the same encoder.

    PYTHONPATH=. python benchmarks/vit_train_step.py --objective mae --model ViT-B/16 --batch 4 --dtypes bf16 \
        --threads 1 --clock cpu --steps 5 --warmup 1 --json
    PYTHONPATH=. python benchmarks/vit_train_step.py --objective mae --device cuda --json   # ViT-B/16, batch 256

Every step is forward, loss, backward and fused AdamW (`zero_grad(set_to_none=True)`), under bf16
autocast on the device for bf16. Supervised: the ViT with a `--num-classes` head and cross-entropy.
MAE: the same ViT without a head inside `vit.MaskedAutoencoder` (mask ratio 0.75, normalised-pixel
loss, masks drawn on the device), once per `--decoders` entry: by default the paper's 512-wide, 8-deep
decoder and its 256-wide ablation (Table 1b, ViT-L: 84.8 against 84.9 fine-tuned). With `--compile only`
every model runs under `torch.compile`, so elementwise work (LayerNorms, GELUs, residual adds, which scale
with tokens, not FLOPs) is fused alike. After warm-up the steps take turns, each going first in turn; a
ratio is the median over rounds of that round's MAE/supervised step times, so load from elsewhere cancels.
`flop_ratio` is the same ratio by forward multiply-accumulates, the figure a compute-bound device would
approach.
Imports only torch and vit, so it runs where pydantic, Ray and MLflow are absent.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from train_step_models import adamw  # this script's folder is on sys.path when it runs


DECODER_RE = re.compile(r"^(\d+)d(\d+)b(\d+)h$")


def decoder_spec(text: str) -> tuple[int, int, int]:
    """"512d8b16h" -> (width 512, depth 8, heads 16)."""
    m = DECODER_RE.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"decoder {text!r} is not WIDTHdDEPTHbHEADSh, e.g. 512d8b16h")
    return int(m[1]), int(m[2]), int(m[3])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The MAE options of the benchmark's command line."""
    p.add_argument("--mask-ratio", type=float, default=0.75, help="with --objective mae")
    p.add_argument("--decoders", type=lambda text: [decoder_spec(d) for d in text.split(",")],
                   default=[(512, 8, 16), (256, 8, 8)],
                   help="with --objective mae: comma-separated WIDTHdDEPTHbHEADSh decoders, each timed against "
                        "the supervised step (default: the paper's 512d8b16h and its 256-wide ablation)")


def _blocks_macs(tokens: int, dim: int, mlp: int, depth: int) -> int:
    """Multiply-accumulates of `depth` pre-LN blocks on `tokens` tokens: qkv, attention, out, MLP."""
    return depth * (tokens * dim * 3 * dim + 2 * tokens * tokens * dim + tokens * dim * dim + 2 * tokens * dim * mlp)


def flop_ratio(config, decoder: tuple[int, int, int], mask_ratio: float, num_classes: int) -> float:
    """Forward MACs per image of an MAE step over a supervised step (head included) of a `config` encoder."""
    from vit.mae import num_visible  # like vit_train_step, vit loads only once a run starts

    c, (width, depth, _) = config, decoder
    n, prefix = c.num_patches, 1 if c.class_token else 0
    keep = num_visible(n, mask_ratio)
    supervised = n * c.patch_dim * c.embed_dim + _blocks_macs(n + prefix, c.embed_dim, c.mlp_dim, c.depth)
    supervised += c.embed_dim * num_classes
    masked = keep * c.patch_dim * c.embed_dim + _blocks_macs(keep + prefix, c.embed_dim, c.mlp_dim, c.depth)
    masked += (keep + prefix) * c.embed_dim * width + _blocks_macs(n + prefix, width, 4 * width, depth)
    return (masked + n * width * c.patch_dim) / supervised


def _steps(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """Step closures by name, "supervised" first, then one per decoder; and the names of the MAE steps."""
    import vit

    torch.manual_seed(0)
    supervised = vit.create_model(args.model, image_size=args.image_size, num_classes=args.num_classes).to(device)
    maes = {}
    for width, depth, heads in args.decoders:
        encoder = vit.create_model(args.model, image_size=args.image_size, num_classes=0)
        maes[f"mae_{width}d{depth}b{heads}h"] = vit.MaskedAutoencoder(encoder, width, depth, heads,
                                                                      args.mask_ratio).to(device)
    g = torch.Generator(device=device).manual_seed(1)
    c = supervised.config
    images = torch.randn(args.batch, c.in_channels, args.image_size, args.image_size, generator=g, device=device)
    labels = torch.randint(0, args.num_classes, (args.batch,), generator=g, device=device)
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    compiled = getattr(args, "compile", "none") == "only"

    def make(model, loss_of) -> Callable[[], None]:
        opt = adamw(model.parameters())
        run = torch.compile(model) if compiled else model  # the same parameters, a fused forward and backward

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(**autocast):
                loss = loss_of(run)
            loss.backward()
            opt.step()

        return step

    steps = {"supervised": make(supervised, lambda m: F.cross_entropy(m(images).float(), labels))}
    for name, mae in maes.items():
        steps[name] = make(mae, lambda m: m(images, generator=g).loss)
    return steps, list(maes)


def _timer(device: torch.device, clock: Callable[[], float]) -> Callable[[Callable[[], None]], float]:
    def timed(fn: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - t0

    return timed


def measure(args: argparse.Namespace, dtype: torch.dtype, clock: Callable[[], float]) -> dict[str, object]:
    """Median step times of every step, taking turns round by round, and each MAE's ratio to supervised."""
    device = torch.device(getattr(args, "device", "cpu"))
    steps, names_of_maes = _steps(args, device, dtype)
    timed = _timer(device, clock)
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.steps):
        shift = i % len(names)  # each step goes first in turn
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(steps[name]))
    result: dict[str, object] = {f"{n}_img_s": args.batch / statistics.median(t) for n, t in times.items()}
    for name in names_of_maes:
        # Each round's own pair, so slow spells from other load cancel out.
        ratios = [m / s for m, s in zip(times[name], times["supervised"])]
        result[f"{name}_over_supervised"] = statistics.median(ratios)
        result[f"{name}_over_supervised_range"] = [min(ratios), max(ratios)]
    return result


def run(args: argparse.Namespace, dtypes: dict[str, torch.dtype], clock: Callable[[], float]) -> dict[str, object]:
    """The MAE comparison's result object, one entry per dtype plus the setting."""
    import vit

    t0 = time.perf_counter()
    result: dict[str, object] = {
        "objective": "mae", "model": args.model, "batch": args.batch, "image_size": args.image_size,
        "device": getattr(args, "device", "cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "mask_ratio": args.mask_ratio,
        "steps": args.steps, "warmup": args.warmup, "compile": getattr(args, "compile", "none"),
        "target_mae_over_supervised": 0.4,
    }
    config = vit.preset_config(args.model, image_size=args.image_size, num_classes=0)
    for d in args.decoders:
        name = "mae_{}d{}b{}h".format(*d)
        result[f"{name}_flop_ratio"] = flop_ratio(config, d, args.mask_ratio, args.num_classes)
    for name in args.dtypes:
        for key, value in measure(args, dtypes[name], clock).items():
            result[f"{key}_{name}"] = value
    result["wall_s"] = time.perf_counter() - t0
    return result
