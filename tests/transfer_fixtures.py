"""Session fixtures shared by the transfer tests (fine-tuning, few-shot evaluation).

Registered for every test module in `tests/conftest.py`.

* `digits_data`: scikit-learn's digits exported at 32×32 and ingested with
  patch 4 (train/test split from the export's manifest; no val split).
* `pretrained`: a real pretrain stage run, tracked on the session's `mlflow
  server`, of a tiny ViT on the same digits at 16×16, i.e. at half the
  fine-tuning resolution. (A few hundred steps on a synthetic corpus would give
  a tiny ViT no features a digit head could use, so no fine-tuning test could
  see the loss fall within its few steps; low-resolution digits do.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelines.image.configs import FinetuneConfig

TINY = dict(depth=2, embed_dim=64, num_heads=2, mlp_dim=128, pool="gap")
PRETRAIN_SIZE = 16
DIGITS_SIZE = 32
PATCH = 4
STEPS = 24  # per trial of the fine-tuning sweeps


@dataclass(frozen=True)
class Pretrained:
    """A finished pretrain run."""

    run_id: str
    tracking_uri: str
    experiment: str
    image_size: int


@pytest.fixture(scope="session")
def digits_export(tmp_path_factory) -> Path:
    """The digits as 32×32 PNGs with their fixed train/test manifest."""
    from pipelines.corpora.images import export_digits

    root = tmp_path_factory.mktemp("digits-export")
    export_digits(str(root), size=DIGITS_SIZE)
    return root


def _ingest(export: Path, out: Path, size: int) -> str:
    from pipelines.image.ingest import run_ingest
    from pipelines.image.configs import IngestConfig

    config = IngestConfig(source=str(export), output=str(out), manifest=str(export / "manifest.csv"),
                          image_size=size, patch_size=PATCH, shard_size=600)
    return run_ingest(config).output


@pytest.fixture(scope="session")
def digits_data(ray_cluster, digits_export, tmp_path_factory) -> str:
    """The digits ingested at 32×32, patch 4: 1,437 train / 360 test images in 10 classes."""
    return _ingest(digits_export, tmp_path_factory.mktemp("digits-32") / "out", DIGITS_SIZE)


@pytest.fixture(scope="session")
def pretrained(ray_cluster, mlflow_server, digits_export, tmp_path_factory) -> Pretrained:
    """A tiny ViT pretrained by the pretrain stage for 160 steps on the digits at 16×16."""
    from pipelines.image.pretrain import run_pretrain
    from pipelines.image.configs import PretrainConfig

    root = tmp_path_factory.mktemp("transfer-pretrain")
    data = _ingest(digits_export, root / "digits-16", PRETRAIN_SIZE)
    experiment = "transfer-pretrain"
    result = run_pretrain(PretrainConfig(
        data=data, model="ViT-Ti/16", model_overrides=TINY, num_workers=1, batch_size_per_worker=32, steps=160,
        warmup_steps=10, lr=3e-3, weight_decay=0.05, eval_interval=0, checkpoint_interval=0, log_interval=40,
        augment=False, storage=str(root / "runs"), tracking_uri=mlflow_server, experiment=experiment,
    ))
    return Pretrained(result.run_id, mlflow_server, experiment, PRETRAIN_SIZE)


def sweep_config(data: str, init: str | None, tracking_uri: str, tmp: Path, **overrides) -> FinetuneConfig:
    """The fine-tuning tests' sweep: four learning rates spread for ASHA (one diverges), `overrides` applied."""
    fields = dict(
        data=data, init=init, search_space={"lr": {"grid": [0.03, 0.01, 1e30, 1e-7]}, "steps": STEPS, "resolution": DIGITS_SIZE},
        eval_interval=4, grace_period=4, reduction_factor=2, batch_size=32, metric="val_loss", max_concurrent_trials=2,
        log_interval=1, registry_model="digits-transfer", storage=str(tmp / "runs"), tracking_uri=tracking_uri,
        experiment="finetune-main",
    )
    fields.update(overrides)
    return FinetuneConfig(**fields)
