"""How long the CLI takes to refuse a bad config: the wall time of `vitpipe ...` from start to its one
error line, for each case below, as users run it (a fresh interpreter each time).

    python benchmarks/config_errors.py [--rounds 5] [--against /path/to/other/checkout]

With `--against`, the other checkout's code (put first on PYTHONPATH) runs each case too, alternating
with this one after a warm-up of each. Prints one JSON object: the median seconds per case and checkout.
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

HERE = Path(__file__).resolve().parents[1]
SPEC = """name: p
storage: {root: out}
stages:
  raw: {kind: ingest, source: corpus, image_size: 16, patch_size: 4}
  pre: {kind: pretrain, inputs: [raw], model: ViT-Ti/4, steps: 20, warmup_steps: 2}
  probe: {kind: evaluate, inputs: [raw, pre], shots: [0]}
"""
FILES = {"spec.yaml": SPEC, "pre.yaml": "data: data\nsteps: 0\n",
         "video.yaml": "data: videos\nsteps: 1\nbackbone: ViT-Q/99\n"}
CASES = {
    "pretrain_config_field": ["pretrain", "pre.yaml"],  # a stage config file with a bad field
    "spec_stage_field": ["run", "spec.yaml"],  # a pipeline spec whose evaluate stage has a bad field
    "video_train_backbone": ["video-train", "video.yaml"],  # a backbone name vit does not know
}


def refuse_seconds(checkout: Path, args: list[str], workdir: Path) -> float:
    """Seconds until `vitpipe ARGS` run from `checkout` exits; it must refuse in one line."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "VITPIPE_LOG_DIR": str(workdir / "logs")}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=workdir, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 1 or not done.stderr.startswith("error: "):
        raise SystemExit(f"{checkout}: vitpipe {' '.join(args)} did not refuse in one line: {done.stderr[-500:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout to time alternately (e.g. the last release)")
    args = parser.parse_args()
    checkouts = {"this": HERE, **({"against": args.against.resolve()} if args.against else {})}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name, text in FILES.items():
            (workdir / name).write_text(text)
        times: dict[str, dict[str, list[float]]] = {case: {c: [] for c in checkouts} for case in CASES}
        for case, argv in CASES.items():
            for checkout in checkouts.values():  # warm-up: the page cache and .pyc files
                refuse_seconds(checkout, argv, workdir)
            for _ in range(args.rounds):
                for label, checkout in checkouts.items():
                    times[case][label].append(refuse_seconds(checkout, argv, workdir))
    print(json.dumps({
        "rounds": args.rounds, "cpu_count": os.cpu_count(),
        "median_seconds": {case: {c: round(statistics.median(v), 2) for c, v in by.items()} for case, by in times.items()},
    }))


if __name__ == "__main__":
    main()
