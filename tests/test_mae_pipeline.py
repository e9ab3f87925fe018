"""An unlabeled ingest → MAE pretrain → fine-tune and few-shot pipeline through the runner (issue 19 §3, §5).

One tiny spec runs once (module fixture) on the session's real local Ray, tracked on the session's
`mlflow server`: the corpus is ingested twice, unlabeled for the MAE stage and labeled for the transfer
stages; the MAE run's encoder then feeds a fine-tune sweep, a few-shot evaluation and a VTN backbone
exactly as a supervised pretrain's does.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

import vit

from pipelines.core import shards
from pipelines.core.storage import open_store
from pipelines.image.reconstruction import RECONSTRUCTION_FIGURE
from pipelines.runner import PipelineResult, run_pipeline
from pipelines.spec_file import load_spec
from pipelines.video.model import FrozenBackbone, build_initial_model
from vit.mae import load_mae

pytestmark = pytest.mark.slow

TINY = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}
INGEST = {"kind": "ingest", "image_size": 16, "patch_size": 4, "val_fraction": 0.2, "test_fraction": 0.2,
          "shard_size": 100}


@pytest.fixture(scope="module")
def pipeline(ray_cluster, mlflow_server, tmp_path_factory) -> tuple[PipelineResult, MlflowClient]:
    from pipelines.corpora.images import synth_corpus

    tmp = tmp_path_factory.mktemp("mae-pipeline")
    synth_corpus(str(tmp / "corpus"), images=150, classes=3, size=16, seed=5)
    spec = {
        "name": "mae-tiny",
        "storage": {"root": str(tmp / "work")},
        "tracking_uri": mlflow_server,
        "experiment": "mae-pipeline-tests",
        "stages": {
            "unlabeled": {**INGEST, "source": str(tmp / "corpus"), "labeled": False},
            "labeled": {**INGEST, "source": str(tmp / "corpus")},
            "mae": {"kind": "pretrain", "inputs": ["unlabeled"], "objective": "mae", "model": "ViT-Ti/16",
                    "model_overrides": TINY, "decoder_dim": 16, "decoder_depth": 1, "decoder_heads": 2,
                    "num_workers": 1, "batch_size_per_worker": 16, "steps": 6, "warmup_steps": 1,
                    "log_interval": 2, "augment": False},
            "finetune": {"kind": "finetune", "inputs": ["labeled", "mae"], "batch_size": 16, "eval_interval": 3,
                         "search_space": {"lr": 0.01, "steps": 6}, "max_concurrent_trials": 1},
            "fewshot": {"kind": "evaluate", "inputs": ["labeled", "mae"], "shots": [1, 2], "repeats": 1},
        },
    }
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return run_pipeline(load_spec(path)), MlflowClient(mlflow_server)


def run_of(result: PipelineResult, stage: str) -> str:
    return next(r.run_id for r in result.rows if r.stage == stage)


def test_every_stage_of_the_unlabeled_mae_pipeline_finishes(pipeline):
    result, _ = pipeline
    assert [(r.stage, r.status) for r in result.rows] == [
        ("unlabeled", "done"), ("labeled", "done"), ("mae", "done"), ("finetune", "done"), ("fewshot", "done")]


def test_the_mae_stage_trains_on_the_unlabeled_ingest(pipeline):
    result, client = pipeline
    mae = client.get_run(run_of(result, "mae"))
    assert mae.data.tags["vitpipe.ingest_run_id"] == run_of(result, "unlabeled")
    assert shards.read_manifest(open_store(result.outputs["unlabeled"].output))["labeled"] is False


def test_every_stage_is_a_child_of_the_pipeline_run_and_the_trials_of_the_fine_tune(pipeline):
    result, client = pipeline
    for row in result.rows:
        assert client.get_run(row.run_id).data.tags["mlflow.parentRunId"] == result.run_id, row.stage
    finetune = run_of(result, "finetune")
    assert client.get_run(finetune).data.tags["vitpipe.upstream_runs"] == (
        f"labeled={run_of(result, 'labeled')},mae={run_of(result, 'mae')}")
    experiment = client.get_run(finetune).info.experiment_id
    trials = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{finetune}'")
    assert len(trials) == 1 and trials[0].info.status == "FINISHED"


def test_the_mae_run_logs_its_reconstruction_picture(pipeline):
    result, client = pipeline
    assert RECONSTRUCTION_FIGURE in {a.path for a in client.list_artifacts(run_of(result, "mae"), "mae")}


def test_the_fine_tune_and_the_few_shot_evaluation_report_their_figures_from_the_mae_encoder(pipeline):
    result, client = pipeline
    metrics = {r.stage: r.metric for r in result.rows}
    assert metrics["finetune"].startswith("test_accuracy=")
    assert "1-shot=" in metrics["fewshot"]
    assert client.get_run(run_of(result, "fewshot")).data.tags["vitpipe.upstream_runs"].endswith(
        f"mae={run_of(result, 'mae')}")


def mae_encoder(run_id: str, tracking_uri: str, tmp: Path) -> dict[str, torch.Tensor]:
    """The encoder weights of MAE run `run_id`'s final checkpoint."""
    mlflow.set_tracking_uri(tracking_uri)
    checkpoint = mlflow.artifacts.download_artifacts(f"runs:/{run_id}/checkpoints/final", dst_path=str(tmp))
    return load_mae(checkpoint).encoder.state_dict()


def test_the_fine_tune_starts_from_the_mae_runs_encoder(pipeline, mlflow_server, tmp_path):
    result, client = pipeline
    assert client.get_run(run_of(result, "finetune")).data.tags["vitpipe.pretrain_run_id"] == run_of(result, "mae")
    # The weights every trial's workers load: staged once by the stage beside the trials.
    work = Path(result.outputs["finetune"].experiment_path + "-work")
    staged = vit.load_checkpoint(work / "init").state_dict()
    encoder = mae_encoder(run_of(result, "mae"), mlflow_server, tmp_path)
    assert staged.keys() == encoder.keys()
    for name in encoder:
        torch.testing.assert_close(staged[name], encoder[name], rtol=0, atol=0, msg=name)


def test_a_vtn_takes_the_mae_encoder_as_its_backbone(pipeline, mlflow_server, tmp_path):
    result, _ = pipeline
    mae_run = run_of(result, "mae")
    encoder = mae_encoder(mae_run, mlflow_server, tmp_path)
    fields = FrozenBackbone(init=mae_run, backbone=None, backbone_overrides={}, frame_size=None, seed=0,
                            endpoint_url=None)
    backbone = build_initial_model(fields, num_classes=3, tracking_uri=mlflow_server).model.backbone.state_dict()
    shared = [k for k in backbone if k in encoder]
    assert "patch_embed.proj.weight" in shared and len(shared) >= len(backbone) - 2
    for name in shared:
        torch.testing.assert_close(backbone[name], encoder[name], rtol=0, atol=0, msg=name)
