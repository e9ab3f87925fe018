"""A sweep's best trial is scored by the weights it tests and registers: its last checkpoint's own report.

Under ASHA a trial's last result (what Tune saw when it stopped the trial) need
not be at a checkpoint: with `checkpoint_interval` past `eval_interval` the
trial may have saved last some steps before, and its Train run may even train
and save on for a moment after the stop. The fast tests here write real trial
checkpoints (weights and the position file `TrialHooks` writes) the way a
trial's Train run lays them out; the slow one runs such an ASHA sweep.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from pyarrow.fs import LocalFileSystem

import vit
from pipelines.image.finetune import run_finetune
from pipelines.image.finetune_results import load_trial_model, pick_best, score_trial, trial_runs
from pipelines.image.finetune_trial import POSITION_FILE, TrialHooks
from tests.transfer_fixtures import DIGITS_SIZE, sweep_config

TINY = dict(depth=1, embed_dim=16, num_heads=2, mlp_dim=32, patch_size=4, image_size=16, num_classes=4)


def _checkpoint(trials: Path, trial_id: str, step: int, val_top1: float, seed: int) -> vit.VisionTransformer:
    """A trial checkpoint at `step` whose position file holds the report it was written with."""
    torch.manual_seed(seed)
    model = vit.create_model("ViT-Ti/16", **TINY)
    directory = trials / trial_id / f"checkpoint_{step:08d}"
    vit.save_checkpoint(model, directory)
    report = {"step": step, "epoch": 0, "lr": 0.01, "train_loss": 1.0, "val_loss": 1.0, "val_top1": val_top1}
    TrialHooks().write_checkpoint(str(directory), {"step": step, "epoch": 0, "batch_in_epoch": step}, report)
    return model


def _outcome(trial_id: str, step: int, val_top1: float, status: str = "early_stopped") -> dict:
    """A trial as Tune ended it: `last` is its last result."""
    last = {"step": step, "val_top1": val_top1}
    return {"trial_id": trial_id, "config": {"lr": 0.01}, "status": status, "last": last, "error": None}


def _score(outcome: dict, trials: Path) -> dict:
    """`outcome` scored by `val_top1` among the trial runs under `trials`."""
    fs = LocalFileSystem()
    return score_trial(outcome, "val_top1", trial_runs(str(trials), fs), fs)


def test_a_trial_is_scored_by_the_report_saved_with_its_last_checkpoint_not_its_last_result(tmp_path):
    _checkpoint(tmp_path, "t0", 4, val_top1=0.30, seed=0)
    scored = _score(_outcome("t0", 6, val_top1=0.50), tmp_path)
    assert scored["metric"] == 0.30
    assert scored["checkpoint"] == f"{tmp_path}/t0/checkpoint_00000004"
    assert scored["checkpoint_step"] == 4


def test_a_trial_without_a_checkpoint_cannot_be_picked(tmp_path):
    _checkpoint(tmp_path, "saved", 24, val_top1=0.40, seed=0)
    outcomes = [_score(_outcome("unsaved", 2, val_top1=0.90), tmp_path),
                _score(_outcome("saved", 24, val_top1=0.40, status="completed"), tmp_path)]
    assert outcomes[0]["metric"] is None and outcomes[0]["checkpoint"] is None
    assert pick_best(outcomes, "max")["trial_id"] == "saved"


def test_the_best_trial_is_picked_by_checkpoint_scores_and_loads_the_checkpoint_it_was_scored_by(tmp_path):
    # "stopped" reported 0.9 at step 6, but its weights saved at step 4 scored 0.3; "done" saved 0.5 at its end.
    _checkpoint(tmp_path, "stopped", 4, val_top1=0.30, seed=0)
    done = _checkpoint(tmp_path, "done", 24, val_top1=0.50, seed=1)
    outcomes = [_score(_outcome("stopped", 6, val_top1=0.90), tmp_path),
                _score(_outcome("done", 24, val_top1=0.50, status="completed"), tmp_path)]
    best = pick_best(outcomes, "max")
    assert (best["trial_id"], best["metric"]) == ("done", 0.50)
    loaded = load_trial_model(best["checkpoint"], LocalFileSystem()).state_dict()
    for name, tensor in done.state_dict().items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def test_a_failed_trial_is_not_scored_even_with_a_checkpoint(tmp_path):
    _checkpoint(tmp_path, "t0", 4, val_top1=0.30, seed=0)
    scored = _score(_outcome("t0", 4, val_top1=0.30, status="failed"), tmp_path)
    assert scored["metric"] is None and scored["checkpoint"] is None


def test_a_trial_whose_last_checkpoint_lacks_its_position_file_is_unscored_not_an_error(tmp_path):
    # What a worker killed while saving leaves (ASHA stops a trial by killing its workers).
    _checkpoint(tmp_path, "t0", 4, val_top1=0.30, seed=0)
    vit.save_checkpoint(vit.create_model("ViT-Ti/16", **TINY), tmp_path / "t0" / "checkpoint_00000008")
    scored = _score(_outcome("t0", 6, val_top1=0.50), tmp_path)
    assert (scored["metric"], scored["checkpoint"], scored["checkpoint_step"]) == (None, None, None)


@pytest.mark.slow
def test_an_asha_sweep_reports_the_metric_of_the_checkpoint_it_tests_and_logs(digits_data, pretrained, tmp_path):
    # Two trials in turn, checkpoints every 4 steps, ASHA's only early rung at step 6. Ranked by val_loss
    # *max* so the trial ASHA stops (lr 0.02 learns faster) is the one picked: its last result (step 6) is
    # never at a checkpoint.
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp_path, run_name="asha-ckpt",
                          search_space={"lr": {"grid": [0.01, 0.02]}, "steps": 24, "resolution": DIGITS_SIZE},
                          metric="val_loss", mode="max", eval_interval=2, checkpoint_interval=4, grace_period=6,
                          max_concurrent_trials=1, registry_model=None, experiment="finetune-asha-ckpt")
    result = run_finetune(config)
    client = MlflowClient(pretrained.tracking_uri)
    run = client.get_run(result.run_id)
    best_trial = run.data.tags["vitpipe.best_trial"]
    assert result.trial_status[best_trial] == "early_stopped"
    logged = vit.load_checkpoint(mlflow.artifacts.download_artifacts(
        f"runs:/{result.run_id}/checkpoints/best", dst_path=str(tmp_path / "best"), tracking_uri=pretrained.tracking_uri,
    )).state_dict()
    [trial_dir] = Path(tmp_path, "runs").glob(f"*/*-work/trials/{best_trial}")  # <experiment id>/<run>-work
    [tested] = [d for d in trial_dir.glob("checkpoint_*") if d.is_dir()
                and all(torch.equal(t, logged[k]) for k, t in vit.load_checkpoint(str(d)).state_dict().items())]
    report = json.loads((tested / POSITION_FILE).read_text())["report"]
    [trial_run] = client.search_runs([run.info.experiment_id], f"tags.`vitpipe.trial_id` = '{best_trial}'")
    assert trial_run.data.metrics["final_step"] == 6 != report["step"]  # its last result was not at a checkpoint
    assert result.best_metric == report["val_loss"]
    assert json.loads(Path(mlflow.artifacts.download_artifacts(
        f"runs:/{result.run_id}/best_config.json", dst_path=str(tmp_path / "cfg"), tracking_uri=pretrained.tracking_uri,
    )).read_text())["val_loss"] == report["val_loss"]
