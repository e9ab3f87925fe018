"""Models in MLflow without pickle: logged as safetensors + config.json, registered with lineage, read back as files.

A logged model is an MLflow pyfunc model "from code" (`pipelines/core/pyfunc_model.py`
with the `vit` package as its code and a `vit.save_checkpoint` folder as its one
artifact, `artifacts/checkpoint/`): MLflow writes no pickle for it, and
`mlflow.pyfunc.load_model` serves it wherever torch, safetensors and mlflow install.
vitpipe itself never loads a model through MLflow: starting weights are the two
checkpoint files, downloaded by name and read with `vit.load_checkpoint`, so no
file from a run or the registry is unpickled or run.

Everything here goes through an explicit `MlflowClient`, never MLflow's global
fluent run, so logging a model neither ends the stage run nor lands in another
experiment's artifact root.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NamedTuple

import vit

CHECKPOINT_FILES = ("config.json", "model.safetensors")  # what vit.save_checkpoint writes, and all that is read
MODEL_CHECKPOINT = "artifacts/checkpoint"  # the checkpoint's folder inside a logged model
CHAMPION = "champion"  # the alias on the best-scoring version of a registered model
TAG_SCORE = "vitpipe.score"
TAG_MODEL_URI = "vitpipe.model_uri"  # on a stage run: the MLflow model it logged
TAG_REGISTERED_MODEL = "vitpipe.registered_model"  # on a stage run: the name it was last registered under
TAG_REGISTERED_VERSION = "vitpipe.registered_version"
TAG_SCORE_METRIC = "vitpipe.score_metric"
_MODEL_CODE = Path(__file__).with_name("pyfunc_model.py")
_VIT_CODE = Path(vit.__file__).parent


class Score(NamedTuple):
    """How good a registered version is: the metric, its value, and which way is better."""

    metric: str
    value: float
    mode: Literal["max", "min"] = "max"


def _requirements() -> list[str]:
    """Pins of what the model's code imports besides mlflow (which MLflow adds itself); no `vitpipe`."""
    pins = {name: importlib.metadata.version(name).split("+")[0] for name in ("torch", "safetensors", "numpy")}
    return [f"{name}=={version}" for name, version in pins.items()]


def _stage_model_files(checkpoint_dir: Path, tmp: Path) -> tuple[Path, Path]:
    """Copies of the checkpoint's two files (folder `checkpoint`) and of vit's sources, nothing else."""
    weights = tmp / "checkpoint"  # the folder's name is its path under `artifacts/` in the model
    weights.mkdir()
    for name in CHECKPOINT_FILES:
        if not (checkpoint_dir / name).is_file():
            raise ValueError(f"checkpoint directory {checkpoint_dir} holds no {name}")
        shutil.copy(checkpoint_dir / name, weights / name)
    code = tmp / "code" / "vit"
    shutil.copytree(_VIT_CODE, code, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return weights, code


class _DropSignatureWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to infer model signature: Type hint")


@contextmanager
def _no_signature_warning() -> Iterator[None]:
    """Without MLflow's "Failed to infer model signature" warning: the model has no signature on purpose (its
    input's shape follows the checkpoint), so the warning, printed on every logged model, told users nothing."""
    logger, dropped = logging.getLogger("mlflow.pyfunc"), _DropSignatureWarning()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def log_vit_model(client: Any, run_id: str, checkpoint_dir: str | Path, name: str = "model") -> str:
    """Log a `vit.save_checkpoint` folder as the run's MLflow model (pyfunc, no pickle); returns its model URI."""
    import mlflow
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name=name, source_run_id=run_id)
    with tempfile.TemporaryDirectory() as tmp:
        weights, code = _stage_model_files(Path(checkpoint_dir), Path(tmp))
        local = Path(tmp, name)
        with _no_signature_warning():
            mlflow.pyfunc.save_model(
                local, python_model=str(_MODEL_CODE), artifacts={"checkpoint": str(weights)}, code_paths=[str(code)],
                pip_requirements=_requirements(), mlflow_model=Model(run_id=run_id, model_id=logged.model_id),
            )
        client.log_model_artifacts(logged.model_id, str(local))
    client.finalize_logged_model(logged.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, 0)])
    return f"models:/{logged.model_id}"


def register(client: Any, name: str, model_uri: str, run_id: str, tags: dict[str, str], *, run_tag: str,
             score: Score) -> str:
    """Register `model_uri` as a new version of `name` (once per stage run, marked by `run_tag`); returns the version.

    `tags` (the lineage: data, upstream runs) and `score` go on the version, with
    `run_tag` set to `run_id`: a resumed execution that registered its model before
    it was interrupted finds that version and does not add another. The `champion`
    alias then moves to the best-scoring version.
    """
    found = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get(run_tag) == run_id]
    if found:  # this execution registered it before it was interrupted
        version = str(found[0].version)
    else:
        version_tags = {**tags, run_tag: run_id, TAG_SCORE_METRIC: score.metric, TAG_SCORE: repr(float(score.value))}
        version = _create_version(client, name, model_uri, run_id, version_tags)
    crown_champion(client, name, score.metric, score.mode)
    return version


def register_run_model(client: Any, run_id: str, name: str, lineage: dict[str, str], *, run_tag: str,
                       score: Score) -> str:
    """Register the model stage run `run_id` logged (its `vitpipe.model_uri` tag) as a version of `name`, and
    record the name and version on the run; returns the version.

    Once per run and name (see `register`), so a finished run that is reused with another
    `registry_model` is registered under that name too, without training again.
    """
    from mlflow.entities import RunTag

    model_uri = client.get_run(run_id).data.tags.get(TAG_MODEL_URI)
    if not model_uri:
        raise ValueError(f"registry_model {name!r}: run {run_id} logged no model to register")
    version = register(client, name, model_uri, run_id, lineage, run_tag=run_tag, score=score)
    client.log_batch(run_id, tags=[RunTag(TAG_REGISTERED_MODEL, name), RunTag(TAG_REGISTERED_VERSION, version)])
    return version


def _create_version(client: Any, name: str, model_uri: str, run_id: str, tags: dict[str, str]) -> str:
    """A new version of `name` (created if missing) from the logged model `model_uri`, linked both ways."""
    import mlflow
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    try:
        client.create_registered_model(name, description="vitpipe models: safetensors + config.json, no pickle")
    except mlflow.exceptions.MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    model_id = model_uri.removeprefix("models:/")
    logged = client.get_logged_model(model_id)
    # The storage location as source: a `models:/` source makes the store look the model up through
    # MLflow's global tracking URI, not this client's.
    created = client.create_model_version(name, logged.artifact_location, run_id=run_id, tags=tags, model_id=model_id)
    links = [*json.loads(logged.tags.get(MLFLOW_MODEL_VERSIONS, "[]")), {"name": name, "version": created.version}]
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(links)})
    return str(created.version)


def crown_champion(client: Any, name: str, metric: str, mode: Literal["max", "min"]) -> str | None:
    """Point the `champion` alias at the version of `name` with the best `metric`; returns it (None: none scored).

    Ties go to the newer version. A NaN score (a diverged training) ranks nowhere: NaN is neither better nor
    worse than any score, so `max` would keep whichever version it met first. The versions are looked at
    again after each move of the alias, until a look agrees with it: a version another process registered
    meanwhile (two sweeps finishing together) was otherwise lost when our stale choice was written last.
    """
    crowned = None
    for _ in range(_CROWN_LOOKS):
        best = _best_version(client, name, metric, mode)
        if best is None or best == crowned:
            return best
        client.set_registered_model_alias(name, CHAMPION, best)
        crowned = best
    return crowned


_CROWN_LOOKS = 5  # each registration that lands between two looks costs one more


def _best_version(client: Any, name: str, metric: str, mode: Literal["max", "min"]) -> str | None:
    """The version of `name` with the best `metric` now (ties: the newer), or None when none is scored."""
    scored = [(float(v.tags[TAG_SCORE]), int(v.version)) for v in client.search_model_versions(f"name = '{name}'")
              if v.tags.get(TAG_SCORE_METRIC) == metric and TAG_SCORE in v.tags]
    scored = [(value, version) for value, version in scored if not math.isnan(value)]
    if not scored:
        return None
    sign = 1.0 if mode == "max" else -1.0
    return str(max(scored, key=lambda s: (sign * s[0], s[1]))[1])


def download_checkpoint(artifact_uri: str, dst: str | Path, tracking_uri: str | None,
                        files: tuple[str, ...] = CHECKPOINT_FILES) -> Path:
    """Download a checkpoint folder's `config.json` and `model.safetensors` (nothing else; only `files` of
    them when given: the config alone is a few hundred bytes) into `dst`.

    Raises a one-line ValueError naming the URI and the missing file.
    """
    import mlflow

    dst = Path(dst)
    # A missing file is named from the listing: downloading it would fail only after the client's
    # retries with backoff (minutes against an mlflow server).
    try:
        listed = mlflow.artifacts.list_artifacts(artifact_uri=artifact_uri, tracking_uri=tracking_uri)
    except (mlflow.exceptions.MlflowException, OSError) as err:
        cause = " ".join(str(err).split())[:200]
        raise ValueError(f"{artifact_uri} is not a vit checkpoint directory ({cause})") from None
    present = {Path(entry.path).name for entry in listed if not entry.is_dir}
    missing = [name for name in CHECKPOINT_FILES if name not in present]
    if missing:
        raise ValueError(f"{artifact_uri} is not a vit checkpoint directory (no {missing[0]})")
    for name in files:
        uri = f"{artifact_uri.rstrip('/')}/{name}"
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp, tracking_uri=tracking_uri)
            except (mlflow.exceptions.MlflowException, OSError) as err:
                cause = " ".join(str(err).split())[:200]
                raise ValueError(f"{artifact_uri} is not a vit checkpoint directory (no {name}: {cause})") from None
            if not Path(local).is_file():
                raise ValueError(f"{artifact_uri} is not a vit checkpoint directory ({name} is not a file)")
            shutil.move(local, dst / name)
    return dst


def load_model_from_run(uri: str, tracking_uri: str | None = None) -> Any:
    """Load a ViT from a logged checkpoint folder, e.g. `runs:/<run_id>/checkpoints/final` (its two files only)."""
    with tempfile.TemporaryDirectory() as tmp:
        return vit.load_checkpoint(download_checkpoint(uri, tmp, tracking_uri))


__all__ = [
    "CHAMPION", "CHECKPOINT_FILES", "MODEL_CHECKPOINT", "Score", "crown_champion", "download_checkpoint",
    "TAG_MODEL_URI", "TAG_REGISTERED_MODEL", "TAG_REGISTERED_VERSION", "load_model_from_run", "log_vit_model",
    "register", "register_run_model",
]
