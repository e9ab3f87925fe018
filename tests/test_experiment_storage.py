"""Each MLflow experiment's stage runs keep their own checkpoints: the same config in a second experiment is a
run of its own. (Resuming and reuse within one experiment, over the same layout: tests/test_pretrain.py.)

Through the pretrain stage's own code path on the session's Ray cluster, a real SQLite tracking store and
local storage shared by the experiments (3 training steps of a tiny ViT, with seeded shuffling and crops on
the data workers: the second run is also the proof that a config's numbers repeat).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from pipelines.core import registry
from pipelines.image.configs import PretrainConfig
from pipelines.image.pretrain import run_pretrain

pytestmark = pytest.mark.slow

TINY = dict(depth=1, embed_dim=32, num_heads=2, mlp_dim=64)
STEPS = 3


def config(data: str, tmp: Path, experiment: str, **overrides) -> PretrainConfig:
    fields = dict(
        data=data, model="ViT-Ti/16", model_overrides=TINY, num_workers=1, batch_size_per_worker=8, steps=STEPS,
        warmup_steps=1, eval_interval=0, checkpoint_interval=1, augment=True, augment_on="cpu", shuffle_buffer=64,
        storage=str(tmp / "runs"),
        tracking_uri=f"sqlite:///{tmp}/mlflow.db", experiment=experiment,
    )
    return PretrainConfig(**{**fields, **overrides})


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


def _steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "train_loss"))


@pytest.fixture(scope="module")
def two_experiments(tiny_dataset, tmp_path_factory):
    """The same config run in experiment a, then in experiment b, over one storage and one tracking store."""
    tmp = tmp_path_factory.mktemp("two-experiments")
    first = run_pretrain(config(tiny_dataset, tmp, "a"))
    files_of_a = _files(Path(first.storage_path))
    second = run_pretrain(config(tiny_dataset, tmp, "b"))
    return tmp, MlflowClient(f"sqlite:///{tmp}/mlflow.db"), first, second, files_of_a


def test_the_same_config_in_a_second_experiment_trains_its_own_steps(two_experiments):
    _, client, first, second, _ = two_experiments
    assert second.run_id != first.run_id and not second.reused and not second.resumed
    assert _steps(client, second.run_id) == list(range(1, STEPS + 1))
    assert "resumed_from_step" not in client.get_run(second.run_id).data.metrics


def test_each_experiment_keeps_its_own_checkpoints_under_its_id(two_experiments):
    tmp, client, first, second, files_of_a = two_experiments
    for result in (first, second):
        run = client.get_run(result.run_id)
        # The folder is the experiment's id, then the run's readable name (`pretrain-<config hash>`).
        assert result.storage_path == str(tmp / "runs" / run.info.experiment_id / run.info.run_name)
        assert run.info.run_name.startswith("pretrain-")
        assert f"checkpoint_{STEPS:08d}" in {p.name for p in Path(result.storage_path).iterdir()}
    assert first.storage_path != second.storage_path
    assert _files(Path(first.storage_path)) == files_of_a  # b wrote nothing into a's checkpoints


def test_the_same_config_in_a_second_experiment_trains_the_same_weights(two_experiments):
    """Seeded file order and crops per pass on the data workers, order kept by Ray Data: a demo's numbers repeat.
    (With the crops on the training worker's device: tests/test_pretrain.py.)"""
    tmp, _, first, second, _ = two_experiments
    uri = f"sqlite:///{tmp}/mlflow.db"
    weights = [registry.load_model_from_run(r.final_checkpoint, tracking_uri=uri).state_dict() for r in (first, second)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=0, atol=0, msg=name)
