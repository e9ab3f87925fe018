"""The `champion` alias: it marks the best-scoring registered version, by a real MLflow registry (SQLite store)."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from pipelines.core import registry


def _scored_versions(tmp_path, scores: list[str], metric: str = "val_loss") -> MlflowClient:
    """A registry holding model `m` with one version per score, in that order (its tags as `register` writes them)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri, registry_uri=uri)
    client.create_registered_model("m")
    for score in scores:
        client.create_model_version("m", f"file://{tmp_path}/model",
                                    tags={registry.TAG_SCORE_METRIC: metric, registry.TAG_SCORE: score})
    return client


def test_a_version_scored_nan_never_becomes_champion(tmp_path):
    # A diverged training logs a NaN score; NaN compares as neither better nor worse, so it must not win.
    client = _scored_versions(tmp_path, ["0.9", "0.5", "nan"])
    assert registry.crown_champion(client, "m", "val_loss", "min") == "2"
    assert registry.crown_champion(client, "m", "val_loss", "max") == "1"
    assert str(client.get_model_version_by_alias("m", registry.CHAMPION).version) == "1"


def test_no_champion_when_every_version_scored_nan(tmp_path):
    client = _scored_versions(tmp_path, ["nan", "nan"])
    assert registry.crown_champion(client, "m", "val_loss", "max") is None
