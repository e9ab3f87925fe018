"""Starting weights that MLflow keeps, named by a run, a logged model or a registered version.

An `init` that names something MLflow knows, but not the weights it should, is refused in one
line that says what it names (the run's stage and status, what it logged) before anything is
trained; a reference vitpipe itself hands on (a fine-tune's `model_uri`) loads. Against the
session's real `mlflow server` (artifacts on the S3 server).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

import vit
from pipelines.core import registry, run_open, tracking
from pipelines.training.starting_weights import fetch_starting_weights, starting_origin

TINY = dict(image_size=16, patch_size=4, num_classes=3, depth=1, embed_dim=16, num_heads=2, mlp_dim=32)


@pytest.fixture
def client(mlflow_server: str) -> MlflowClient:
    return MlflowClient(mlflow_server)


def _run(client: MlflowClient, stage: str) -> str:
    run_id, _ = run_open.start_stage_run(client, f"tracked-{uuid.uuid4().hex[:8]}", stage, uuid.uuid4().hex)
    return run_id


def _checkpoint(directory: Path) -> Path:
    torch.manual_seed(0)
    return vit.save_checkpoint(vit.create_model("ViT-Ti/16", **TINY), directory)


def _fetch(init: str, client: MlflowClient):
    return fetch_starting_weights(init, model_name=None, model_overrides={}, tracking_uri=client.tracking_uri)


def test_a_logged_model_uri_loads_the_weights_of_the_run_that_logged_it(client, tmp_path):
    """A fine-tune's `model_uri` (`models:/m-...`) is what a pipeline hands an evaluate or embed stage as `init`."""
    run_id = _run(client, "finetune")
    uri = registry.log_vit_model(client, run_id, _checkpoint(tmp_path / "ckpt"))
    start = _fetch(uri, client)
    assert start.source_run_id == starting_origin(uri, client.tracking_uri).run_id == run_id
    expected = vit.load_checkpoint(tmp_path / "ckpt").state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in start.model.state_dict().items())


def test_an_unknown_logged_model_is_one_line(client):
    uri = f"models:/m-{'0' * 32}"
    with pytest.raises(ValueError) as err:
        starting_origin(uri, client.tracking_uri)
    assert str(err.value) == f"init: logged model {uri!r} not found at {client.tracking_uri}"


def test_a_fine_tune_run_id_names_the_checkpoints_it_logged(client, tmp_path):
    """A fine-tune logs its best trial at checkpoints/best, not at the default checkpoints/final."""
    run_id = _run(client, "finetune")
    tracking.log_checkpoint_dir(client, run_id, _checkpoint(tmp_path / "ckpt"), "checkpoints/best")
    client.set_terminated(run_id, "FINISHED")
    with pytest.raises(ValueError) as err:
        _fetch(run_id, client)
    assert str(err.value) == (f"init {run_id}: run {run_id} (finetune, FINISHED) has no folder checkpoints/final; "
                              f"its checkpoints: runs:/{run_id}/checkpoints/best")


def test_a_run_still_running_without_a_checkpoint_says_so(client):
    run_id = _run(client, "pretrain")
    with pytest.raises(ValueError) as err:
        _fetch(f"runs:/{run_id}/checkpoints/final", client)
    assert str(err.value) == (f"init runs:/{run_id}/checkpoints/final: run {run_id} (pretrain, RUNNING) has no "
                              "folder checkpoints/final; it logged no checkpoints")


def test_a_deleted_run_is_refused_before_its_weights_are_read(client, tmp_path):
    run_id = _run(client, "pretrain")
    tracking.log_checkpoint_dir(client, run_id, _checkpoint(tmp_path / "ckpt"), "checkpoints/final")
    client.set_terminated(run_id, "FINISHED")
    client.delete_run(run_id)
    with pytest.raises(ValueError) as err:
        starting_origin(run_id, client.tracking_uri)
    assert str(err.value) == f"init: MLflow run {run_id!r} is deleted (restore it, or name another run)"
