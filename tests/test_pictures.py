"""Pictures the stages log where people look: trials' learning curves and where the pretrained ViT looks."""

from __future__ import annotations

from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

import vit
from pipelines.core import tracking
from pipelines.image.attention_map import attention_maps, rollout
from pipelines.image.finetune_results import TRIAL_CURVES_FIGURE, figure_of_trial_curves, log_trial_curves


def test_rollout_through_layers_that_attend_to_themselves_keeps_the_pooled_tokens_own_row():
    tokens = 5  # [CLS] + 4 patches
    own = torch.eye(tokens).expand(2, 3, tokens, tokens)  # (B, heads, T, T)
    uniform = torch.full((2, 3, tokens, tokens), 1 / tokens)
    maps = rollout([uniform, own], num_prefix_tokens=1)
    assert maps.shape == (2, 4)
    assert torch.allclose(maps.sum(-1), torch.ones(2)) and torch.allclose(maps, torch.full((2, 4), 0.25))


def test_attention_maps_of_a_vit_cover_its_patch_grid():
    model = vit.VisionTransformer(vit.preset_config("ViT-Ti/16", image_size=16, patch_size=4, depth=2, embed_dim=32,
                                                    num_heads=2, mlp_dim=64, num_classes=3))
    maps = attention_maps(model, torch.randn(3, 16, 48), (4, 4))
    assert maps.shape == (3, 4, 4) and abs(maps.sum() - 3) < 1e-4 and (maps >= 0).all()


def _sweep(tmp_path: Path) -> tuple[MlflowClient, str, list[dict], dict[str, list]]:
    """A stage run, two trials' nested runs with metrics and one trial that failed before its run was opened;
    also what each trial logged: `{key: sorted [(trial_id, [(step, value), ...]), ...]}`."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = tracking.get_or_create_experiment(client, "curves")
    parent = client.create_run(experiment).info.run_id
    outcomes, logged = [], {"val_top1": [], "train_loss": []}
    for i, status in enumerate(("completed", "early_stopped")):
        run_id = client.create_run(experiment).info.run_id
        buffer = tracking.MetricBuffer(client, run_id)
        values = {"train_loss": [], "val_top1": []}
        for step in range(1, 5 if status == "completed" else 3):
            metrics = {"train_loss": 2.0 / step + i, "val_top1": 0.2 * step}
            buffer.add(metrics, step)
            for key, value in metrics.items():
                values[key].append((step, value))
        buffer.flush()
        outcomes.append({"trial_id": f"t{i}", "status": status, "run_id": run_id})
        for key, points in values.items():
            logged[key].append((f"t{i}", points))
    outcomes.append({"trial_id": "t2", "status": "failed"})  # failed before its run was opened
    return client, parent, outcomes, logged


def test_the_trial_curves_figure_has_one_curve_per_trial_that_logged_metrics(tmp_path):
    client, _, outcomes, logged = _sweep(tmp_path)
    figure = figure_of_trial_curves(client, outcomes, ("val_top1", "train_loss"))
    assert len(figure.axes) == 2
    for ax, key in zip(figure.axes, ("val_top1", "train_loss")):
        plotted = sorted((line.get_label(), [(float(x), float(y)) for x, y in zip(line.get_xdata(), line.get_ydata())])
                         for line in ax.get_lines())
        assert plotted == logged[key]  # t0 and t1 with their own points; t2 has none
    figure.clf()


def test_the_fine_tune_run_gets_the_trial_curves_figure_as_a_png(tmp_path):
    client, parent, outcomes, _ = _sweep(tmp_path)
    assert log_trial_curves(client, parent, outcomes)
    picture = Path(client.download_artifacts(parent, TRIAL_CURVES_FIGURE, str(tmp_path)))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_trial_curves_figure_when_no_trial_logged_a_metric(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.create_run(tracking.get_or_create_experiment(client, "none")).info.run_id
    assert not log_trial_curves(client, parent, [{"trial_id": "t0", "status": "failed"}])


def test_logging_a_figure_leaves_none_behind_in_pyplot(tmp_path):
    # pyplot keeps every figure it made until closed: a driver logging a sweep per pipeline run grew without end.
    import matplotlib.pyplot as plt

    client, parent, outcomes, _ = _sweep(tmp_path)
    before = plt.get_fignums()
    assert log_trial_curves(client, parent, outcomes)
    assert plt.get_fignums() == before
