"""The pretrain stage's input path in images/s per CPU core: shards → Ray Data → the worker's batches.

    python benchmarks/data_feed.py --json                  # 5,000 images at 224 px, patch 16, batch 128
    python benchmarks/data_feed.py --images 512 --json     # a quick check

A corpus of photo-like JPEGs (`ingest_throughput.make_corpus`) is ingested once with the
project's own ingest (224 px, patch 16) and kept in `--workdir`. Each measurement then
streams one pass over the train split through `pipelines.image.data.patch_dataset` and the
worker's own iterator (`pipelines.training.worker.train_batches` on a streaming split, as
Ray Train hands it to a worker, rows in order), in two modes that alternate after a warm-up:

* `cpu_aug`: random-resized crop + flip per image with Pillow on the Ray Data workers (the
  pretrain recipe's `augment_on: cpu`).
* `device_aug`: no CPU augmentation in the data path, which carries the stored uint8 pixels
  (`patch_dataset(raw=True)`); normalising them and the batched tensor crop
  (`pipelines.training.augment`, `augment_on: device`) run on each batch as it arrives, here
  on CPU torch (one thread). Their CPU seconds are counted apart: on a GPU they run there.
* `device_aug_float` (with `--modes`): the same, but the data path normalises to float32 on
  the CPU as the `cpu_aug` path does: four times the bytes through Ray.

Per core means images over the CPU seconds (user + system) of the whole process tree, the
driver and every Ray process, in the timed window (from the first batch to the last).
`cores_per_gpu` is 3,600 images/s (one H200's ViT-B/16 step, compiled) over the per-core
rate. Medians over `--rounds`.
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

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ingest_throughput import make_corpus  # noqa: E402

from pipelines.image.data import patch_dataset  # noqa: E402
from pipelines.image.ingest import run_ingest  # noqa: E402
from pipelines.image.configs import IngestConfig
from pipelines.training.augment import augment_patch_batches  # noqa: E402
from pipelines.training.hooks import LoopHooks  # noqa: E402
from pipelines.training.recipe import AugmentConfig, LoopSettings  # noqa: E402
from pipelines.training.worker import train_batches  # noqa: E402

GPU_IMAGES_PER_S = 3600  # ViT-B/16 at 224, bf16, compiled, one H200 (issue 18)


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and all its descendants alive now (Ray's too)."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def ingest(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The shards of the benchmark corpus (ingested once, reused while complete) and their manifest."""
    root, _ = make_corpus(args.workdir, args.images, 256, 512, args.cpus)
    out = args.workdir / f"feed-shards-{args.images}-{args.image_size}-{args.patch_size}"
    result = run_ingest(IngestConfig(source=str(root), output=str(out), image_size=args.image_size,
                                     patch_size=args.patch_size, shard_size=256, val_fraction=0.0))
    return str(out), result.manifest


class Pass:
    """One timed pass over the train split in one mode."""

    def __init__(self, data: str, manifest: dict[str, Any], batch: int, mode: str) -> None:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # as `build_trainer` sets it for a seeded run
        ds = patch_dataset(data, "train", augment=mode == "cpu_aug", raw=mode == "device_aug", shuffle=True, seed=0,
                           batch_size=64)
        self.shard = ds.streaming_split(1, equal=True)[0]  # what Ray Train hands each worker
        self.settings = LoopSettings(model_name="ViT-B/16", steps=1, batch_size_per_worker=batch, seed=0)
        self.manifest, self.device_aug = manifest, mode.startswith("device_aug")

    def run(self) -> dict[str, float]:
        """Images/s per core of the feed (first batch to last) and, apart, of the tensor augmentation."""
        m = self.manifest
        batches = train_batches(self.shard, self.settings, rank=0, epoch=0, skip=0)
        hooks = LoopHooks()
        aug_seconds, images, start = 0.0, 0, None
        for epoch, index, batch in batches:
            if start is None:  # the window opens once the stream runs: the pipeline's start-up is not counted
                start, cpu0 = time.perf_counter(), tree_cpu_seconds()
            else:
                images += len(batch["label"])
            if self.device_aug:
                t0 = time.thread_time()
                ((_, _, batch),) = augment_patch_batches(
                    iter([(epoch, index, batch)]), patch_size=m["patch_size"], grid=tuple(m["grid"]),
                    aug=AugmentConfig(), seed=0, rank=0)
                aug_seconds += time.thread_time() - t0
            hooks.inputs(batch)
            if index == m["counts"]["train"] // self.settings.batch_size_per_worker:
                break  # the last full batch of the pass: `train_batches` would start the next epoch
        seconds, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu0
        feed_cpu = cpu - aug_seconds
        out = {"images": images, "wall_images_per_s": images / seconds, "cpu_seconds": cpu,
               "per_core": images / feed_cpu}
        if self.device_aug:
            out["tensor_aug_per_core"] = images / aug_seconds
        return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--patch-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128, help="rows per worker batch")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="cpu_aug,device_aug", help="cpu_aug, device_aug, device_aug_float")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "vitpipe-bench")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args()


def main() -> None:
    import ray
    import torch

    args = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the tensor augmentation's CPU time is then this thread's
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
    data, manifest = ingest(args)
    modes = args.modes.split(",")
    for mode in modes:  # warm-up: workers started, libraries imported, files cached
        Pass(data, manifest, args.batch, mode).run()
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            rounds[mode].append(Pass(data, manifest, args.batch, mode).run())
    ray.shutdown()

    report: dict[str, Any] = {"images": manifest["counts"]["train"], "image_size": args.image_size,
                              "patch_size": args.patch_size, "batch": args.batch, "cpus": args.cpus,
                              "rounds": args.rounds}
    for name, runs in rounds.items():
        for key in runs[0]:
            if key != "images":
                report[f"{name}_{key}"] = statistics.median(r[key] for r in runs)
        report[f"{name}_per_core_rounds"] = [round(r["per_core"], 1) for r in runs]
    for mode in modes:
        report[f"cores_per_gpu_{mode}"] = GPU_IMAGES_PER_S / report[f"{mode}_per_core"]
    report = {k: round(v, 3) if isinstance(v, float) else v for k, v in report.items()}
    print(json.dumps(report) if args.json else "\n".join(f"{k:>32}: {v}" for k, v in report.items()))


if __name__ == "__main__":
    main()
