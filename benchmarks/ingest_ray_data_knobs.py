"""Ray Data knobs of the ingest stage against its shard function as plain Ray tasks, alternating (issue 18 §4).

    PYTHONPATH=$PWD:$PWD/benchmarks ROUNDS=2 python benchmarks/ingest_ray_data_knobs.py 5000 [VARIANT,...]

Uses `ingest_throughput`'s corpus (`/tmp/feed-bench`), warm-up and shard function. Variants:
`default` (the stage as it is), `no_progress` (Ray Data's progress bars off), `actors` (the
shard step on an `ActorPoolStrategy(size=2)` of callable-class actors, patched in for the run),
`actors_no_progress`, `queue_ahead_2` (Ray Data's CPU limit 2 above the cluster's),
`no_memory_poll` (no per-task memory polling thread), `default_scheduling` (Ray's default placement
instead of SPREAD), and combinations. Prints one JSON object: per variant the median images/s, the rounds,
the driver's CPU seconds and the ratio to plain Ray tasks.
"""
import json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/benchmarks")
import psutil, ray, ray.data
import ingest_throughput as it
from pipelines.image.ingest import IngestConfig

def tree():
    me = psutil.Process(); t = me.cpu_times(); d = t.user + t.system; tot = d
    for p in me.children(recursive=True):
        try: c = p.cpu_times(); tot += c.user + c.system
        except psutil.NoSuchProcess: pass
    return d, tot

VARIANTS = {
    "default": {},
    "no_progress": {"enable_progress_bars": False, "enable_operator_progress_bars": False},
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
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
workdir = Path("/tmp/feed-bench"); workdir.mkdir(exist_ok=True)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
root, keys = it.make_corpus(workdir, n, 256, 512, 2)
common = dict(image_size=224, patch_size=16, shard_size=256, val_fraction=0.1)
cfg = IngestConfig(source=str(root), output=str(workdir / "stage-out"), **common)
other = cfg.model_copy(update={"output": str(workdir / "other-out")})
ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
class A: pass
args = A(); args.workdir = workdir
it.warm_up(args, root, keys, common)
ray_shard = ray.remote(num_cpus=1)(it._shard)
def tasks(plans, c): return ray.get([ray_shard.remote(p, c) for p in plans])
def measure(fn):
    d0, _ = tree(); r = fn(); d1, _ = tree(); return r, d1 - d0
def with_ctx(over):
    over = dict(over); pipe = over.pop("__pipeline__", None)
    ctx = ray.data.DataContext.get_current(); old = {k: getattr(ctx, k) for k in over}
    for k, v in over.items(): setattr(ctx, k, v)
    if pipe: ING._run_pipeline = pipe
    try: return it.stage(cfg, len(keys))
    finally:
        ING._run_pipeline = ORIG
        for k, v in old.items(): setattr(ctx, k, v)
res = {k: [] for k in ["ray_tasks", *names]}
it.without_ray_data(tasks, other, len(keys))
for r in range(int(os.environ.get("ROUNDS", 3))):
    res["ray_tasks"].append(measure(lambda: it.without_ray_data(tasks, other, len(keys))))
    for nm in names:
        res[nm].append(measure(lambda: with_ctx(VARIANTS[nm])))
out = {}
for k, v in res.items():
    out[k] = {"ips": round(statistics.median(x[0] for x in v), 1), "rounds": [round(x[0]) for x in v],
              "driver_cpu": round(statistics.median(x[1] for x in v), 2)}
    out[k]["vs_tasks"] = round(out[k]["ips"] / out["ray_tasks"]["ips"], 3)
print(json.dumps(out))
