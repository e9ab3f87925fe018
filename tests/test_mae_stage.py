"""MAE pretraining as a pretrain objective (issue 19 §2, §3, §5): on an unlabeled ingest, through the real
stage on the session's Ray cluster, tracked on the session's `mlflow server`.

The unlabeled data is the session's tiny fractal corpus through the real ingest with `labeled: false`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

import vit
from pipelines.core import registry
from pipelines.core.errors import VitpipeError
from pipelines.image import pretrain
from pipelines.image.mae_hooks import MAEHooks
from pipelines.image.pretrain import PretrainResult, load_config, run_identity, run_pretrain
from pipelines.image.configs import FinetuneConfig, PretrainConfig
from pipelines.image.finetune import run_finetune
from pipelines.image.reconstruction import RECONSTRUCTION_FIGURE
from vit.mae import DECODER_FILE, load_mae
from tests.run_files import run_dir

pytestmark = pytest.mark.slow

TINY = dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64)
DECODER = dict(decoder_dim=16, decoder_depth=1, decoder_heads=2)
KILL_AT_STEP = 6  # after the checkpoint of step 4 is recorded


@pytest.fixture(scope="module")
def unlabeled(tiny_dataset, tmp_path_factory) -> str:
    """The tiny fractal corpus ingested unlabeled (`labeled: false`), as the tiny ingest's sizes and splits."""
    from pipelines.image.ingest import run_ingest
    from pipelines.image.configs import IngestConfig

    corpus = Path(tiny_dataset).parent / "corpus"
    config = IngestConfig(source=str(corpus), output=str(tmp_path_factory.mktemp("unlabeled") / "out"),
                          labeled=False, image_size=16, patch_size=4, val_fraction=0.2, test_fraction=0.1,
                          shard_size=32)
    return run_ingest(config).output


def mae_config(data: str, tmp: Path, tracking_uri: str, **overrides: Any) -> PretrainConfig:
    fields = dict(data=data, objective="mae", model="ViT-Ti/16", model_overrides=TINY, **DECODER, num_workers=1,
                  batch_size_per_worker=16, steps=8, warmup_steps=2, lr=1e-3, checkpoint_interval=4, keep_last=2,
                  log_interval=4, augment=False, storage=str(tmp / "runs"), tracking_uri=tracking_uri,
                  experiment="mae-stage")
    return PretrainConfig(**{**fields, **overrides})


@dataclass(frozen=True)
class MAERun:
    config: PretrainConfig
    result: PretrainResult
    client: MlflowClient


@pytest.fixture(scope="module")
def mae_run(unlabeled, ray_cluster, mlflow_server, tmp_path_factory) -> MAERun:
    """One uninterrupted MAE pretrain of 8 steps on the unlabeled ingest."""
    config = mae_config(unlabeled, tmp_path_factory.mktemp("mae-run"), mlflow_server)
    return MAERun(config, run_pretrain(config), MlflowClient(mlflow_server))


def final_mae(run_id: str, tracking_uri: str, tmp: Path) -> vit.MaskedAutoencoder:
    mlflow.set_tracking_uri(tracking_uri)
    return load_mae(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/checkpoints/final", dst_path=str(tmp)))


# ---------------------------------------------------------------- the config


def test_an_mae_config_takes_the_papers_recipe_with_the_learning_rate_scaled_by_the_global_batch():
    config = load_config({"data": "/d", "objective": "mae", "steps": 10, "warmup_steps": 1, "num_workers": 2,
                          "batch_size_per_worker": 64})
    assert (config.betas, config.weight_decay, config.schedule) == ((0.9, 0.95), 0.05, "cosine")
    assert config.lr == pytest.approx(1.5e-4 * 128 / 256)
    assert (config.mask_ratio, config.decoder_dim, config.decoder_depth, config.norm_pix_loss) == (0.75, 512, 8, True)


def test_values_set_in_an_mae_config_win_over_the_papers_recipe():
    config = load_config({"data": "/d", "objective": "mae", "steps": 10, "warmup_steps": 1, "lr": 0.01,
                          "weight_decay": 0.1, "schedule": "linear"})
    assert (config.lr, config.weight_decay, config.schedule) == (0.01, 0.1, "linear")


def test_an_mae_min_lr_above_the_learning_rate_scaled_by_the_batch_is_refused():
    with pytest.raises(ValueError) as err:
        load_config({"data": "/d", "objective": "mae", "min_lr": 1e-4, "steps": 100, "warmup_steps": 10})
    assert str(err.value) == ("pretrain config: min_lr (0.0001) must not exceed lr (7.5e-05), "
                              "the MAE recipe's 0.00015 × global batch 128 / 256")


def test_a_supervised_config_keeps_the_identity_it_had_before_objectives_existed():
    config = load_config({"data": "/d", "steps": 10, "warmup_steps": 1})
    identity = run_identity(config, {"content_hash": "h"})
    mae_fields = {"objective", "mask_ratio", "decoder_dim", "decoder_depth", "decoder_heads", "norm_pix_loss"}
    assert not mae_fields & set(identity)


# ---------------------------------------------------------------- unlabeled data


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_a_stage_that_reads_labels_fails_first_on_an_unlabeled_ingest_with_one_line_naming_the_data(
        stage, unlabeled, tmp_path):
    # Found later, fine-tuning's was "IndexError: Target -9223372036854775808 is out of bounds" in every trial.
    where = dict(storage=str(tmp_path / "runs"), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    if stage == "pretrain":
        run, config, cause = run_pretrain, PretrainConfig(data=unlabeled, steps=4, warmup_steps=1, **where), \
            "supervised pretraining cannot run on it; use objective: mae"
    else:
        run, config, cause = run_finetune, FinetuneConfig(data=unlabeled, model="ViT-Ti/4", **where), \
            "fine-tuning, which trains a classifier on its labels, cannot run on it"
    with pytest.raises(VitpipeError) as info:
        run(config)
    assert str(info.value) == (f'{unlabeled}: the ingest output is unlabeled (manifest.json has "labeled": false), '
                               f"so {cause}")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()  # nothing ran, nothing recorded


@pytest.mark.parametrize("ratio, keeps", [(0.99, 0), (0.01, 16)])
def test_a_mask_ratio_that_leaves_no_patch_of_a_kind_is_refused_before_anything_runs(unlabeled, tmp_path, ratio, keeps):
    # The tiny ingest holds 16 patches per image: 0.99 masks them all, 0.01 none.
    config = mae_config(unlabeled, tmp_path, f"sqlite:///{tmp_path}/mlflow.db", mask_ratio=ratio)
    with pytest.raises(ValueError, match=rf"^mask_ratio {ratio} on 16 patches keeps {keeps}: ") as info:
        run_pretrain(config)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()  # nothing ran, nothing recorded


# ---------------------------------------------------------------- one MAE run


def test_an_mae_run_on_unlabeled_data_is_registered_like_any_pretrain(mae_run):
    run = mae_run.client.get_run(mae_run.result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["vitpipe.stage"] == "pretrain"
    assert run.data.params["objective"] == "mae"
    assert mae_run.result.model_uri
    assert max(m.step for m in mae_run.client.get_metric_history(run.info.run_id, "train_loss")) == 8


def test_the_checkpoint_holds_the_encoder_as_a_vit_checkpoint_and_the_decoder_beside_it(mae_run):
    artifacts = mae_run.client.list_artifacts(mae_run.result.run_id, "checkpoints/final")
    names = {a.path.rsplit("/", 1)[-1] for a in artifacts}
    assert {"model.safetensors", "config.json", DECODER_FILE} <= names
    encoder = registry.load_model_from_run(mae_run.result.final_checkpoint, tracking_uri=mae_run.config.tracking_uri)
    assert isinstance(encoder, vit.VisionTransformer) and encoder.config.num_classes == 0


def test_a_reconstruction_picture_is_logged_at_the_end_of_an_mae_run(mae_run):
    folder, name = RECONSTRUCTION_FIGURE.rsplit("/", 1)
    assert name in {a.path.rsplit("/", 1)[-1] for a in mae_run.client.list_artifacts(mae_run.result.run_id, folder)}


# A fine-tune from an MAE run, and the encoder it starts from: tests/test_mae_pipeline.py.

# ---------------------------------------------------------------- resuming


class KillOnce(MAEHooks):
    """MAE hooks whose worker SIGKILLs itself once, at `step`, after checkpoint 4 is recorded."""

    def __init__(self, base: MAEHooks, step: int, snapshot: str, marker: str) -> None:
        super().__init__(base.options, base.batches)
        self.step, self.snapshot, self.marker = step, snapshot, marker

    def train_batches(self, s, worker, epoch, skip):
        for count, item in enumerate(super().train_batches(s, worker, epoch, skip), start=self.start_step):
            if count == self.step and not os.path.exists(self.marker):
                deadline = time.monotonic() + 120
                while "checkpoint_00000004" not in _read(self.snapshot) and time.monotonic() < deadline:
                    time.sleep(0.2)
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
            yield item


def _read(path: str) -> str:
    return Path(path).read_text() if os.path.exists(path) else ""


def test_an_mae_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_runs_weights(
        mae_run, unlabeled, ray_cluster, tmp_path, monkeypatch):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    config = mae_config(unlabeled, tmp_path, f"sqlite:///{tmp_path}/mlflow.db", run_name="mae-kill")
    snapshot = str(run_dir(config) / "checkpoint_manager_snapshot.json")
    make_hooks = pretrain.pretrain_hooks
    monkeypatch.setattr(pretrain, "pretrain_hooks", lambda c, m: KillOnce(make_hooks(c, m), KILL_AT_STEP, snapshot,
                                                                          str(tmp_path / "killed")))
    result = run_pretrain(config)

    assert (tmp_path / "killed").exists()
    assert result.resumed
    assert MlflowClient(config.tracking_uri).get_run(result.run_id).data.tags["vitpipe.resumed_from_step"] == "4"
    resumed = final_mae(result.run_id, config.tracking_uri, tmp_path / "resumed").state_dict()
    uninterrupted = final_mae(mae_run.result.run_id, mae_run.config.tracking_uri, tmp_path / "whole").state_dict()
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=0, atol=0, msg=name)


def test_the_mae_demo_spec_chains_mae_pretraining_into_a_fine_tune():
    from pipelines.spec_file import load_spec

    spec = load_spec(Path(pretrain.__file__).parents[1] / "specs" / "mae_demo.yaml")
    assert spec.resolved_config("mae")["objective"] == "mae"
    assert [ref.fill.field for ref in spec.inputs_of("finetune_mae")] == ["data", "init"]
    assert spec.stages["finetune_scratch"].inputs == ["digits"]
