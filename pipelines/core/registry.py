"""The MLflow Model Registry: a stage's final model registered once, with its lineage as tags."""

from __future__ import annotations

from typing import Any


def register(client: Any, tracking_uri: str, name: str, model_uri: str, run_id: str, tags: dict[str, str], *,
             run_tag: str) -> str:
    """Register `model_uri` as a new version of `name` (once per stage run, marked by `run_tag`); returns the version.

    `tags` (the lineage: data, upstream runs) go on the version, with `run_tag` set to `run_id`: a resumed
    execution that registered its model before it was interrupted finds that version and does not add another.
    """
    import mlflow

    for version in client.search_model_versions(f"name = '{name}'"):
        if version.tags.get(run_tag) == run_id:
            return str(version.version)  # this execution registered it before it was interrupted
    mlflow.set_tracking_uri(tracking_uri)
    version = mlflow.register_model(model_uri, name, tags={**tags, run_tag: run_id})
    return str(version.version)
