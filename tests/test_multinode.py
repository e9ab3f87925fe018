"""Proof across nodes, on one machine: training, node loss and a submitted pipeline (its sweep's trials a
node each) on a real multi-node Ray cluster (head + 2 worker nodes, token auth on), with storage on the S3
test server and tracking on a real `mlflow server`.

One cluster serves the module (`tests/multinode_fixtures.py`). Stages run in driver processes on
the head, which also report where Ray Train put their workers; the pipeline goes in as a job, whose
workers' nodes the Ray state API gives afterwards.

Node loss uses a fixed worker count with `FailureConfig(max_failures)`, not Train V2's elastic
`num_workers` range: a checkpoint resumes each rank's data position and random streams, and the
driver fixes the global batch (workers × per-worker batch × accumulation), so a group of another
size would neither continue the same streams nor keep the global batch. Half a slot per worker lets
the restarted group of two fit on the worker node that is left.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from pipelines.core import registry
from tests.conftest import _free_port
from tests.multinode_fixtures import (  # noqa: F401
    REPO, SCRIPT, cluster_processes, finish, nodes_cluster, train_worker_node, wait_for_key,
)

pytestmark = pytest.mark.slow

BUCKET = "multinode"
TINY = dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64)
ONE_SLOT = {"CPU": 1.0, "train_slot": 1.0}  # a worker node to itself: two such workers run on two nodes
HALF_SLOT = {"CPU": 1.0, "train_slot": 0.5}  # two fit on one worker node (Ray packs them there)


@pytest.fixture(scope="module")
def corpus(ray_cluster, tmp_path_factory) -> Path:
    """400 fractal images in 4 classes, 24×24, on the local disk every node shares. Rendered by Ray tasks on the
    session cluster: without one, Ray would start a cluster of its own in this process, and the session
    cluster's `ray.init` would then fail in any later test."""
    from pipelines.corpora.images import synth_corpus

    root = tmp_path_factory.mktemp("multinode-corpus")
    synth_corpus(str(root), images=400, classes=4, size=24, seed=3)
    return root


@pytest.fixture(scope="module")
def fractals(nodes_cluster, s3_server, corpus) -> str:  # noqa: F811
    """The corpus ingested on the cluster into S3 at 16×16, patch 4, val 20%."""
    s3_server.client().create_bucket(Bucket=BUCKET)
    output = f"s3://{BUCKET}/data/fractals"
    nodes_cluster.drive("ingest", dict(source=str(corpus), output=output, endpoint_url=s3_server.endpoint_url,
                                       image_size=16, patch_size=4, val_fraction=0.2, shard_size=100))
    return output


def pretrain_config(data: str, s3_server, tracking_uri: str, name: str, **overrides) -> dict:
    """A tiny two-worker pretrain run checkpointing to s3://multinode/runs/<name>/<experiment id>/<run name>."""
    config = dict(
        data=data, endpoint_url=s3_server.endpoint_url, model="ViT-Ti/16", model_overrides=TINY, num_workers=2,
        batch_size_per_worker=16, steps=8, warmup_steps=2, lr=2e-3, eval_interval=0, checkpoint_interval=0,
        log_interval=4, augment=False, storage=f"s3://{BUCKET}/runs/{name}", tracking_uri=tracking_uri,
        experiment="multinode",
    )
    return {**config, **overrides}


@pytest.fixture(scope="module")
def across_nodes(nodes_cluster, fractals, s3_server, mlflow_server) -> dict:  # noqa: F811
    """Two pretrain workers, each on a worker node of its own."""
    return nodes_cluster.drive("pretrain", pretrain_config(fractals, s3_server, mlflow_server, "spread",
                                                           resources_per_worker=ONE_SLOT))


def test_pretraining_on_two_nodes_reaches_the_weights_of_a_one_node_run(nodes_cluster, across_nodes, fractals,  # noqa: F811
                                                                       s3_server, mlflow_server):
    one_node = nodes_cluster.drive("pretrain", pretrain_config(
        fractals, s3_server, mlflow_server, "one-node", resources_per_worker={"CPU": 1.0, "worker_1": 0.5}))
    assert sorted(across_nodes["train_nodes"]) == ["worker_1", "worker_2"]
    assert one_node["train_nodes"] == ["worker_1", "worker_1"]
    spread, packed = (registry.load_model_from_run(run["result"]["final_checkpoint"], tracking_uri=mlflow_server)
                      for run in (across_nodes, one_node))
    packed_weights = packed.state_dict()
    for name, value in spread.state_dict().items():
        torch.testing.assert_close(value, packed_weights[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_run_that_loses_a_node_resumes_from_its_s3_checkpoint_on_the_node_left(nodes_cluster, fractals,  # noqa: F811
                                                                                 s3_server, mlflow_server):
    # One pass over the 322 training rows (40 steps of 2 × 4) keeps the proof short; many passes are tested
    # to start with the first one in tests/test_passes.py.
    steps = 40
    config = pretrain_config(fractals, s3_server, mlflow_server, "node-loss", steps=steps, batch_size_per_worker=4,
                             checkpoint_interval=2, log_interval=2, max_failures=2, resources_per_worker=HALF_SLOT)
    driver = nodes_cluster.start_driver("pretrain", config)
    try:
        # Ray Train records a checkpoint in this snapshot once the checkpoint is whole on S3.
        wait_for_key(s3_server.client(), BUCKET, "runs/node-loss/", "checkpoint_manager_snapshot.json", timeout=300)
        lost = train_worker_node(nodes_cluster.env)
        nodes_cluster.kill_node(lost)
    except BaseException:
        driver.kill()
        print(driver.communicate()[0][-4000:])  # the driver's side of the story, shown with the failure
        raise
    try:
        run = finish(driver, timeout=240)
    finally:
        nodes_cluster.start_node(lost)  # the other proofs need both worker nodes
    left = ({"worker_1", "worker_2"} - {lost}).pop()
    assert sorted(run["train_nodes"]) == sorted([lost, lost, left, left])  # the first group, then the restarted one
    client = MlflowClient(mlflow_server)
    resumed_from = int(client.get_run(run["result"]["run_id"]).data.tags["vitpipe.resumed_from_step"])
    assert 2 <= resumed_from < steps and resumed_from % 2 == 0  # a checkpoint of the first group, from S3
    assert max(m.step for m in client.get_metric_history(run["result"]["run_id"], "train_loss")) == steps


def test_a_submitted_pipeline_runs_ingest_pretrain_and_a_sweep_across_nodes_to_succeeded(  # noqa: F811
        nodes_cluster, corpus, s3_server, mlflow_server, tmp_path):
    spec = {
        "name": "multinode-job",
        "storage": {"root": f"s3://{BUCKET}/job", "endpoint_url": s3_server.endpoint_url},
        "tracking_uri": mlflow_server,
        "experiment": "multinode-job",
        "stages": {
            "corpus": {"kind": "ingest", "source": str(corpus), "image_size": 16, "patch_size": 4,
                       "val_fraction": 0.2, "shard_size": 100},
            "pretrain": {"kind": "pretrain", "inputs": ["corpus"], "model": "ViT-Ti/16", "model_overrides": TINY,
                         "num_workers": 2, "resources_per_worker": ONE_SLOT, "batch_size_per_worker": 16,
                         "steps": 8, "warmup_steps": 2, "eval_interval": 0, "checkpoint_interval": 0,
                         "augment": False},
            # Two trials at once, one worker each on a worker node to itself: a node each.
            "finetune": {"kind": "finetune", "inputs": ["corpus", "pretrain"], "optimizer": "adamw",
                         "search_space": {"lr": {"grid": [0.003, 0.001]}, "steps": 8}, "scheduler": "fifo",
                         "eval_interval": 4, "batch_size": 32, "num_workers": 1, "resources_per_worker": ONE_SLOT,
                         "max_concurrent_trials": 2},
        },
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    client_env = {k: v for k, v in nodes_cluster.env.items() if not k.startswith("AWS_")}  # no keys on the laptop
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "submit", str(path), "--address",
                           nodes_cluster.dashboard], cwd=REPO, env=client_env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    job_id = done.stdout.splitlines()[0]
    status = subprocess.run([sys.executable, "-m", "pipelines.cli", "status", job_id, "--address",
                             nodes_cluster.dashboard], cwd=REPO, env=client_env, capture_output=True, text=True,
                            timeout=120)
    assert status.stdout.strip() == "SUCCEEDED"
    for stage in ("corpus", "pretrain", "finetune"):
        assert re.search(rf"^{stage}\s+\w+\s+done\s", done.stdout, re.M), done.stdout[-3000:]
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("multinode-job").experiment_id
    stages = {r.data.tags.get("vitpipe.stage"): r for r in client.search_runs([experiment])
              if r.info.status == "FINISHED"}
    assert {"ingest", "pretrain", "finetune"} <= set(stages)
    # Pretraining's two workers are on both worker nodes (a slot each); so are the two trials', one each.
    assert sorted(nodes_cluster.job_train_nodes(job_id)) == ["worker_1", "worker_1", "worker_2", "worker_2"]
    trials = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{stages['finetune'].info.run_id}'")
    assert sorted(float(r.data.params["lr"]) for r in trials) == [0.001, 0.003]
    assert all(r.info.status == "FINISHED" for r in trials)


def test_stopping_a_local_cluster_ends_it_on_sigterm_and_leaves_another_running(nodes_cluster):  # noqa: F811
    port = _free_port()
    env = {**nodes_cluster.env, "RAY_PORT": str(port), "DASHBOARD_PORT": str(_free_port()), "RAY_TMP": f"/tmp/vp-stop-{port}"}
    started = subprocess.run([str(SCRIPT), "start", "1"], env=env, timeout=300, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr[-3000:]
    assert {"gcs_server", "raylet"} <= {exe.rsplit("/", 1)[-1] for exe in cluster_processes(env["RAY_TMP"]).values()}
    others = {pid for pid, exe in cluster_processes(nodes_cluster.env["RAY_TMP"]).items() if exe.endswith(("/raylet", "/gcs_server"))}
    assert others

    stopped = subprocess.run([str(SCRIPT), "stop"], env=env, timeout=120, capture_output=True, text=True)
    assert stopped.returncode == 0 and "SIGKILL" not in stopped.stdout, stopped.stdout  # raylets, head, GCS last
    assert not cluster_processes(env["RAY_TMP"])
    assert others <= set(cluster_processes(nodes_cluster.env["RAY_TMP"]))
