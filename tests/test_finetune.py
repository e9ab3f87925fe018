"""The transfer stage end to end: a Ray Tune sweep of Ray Train runs on the session's real local cluster,
tracked on a real `mlflow server`, starting from a real pretrain run.

The main sweep runs once (module fixture) and several tests read its outcome:
four trials of a tiny ViT fine-tuned on the digits at 32×32, twice the 16×16 it
was pretrained at. Learning rates are spread so ASHA has clearly worse trials
to stop (1e-7 barely moves) and one trial diverges (lr 1e30), which must not
take the sweep down.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import time
from dataclasses import dataclass

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from pyarrow.fs import LocalFileSystem

import vit
from pipelines.core.shards import read_manifest
from pipelines.core.errors import VitpipeError
from pipelines.image.finetune import FinetuneResult, run_finetune
from pipelines.image.configs import FinetuneConfig
from pipelines.image.finetune_trial import latest_checkpoint
from pipelines.image.labeled_rows import DataSpec, augment_config, load_rows, train_dataset
from pipelines.training.starting_weights import fetch_starting_weights
from tests.fault_proxy import FaultProxy
from tests.run_files import run_dir
from tests.transfer_fixtures import DIGITS_SIZE, STEPS, sweep_config

pytestmark = pytest.mark.slow


@dataclass
class Sweep:
    config: FinetuneConfig
    result: FinetuneResult
    client: MlflowClient

    def children(self):
        experiment = self.client.get_experiment_by_name(self.config.experiment).experiment_id
        return self.client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{self.result.run_id}'")

    def history(self, run_id: str, key: str) -> dict[int, float]:
        return {m.step: m.value for m in sorted(self.client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}


@pytest.fixture(scope="module")
def sweep(digits_data, pretrained, tmp_path_factory) -> Sweep:
    tmp = tmp_path_factory.mktemp("finetune-main")
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp)
    return Sweep(config, run_finetune(config), MlflowClient(pretrained.tracking_uri))


# ---------------------------------------------------------------- the main sweep


def test_the_sweep_runs_every_trial_and_stops_at_least_one_early(sweep):
    statuses = sweep.result.trial_status
    assert len(statuses) == 4
    assert "early_stopped" in statuses.values()
    assert list(statuses.values()).count("failed") == 1  # lr 1e30 diverged; the sweep went on
    stopped = [r for r in sweep.children() if r.data.tags["vitpipe.trial_status"] == "early_stopped"]
    assert all(r.data.metrics["final_step"] < STEPS for r in stopped)


def test_every_trial_is_a_nested_run_with_its_hyperparameters_and_metrics(sweep):
    children = sweep.children()
    assert len(children) == 4
    assert sorted(float(r.data.params["lr"]) for r in children) == sorted([0.03, 0.01, 1e30, 1e-7])
    for run in children:
        assert run.data.params["resolution"] == str(DIGITS_SIZE)
        assert run.data.tags["vitpipe.trial_id"] in sweep.result.trial_status
        failed = run.data.tags["vitpipe.trial_status"] == "failed"
        assert run.info.status == ("FAILED" if failed else "FINISHED")
        if failed:
            assert "diverged at step 2" in run.data.tags["vitpipe.error"]
            continue
        assert sweep.history(run.info.run_id, "train_loss")  # per-step metrics from rank 0
        assert sorted(sweep.history(run.info.run_id, "val_loss"))[0] == 4  # the first evaluation
        assert "final_val_loss" in run.data.metrics


def test_the_best_trial_is_tested_and_its_config_figures_and_model_logged(sweep):
    run = sweep.client.get_run(sweep.result.run_id)
    best = sweep.result.best_config
    assert best["lr"] in (0.03, 0.01)  # the two learning rates that learn at all
    assert run.data.params["best.lr"] == str(best["lr"])
    assert sweep.result.test_accuracy == run.data.metrics["test_top1"]
    assert sweep.result.test_accuracy > 0.2  # ten classes: chance is 0.1
    artifacts = {a.path for a in sweep.client.list_artifacts(run.info.run_id)}
    assert {"sweep.png", "confusion_matrix.png", "best_config.json", "checkpoints"} <= artifacts
    assert run.info.status == "FINISHED"


def test_the_best_model_is_registered_with_lineage_to_its_pretrain_run_and_data(sweep, pretrained, digits_data):
    versions = sweep.client.search_model_versions("name = 'digits-transfer'")
    assert [v.version for v in versions] == [sweep.result.registered_version]
    tags = versions[0].tags
    assert tags["vitpipe.pretrain_run_id"] == pretrained.run_id
    assert tags["vitpipe.finetune_run_id"] == sweep.result.run_id
    assert tags["vitpipe.manifest_hash"] == read_manifest(digits_data)["content_hash"]
    assert versions[0].run_id == sweep.result.run_id


def test_ctrl_c_after_a_sweep_stops_the_process_at_once(sweep):
    # Not Ray Tune's handler, which would swallow it to stop the sweep that has already ended.
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


def test_after_a_sweep_sigusr1_is_no_longer_handled_by_tune(sweep):
    # Tune stops a sweep on SIGUSR1 too, and its handler would swallow every later one. The process started
    # with no Python handler for it (the default or an inherited SIG_IGN).
    assert not callable(signal.getsignal(signal.SIGUSR1))


def test_the_registered_version_and_the_logged_best_checkpoint_start_the_same_model(sweep):
    registered = fetch_starting_weights(f"models:/digits-transfer/{sweep.result.registered_version}", model_name=None,
                                        model_overrides={}, tracking_uri=sweep.config.tracking_uri)
    logged = fetch_starting_weights(f"runs:/{sweep.result.run_id}/checkpoints/best", model_name=None,
                                    model_overrides={}, tracking_uri=sweep.config.tracking_uri)
    assert (registered.kind, registered.source_run_id) == ("registry", sweep.result.run_id)
    assert logged.kind == "run"
    theirs = logged.model.state_dict()
    for name, tensor in registered.model.state_dict().items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)


def test_fine_tuning_at_twice_the_pretraining_resolution_starts_at_chance_and_lowers_the_loss(sweep, pretrained):
    params = sweep.client.get_run(sweep.result.run_id).data.params
    assert int(params["pretrain_resolution"]) * 2 == DIGITS_SIZE == sweep.result.best_config["resolution"]
    best = next(r for r in sweep.children() if float(r.data.params["lr"]) == sweep.result.best_config["lr"])
    losses = sweep.history(best.info.run_id, "train_loss")
    assert losses[1] == pytest.approx(math.log(10), abs=1e-3)  # zero-initialised head: uniform logits
    last_four = [losses[s] for s in sorted(losses)[-4:]]  # ASHA may have stopped even the best trial early
    assert sum(last_four) / 4 < math.log(10) - 0.3


def test_trials_start_from_the_pretrained_backbone(sweep, pretrained, tmp_path):
    # The lr-1e-7 trial barely moves its weights, so its last checkpoint still shows where trials start.
    still = next(r for r in sweep.children() if float(r.data.params["lr"]) == 1e-7)
    stage_run = sweep.client.get_run(sweep.result.run_id).info.run_name
    trial_dir = run_dir(sweep.config, f"{stage_run}-work") / "trials" / still.data.tags["vitpipe.trial_id"]
    started = vit.load_checkpoint(latest_checkpoint(LocalFileSystem(), str(trial_dir))).state_dict()
    local = mlflow.artifacts.download_artifacts(f"runs:/{pretrained.run_id}/checkpoints/final", dst_path=str(tmp_path),
                                                tracking_uri=pretrained.tracking_uri)
    pretrain = vit.load_checkpoint(local).state_dict()
    # The head is new and the position embeddings are resampled to the fine-tune grid; the rest is carried over.
    backbone = [k for k in pretrain if not k.startswith(("head.", "pos_embed"))]
    assert "patch_embed.proj.weight" in backbone and "blocks.1.mlp.fc2.weight" in backbone
    for name in backbone:
        torch.testing.assert_close(started[name], pretrain[name], rtol=0, atol=1e-4, msg=name)


def test_running_a_finished_sweep_again_returns_it_without_training(sweep):
    again = run_finetune(sweep.config)
    assert again.reused
    assert (again.run_id, again.registered_version) == (sweep.result.run_id, sweep.result.registered_version)
    assert len(sweep.children()) == 4


def test_a_finished_sweep_is_handed_back_without_downloading_its_starting_weights(sweep):
    # Over this link every read of a checkpoint's weights is refused: the reused sweep must read none.
    with FaultProxy(sweep.config.tracking_uri, timeout=60) as link:
        link.fail("model.safetensors", "denied", times=None)
        again = run_finetune(sweep.config.model_copy(update={"tracking_uri": link.url}))
    assert again.reused and again.run_id == sweep.result.run_id
    assert link.injected["model.safetensors", "denied"] == 0


def test_a_finished_sweep_asked_for_under_another_name_is_registered_there_without_training(sweep, pretrained):
    renamed = sweep.config.model_copy(update={"registry_model": "digits-transfer-renamed"})
    for _ in range(2):  # the second time finds the version the first registered
        again = run_finetune(renamed)
        assert again.reused and again.run_id == sweep.result.run_id
    versions = sweep.client.search_model_versions("name = 'digits-transfer-renamed'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", sweep.result.run_id)]
    assert versions[0].tags["vitpipe.pretrain_run_id"] == pretrained.run_id
    assert versions[0].tags["vitpipe.score_metric"] == "test_top1"
    assert (again.registered_model, again.registered_version) == ("digits-transfer-renamed", "1")
    assert len(sweep.children()) == 4  # no trial ran again


# ---------------------------------------------------------------- bad input


def test_a_pbt_sweep_runs_its_trials_in_segments_to_the_last_step(digits_data, pretrained, tmp_path):
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp_path, run_name="pbt",
                          search_space={"lr": {"grid": [0.03, 1e-7]}, "steps": 8, "resolution": DIGITS_SIZE},
                          scheduler="pbt", perturbation_interval=4, eval_interval=4, registry_model=None,
                          experiment="finetune-pbt")
    result = run_finetune(config)
    assert result.num_trials == 2 and set(result.trial_status.values()) == {"completed"}
    client = MlflowClient(config.tracking_uri)
    experiment = client.get_experiment_by_name("finetune-pbt").experiment_id
    for trial in client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{result.run_id}'"):
        steps = {m.step for m in client.get_metric_history(trial.info.run_id, "val_loss")}
        assert max(steps) == 8, steps  # both segments ran, up to the last step


def test_a_trial_that_tune_stops_on_its_last_report_has_every_step_metric_stored(digits_data, pretrained, tmp_path):
    # ASHA stops a trial as soon as it reports its last step (max_t), and stopping kills the trial's workers.
    # Over a link that holds rank 0's step metrics back longer than that takes, they are still on the wire then.
    with FaultProxy(pretrained.tracking_uri, timeout=120) as slow_link:
        slow_link.delay(b'"train_loss"', seconds=8)
        config = sweep_config(digits_data, pretrained.run_id, slow_link.url, tmp_path, run_name="slow-link",
                              search_space={"lr": {"grid": [0.03]}, "steps": 4, "resolution": DIGITS_SIZE},
                              eval_interval=4, registry_model=None, experiment="finetune-slow-link")
        result = run_finetune(config)
    assert set(result.trial_status.values()) == {"completed"}
    client = MlflowClient(pretrained.tracking_uri)
    experiment = client.get_experiment_by_name("finetune-slow-link").experiment_id
    [trial] = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{result.run_id}'")
    assert sorted(m.step for m in client.get_metric_history(trial.info.run_id, "train_loss")) == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(trial.info.run_id, "val_loss")] == [4]


def test_streamed_training_rows_are_the_in_memory_training_rows_without_the_minival(digits_data, ray_cluster):
    data = DataSpec(digits_data, read_manifest(digits_data), holdout=0.1)  # the digits have no val split
    streamed = train_dataset(data, size=DIGITS_SIZE).take_all()
    patches, labels = load_rows(data, "train", size=DIGITS_SIZE)

    def rows(pairs) -> list[tuple[int, str]]:
        return sorted((int(label), hashlib.sha256(np.ascontiguousarray(p).tobytes()).hexdigest()) for p, label in pairs)

    assert len(streamed) == len(labels) < read_manifest(digits_data)["counts"]["train"]
    assert rows((r["patches"], r["label"]) for r in streamed) == rows(zip(patches, labels))


def test_streamed_training_passes_repeat_from_their_seed_each_with_its_own_order_and_crops(digits_data, ray_cluster):
    data = DataSpec(digits_data, read_manifest(digits_data), holdout=0.1)

    def passes(seed: int) -> list[str]:
        ds = train_dataset(data, size=DIGITS_SIZE, aug=augment_config(0.5, True), seed=seed, epochs=2)
        ds.context.execution_options.preserve_order = True  # as a trial's Train run reads it
        return [hashlib.sha256(np.ascontiguousarray(r["patches"]).tobytes()).hexdigest() for r in ds.take_all()]

    first, again, other = passes(0), passes(0), passes(1)
    assert first == again and first != other
    half = len(first) // 2
    assert first[:half] != first[half:]


def test_a_sweep_streaming_its_training_rows_through_ray_data_trains_every_step(digits_data, pretrained, tmp_path):
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp_path, run_name="streamed",
                          search_space={"lr": {"grid": [0.03]}, "steps": 4, "resolution": DIGITS_SIZE},
                          eval_interval=4, registry_model=None, experiment="finetune-streamed", train_data="stream")
    result = run_finetune(config)
    assert set(result.trial_status.values()) == {"completed"}
    client = MlflowClient(pretrained.tracking_uri)
    experiment = client.get_experiment_by_name("finetune-streamed").experiment_id
    [trial] = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{result.run_id}'")
    assert sorted(m.step for m in client.get_metric_history(trial.info.run_id, "train_loss")) == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(trial.info.run_id, "val_loss")] == [4]


def test_a_sweep_whose_every_trial_fails_raises_one_error_naming_the_cause(digits_data, pretrained, tmp_path):
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp_path, run_name="all-fail",
                          search_space={"lr": 1e30, "steps": 8, "resolution": DIGITS_SIZE}, registry_model=None,
                          experiment="finetune-fail")
    with pytest.raises(VitpipeError, match=r"finetune: all 1 trials failed; first \(\w+\): .*trial diverged at step 2") as info:
        run_finetune(config)
    assert "\n" not in str(info.value)
    client = MlflowClient(config.tracking_uri)
    experiment = client.get_experiment_by_name("finetune-fail").experiment_id
    stage = client.search_runs([experiment], filter_string="tags.`vitpipe.stage` = 'finetune'")[0]
    assert stage.info.status == "FAILED"


def test_a_missing_pretrain_run_is_named(digits_data, pretrained, tmp_path):
    missing = "0" * 32
    config = sweep_config(digits_data, missing, pretrained.tracking_uri, tmp_path)
    with pytest.raises(ValueError, match=rf"init: MLflow run '{missing}' not found at http://127\.0\.0\.1:\d+$"):
        run_finetune(config)


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_fields(digits_data, pretrained, tmp_path):
    config = sweep_config(digits_data, f"runs:/{pretrained.run_id}/checkpoints/final", pretrained.tracking_uri, tmp_path,
                          model="ViT-Ti/16", model_overrides={"depth": 3, "embed_dim": 64, "num_heads": 2, "mlp_dim": 128,
                                                              "pool": "gap", "patch_size": 4})
    with pytest.raises(ValueError, match=r"checkpoint architecture does not match model 'ViT-Ti/16': depth 2 \(checkpoint\) vs 3 \(requested\)$"):
        run_finetune(config)
