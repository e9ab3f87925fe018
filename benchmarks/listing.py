"""Sequential against parallel listing of a corpus on the loopback S3 server: keys/s, one JSON object.

    python benchmarks/listing.py --keys 200000 --prefixes 1000 --rounds 5

Starts the test suite's moto server (over HTTP, in its own process) holding `--keys` one-byte
objects in `--prefixes` class folders under `corpus/`. They are put straight into the server's
store before it starts serving (200,000 objects take seconds; as many PUTs over HTTP take
minutes), and the bucket serves every round of the run. The server answers LIST calls from a
sorted index, as S3 does (moto's own LIST scans the whole bucket on every call), and makes each
call wait a modelled round trip (`--latency-ms`, each value in turn; 0: loopback only, CPU-bound).
Then, for each latency, after one warm-up of each:

* sequential: `Store.list_entries`, one `list_objects_v2` stream of 1,000-key pages;
* sequential_dateutil: the same with botocore's own timestamp parser, not vitpipe's;
* parallel: `pipelines.core.listing.source_entries`, what the ingest's plan task uses: the
  class folders from one `Delimiter="/"` listing, each folder listed by a Ray task, `--width`
  folders in flight, pages consumed in key order,

alternating round by round; medians of `--rounds`. Both must return the same entries. The
server, this process and the Ray workers share the machine's cores. The figures are scaled to
`--scale` keys (default 14 M, ImageNet-21k) at the measured rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import _MOTO_LAUNCHER, _free_port, _wait_until_up  # noqa: E402  the test suite's S3 server

from pipelines.core.listing import source_entries  # noqa: E402
from pipelines.core.storage import S3Settings, open_store  # noqa: E402

BUCKET = "bench"
PAGE = 1000  # keys per LIST call: S3's maximum

# Runs in the server process before `main` starts serving: fills moto's in-memory store, and
# answers `list_objects_v2` from a sorted index of the (then unchanging) bucket. moto's own LIST
# scans and sorts the whole bucket on every call: about 0.1 s a page at 20,000 keys, a cost that
# grows with the bucket and that S3 does not have. Each LIST call then waits the round trip
# named in the file BENCH_LATENCY_FILE (milliseconds; 0 for none), S3's time per page.
_SERVER = """
import bisect, os, time
from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import S3Backend, s3_backends
from moto.utilities.utils import md5_hash

_backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
_backend.create_bucket("{bucket}", "us-east-1")
_keys, _prefixes = int(os.environ["BENCH_KEYS"]), int(os.environ["BENCH_PREFIXES"])
for _i in range(_keys):
    _backend.put_object("{bucket}", f"corpus/n{{_i % _prefixes:08d}}/{{_i:09d}}.JPEG", b"x")
_names = sorted(_backend.get_bucket("{bucket}").keys.keys())


def _list_v2(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys):
    with open(os.environ["BENCH_LATENCY_FILE"]) as f:
        time.sleep(float(f.read()) / 1000)
    prefix = prefix or ""
    after = self._pagination_tokens.get(continuation_token) if continuation_token else start_after
    i = bisect.bisect_left(_names, prefix)
    if after and delimiter and after.endswith(delimiter):  # a folder on the last page: past every key in it
        i = max(i, bisect.bisect_left(_names, after[:-1] + chr(ord(after[-1]) + 1)))
    elif after:
        i = max(i, bisect.bisect_right(_names, after))
    out, truncated = [], False
    while i < len(_names) and _names[i].startswith(prefix):
        if len(out) == max_keys:
            truncated = True
            break
        rest = _names[i][len(prefix):]
        if delimiter and delimiter in rest:
            folder = prefix + rest.split(delimiter)[0] + delimiter
            out.append(folder)
            i = bisect.bisect_left(_names, folder[:-1] + chr(ord(folder[-1]) + 1))
        else:
            out.append(bucket.keys[_names[i]])
            i += 1
    token = None
    if truncated:
        last = out[-1] if isinstance(out[-1], str) else out[-1].name
        token = md5_hash(last.encode("utf-8")).hexdigest()
        self._pagination_tokens[token] = last
    return out, truncated, token


S3Backend.list_objects_v2 = _list_v2
""".format(bucket=BUCKET)


def start_server(keys: int, prefixes: int, latency_file: Path) -> tuple[subprocess.Popen, str]:
    """The moto server on a free loopback port, already holding the corpus."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(BENCH_KEYS=str(keys), BENCH_PREFIXES=str(prefixes), BENCH_LATENCY_FILE=str(latency_file))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER + _MOTO_LAUNCHER, "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
    )
    _wait_until_up(url, proc, log, timeout=600)
    return proc, url


def server_cpu(server: psutil.Process) -> float:
    """The server process's CPU seconds so far (user + system)."""
    times = server.cpu_times()
    return times.user + times.system


def measure(url: str, server: psutil.Process, rounds: int, width: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per round for each way of listing, and the server's CPU seconds in them, alternating after
    one warm-up of each."""
    store = open_store(f"s3://{BUCKET}/corpus", S3Settings.resolve(url))
    # The same listing through a client with botocore's own timestamp parser (dateutil), as vitpipe's
    # clients had it before they read ISO 8601 with `datetime.fromisoformat`.
    dateutil_store = open_store(f"s3://{BUCKET}/corpus", S3Settings.resolve(url))
    dateutil_store._client = boto3.session.Session().client("s3", endpoint_url=url, region_name="us-east-1")
    ways = {
        "sequential": lambda: [e for page in store.list_entries(page_size=PAGE) for e in page],
        "sequential_dateutil": lambda: [e for page in dateutil_store.list_entries(page_size=PAGE) for e in page],
        "parallel": lambda: [e for page in source_entries(store, width=width, page_size=PAGE) for e in page],
    }
    expected = None
    for name, way in ways.items():
        start = time.perf_counter()
        entries = way()
        expected = entries if expected is None else expected
        if entries != expected:
            raise SystemExit(f"the {name} listing differs from the sequential one")
        print(f"warm-up {name}: {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "server_cpu": []} for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            start, cpu = time.perf_counter(), server_cpu(server)
            count = len(way())
            times[name]["wall"].append(time.perf_counter() - start)
            times[name]["server_cpu"].append(server_cpu(server) - cpu)
            assert count == len(expected)
            print(f"{name}: {times[name]['wall'][-1]:.2f} s", file=sys.stderr, flush=True)  # progress, not the result
    return times


def summary(times: dict[str, dict[str, list[float]]], keys: int, scale: int) -> dict[str, object]:
    """Medians as keys/s, the speed-up, both scaled to `scale` keys, and how busy the server was: a share
    near 1 means that way of listing waited on the server's one Python thread, not on round trips."""
    rate = {name: keys / statistics.median(t["wall"]) for name, t in times.items()}
    busy = {name: statistics.median(c / w for c, w in zip(t["server_cpu"], t["wall"])) for name, t in times.items()}
    return {
        "sequential_s": [round(t, 2) for t in times["sequential"]["wall"]],
        "parallel_s": [round(t, 2) for t in times["parallel"]["wall"]],
        "server_cpu_share_sequential": round(busy["sequential"], 2),
        "server_cpu_share_parallel": round(busy["parallel"], 2),
        "server_cpu_us_per_key": round(statistics.median(times["sequential"]["server_cpu"]) / keys * 1e6, 1),
        "sequential_dateutil_s": [round(t, 2) for t in times["sequential_dateutil"]["wall"]],
        "sequential_keys_per_s": round(rate["sequential"]),
        "sequential_dateutil_keys_per_s": round(rate["sequential_dateutil"]),
        "parallel_keys_per_s": round(rate["parallel"]),
        "speedup": round(rate["parallel"] / rate["sequential"], 2),
        "sequential_minutes_at_scale": round(scale / rate["sequential"] / 60, 1),
        "parallel_minutes_at_scale": round(scale / rate["parallel"] / 60, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--prefixes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=16, help="folders listed at once (the ingest's list_concurrency)")
    parser.add_argument("--latency-ms", default="0,100", help="LIST round trips to model, comma-separated")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="the local Ray cluster's CPUs")
    parser.add_argument("--scale", type=int, default=14_000_000)
    args = parser.parse_args()

    import ray

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret", AWS_DEFAULT_REGION="us-east-1")
    latency_file = Path(tempfile.mkstemp(suffix=".ms")[1])
    latency_file.write_text("0")
    started = time.perf_counter()
    proc, url = start_server(args.keys, args.prefixes, latency_file)
    print(f"server filled in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    report: dict[str, object] = {
        "keys": args.keys, "prefixes": args.prefixes, "width": args.width, "cpus": args.cpus,
        "rounds": args.rounds, "server_fill_s": round(time.perf_counter() - started, 1), "scale": args.scale,
        "sequential_list_calls_at_scale": -(-args.scale // PAGE),
    }
    try:
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
        for latency in args.latency_ms.split(","):
            latency_file.write_text(latency)
            times = measure(url, psutil.Process(proc.pid), args.rounds, args.width)
            report[f"latency_{latency}ms"] = summary(times, args.keys, args.scale)
    finally:
        ray.shutdown()
        proc.terminate()
        proc.wait()
        latency_file.unlink()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
