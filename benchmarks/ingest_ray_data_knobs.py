"""Ray Data knobs of the ingest stage against its shard function as plain Ray tasks, alternating (issue 18 §4).

    PYTHONPATH=$PWD:$PWD/benchmarks ROUNDS=2 python benchmarks/ingest_ray_data_knobs.py 5000[,20000] [VARIANT,...] [--spare-worker]

Uses `ingest_throughput`'s corpus (`/tmp/feed-bench`), warm-up and shard function. Variants:
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
import json, os, statistics, sys
from pathlib import Path
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/benchmarks")
import psutil, ray, ray.data
import ingest_throughput as it
from pipelines.image.ingest import IngestConfig

def workers() -> set[int]:
    """Pids of this cluster's worker processes (the raylet's children)."""
    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    return {p.pid for p in raylet.children()}

def tree():
    me = psutil.Process(); t = me.cpu_times(); d = t.user + t.system; tot = d
    for p in me.children(recursive=True):
        try: c = p.cpu_times(); tot += c.user + c.system
        except psutil.NoSuchProcess: pass
    return d, tot

VARIANTS = {
    "default": {},
    "no_progress": {"enable_progress_bars": False, "enable_operator_progress_bars": False},
    "no_operator_progress": {"enable_operator_progress_bars": False},  # the whole dataset's bar only
}
import pipelines.core.ingest as ING
ORIG = ING._run_pipeline
class _Proc:
    def __call__(self, batch, **kw):
        return ING._process_udf(batch, **kw)
def actor_pipeline(config, source, manifest, out, fingerprint, process):
    real_map = ray.data.Dataset.map_batches
    def patched(self, fn, *a, **kw):
        if fn is ING._process_udf:
            kw.pop("max_retries", None); kw.pop("retry_exceptions", None)
            kw["compute"] = ray.data.ActorPoolStrategy(size=2)
            return real_map(self, _Proc, *a, **kw)
        return real_map(self, fn, *a, **kw)
    ray.data.Dataset.map_batches = patched
    try:
        return ORIG(config, source, manifest, out, fingerprint, process)
    finally:
        ray.data.Dataset.map_batches = real_map
def queue_ahead(extra: int):
    """Ray Data's CPU limit raised above the cluster's, so `extra` shard tasks wait queued at the raylet
    and start the moment a CPU frees, as plain tasks all submitted at once do."""
    options = ray.data.ExecutionOptions()
    options.resource_limits = options.resource_limits.copy(cpu=2 + extra)
    return {"execution_options": options}
VARIANTS["queue_ahead_2"] = queue_ahead(2)
VARIANTS["queue_ahead_2_no_progress"] = {**queue_ahead(2), **VARIANTS["no_progress"]}
# Each Ray Data task polls its process's memory in a thread (every second) and builds per-block stats.
VARIANTS["no_memory_poll"] = {"memory_usage_poll_interval_s": None}
# Ray Data spreads map tasks over nodes by default; plain tasks use Ray's default placement.
VARIANTS["default_scheduling"] = {"scheduling_strategy": "DEFAULT"}
VARIANTS["actors"] = {"__pipeline__": actor_pipeline}
VARIANTS["actors_no_progress"] = {"__pipeline__": actor_pipeline, "enable_progress_bars": False, "enable_operator_progress_bars": False}
argv = [a for a in sys.argv[1:] if a != "--spare-worker"]
names = argv[1].split(",") if len(argv) > 1 else list(VARIANTS)
sizes = [int(x) for x in argv[0].split(",")] if argv else [5000]
workdir = Path("/tmp/feed-bench"); workdir.mkdir(exist_ok=True)
common = dict(image_size=224, patch_size=16, shard_size=256, val_fraction=0.1)
corpora = {}
for n in sizes:
    root, keys = it.make_corpus(workdir, n, 256, 512, 2)
    cfg = IngestConfig(source=str(root), output=str(workdir / "stage-out"), **common)
    corpora[n] = (root, keys, cfg, cfg.model_copy(update={"output": str(workdir / "other-out")}))
spare = {"num_workers_soft_limit": 3} if "--spare-worker" in sys.argv else {}
ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _system_config=spare)
class A: pass
args = A(); args.workdir = workdir
it.warm_up(args, *corpora[sizes[0]][:2], common)
ray_shard = ray.remote(num_cpus=1)(it._shard)
def tasks(plans, c): return ray.get([ray_shard.remote(p, c) for p in plans])
def measure(fn):
    w0 = workers(); d0, _ = tree(); r = fn(); d1, _ = tree(); return r, d1 - d0, len(workers() - w0)
def with_ctx(over, cfg, n):
    over = dict(over); pipe = over.pop("__pipeline__", None)
    ctx = ray.data.DataContext.get_current(); old = {k: getattr(ctx, k) for k in over}
    for k, v in over.items(): setattr(ctx, k, v)
    if pipe: ING._run_pipeline = pipe
    try: return it.stage(cfg, n)
    finally:
        ING._run_pipeline = ORIG
        for k, v in old.items(): setattr(ctx, k, v)
res = {(n, k): [] for n in sizes for k in ["ray_tasks", *names]}
it.without_ray_data(tasks, corpora[sizes[0]][3], sizes[0])
for r in range(int(os.environ.get("ROUNDS", 3))):
    for n in sizes:  # every size and variant in every round, so a drifting machine favours none
        _, _, cfg, other = corpora[n]
        res[n, "ray_tasks"].append(measure(lambda: it.without_ray_data(tasks, other, n)))
        for nm in names:
            res[n, nm].append(measure(lambda: with_ctx(VARIANTS[nm], cfg, n)))
out = {"sizes": sizes, "spare_worker": bool(spare)}
for (n, k), v in res.items():
    row = out.setdefault(str(n), {})[k] = {
        "ips": round(statistics.median(x[0] for x in v), 1), "rounds": [round(x[0]) for x in v],
        "driver_cpu": round(statistics.median(x[1] for x in v), 2), "new_workers": [x[2] for x in v]}
    row["vs_tasks"] = round(row["ips"] / out[str(n)]["ray_tasks"]["ips"], 3)
if len(sizes) > 1:  # seconds = fixed + images / rate, through the smallest and largest size's medians
    lo, hi = min(sizes), max(sizes)
    for k in ["ray_tasks", *names]:
        t_lo, t_hi = lo / out[str(lo)][k]["ips"], hi / out[str(hi)][k]["ips"]
        rate = (hi - lo) / (t_hi - t_lo)
        out.setdefault("fit", {})[k] = {"per_image_ips": round(rate, 1), "fixed_s": round(t_lo - lo / rate, 2)}
    for k in names:
        out["fit"][k]["per_image_vs_tasks"] = round(out["fit"][k]["per_image_ips"] / out["fit"]["ray_tasks"]["per_image_ips"], 3)
print(json.dumps(out))
