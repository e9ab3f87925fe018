"""A stage driver for the multi-node proofs (tests/test_multinode.py): one stage on the cluster at $RAY_ADDRESS.

    python -m tests.multinode_driver {ingest|pretrain|finetune} CONFIG_JSON
    python -m tests.multinode_driver job-nodes SUBMISSION_ID

Prints one JSON line: the stage's result, and `train_nodes`, the node (its `worker_I`
resource, or `head`) of every Ray Train worker this driver's job started; or, for
`job-nodes`, the `train_nodes` of a job submitted through the Jobs API.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Any


def node_names() -> dict[str, str]:
    """Node id -> the node's name in the local cluster (`head`, `worker_1`, ...), read while every node is alive."""
    import ray

    names = {}
    for node in ray.nodes():
        named = [r for r in node["Resources"] if r == "head" or re.fullmatch(r"worker_\d+", r)]
        names[node["NodeID"]] = named[0] if named else node["NodeID"]
    return names


def train_nodes(names: dict[str, str], job: str | None = None) -> list[str]:
    """Where each Ray Train worker of `job` (default: this driver's job) ran, dead ones included."""
    import ray
    from ray.util.state import list_actors

    job = job or ray.get_runtime_context().get_job_id()
    actors = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("job_id", "=", job)], detail=True,
                         limit=10_000, raise_on_missing_output=False)
    return [names.get(a.node_id, a.node_id) for a in actors]


def run_stage(stage: str, config: dict[str, Any]) -> Any:
    """Run one stage from its config fields; returns its result model."""
    if stage == "ingest":
        from pipelines.image.ingest import run_ingest
        from pipelines.image.configs import IngestConfig

        return run_ingest(IngestConfig(**config))
    if stage == "pretrain":
        from pipelines.image.pretrain import run_pretrain
        from pipelines.image.configs import PretrainConfig

        return run_pretrain(PretrainConfig(**config))
    if stage == "finetune":
        from pipelines.image.finetune import run_finetune
        from pipelines.image.configs import FinetuneConfig

        return run_finetune(FinetuneConfig(**config))
    raise SystemExit(f"unknown stage {stage!r}: ingest, pretrain or finetune")


def main() -> None:
    import ray

    ray.init(_node_ip_address="127.0.0.1")  # $RAY_ADDRESS, joined as the head's loopback address it runs on
    names = node_names()
    if sys.argv[1] == "job-nodes":
        from ray.util.state import list_jobs

        [job] = list_jobs(filters=[("submission_id", "=", sys.argv[2])])
        print(json.dumps({"train_nodes": train_nodes(names, job.job_id)}), flush=True)
        return
    stage, config = sys.argv[1], json.loads(sys.argv[2])
    result = run_stage(stage, config)
    fields = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result.model_dump(mode="json")
    print(json.dumps({"result": fields, "train_nodes": train_nodes(names)}, default=str), flush=True)


if __name__ == "__main__":
    main()
