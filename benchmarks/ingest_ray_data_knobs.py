"""Ray Data knobs of the ingest stage against its shard function as plain Ray tasks, alternating (issue 18 §4).

    python benchmarks/ingest_ray_data_knobs.py 5000[,20000] [VARIANT,...] [--spare-worker] [--rounds N]

Uses `ingest_throughput`'s corpus (in `--workdir`, `/tmp/feed-bench`), warm-up and shard function; `--rounds`
defaults to `$ROUNDS`, else 3. Variants:
`default` (the stage as it is), `no_progress` (Ray Data's progress bars off), `no_operator_progress` (only
the whole dataset's bar), `actors` (the shard step on an `ActorPoolStrategy(size=2)` of callable-class actors,
patched in for the run), `actors_no_progress`, `queue_ahead_2` (Ray Data's CPU limit 2 above the cluster's),
`no_memory_poll` (no per-task memory polling thread), `default_scheduling` (Ray's default placement
instead of SPREAD), and combinations. `--spare-worker` starts the cluster keeping one idle worker process
beyond one per CPU (Ray's `num_workers_soft_limit`), so the planner's zero-CPU task finds a worker instead of
starting one each run. Several corpus sizes (images, comma-separated) alternate within each round, and
each way's run time is then split into a fixed part and a per-image rate (a line through the smallest and
largest size). Prints one JSON object: per size and variant the median images/s, the rounds, the driver's
CPU seconds, the worker processes started during each run, and the ratio to plain Ray tasks; with several
sizes, `fit`: each way's fixed seconds a run and per-image rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import psutil
import ray
import ray.data

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import ingest_throughput as it  # noqa: E402

from pipelines.core import ingest as core_ingest  # noqa: E402
from pipelines.core.ingest import IngestKind  # noqa: E402
from pipelines.core.stage_config import ShardedIngestConfig
from pipelines.core.storage import Store  # noqa: E402
from pipelines.image.configs import IngestConfig  # noqa: E402

CPUS = 2  # the local cluster's CPUs (and the corpus writer's processes)
ACTORS = 2  # the actor pool's size in the `actors` variants
COMMON = dict(image_size=224, patch_size=16, shard_size=256, val_fraction=0.1)
BASELINE = "ray_tasks"  # the stage's shard function as plain Ray tasks: Ray without Ray Data
NO_PROGRESS = {"enable_progress_bars": False, "enable_operator_progress_bars": False}

# Kept before any variant swaps it out, so every run can restore it.
STAGE_PIPELINE = core_ingest._run_pipeline
# One remote function for every run: a new one would be exported to the cluster again each time.
SHARD_TASK = ray.remote(num_cpus=1)(it._shard)


@dataclass
class Variant:
    """One way to run the stage: DataContext settings, and whether the shard step runs on actors."""

    settings: dict[str, Any] = field(default_factory=dict)
    actors: bool = False


class Run(NamedTuple):
    """One timed run: images/s, the driver's CPU seconds, and the worker processes it started."""

    ips: float
    driver_cpu: float
    new_workers: int


class Corpus(NamedTuple):
    """One size's corpus, with the configs the stage and the plain tasks write under."""

    root: Path
    keys: list[str]
    stage: IngestConfig
    tasks: IngestConfig


def queue_ahead(extra: int) -> dict[str, Any]:
    """DataContext settings that raise Ray Data's CPU limit `extra` above the cluster's."""
    # The extra shard tasks then wait queued at the raylet and start the moment a CPU frees,
    # as plain tasks all submitted at once do.
    options = ray.data.ExecutionOptions()
    options.resource_limits = options.resource_limits.copy(cpu=CPUS + extra)
    return {"execution_options": options}


def variants() -> dict[str, Variant]:
    """Every variant by name, in the order they run when none are named."""
    return {
        "default": Variant(),
        "no_progress": Variant(NO_PROGRESS),
        "no_operator_progress": Variant({"enable_operator_progress_bars": False}),  # the whole dataset's bar only
        "queue_ahead_2": Variant(queue_ahead(2)),
        "queue_ahead_2_no_progress": Variant({**queue_ahead(2), **NO_PROGRESS}),
        # Each Ray Data task polls its process's memory in a thread (every second) and builds per-block stats.
        "no_memory_poll": Variant({"memory_usage_poll_interval_s": None}),
        # Ray Data spreads map tasks over nodes by default; plain tasks use Ray's default placement.
        "default_scheduling": Variant({"scheduling_strategy": "DEFAULT"}),
        "actors": Variant(actors=True),
        "actors_no_progress": Variant(NO_PROGRESS, actors=True),
    }


@contextlib.contextmanager
def data_context(settings: dict[str, Any]) -> Iterator[None]:
    """Ray Data's current DataContext with `settings` set for the block, then as it was."""
    ctx = ray.data.DataContext.get_current()
    previous = {name: getattr(ctx, name) for name in settings}
    for name, value in settings.items():
        setattr(ctx, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(ctx, name, value)


class ShardStep:
    """The stage's shard step as a callable class, which Ray Data runs on an actor pool."""

    def __call__(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """One shard, exactly as the stage's task does it."""
        return core_ingest._process_udf(batch, **kwargs)


def _map_shards_on_actors(
    map_batches: Callable[..., ray.data.Dataset], ds: ray.data.Dataset, fn: Callable[..., Any], *args: Any,
    **kwargs: Any,
) -> ray.data.Dataset:
    """`Dataset.map_batches`, but the shard step on an actor pool of `ShardStep`s; the planner stays a task."""
    if fn is not core_ingest._process_udf:
        return map_batches(ds, fn, *args, **kwargs)
    # Retries are task options; an actor pool does not take them.
    kwargs.pop("max_retries", None)
    kwargs.pop("retry_exceptions", None)
    kwargs["compute"] = ray.data.ActorPoolStrategy(size=ACTORS)
    return map_batches(ds, ShardStep, *args, **kwargs)


def actor_pipeline(
    config: ShardedIngestConfig, source: Store, manifest: Store | None, out: Store, fingerprint: str, kind: IngestKind,
) -> tuple[list[dict[str, Any]], str]:
    """The stage's own pipeline, with `Dataset.map_batches` patched for it to put the shard step on actors."""
    map_batches = ray.data.Dataset.map_batches

    def patched(ds: ray.data.Dataset, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ray.data.Dataset:
        """A method that forwards to `_map_shards_on_actors` with the real `map_batches`."""
        return _map_shards_on_actors(map_batches, ds, fn, *args, **kwargs)

    with mock.patch.object(ray.data.Dataset, "map_batches", patched):
        return STAGE_PIPELINE(config, source, manifest, out, fingerprint, kind)


def run_variant(variant: Variant, config: IngestConfig, n: int) -> float:
    """Images/s of the whole stage over `n` images, run the way `variant` says."""
    pipeline = actor_pipeline if variant.actors else STAGE_PIPELINE
    with data_context(variant.settings), mock.patch.object(core_ingest, "_run_pipeline", pipeline):
        return it.stage(config, n)


def plain_tasks(plans: list[dict[str, Any]], config: IngestConfig) -> list[int]:
    """Rows of each plan's shard, every plan a Ray task of one CPU, all submitted at once."""
    return ray.get([SHARD_TASK.remote(plan, config) for plan in plans])


def worker_pids() -> set[int]:
    """Pids of this cluster's worker processes (the raylet's children)."""
    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    return {p.pid for p in raylet.children()}


def driver_cpu_seconds() -> float:
    """User + system CPU seconds of this process alone (Ray's processes not counted)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def measure(run: Callable[[], float]) -> Run:
    """`run()`'s images/s, with the driver's CPU seconds and the worker processes started meanwhile."""
    workers, cpu = worker_pids(), driver_cpu_seconds()
    ips = run()
    cpu = driver_cpu_seconds() - cpu
    return Run(ips, cpu, len(worker_pids() - workers))


def make_corpora(workdir: Path, sizes: list[int]) -> dict[int, Corpus]:
    """Each size's corpus (made once, reused while complete) and its two configs."""
    corpora = {}
    for n in sizes:
        root, keys = it.make_corpus(workdir, n, 256, 512, CPUS)
        config = IngestConfig(source=str(root), output=str(workdir / "stage-out"), **COMMON)
        # The plain tasks write elsewhere, so neither finds the other's shards to reuse.
        corpora[n] = Corpus(root, keys, config, config.model_copy(update={"output": str(workdir / "other-out")}))
    return corpora


def start_cluster(spare_worker: bool) -> None:
    """A local Ray cluster of `CPUS` CPUs, keeping one idle worker beyond one per CPU if asked."""
    system_config = {"num_workers_soft_limit": CPUS + 1} if spare_worker else {}
    ray.init(address="local", num_cpus=CPUS, include_dashboard=False, _node_ip_address="127.0.0.1",
             _system_config=system_config)


def warm_up(args: argparse.Namespace, corpus: Corpus, n: int) -> None:
    """One untimed stage run and one plain-task run, so the timed ones find workers started and code exported."""
    it.warm_up(args, corpus.root, corpus.keys, COMMON)
    it.without_ray_data(plain_tasks, corpus.tasks, n)


def run_rounds(
    args: argparse.Namespace, table: dict[str, Variant], corpora: dict[int, Corpus],
) -> dict[tuple[int, str], list[Run]]:
    """Each size's plain tasks and named variants, one run of each per round."""
    runs: dict[tuple[int, str], list[Run]] = {(n, way): [] for n in args.sizes for way in [BASELINE, *args.variants]}
    for _ in range(args.rounds):
        # Every size and variant in every round, plain tasks first, so a drifting machine favours none.
        for n in args.sizes:
            corpus = corpora[n]
            runs[n, BASELINE].append(measure(partial(it.without_ray_data, plain_tasks, corpus.tasks, n)))
            for name in args.variants:
                runs[n, name].append(measure(partial(run_variant, table[name], corpus.stage, n)))
    return runs


def summary(runs: list[Run]) -> dict[str, Any]:
    """Medians of one size and way's runs, with each round's images/s and new workers."""
    return {
        "ips": round(statistics.median(r.ips for r in runs), 1),
        "rounds": [round(r.ips) for r in runs],
        "driver_cpu": round(statistics.median(r.driver_cpu for r in runs), 2),
        "new_workers": [r.new_workers for r in runs],
    }


def fit(report: dict[str, Any], sizes: list[int], names: list[str]) -> dict[str, dict[str, float]]:
    """Each way's fixed seconds a run and per-image rate, from the smallest and largest size's medians."""
    # seconds = fixed + images / rate, a line through those two points
    lo, hi = min(sizes), max(sizes)
    lines = {}
    for way in [BASELINE, *names]:
        t_lo, t_hi = lo / report[str(lo)][way]["ips"], hi / report[str(hi)][way]["ips"]
        rate = (hi - lo) / (t_hi - t_lo)
        lines[way] = {"per_image_ips": round(rate, 1), "fixed_s": round(t_lo - lo / rate, 2)}
    for name in names:
        lines[name]["per_image_vs_tasks"] = round(lines[name]["per_image_ips"] / lines[BASELINE]["per_image_ips"], 3)
    return lines


def make_report(args: argparse.Namespace, runs: dict[tuple[int, str], list[Run]]) -> dict[str, Any]:
    """The JSON object printed: per size and way the summary and its ratio to plain tasks, then the fit."""
    report: dict[str, Any] = {"sizes": args.sizes, "spare_worker": args.spare_worker}
    for (n, way), way_runs in runs.items():
        row = report.setdefault(str(n), {})[way] = summary(way_runs)
        row["vs_tasks"] = round(row["ips"] / report[str(n)][BASELINE]["ips"], 3)
    if len(args.sizes) > 1:
        report["fit"] = fit(report, args.sizes, args.variants)
    return report


def parse_args(known: list[str]) -> argparse.Namespace:
    """The command line: sizes and variants comma-separated; `known` are the variants there are."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="?", default="5000", help="corpus sizes in images, comma-separated")
    parser.add_argument("variants", nargs="?", default=",".join(known),
                        help=f"variants, comma-separated (default: all of {', '.join(known)})")
    parser.add_argument("--spare-worker", action="store_true",
                        help="keep one idle worker process beyond one per CPU (num_workers_soft_limit)")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", 3)),
                        help="alternating rounds (medians); default $ROUNDS, else 3")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/feed-bench"), help="corpora and outputs")
    # Intermixed, so `--spare-worker` may also stand between the two positionals.
    args = parser.parse_intermixed_args()
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.variants = args.variants.split(",")
    unknown = [name for name in args.variants if name not in known]
    if unknown:
        parser.error(f"unknown variants: {', '.join(unknown)}")
    return args


def main() -> None:
    """Make the corpora, start the cluster, warm it up, run the rounds and print the report."""
    table = variants()
    args = parse_args(list(table))
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpora = make_corpora(args.workdir, args.sizes)
    start_cluster(args.spare_worker)
    warm_up(args, corpora[args.sizes[0]], args.sizes[0])
    runs = run_rounds(args, table, corpora)
    ray.shutdown()
    print(json.dumps(make_report(args, runs)))


if __name__ == "__main__":
    main()
