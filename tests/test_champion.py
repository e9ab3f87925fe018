"""The `champion` alias: it marks the best-scoring registered version, by a real MLflow registry (SQLite store)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

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


TWIN_REGISTERS = textwrap.dedent("""
    import sys
    from mlflow.tracking import MlflowClient
    from pipelines.core import registry
    client = MlflowClient(sys.argv[1], registry_uri=sys.argv[1])
    client.create_model_version("m", "file:///tmp/model", tags={registry.TAG_SCORE_METRIC: "val_loss",
                                                                registry.TAG_SCORE: "0.1"})
    registry.crown_champion(client, "m", "val_loss", "min")
""")


class _TwinRegistersAfterOurLook(MlflowClient):
    """A real client; right after its first look at the versions, another process registers a better one and
    crowns it (two sweeps that finish together)."""

    def search_model_versions(self, *args: Any, **kwargs: Any) -> Any:
        found = super().search_model_versions(*args, **kwargs)
        if not getattr(self, "twin_done", False):
            self.twin_done = True
            subprocess.run([sys.executable, "-c", TWIN_REGISTERS, self._registry_uri], check=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
        return found


def test_a_better_version_registered_while_the_champion_is_chosen_ends_champion(tmp_path):
    _scored_versions(tmp_path, ["0.5"])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = _TwinRegistersAfterOurLook(uri, registry_uri=uri)
    registry.crown_champion(client, "m", "val_loss", "min")
    assert str(MlflowClient(uri, registry_uri=uri).get_model_version_by_alias("m", registry.CHAMPION).version) == "2"
