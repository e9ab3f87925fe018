"""A named run (`run_name`) whose config changed never restores the old run's checkpoints: it is refused.

Through the pretrain stage's own code path on the session's Ray cluster, a real SQLite tracking store
and local storage (2 training steps of a tiny ViT).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.image.pretrain import run_pretrain
from pipelines.image.configs import PretrainConfig

pytestmark = pytest.mark.slow

TINY = dict(depth=1, embed_dim=32, num_heads=2, mlp_dim=64)


def named(data: str, tmp: Path, **overrides) -> PretrainConfig:
    fields = dict(
        data=data, model="ViT-Ti/16", model_overrides=TINY, num_workers=1, batch_size_per_worker=8, steps=2,
        warmup_steps=1, eval_interval=0, checkpoint_interval=1, augment=False, storage=str(tmp / "runs"),
        tracking_uri=f"sqlite:///{tmp}/mlflow.db", experiment="named-runs", run_name="nightly",
    )
    return PretrainConfig(**{**fields, **overrides})


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


def test_a_named_pretrain_whose_config_changed_is_refused_and_leaves_the_old_checkpoints_alone(tiny_dataset, tmp_path):
    first = run_pretrain(named(tiny_dataset, tmp_path))
    stored = _files(tmp_path / "runs")
    assert any("checkpoint" in name for name in stored)

    other = {**TINY, "class_token": True, "pool": "gap"}  # another architecture under the same name
    with pytest.raises(ValueError) as err:
        run_pretrain(named(tiny_dataset, tmp_path, model_overrides=other, lr=0.01))
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"run_name 'nightly' already names pretrain run {first.run_id} with another "
                                     "config (changed: lr, model_overrides.class_token, model_overrides.pool)")
    assert _files(tmp_path / "runs") == stored  # nothing restored, nothing written
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("named-runs").experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment])] == [first.run_id]
    assert run_pretrain(named(tiny_dataset, tmp_path)).reused  # the unchanged config still finds its run
