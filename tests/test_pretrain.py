"""The pretrain stage end to end: Ray Train on the session's real local cluster, real ingest output.

Two CPU workers train a tiny ViT (depth 2, width 32, 16×16 images, patch 4) on a
small fractal corpus. The main run tracks into a real `mlflow server` (artifacts
on the S3 test server) and checkpoints to S3; the fault tests use local storage
and SQLite tracking.
"""

from __future__ import annotations

import json
import shutil
import os
import signal
import threading
import time
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

import vit
from pipelines.core import registry
from pipelines.core.errors import VitpipeError
from pipelines.image.pretrain import run_pretrain
from pipelines.image.configs import PretrainConfig
from pipelines.training.trainer import TrainingDivergedError
from tests.run_files import run_dir

pytestmark = pytest.mark.slow

TINY = dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64)


@pytest.fixture(scope="module")
def corpus(ray_cluster, tmp_path_factory) -> str:
    """A finished ingest output: 800 fractal images in 4 classes at 16×16, patch 4, val 20%.

    Large enough that a run reads few passes: each pass over a split costs Ray Data seconds of start-up.
    """
    from pipelines.corpora.images import synth_corpus
    from pipelines.image.ingest import run_ingest
    from pipelines.image.configs import IngestConfig

    root = tmp_path_factory.mktemp("pretrain-data")
    synth_corpus(str(root / "corpus"), images=800, classes=4, size=24, seed=1)
    config = IngestConfig(source=str(root / "corpus"), output=str(root / "out"), image_size=16, patch_size=4,
                          val_fraction=0.2, shard_size=200)
    return run_ingest(config).output


def base_config(data: str, tmp: Path, **overrides) -> PretrainConfig:
    fields = dict(
        data=data, model="ViT-Ti/16", model_overrides=TINY, num_workers=2, batch_size_per_worker=16,
        steps=24, warmup_steps=2, lr=2e-3, eval_interval=0, checkpoint_interval=8, keep_last=2,
        log_interval=4, augment=False, storage=str(tmp / "runs"),
        tracking_uri=f"sqlite:///{tmp}/mlflow.db", experiment="pretrain-tests", max_failures=2,
    )
    fields.update(overrides)
    return PretrainConfig(**fields)


# The fault tests: one epoch of the train split (20 steps of 32), a checkpoint every 4 steps to resume from.
FAULT = dict(steps=12, checkpoint_interval=4)


def history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    """Latest value per step of a metric."""
    return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}


# ---------------------------------------------------------------- the main run: real MLflow server, S3 storage


@pytest.fixture(scope="module")
def trained(corpus, mlflow_server, s3_server, tmp_path_factory):
    """One stage execution: 24 steps, eval at 12 and 24, checkpoints every 8 (keep 2) to s3://."""
    bucket = "pretrain-runs"
    s3_server.client().create_bucket(Bucket=bucket)
    tmp = tmp_path_factory.mktemp("pretrain-main")
    config = base_config(
        corpus, tmp, storage=f"s3://{bucket}/runs", endpoint_url=s3_server.endpoint_url,
        tracking_uri=mlflow_server.replace("http://", "http://bob:hunter2@"),  # workers log through it too
        experiment="pretrain-main", eval_interval=12, augment=True,
        ingest_run_id="ingest-run-123",
    )
    with pytest.MonkeyPatch.context() as mp:  # the AWS chain the driver resolves credentials from
        for name, value in s3_server.env.items():
            mp.setenv(name, value)
        result = run_pretrain(config)
    return config, result, MlflowClient(mlflow_server)


def test_loss_falls(trained):
    _, result, client = trained
    losses = history(client, result.run_id, "train_loss")
    first = sum(losses[s] for s in range(1, 7)) / 6
    last = sum(losses[s] for s in range(19, 25)) / 6
    assert last < first - 0.1, losses


def test_one_mlflow_run_per_stage_execution_on_the_server(trained):
    config, result, client = trained
    experiment = client.get_experiment_by_name(config.experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [result.run_id]
    assert runs[0].info.status == "FINISHED"
    # Only rank 0 logs: one value per step, not one per worker.
    assert len(client.get_metric_history(result.run_id, "train_loss")) == config.steps


def test_step_metrics_are_logged_every_step_and_eval_at_its_interval(trained):
    config, result, client = trained
    for key in ("train_loss", "lr", "grad_norm", "images_per_s", "epoch"):
        assert sorted(history(client, result.run_id, key)) == list(range(1, config.steps + 1)), key
    top1 = history(client, result.run_id, "val_top1")
    assert sorted(top1) == [12, 24]
    assert all(0.0 <= v <= 1.0 for v in top1.values())
    assert sorted(history(client, result.run_id, "val_loss")) == [12, 24]


def test_learning_rate_warms_up_then_decays_linearly(trained):
    config, result, client = trained
    lr = history(client, result.run_id, "lr")
    assert lr[1] == pytest.approx(config.lr / 2) and lr[2] == pytest.approx(config.lr)
    assert lr[config.steps] == pytest.approx(config.lr / (config.steps - config.warmup_steps))


def test_run_holds_resolved_config_system_info_and_lineage(trained):
    config, result, client = trained
    run = client.get_run(result.run_id)
    params, tags = run.data.params, run.data.tags
    assert params["model"] == "ViT-Ti/16" and params["lr"] == str(config.lr)
    assert params["model_overrides.num_classes"] == "4" and params["model_overrides.patch_size"] == "4"
    assert params["grad_accum_steps"] == "1"
    assert tags["vitpipe.num_workers"] == "2"
    assert tags["vitpipe.ray_version"] and tags["vitpipe.torch_version"] == torch.__version__
    assert tags["vitpipe.precision"] in ("bfloat16", "float32") and tags["vitpipe.worker_device"] == "cpu"
    assert tags["vitpipe.ingest_run_id"] == "ingest-run-123"
    manifest = json.loads(Path(config.data, "manifest.json").read_text())
    assert tags["vitpipe.manifest_hash"] == manifest["content_hash"]
    assert "config.yaml" in [a.path for a in client.list_artifacts(result.run_id)]


def test_credentials_never_reach_mlflow(trained, s3_server):
    _, result, client = trained
    run = client.get_run(result.run_id)
    config_text = Path(client.download_artifacts(result.run_id, "config.yaml")).read_text()
    for text in (json.dumps(run.data.params), json.dumps(run.data.tags), config_text):
        assert s3_server.secret_key not in text and s3_server.access_key not in text and "hunter2" not in text


def test_storage_keeps_the_last_checkpoints_and_the_best_model(trained, s3_server):
    config, result, client = trained
    keys = [o["Key"] for page in s3_server.client().get_paginator("list_objects_v2").paginate(Bucket="pretrain-runs")
            for o in page.get("Contents", [])]
    experiment = client.get_experiment_by_name(config.experiment).experiment_id  # each experiment its own folder
    folder = f"runs/{experiment}/{Path(result.storage_path).name}/"
    checkpoints = sorted({k[len(folder):].split("/")[0] for k in keys if k.startswith(folder + "checkpoint_0")})
    assert checkpoints == ["checkpoint_00000016", "checkpoint_00000024"]
    assert f"{folder}checkpoint_00000024/train_state.pt" in keys
    assert f"{folder}best/model.safetensors" in keys


def test_final_and_best_checkpoints_and_curve_are_logged(trained):
    _, result, client = trained
    artifacts = {a.path for p in ("checkpoints/final", "checkpoints/best") for a in client.list_artifacts(result.run_id, p)}
    assert {"checkpoints/final/model.safetensors", "checkpoints/final/config.json",
            "checkpoints/best/model.safetensors", "checkpoints/best/best.json"} <= artifacts
    assert "checkpoints/final/train_state.pt" not in artifacts  # fine-tuning needs the model, not the optimizer
    best = json.loads(Path(client.download_artifacts(result.run_id, "checkpoints/best/best.json")).read_text())
    assert best["val_top1"] == max(history(client, result.run_id, "val_top1").values())
    assert "learning_curve.png" in [a.path for a in client.list_artifacts(result.run_id)]


def test_logged_checkpoint_loads_into_vit_with_the_logged_models_logits(trained):
    config, result, client = trained
    mlflow.set_tracking_uri(client.tracking_uri)
    from_checkpoint = registry.load_model_from_run(result.final_checkpoint)
    from_model = mlflow.pyfunc.load_model(result.model_uri)  # the logged pyfunc: safetensors + vit code, no pickle
    assert isinstance(from_checkpoint, vit.VisionTransformer)
    x = torch.randn(5, 16, 48)
    with torch.no_grad():
        torch.testing.assert_close(from_checkpoint.eval()(x), torch.from_numpy(from_model.predict(x.numpy())),
                                   rtol=0, atol=0)


def test_logged_checkpoint_reproduces_the_final_validation_accuracy(trained):
    from pipelines.image.data import load_split

    config, result, client = trained
    model = registry.load_model_from_run(result.final_checkpoint, tracking_uri=client.tracking_uri).eval()
    val = load_split(config.data, "val")
    x, y = torch.as_tensor(val[0]), torch.as_tensor(val[1])
    precision = client.get_run(result.run_id).data.tags["vitpipe.precision"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        top1 = float((model(x).float().argmax(-1) == y).float().mean())
    # Same weights, same data; bf16 kernels may round a borderline sample differently at another batch size.
    assert abs(top1 - result.metrics["val_top1"]) <= 1.5 / len(y)


def test_rerunning_a_finished_config_trains_nothing_and_keeps_one_run(trained, s3_server):
    config, result, client = trained
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env.items():
            mp.setenv(name, value)
        again = run_pretrain(config)
    assert again.reused and again.run_id == result.run_id
    experiment = client.get_experiment_by_name(config.experiment)
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_a_finished_run_is_handed_back_without_starting_or_joining_ray(trained, s3_server, monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("Ray was started or joined for a finished run")

    monkeypatch.setattr("pipelines.image.pretrain.connect", tripwire)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    config, result, _ = trained
    again = run_pretrain(config, ray_address="127.0.0.1:1")  # nothing listens there
    assert again.reused and again.run_id == result.run_id


def test_a_finished_run_leaves_no_train_controller_alive(trained, ray_cluster):
    # Ray Train's Ctrl-C handler holds the run's controller actor (and its dataset actors) until replaced.
    import ray
    from ray.util.state import list_actors

    job = ray.get_runtime_context().get_job_id()
    filters = [("class_name", "=", "TrainController"), ("state", "=", "ALIVE"), ("job_id", "=", job)]
    deadline = time.monotonic() + 60
    while (alive := list_actors(address=ray_cluster.dashboard_url, filters=filters)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not alive, [(a.actor_id, a.pid) for a in alive]


def test_ctrl_c_after_a_run_stops_the_process_at_once(trained):
    # Not Ray Train's handler, which would abort the finished run and swallow the first two Ctrl-Cs.
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


# ---------------------------------------------------------------- reproducibility


def test_the_same_config_with_crops_on_the_device_trains_the_same_weights_twice(corpus, ray_cluster, tmp_path):
    """Seeded file order, and crops per pass on the training worker's device, order kept by Ray Data: a demo's
    numbers repeat. (With the crops on the data workers: tests/test_experiment_storage.py.)"""
    weights = []
    for attempt in ("first", "second"):  # separate storage and tracking: nothing is reused or resumed
        config = base_config(corpus, tmp_path / attempt, num_workers=1, steps=6, checkpoint_interval=0,
                             augment=True, augment_on="device", shuffle_buffer=64)
        result = run_pretrain(config)
        model = registry.load_model_from_run(result.final_checkpoint, tracking_uri=config.tracking_uri)
        weights.append(model.state_dict())
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- faults
# A driver SIGKILLed mid-run and run again: tests/test_runner.py (the same resume, through `vitpipe run`).


def _wait_for_checkpoint(run_dir: Path, name: str, alive, timeout: float = 600) -> None:
    """Block until Ray Train has recorded checkpoint `name` of the run (not merely started writing it)."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if snapshot.exists() and name in snapshot.read_text():
            return
        assert alive(), "the stage ended before its first checkpoint"
        time.sleep(0.2)
    raise AssertionError(f"no {name} in {run_dir} within {timeout}s")


def test_killed_worker_is_restarted_and_training_resumes_from_checkpoint(corpus, ray_cluster, tmp_path):
    from ray.util.state import list_actors

    config = base_config(corpus, tmp_path, run_name="worker-kill", **FAULT)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_pretrain(config)), daemon=True)
    thread.start()
    _wait_for_checkpoint(run_dir(config), "checkpoint_00000004", thread.is_alive)
    workers = list_actors(address=ray_cluster.dashboard_url,
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    assert len(workers) == 2
    os.kill(workers[1].pid, signal.SIGKILL)
    thread.join(timeout=600)
    assert not thread.is_alive()

    result = outcome["result"]
    client = MlflowClient(config.tracking_uri)
    assert result.resumed
    resumed_from = int(client.get_run(result.run_id).data.tags["vitpipe.resumed_from_step"])
    assert resumed_from in (4, 8)  # the last checkpoint when the worker died
    assert max(history(client, result.run_id, "train_loss")) == config.steps
    assert result.metrics["resumed_from_step"] == resumed_from
    experiment = client.get_experiment_by_name(config.experiment)
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_non_finite_loss_stops_the_stage_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    # An absurd learning rate blows the weights up after step 1; step 2's loss is NaN.
    config = base_config(corpus, tmp_path, run_name="diverge", lr=1e30, warmup_steps=0, checkpoint_interval=1)
    with pytest.raises(TrainingDivergedError, match=r"non-finite at step 2;.*checkpoint_00000001"):
        run_pretrain(config)
    assert (run_dir(config) / "checkpoint_00000001" / "model.safetensors").exists()
    assert not (run_dir(config) / "checkpoint_00000002").exists()
    client = MlflowClient(config.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name(config.experiment).experiment_id])[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["vitpipe.diverged_at_step"] == "2"


def test_a_worker_error_reaches_the_user_as_one_line_with_its_cause(corpus, tmp_path):
    # A damaged shard: its footer reads, its pages do not, so the workers' reads fail, not the driver's.
    shutil.copytree(corpus, data := tmp_path / "data")
    shard = sorted((data / "shards").glob("*.parquet"))[0]
    raw = shard.read_bytes()
    shard.write_bytes(raw[:64] + bytes(len(raw) // 2 - 64) + raw[len(raw) // 2:])
    config = base_config(str(data), tmp_path, run_name="damaged", max_failures=0)
    with pytest.raises(VitpipeError, match=r"^pretrain: training failed \(max_failures=0\): \w+(Error|Exception): ") as caught:
        run_pretrain(config)
    assert "worker errors:" not in str(caught.value), str(caught.value)
