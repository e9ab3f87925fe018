"""Starting weights that MLflow keeps: a run's checkpoint folder, a registered model version, a logged model.

`pipelines.training.starting_weights` classifies an `init` and loads the weights;
this module finds them in MLflow: the run, version or logged model an `init` names
(metadata only) and the two checkpoint files (`config.json`, `model.safetensors`)
behind it, downloaded by name. Every refusal is one ValueError line naming the
`init`: a deleted run, or a run with nothing at the path named (it says which
stage the run is of, its status, and the checkpoints it did log).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

from pipelines.core.registry import MODEL_CHECKPOINT, download_checkpoint
from pipelines.core.uris import strip_userinfo

DEFAULT_RUN_ARTIFACT = "checkpoints/final"
# MLflow 3's logged-model ids: `models:/m-<hex>` is what a stage's `vitpipe.model_uri` tag (a fine-tune's
# `model_uri`) holds, and what a pipeline hands an evaluate or embed stage as its `init`.
_LOGGED_MODEL = re.compile(r"^m-[0-9a-f]{32}$")


class Found(NamedTuple):
    """A model reference (`models:/...`) looked up: the run that logged it, the registered version to pin
    (`name/N`; None for a logged model, which never changes), and where its files are."""

    run_id: str | None
    pin: str | None
    root: str


def _client(tracking_uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri)


def _not_found(err: Exception) -> bool:
    return getattr(err, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND") or "not found" in str(err).lower()


def run_and_artifact(init: str) -> tuple[str, str]:
    """`runs:/<id>[/path]` or a bare run id as (run id, artifact path)."""
    if init.startswith("runs:/"):
        run_id, _, artifact = init.removeprefix("runs:/").partition("/")
    else:
        run_id, artifact = init, ""
    if not run_id:  # MLflow would answer with its own error, and only once asked
        raise ValueError(f"init {init}: expected runs:/<run id>/<artifact path>")
    return run_id, artifact.strip("/") or DEFAULT_RUN_ARTIFACT


def check_run(run_id: str, tracking_uri: str) -> None:
    """A one-line ValueError unless MLflow at `tracking_uri` knows run `run_id`, and it is not deleted."""
    import mlflow

    try:
        run = _client(tracking_uri).get_run(run_id)
    except mlflow.exceptions.MlflowException as err:
        if _not_found(err):
            raise ValueError(f"init: MLflow run {run_id!r} not found at {strip_userinfo(tracking_uri)}") from None
        raise
    # A deleted run's files go at the next `mlflow gc`, and with them what a run started from it names.
    if run.info.lifecycle_stage == "deleted":
        raise ValueError(f"init: MLflow run {run_id!r} is deleted (restore it, or name another run)")


def run_files(init: str, tmp: str, tracking_uri: str, files: tuple[str, ...]) -> tuple[Path, str]:
    """The checkpoint `files` of the run folder `init` names, downloaded into `tmp`, and the URI they came from."""
    run_id, artifact = run_and_artifact(init)
    uri = f"runs:/{run_id}/{artifact}"
    try:
        return download_checkpoint(uri, tmp, tracking_uri, files), uri
    except ValueError as err:
        client = _client(tracking_uri)
        if not _nothing_at(client, run_id, artifact):
            raise ValueError(f"init: {err}") from None
        # Nothing there: a run of another stage, or one that has not logged its checkpoint (yet).
        raise ValueError(f"init {init}: {_run_holds(client, run_id, artifact)}") from None


def _nothing_at(client: Any, run_id: str, artifact: str) -> bool:
    """Whether run `run_id` logged nothing at `artifact` (False when that cannot be told: the error at hand
    says more)."""
    import mlflow

    try:
        return not client.list_artifacts(run_id, artifact)
    except (mlflow.exceptions.MlflowException, OSError):
        return False


def _run_holds(client: Any, run_id: str, artifact: str) -> str:
    """What run `run_id` is and which checkpoint folders it logged, for an `artifact` path where it logged
    nothing."""
    from pipelines.core.tracking import TAG_STAGE  # deferred: it imports mlflow; a config check must not

    run = client.get_run(run_id)
    stage = run.data.tags.get(TAG_STAGE, "not a vitpipe stage")
    folders = [f"runs:/{run_id}/{entry.path}" for entry in client.list_artifacts(run_id, "checkpoints") if entry.is_dir]
    holds = f"its checkpoints: {', '.join(folders)}" if folders else "it logged no checkpoints"
    return f"run {run_id} ({stage}, {run.info.status}) has no folder {artifact}; {holds}"


def _registered_version(client: Any, name_version: str) -> Any:
    """The model version `name/<number>`, `name/latest` or `name@alias` names."""
    if "@" in name_version:
        name, alias = name_version.split("@", 1)
        return client.get_model_version_by_alias(name, alias)
    name, _, number = name_version.rpartition("/")
    if name and number == "latest":
        versions = client.search_model_versions(f"name = '{name}'")
        if not versions:
            raise ValueError(f"init: registered model {name!r} has no versions")
        return max(versions, key=lambda v: int(v.version))
    if not (name and number.isdigit()):
        raise ValueError(f"init models:/{name_version}: expected models:/<name>/<version> or models:/<name>@<alias>")
    return client.get_model_version(name, number)


def registered_version(init: str, tracking_uri: str) -> Found:
    """The model `init` (`models:/...`) names, a registered version or a logged model, and where its files are."""
    import mlflow

    client = _client(tracking_uri)
    reference = init.removeprefix("models:/")
    what = "logged model" if _LOGGED_MODEL.match(reference) else "registered model"
    try:
        if what == "logged model":
            logged = client.get_logged_model(reference)
            return Found(logged.source_run_id, None, logged.artifact_location)
        version = _registered_version(client, reference)
        return Found(version.run_id, f"{version.name}/{version.version}",
                     client.get_model_version_download_uri(version.name, version.version))
    except mlflow.exceptions.MlflowException as err:
        if _not_found(err):
            raise ValueError(f"init: {what} {init!r} not found at {strip_userinfo(tracking_uri)}") from None
        raise


def registry_files(init: str, tmp: str, tracking_uri: str, files: tuple[str, ...]) -> tuple[Path, str]:
    """The registered version's or logged model's `artifacts/checkpoint` files; MLflow's loaders (and pickle)
    are not used."""
    found = registered_version(init, tracking_uri)
    try:
        return download_checkpoint(f"{found.root.rstrip('/')}/{MODEL_CHECKPOINT}", tmp, tracking_uri, files), init
    except ValueError:
        what = f"version {found.pin.rpartition('/')[2]}" if found.pin else "the logged model"
        raise ValueError(
            f"init {init}: {what} holds no {MODEL_CHECKPOINT}/model.safetensors; vitpipe "
            "loads only safetensors weights, never a pickled model (register it again with this vitpipe)"
        ) from None


__all__ = ["DEFAULT_RUN_ARTIFACT", "Found", "check_run", "registered_version", "registry_files", "run_and_artifact",
           "run_files"]
