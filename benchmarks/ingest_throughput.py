"""Ingest throughput: the Ray stage against a plain single-process loop doing the same work.

    python benchmarks/ingest_throughput.py --json                 # 5,000 JPEGs, 256-512 px, to 224/16
    python benchmarks/ingest_throughput.py --images 300 --json    # a quick check

Measured in one run, on one corpus of JPEGs in class folders, in `--rounds` alternating
rounds (decode, loop, stage, Ray tasks, pool, decode, ...) after a warm-up; medians are reported:

* `decode_resize_per_core`: PIL decode + resize + centre crop only (bytes already in
  memory, `pipelines.image.patches.decode_image`), one process: the per-core ceiling.
* `loop`: one process reads each file, decodes and resizes it, patchifies with numpy
  and appends to one Parquet writer (same compression as the stage).
* `stage`: `run_ingest` on a local Ray cluster of `--cpus` CPUs, after a small warm-up
  run that starts the worker processes. Wall time of the whole stage: listing,
  planning, decoding, Parquet writes, manifest.
* `ray_tasks`: the stage's own per-shard function (`pipelines.image.ingest.process_shard`) over
  the same shard plans as plain Ray tasks of one CPU, all submitted at once: Ray without
  Ray Data.
* `process_pool`: the same over a plain `ProcessPoolExecutor` of `--cpus` warm processes,
  no Ray: what the stage would reach with no orchestration cost at all.
  `stage_vs_ray_tasks` is Ray Data's share, `ray_tasks_vs_process_pool` Ray's; the gap
  between `process_pool` and `--cpus` x `decode_resize_per_core` is the shard work beyond
  decoding (patchify, hash, Parquet write) and two processes sharing one machine.
* the same loop and stage reading from a local S3 server (moto, over HTTP), writing
  to local disk. That server shares the same CPUs, so these figures are reported as
  they are.

Targets on 2 cores, local folder: `ratio` = stage / loop >= 1.6, and
`per_core_vs_decode` = (stage / cpus) / decode_resize_per_core >= 0.8.

Every timed measurement starts after `os.sync()`, so none pays for writing back the
pages that the one before it left dirty.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.core import plan as ingest_plan, shards  # noqa: E402
from pipelines.core.storage import S3Settings, open_store  # noqa: E402
from pipelines.image.ingest import process_shard, run_ingest  # noqa: E402
from pipelines.image.configs import IngestConfig
from pipelines.image.patches import decode_image, patchify  # noqa: E402

CLASSES = 10


def _photo_like(seed: int, min_side: int, max_side: int) -> bytes:
    """A JPEG with smooth regions, edges and sensor-like noise, so decoding costs what photos cost."""
    rng = np.random.default_rng(seed)
    w, h = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
    coarse = rng.integers(0, 256, size=(rng.integers(3, 9), rng.integers(3, 9), 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    img += 40 * np.sin(xx[..., None] / rng.uniform(3, 30) + yy[..., None] / rng.uniform(3, 30))
    img += rng.normal(0, 6, size=img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _write_one(args: tuple[str, int, int, int]) -> None:
    path, seed, lo, hi = args
    Path(path).write_bytes(_photo_like(seed, lo, hi))


def make_corpus(workdir: Path, n: int, lo: int, hi: int, cpus: int) -> tuple[Path, list[str]]:
    """`<workdir>/corpus-...` with n JPEGs in class folders (reused when already complete)."""
    root = workdir / f"corpus-{n}-{lo}-{hi}"
    keys = [f"c{i % CLASSES:02d}/{i:06d}.jpg" for i in range(n)]
    done = workdir / f"{root.name}.complete"  # outside the corpus, which must hold only images
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        for c in range(CLASSES):
            (root / f"c{c:02d}").mkdir(parents=True)
        with ProcessPoolExecutor(cpus) as pool:
            list(pool.map(_write_one, [(str(root / k), i, lo, hi) for i, k in enumerate(keys)], chunksize=64))
        done.write_text("")
    return root, sorted(keys)


def decode_rate(root: Path, keys: list[str], size: int, limit: int = 1000) -> float:
    """Images/s of decode + resize alone, in this process, bytes in memory."""
    blobs = [(root / k).read_bytes() for k in keys[:limit]]
    decode_image(blobs[0], size, max_pixels=10**9)  # warm caches
    os.sync()
    start = time.perf_counter()
    for data in blobs:
        decode_image(data, size, max_pixels=10**9)
    return len(blobs) / (time.perf_counter() - start)


def plain_loop(read, keys: list[str], out: Path, config: IngestConfig) -> float:
    """Images/s of a single-process read → decode → patchify → one Parquet writer."""
    size, p = config.image_size, config.patch_size
    n_patches, dim = (size // p) ** 2, p * p * 3
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.sync()
    start = time.perf_counter()
    with pq.ParquetWriter(out / "all.parquet", shards.SCHEMA, compression=config.compression, **shards.WRITE_OPTIONS) as writer:
        for lo in range(0, len(keys), config.shard_size):
            batch = keys[lo : lo + config.shard_size]
            pixels = np.empty((len(batch), n_patches, dim), dtype=np.uint8)
            for i, key in enumerate(batch):
                patchify(decode_image(read(key), size, max_pixels=config.max_pixels), p, out=pixels[i])
            splits = [shards.split_of(k, config.val_fraction, config.test_fraction) for k in batch]
            labels = [int(k[1:3]) for k in batch]
            writer.write_table(shards.build_table(pixels, labels, batch, splits))
    return len(keys) / (time.perf_counter() - start)


def _shard(plan: dict, config: IngestConfig) -> int:
    settings = S3Settings.resolve(None)
    return process_shard(plan, config, open_store(config.source, settings), open_store(config.output, settings))["rows"]


def without_ray_data(run_all: Callable[[list[dict], IngestConfig], Iterable[int]], config: IngestConfig, n: int) -> float:
    """Images/s of the stage's shard function over the stage's plans, `run_all(plans, config)` running them."""
    shutil.rmtree(config.output, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    plans = list(ingest_plan.cut_shards(ingest_plan.folder_items(open_store(config.source, S3Settings.resolve(None)).list_entries()),
                                        config.shard_size, config.mix_window, config.seed))
    for plan in plans:
        ingest_plan.seal(plan, "bench")
    rows = sum(run_all(plans, config))
    seconds = time.perf_counter() - start
    assert rows == n, rows
    return n / seconds


def stage(config: IngestConfig, n: int) -> float:
    shutil.rmtree(config.output, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    result = run_ingest(config)
    seconds = time.perf_counter() - start
    assert result.counts["images"] == n, result.counts
    return n / seconds


# Any credentials do for the loopback moto server.
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def start_s3_server() -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import _MOTO_LAUNCHER, _free_port, _wait_until_up  # the test suite's S3 server

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _MOTO_LAUNCHER, "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
    )
    _wait_until_up(url, proc, log)
    return proc, url


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--min-side", type=int, default=256)
    parser.add_argument("--max-side", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--patch-size", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "vitpipe-bench")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of decode, loop, stage, Ray tasks and process pool (medians)")
    parser.add_argument("--s3-rounds", type=int, default=1, help="alternating rounds of the S3 loop and stage")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args()


def warm_up(args: argparse.Namespace, root: Path, keys: list[str], common: dict) -> Path:
    """Run the stage on a tiny corpus, so the measured runs find the worker processes started; returns that corpus."""
    warm = args.workdir / "warm"
    shutil.rmtree(warm, ignore_errors=True)
    for c in range(2):
        (warm / f"c{c}").mkdir(parents=True)
        for k in keys[c :: CLASSES][:16]:
            shutil.copy(root / k, warm / f"c{c}" / Path(k).name)
    # Small shards, so that every CPU's worker process is started (and has imported its libraries)
    # before the measured runs: a cluster in use has its workers up.
    warm_common = {**common, "shard_size": 2}
    stage(IngestConfig(source=str(warm), output=str(args.workdir / "warm-out"), **warm_common), 32)
    return warm


def local_rounds(args: argparse.Namespace, root: Path, keys: list[str], config: IngestConfig, warm: Path) -> dict[str, list[float]]:
    """Images/s of every local measurement, round by round."""
    import ray

    # Alternate the measurements round by round, so a drifting machine favours none of them.
    rates: dict[str, list[float]] = {"decode_resize_per_core": [], "loop": [], "stage": [], "ray_tasks": [],
                                     "process_pool": []}
    other_config = config.model_copy(update={"output": str(args.workdir / "other-out")})
    ray_shard = ray.remote(num_cpus=1)(_shard)

    def ray_tasks(plans: list[dict], config: IngestConfig) -> list[int]:
        return ray.get([ray_shard.remote(plan, config) for plan in plans])

    # spawn: forking a process that runs Ray's threads is unsafe
    with ProcessPoolExecutor(args.cpus, mp_context=multiprocessing.get_context("spawn")) as pool:
        def process_pool(plans: list[dict], config: IngestConfig) -> Iterable[int]:
            return pool.map(_shard, plans, [config] * len(plans))

        without_ray_data(process_pool, other_config.model_copy(update={"source": str(warm)}), 32)  # start the processes
        for _ in range(args.rounds):
            rates["decode_resize_per_core"].append(decode_rate(root, keys, args.image_size))
            rates["loop"].append(plain_loop(lambda k: (root / k).read_bytes(), keys, args.workdir / "loop-out", config))
            rates["stage"].append(stage(config, len(keys)))
            rates["ray_tasks"].append(without_ray_data(ray_tasks, other_config, len(keys)))
            rates["process_pool"].append(without_ray_data(process_pool, other_config, len(keys)))
    return rates


def add_medians(report: dict[str, object], rates: dict[str, list[float]]) -> None:
    """Each measurement's median, and its rounds, into `report`."""
    for name, values in rates.items():
        report[name] = statistics.median(values)
        report[f"{name}_rounds"] = [round(v, 1) for v in values]


def add_ratios(report: dict[str, Any], cpus: int) -> None:
    """The local measurements against each other."""
    report["stage_per_core"] = report["stage"] / cpus
    report["ratio"] = report["stage"] / report["loop"]
    report["per_core_vs_decode"] = report["stage_per_core"] / report["decode_resize_per_core"]
    report["stage_vs_ray_tasks"] = report["stage"] / report["ray_tasks"]
    report["ray_tasks_vs_process_pool"] = report["ray_tasks"] / report["process_pool"]
    report["stage_vs_process_pool"] = report["stage"] / report["process_pool"]
    report["process_pool_per_core_vs_decode"] = report["process_pool"] / cpus / report["decode_resize_per_core"]


def s3_rounds(args: argparse.Namespace, root: Path, keys: list[str], common: dict, local_config: IngestConfig) -> dict[str, list[float]]:
    """Images/s of the loop and the stage reading the corpus from a local S3 server, round by round."""
    import boto3

    proc, url = start_s3_server()
    try:
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="bench")
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: client.put_object(Bucket="bench", Key=f"corpus/{k}", Body=(root / k).read_bytes()), keys))
        s3_config = IngestConfig(source="s3://bench/corpus", output=str(args.workdir / "stage-out"), endpoint_url=url, **common)
        rates: dict[str, list[float]] = {"loop_s3": [], "stage_s3": []}
        for _ in range(args.s3_rounds):
            rates["loop_s3"].append(plain_loop(
                lambda k: client.get_object(Bucket="bench", Key=f"corpus/{k}")["Body"].read(),
                keys, args.workdir / "loop-out", local_config,
            ))
            rates["stage_s3"].append(stage(s3_config, len(keys)))
        return rates
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    import ray

    args = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    root, keys = make_corpus(args.workdir, args.images, args.min_side, args.max_side, args.cpus)
    common = dict(image_size=args.image_size, patch_size=args.patch_size, shard_size=args.shard_size, val_fraction=0.1)
    local_config = IngestConfig(source=str(root), output=str(args.workdir / "stage-out"), **common)

    report: dict[str, Any] = {"images": len(keys), "cpus": args.cpus, "sides": [args.min_side, args.max_side],
                              "image_size": args.image_size, "patch_size": args.patch_size,
                              "shard_size": args.shard_size, "rounds": args.rounds}

    if not args.skip_s3:  # before Ray starts: its workers resolve credentials from the AWS chain they inherit
        os.environ.update(S3_CREDENTIALS)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
    warm = warm_up(args, root, keys, common)
    add_medians(report, local_rounds(args, root, keys, local_config, warm))
    add_ratios(report, args.cpus)
    if not args.skip_s3:
        add_medians(report, s3_rounds(args, root, keys, common, local_config))
        report["ratio_s3"] = report["stage_s3"] / report["loop_s3"]
    ray.shutdown()

    report = {k: round(v, 3) if isinstance(v, float) else v for k, v in report.items()}
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
