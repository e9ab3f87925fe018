"""Digits test accuracy after MAE pretraining, supervised pretraining and none, over seeds.

    vitpipe corpus synth  vitpipe-work/corpus/fractals --images 6000 --classes 100 --size 32
    vitpipe corpus digits vitpipe-work/corpus/digits --size 16
    python benchmarks/transfer_seeds.py --seeds 0,1,2      # prints one JSON object

Runs, from the working directory, `pipelines/specs/demo.yaml` (supervised pretraining on the labeled
fractals, fine-tune from it and from scratch) and `pipelines/specs/mae_demo.yaml` (MAE pretraining on the
fractals ingested unlabeled, fine-tune from its encoder) once per seed, with every training stage's `seed`
set: pretraining initialisation, data order, crops and masks, and the fine-tune sweeps' initialisation and
order. The scratch sweep is field for field the same in both specs, so the second spec reuses it. Stages
already finished with the same identity are reused, so a rerun only adds what is missing.

Each arm's figure is its sweep's best trial's test accuracy (the runner's key metric); `mean` is over
seeds. `wall_s` is each spec's wall time per seed, reused stages included (so after the first seed the
ingests cost nothing, and the MAE spec's scratch sweep is always reused from demo.yaml). The MAE spec's
time from a fresh work directory is `time vitpipe run pipelines/specs/mae_demo.yaml`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.runner import run_pipeline  # noqa: E402
from pipelines.spec_file import load_spec  # noqa: E402

# arm -> (spec, stage whose key metric is the arm's figure)
ARMS = {
    "supervised": ("demo.yaml", "finetune_pretrained"),
    "mae": ("mae_demo.yaml", "finetune_mae"),
    "scratch": ("demo.yaml", "finetune_scratch"),
}
SEEDED = {  # the training stages of each spec
    "demo.yaml": ("pretrain", "finetune_pretrained", "finetune_scratch"),
    "mae_demo.yaml": ("mae", "finetune_mae", "finetune_scratch"),
}


def accuracy(metric: str) -> float:
    """"test_accuracy=0.95" -> 0.95."""
    return float(metric.rsplit("=", 1)[1])


def run_seed(seed: int, specs_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Both specs at `seed`: each arm's test accuracy, and each spec's wall seconds."""
    metrics: dict[str, str] = {}
    walls: dict[str, float] = {}
    for name, stages in SEEDED.items():
        spec = load_spec(specs_dir / name, [f"{stage}.seed={seed}" for stage in stages])
        t0 = time.perf_counter()
        result = run_pipeline(spec)
        walls[name] = time.perf_counter() - t0
        if not result.ok:
            failed = next(r for r in result.rows if r.status not in ("done", "reused"))
            raise SystemExit(f"{name} seed {seed}: stage {failed.stage} {failed.status}: {failed.error}")
        metrics.update({f"{name}:{r.stage}": r.metric for r in result.rows})
    arms = {arm: accuracy(metrics[f"{spec}:{stage}"]) for arm, (spec, stage) in ARMS.items()}
    return arms, walls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--specs", type=Path, default=ROOT / "pipelines" / "specs")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    per_seed: dict[str, dict[str, float]] = {}
    walls: dict[str, dict[str, float]] = {}
    for seed in seeds:
        per_seed[str(seed)], walls[str(seed)] = run_seed(seed, args.specs)
    result = {
        "seeds": seeds,
        "test_accuracy": per_seed,
        "mean": {arm: statistics.mean(per_seed[str(s)][arm] for s in seeds) for arm in ARMS},
        "wall_s": walls,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
