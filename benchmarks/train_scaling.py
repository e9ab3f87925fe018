"""Throughput of the Ray Train loop against the same step in one plain process.

    python benchmarks/train_scaling.py --json

Ray side: `pipelines.training.loop.train_loop_per_worker` on N workers × 1 torch
thread, streaming an ingested corpus through Ray Data (`get_dataset_shard` →
`iter_torch_batches`), DDP over gloo. Plain side: the same model and the same
`TrainStep` in this process with N torch threads, on the same global batch,
data already in memory. Plain and Ray runs alternate for `--rounds` rounds, each
after its own warm-up steps, and the medians are compared, so a drifting machine
load does not favour either side.
`ratio` = Ray rate / plain rate: what Ray and data streaming cost (target ≥ 0.9).

Prints one JSON object with `--json`, a short table otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.corpora.images import synth_corpus  # noqa: E402
from pipelines.core.shards import read_manifest  # noqa: E402
from pipelines.image.data import load_split, patch_dataset  # noqa: E402
from pipelines.image.ingest import run_ingest  # noqa: E402
from pipelines.image.configs import IngestConfig
from pipelines.training import step as train_step  # noqa: E402
from pipelines.training.loop import train_loop_per_worker  # noqa: E402
from pipelines.training.recipe import LoopSettings  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps run before timing starts (both sides)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (both sides)")
    p.add_argument("--rounds", type=int, default=3, help="alternating plain/Ray rounds (medians reported)")
    # Enough rows that warm-up + timed steps fit in one pass: the timed window is steady-state
    # streaming, not Ray Data's per-pass start-up (seconds here), which long runs amortise.
    p.add_argument("--images", type=int, default=2600, help="corpus size (train split ~90%%)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--data", default=None, help="an existing ingest output to use instead of generating one")
    p.add_argument("--workdir", default=None, help="where to put the corpus and run files (default: a temp dir)")
    args = p.parse_args(argv)
    if args.global_batch % args.workers:
        p.error(f"--global-batch {args.global_batch} is not divisible by --workers {args.workers}")
    return args


def steps_per_pass(manifest: dict[str, Any], args: argparse.Namespace) -> int:
    """Optimizer steps one pass over the train split gives each worker."""
    return int(manifest["counts"]["train"]) // args.workers // (args.global_batch // args.workers)


def make_data(workdir: Path, args: argparse.Namespace) -> str:
    """Render a fractal corpus and ingest it (in a short-lived local Ray)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        synth_corpus(str(workdir / "corpus"), images=args.images, classes=10, size=args.image_size, seed=0)
        config = IngestConfig(source=str(workdir / "corpus"), output=str(workdir / "data"), image_size=args.image_size,
                              patch_size=args.patch_size, val_fraction=0.1, shard_size=512)
        return run_ingest(config).output
    finally:
        ray.shutdown()


def settings_for(args: argparse.Namespace, manifest: dict[str, Any], steps: int, checkpoint_interval: int) -> LoopSettings:
    overrides = dict(image_size=args.image_size, patch_size=args.patch_size, num_classes=int(manifest["num_classes"]),
                     depth=args.depth, embed_dim=args.width, num_heads=args.heads, mlp_dim=4 * args.width)
    return LoopSettings(
        model_name="ViT-B/16", model_overrides=overrides, steps=steps, warmup_steps=1, lr=1e-3,
        precision=args.precision, batch_size_per_worker=args.global_batch // args.workers,
        checkpoint_interval=checkpoint_interval, eval_interval=0, log_interval=10**9, torch_threads=1,
        val_dataset=None,
    )


def plain_rate(args: argparse.Namespace, settings: LoopSettings, data: str) -> float:
    """Images/s of `TrainStep` in this process with `--workers` threads, data in memory."""
    torch.set_num_threads(args.workers)
    x_all, y_all = load_split(data, "train")
    x_all, y_all = torch.as_tensor(x_all), torch.as_tensor(y_all).long()
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = train_step.build_model(settings)
    opt = train_step.build_optimizer(model, settings.lr, settings.weight_decay, settings.betas)
    step = train_step.TrainStep(model, opt, train_step.build_scheduler(opt, settings), device=device,
                                amp_dtype=train_step.resolve_precision(settings.precision, device))
    b = args.global_batch
    batches = len(x_all) // b

    def run(n: int, offset: int) -> None:
        for i in range(n):
            j = (offset + i) % batches
            step([(x_all[j * b:(j + 1) * b], y_all[j * b:(j + 1) * b])])

    run(args.warmup_steps, 0)
    start = time.perf_counter()
    run(args.steps, args.warmup_steps)
    return b * args.steps / (time.perf_counter() - start)


def ray_rate(args: argparse.Namespace, settings: LoopSettings, data: str, storage: Path) -> tuple[float, str]:
    """Images/s of the Ray Train loop over the timed steps (the loop's own per-report rate)."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    # Logical CPUs for the workers plus Ray Data's read/decode tasks; they share the physical cores.
    ray.init(num_cpus=args.workers + 2, _node_ip_address="127.0.0.1", include_dashboard=True,
             dashboard_host="127.0.0.1", log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=settings.model_dump(mode="json"),
            scaling_config=ray.train.ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
            run_config=ray.train.RunConfig(name="train-scaling", storage_path=str(storage)),
            datasets={"train": patch_dataset(data, "train", augment=False)},
        )
        result = trainer.fit()
        # The last report covers the steps after the warm-up checkpoint: the timed window.
        dtype = train_step.resolve_precision(settings.precision, torch.device("cpu")) or torch.float32
        return float(result.metrics["images_per_s"]), str(dtype)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ray's default 30 s for the raylet to come up is too short on a busy small machine.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        data = args.data or make_data(work, args)
        manifest = read_manifest(data)
        total = args.warmup_steps + args.steps
        if total > steps_per_pass(manifest, args):
            print(f"note: {total} steps span more than one pass over the data "
                  f"({steps_per_pass(manifest, args)} steps); the Ray rate includes a pass start-up", file=sys.stderr)
        settings = settings_for(args, manifest, total, checkpoint_interval=args.warmup_steps)
        # Alternate plain and Ray round by round (each after its own warm-up), so a drifting
        # machine favours neither; report medians.
        plain_rates, ray_rates = [], []
        for i in range(args.rounds):
            plain_rates.append(plain_rate(args, settings, data))
            ips, precision = ray_rate(args, settings, data, work / f"runs-{i}")
            ray_rates.append(ips)
    plain, ray_ips = statistics.median(plain_rates), statistics.median(ray_rates)
    out = {
        "ray_images_per_s": round(ray_ips, 2),
        "plain_images_per_s": round(plain, 2),
        "ray_images_per_s_rounds": [round(r, 1) for r in ray_rates],
        "plain_images_per_s_rounds": [round(r, 1) for r in plain_rates],
        "ratio": round(ray_ips / plain, 3),
        "workers": args.workers,
        "threads_per_worker": 1,
        "plain_threads": args.workers,
        "global_batch": args.global_batch,
        "timed_steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "steps_per_pass": steps_per_pass(manifest, args),
        "precision": precision.replace("torch.", ""),
        "model": {"depth": args.depth, "width": args.width, "heads": args.heads, "image_size": args.image_size,
                  "patch_size": args.patch_size, "tokens": (args.image_size // args.patch_size) ** 2 + 1},
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key in ("ray_images_per_s", "plain_images_per_s", "ratio"):
            print(f"{key:>20}: {out[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
