"""Few-shot linear evaluation: the closed-form probe, and the stage on a real pretrain run and tracking server."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

import vit
from pipelines.core.errors import VitpipeError
from pipelines.core.shards import read_manifest
from pipelines.image.evaluate import few_shot_accuracy, few_shot_table, load_config, ridge_fit, run_evaluate, sample_support
from pipelines.image.configs import EvaluateConfig
from pipelines.image.labeled_rows import DataSpec
from tests.fault_proxy import FaultProxy


def blobs(n_per_class: int, classes: int, dim: int, seed: int, spread: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(99)) * 3
    labels = torch.arange(classes).repeat_interleave(n_per_class)
    return centres[labels] + spread * torch.randn(len(labels), dim, generator=gen), labels


# ---------------------------------------------------------------- the probe


def test_the_ridge_probe_separates_separable_classes_from_one_example_each():
    support, query = blobs(1, 5, 16, seed=0), blobs(40, 5, 16, seed=1)
    assert few_shot_accuracy(support, query, 5, l2_reg=0.01) == 1.0


def test_the_probe_regresses_to_plus_minus_one_targets():
    features, labels = blobs(30, 3, 8, seed=2, spread=0.01)
    w, b = ridge_fit(features, labels, 3, l2_reg=1e-6)
    outputs = features.double() @ w + b
    target = -torch.ones(90, 3, dtype=torch.float64)
    target[torch.arange(90), labels] = 1
    torch.testing.assert_close(outputs, target, atol=0.05, rtol=0)


def _explicit(features: torch.Tensor, labels: torch.Tensor, classes: int, l2_reg: float, dual: bool) -> torch.Tensor:
    x = features.double() - features.double().mean(0)
    y = -torch.ones(len(labels), classes, dtype=torch.float64)
    y[torch.arange(len(labels)), labels] = 1
    lam = l2_reg * float((x * x).sum(1).mean())
    if dual:
        return x.T @ torch.linalg.solve(x @ x.T + lam * torch.eye(len(x), dtype=torch.float64), y)
    return torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1], dtype=torch.float64), x.T @ y)


@pytest.mark.parametrize(("n_per_class", "dim"), [(4, 64), (40, 8)])  # fewer examples than features, and more
def test_primal_and_dual_forms_give_the_same_weights(n_per_class, dim):
    features, labels = blobs(n_per_class, 3, dim, seed=3)
    w, _ = ridge_fit(features, labels, 3, l2_reg=0.1)
    torch.testing.assert_close(w, _explicit(features, labels, 3, 0.1, dual=True))
    torch.testing.assert_close(w, _explicit(features, labels, 3, 0.1, dual=False))


def test_support_sets_hold_k_distinct_images_of_every_class():
    labels = np.repeat(np.arange(4), 10)
    picks = sample_support(labels, 5, np.random.default_rng(0), dict(enumerate("abcd")))
    assert len(set(picks.tolist())) == 20
    assert np.bincount(labels[picks]).tolist() == [5, 5, 5, 5]


def test_support_comes_only_from_the_classes_there_are_when_labels_skip_ids():
    labels = np.repeat([3, 4], 6)  # a label manifest's ids 3 and 4: ids 0-2 have no images
    picks = sample_support(labels, 2, np.random.default_rng(0), {3: "3", 4: "4"})
    assert sorted(labels[picks].tolist()) == [3, 3, 4, 4]


def test_asking_for_more_shots_than_a_class_has_names_the_class():
    labels = np.array([0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"shots: 3-shot needs 3 support images of every class; class 'one' has 2"):
        sample_support(labels, 3, np.random.default_rng(0), {0: "zero", 1: "one"})


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"shots": []}, r"evaluate config: shots is empty"), ({"shots": [5, 0]}, r"shots must be positive, got 0"),
     ({"l2_reg": 0}, r"evaluate config: l2_reg: Input should be greater than 0"),
     ({"support_split": "val", "query_split": "val"}, r"support_split and query_split are both 'val'")],
)
def test_bad_config_is_one_line_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        load_config({"data": "x", "init": "0" * 32, **fields})



def test_a_model_reading_patches_of_another_length_is_refused_naming_both_lengths():
    from pipelines.image.frozen_model import load_frozen_model

    # Same 4-pixel patches, one channel against the data's three: the patch size alone does not tell them apart.
    config = EvaluateConfig(data="DATA", init=None, model="ViT-Ti/4", model_overrides={
        "depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64, "in_channels": 1})
    with pytest.raises(ValueError) as err:
        load_frozen_model(config, {"image_size": 16, "patch_size": 4, "patch_dim": 48}, "unused")
    assert str(err.value) == "model reads 4-pixel patches of length 16, but DATA holds 4-pixel patches of length 48"

# ---------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def evaluated(digits_data, pretrained):
    config = EvaluateConfig(data=digits_data, init=pretrained.run_id, shots=[1, 5, 10], repeats=3,
                            tracking_uri=pretrained.tracking_uri, experiment="evaluate-tests")
    return config, run_evaluate(config)


@pytest.mark.slow
def test_few_shot_accuracy_of_a_pretrained_model_beats_chance_and_grows_with_shots(evaluated):
    _, result = evaluated
    assert result.chance == pytest.approx(0.1)
    assert all(acc > 2 * result.chance for acc in result.accuracy.values())
    assert result.accuracy[10] > result.accuracy[1]


def mean_table(model: torch.nn.Module, config: EvaluateConfig, size: int) -> dict[int, float]:
    """`model`'s few-shot table on `config.data` at `size`, averaged over the repeats as the stage logs it."""
    data = DataSpec(config.data, read_manifest(config.data), None)
    return {k: float(np.mean(v)) for k, v in few_shot_table(model, data, config, size).items()}


@pytest.mark.slow
def test_the_table_is_that_of_the_pretrained_weights_not_of_a_fresh_model(evaluated, pretrained, tmp_path):
    config, result = evaluated
    local = mlflow.artifacts.download_artifacts(f"runs:/{pretrained.run_id}/checkpoints/final", dst_path=str(tmp_path),
                                                tracking_uri=pretrained.tracking_uri)
    trained = vit.load_checkpoint(local)
    torch.manual_seed(0)
    fresh = vit.VisionTransformer(trained.config)  # a random model scores well above chance here too
    assert result.accuracy == pytest.approx(mean_table(trained, config, pretrained.image_size))
    assert result.accuracy != pytest.approx(mean_table(fresh, config, pretrained.image_size))


@pytest.mark.slow
def test_the_stage_logs_its_table_and_links_the_pretrain_run(evaluated, pretrained):
    config, result = evaluated
    client = MlflowClient(config.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.data.tags["vitpipe.stage"] == "evaluate"
    assert run.data.tags["vitpipe.pretrain_run_id"] == pretrained.run_id
    assert {f"fewshot_{k}shot_top1" for k in (1, 5, 10)} <= set(run.data.metrics)
    assert "fewshot_table.json" in {a.path for a in client.list_artifacts(result.run_id)}
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_the_same_evaluation_again_returns_the_finished_run_without_computing_it(evaluated):
    config, result = evaluated
    again = run_evaluate(config)
    assert again.reused
    assert (again.run_id, again.accuracy) == (result.run_id, result.accuracy)


@pytest.mark.slow
def test_a_finished_evaluation_is_handed_back_without_downloading_its_weights(evaluated):
    config, result = evaluated
    # Over this link every read of the weights is refused: the reused run reads only their config.json.
    with FaultProxy(config.tracking_uri, timeout=60) as link:
        link.fail("model.safetensors", "denied", times=None)
        again = run_evaluate(config.model_copy(update={"tracking_uri": link.url}))
    assert again.reused and again.run_id == result.run_id
    assert link.injected["model.safetensors", "denied"] == 0


@pytest.mark.slow
def test_more_shots_than_the_support_split_holds_is_refused(digits_data, pretrained):
    config = EvaluateConfig(data=digits_data, init=pretrained.run_id, shots=[200], tracking_uri=pretrained.tracking_uri,
                            experiment="evaluate-tests")
    with pytest.raises(ValueError, match=r"200-shot needs 200 support images of every class; class '\d' has 1\d\d$"):
        run_evaluate(config)


@pytest.fixture(scope="module")
def unlabeled_data(ray_cluster, tmp_path_factory) -> str:
    """An ingest output with `"labeled": false`: 24 fractal images, 16×16, patch 4, no classes."""
    from pipelines.corpora.images import synth_corpus
    from pipelines.image.configs import IngestConfig
    from pipelines.image.ingest import run_ingest

    root = tmp_path_factory.mktemp("unlabeled")
    synth_corpus(str(root / "corpus"), images=24, classes=2, size=16, seed=0)
    return run_ingest(IngestConfig(source=str(root / "corpus"), output=str(root / "out"), image_size=16, patch_size=4,
                                   val_fraction=0.0, test_fraction=0.3, labeled=False)).output


@pytest.mark.slow
def test_an_unlabeled_ingest_output_is_refused_in_one_line_naming_it(unlabeled_data, tmp_path):
    config = EvaluateConfig(data=unlabeled_data, init=None, model="ViT-Ti/4", shots=[1], repeats=1,
                            model_overrides={"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64},
                            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="evaluate-unlabeled")
    with pytest.raises(VitpipeError) as err:
        run_evaluate(config)
    assert str(err.value) == (f"{unlabeled_data}: the ingest output is unlabeled (manifest.json has \"labeled\": "
                              "false), so few-shot evaluation, which scores class labels, cannot run on it")
