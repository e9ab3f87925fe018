"""What a rerun's one listing pass costs: keys/s listed and planned against a local S3 server.

    python benchmarks/listing_rate.py --objects 10000 --json
    python benchmarks/listing_rate.py --source s3://bucket/prefix --json   # your own bucket (AWS chain)

Puts `--objects` one-byte objects in class folders on a moto server (over HTTP, the test
suite's launcher), or takes an existing `--source` prefix, then times, best of `--rounds`:

* `list_keys_per_s`: `Store.list_entries` alone (LIST calls of 1,000 keys with size and ETag);
* `plan_keys_per_s`: what the ingest's plan task does with the same pages: version tags,
  content-defined windows, shard plans and their fingerprints, the input digest.

It then scales both to `--scale` objects (default 14 M): the LIST calls a rerun makes, and
the time at the measured rate. The server shares the machine's CPUs with this process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ingest_throughput import start_s3_server  # noqa: E402

from pipelines.core import plan as ingest_plan  # noqa: E402
from pipelines.core.storage import S3Settings, open_store  # noqa: E402

PAGE = 1000  # keys per LIST call: S3's maximum


def _best(fn, rounds: int) -> float:
    """The shortest of `rounds` timed calls of `fn`."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _plan_all(store) -> None:
    digest = hashlib.sha256()
    items = ingest_plan.folder_items(store.list_entries())
    for plan in ingest_plan.cut_shards(items, 512, 8, 0):
        digest.update(ingest_plan.seal(plan, "bench")["fingerprint"].encode())


def _time(store, rounds: int) -> tuple[float, float]:
    """Seconds to list `store`, and to list and plan it (best of `rounds` each)."""
    list_s = _best(lambda: sum(len(p) for p in store.list_entries(page_size=PAGE)), rounds)
    return list_s, _best(lambda: _plan_all(store), rounds)


def _on_moto(objects: int, rounds: int) -> tuple[float, float]:
    """`_time` over `objects` one-byte objects on a fresh moto server."""
    import boto3

    proc, url = start_s3_server()
    try:
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
                           "AWS_DEFAULT_REGION": "us-east-1"})
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="bench")
        keys = [f"corpus/class{i % 100:03d}/{i:08d}.jpg" for i in range(objects)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: client.put_object(Bucket="bench", Key=k, Body=b"x"), keys))
        return _time(open_store("s3://bench/corpus", S3Settings.resolve(url)), rounds)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=int, default=14_000_000)
    parser.add_argument("--source", help="time the listing of this prefix instead of a generated one on moto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.source:
        store = open_store(args.source)
        objects = sum(len(p) for p in store.list_entries(page_size=PAGE))
        list_s, plan_s = _time(store, args.rounds)
    else:
        objects = args.objects
        list_s, plan_s = _on_moto(args.objects, args.rounds)
    calls = -(-args.scale // PAGE)
    report = {
        "objects": objects,
        "list_keys_per_s": round(objects / list_s),
        "plan_keys_per_s": round(objects / plan_s),
        "scale": args.scale,
        "list_calls_at_scale": calls,
        "list_minutes_at_scale": round(args.scale / (objects / list_s) / 60, 1),
        "plan_minutes_at_scale": round(args.scale / (objects / plan_s) / 60, 1),
    }
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))


if __name__ == "__main__":
    main()
