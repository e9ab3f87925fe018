"""Where a training stage's run keeps its files: `<storage>/<experiment id>/<run name>` (see
`pipelines.training.trainer.storage_location`), for tests that look at them, or wait for them, mid-run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from pipelines.core import tracking


def run_dir(config: Any, name: str | None = None) -> Path:
    """The local folder of run `name` (default `config.run_name`) of `config`'s experiment, made now if new, so
    that the folder is known before the stage starts."""
    experiment_id = tracking.get_or_create_experiment(MlflowClient(config.tracking_uri), config.experiment)
    return Path(config.storage) / experiment_id / (name or config.run_name)
