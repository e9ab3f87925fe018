"""Images/s of the embed stage on this machine, beside a plain PyTorch forward of the same model on the same images.

    python benchmarks/embed_throughput.py            # prints one JSON object

A synthetic fractal corpus (`--images`, default 256) is ingested at `--image-size`
(224, patch 16) into a temporary folder; the model is a randomly initialised
`--model` (ViT-Ti/16; speed does not depend on the weights), saved as a checkpoint
directory that the stage loads as `init`.

Two ways of embedding every image, taking turns for `--rounds` rounds after one
warm-up of each (medians quoted):

* `stage`: `run_embed` with `force` (every shard recomputed) on a local Ray cluster of
  `--cpus` + 1 logical CPUs: one actor of `--cpus` CPUs (as many torch threads), batches of 64,
  and the extra one for the tasks that read the shards.
  Its figure is the stage's own `images_per_s`: the images over the whole
  computation, reading the shards, starting the actor and shipping the model included;
* `direct`: the same images, already decoded and normalised in memory, through
  `pooled_features` in batches of 64 with as many threads, no Ray: the model's own cost.

Both run at the precision the stage resolves for "auto" on this CPU (reported).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

import vit  # noqa: E402
from pipelines.core.shards import read_manifest  # noqa: E402
from pipelines.corpora.images import synth_corpus  # noqa: E402
from pipelines.image.data import normalize, patches_array  # noqa: E402
from pipelines.image.embed import run_embed  # noqa: E402
from pipelines.image.configs import EmbedConfig
from pipelines.image.ingest import run_ingest  # noqa: E402
from pipelines.image.configs import IngestConfig
from pipelines.training.step import resolve_precision  # noqa: E402


def ingest(tmp: Path, images: int, size: int) -> str:
    synth_corpus(str(tmp / "corpus"), images=images, classes=8, size=size, seed=0)
    config = IngestConfig(source=str(tmp / "corpus"), output=str(tmp / "data"), image_size=size, patch_size=16,
                          val_fraction=0.0, shard_size=64)
    return run_ingest(config).output


def stored_patches(uri: str) -> np.ndarray:
    """Every image of the ingest output, normalised, as the stage's actors see them."""
    manifest = read_manifest(uri)
    tables = [pq.read_table(f"{uri}/{s['path']}", columns=["patches"]) for s in manifest["shards"]]
    return np.concatenate([normalize(patches_array(t.column("patches"), manifest["num_patches"],
                                                   manifest["patch_dim"])) for t in tables])


def direct(model: torch.nn.Module, patches: np.ndarray, bf16: bool) -> float:
    """Images/s of `pooled_features` over `patches` in batches of 64."""
    start = time.perf_counter()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, len(patches), 64):
            model.pooled_features(torch.from_numpy(patches[i:i + 64]))
    return len(patches) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--model", default="ViT-Ti/16")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    logging.disable(logging.WARNING)
    torch.set_num_threads(args.cpus)
    # One logical CPU more than the actor takes: the tasks reading the shards need one (they use little).
    ray.init(num_cpus=args.cpus + 1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = ingest(tmp, args.images, args.image_size)
        torch.manual_seed(0)
        model = vit.create_model(args.model, image_size=args.image_size, num_classes=0).eval()
        checkpoint = vit.save_checkpoint(model, tmp / "checkpoint")
        bf16 = resolve_precision("auto", torch.device("cpu")) is not None
        config = EmbedConfig(data=data, output=str(tmp / "embeddings"), init=str(checkpoint), batch_size=64,
                             cpus_per_worker=args.cpus, tracking_uri=f"sqlite:///{tmp}/mlflow.db", experiment="bench")
        patches = stored_patches(data)
        ways = {"stage": lambda: run_embed(config, force=True).images_per_s,
                "direct": lambda: direct(model, patches, bf16)}
        for way in ways.values():
            way()  # warm-up
        figures: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):  # the first mover alternates
                figures[name].append(ways[name]())
    ray.shutdown()
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(json.dumps({
        "benchmark": "embed_throughput", "model": args.model, "image_size": args.image_size, "images": args.images,
        "cpus": args.cpus, "precision": "bf16" if bf16 else "fp32", "rounds": args.rounds,
        "stage_images_per_s": round(medians["stage"], 1), "direct_images_per_s": round(medians["direct"], 1),
        "stage_over_direct": round(medians["stage"] / medians["direct"], 3),
        "all": {name: [round(v, 1) for v in values] for name, values in figures.items()},
    }))


if __name__ == "__main__":
    main()
