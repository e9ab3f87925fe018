"""The pretrain stage: supervised ViT pretraining, data-parallel on Ray Train, tracked in MLflow.

The driver validates the config against the ingest manifest, opens the stage's
single MLflow run, builds a `TorchTrainer` whose workers run
`pipelines.training.loop.train_loop_per_worker`, and after training logs the final
and best checkpoints, the model and a learning curve into the run.

Running the same config again resumes: Ray Train finds the latest checkpoint
under the same `(storage, run name)`, and the unfinished MLflow run tagged with
the same config hash is reopened, so an execution stays one run however often
its driver dies. A config whose run already finished is not trained again.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from pipelines.core import tracking
from pipelines.core.stage_config import load_stage_config
from pipelines.core.errors import VitpipeError, find_vitpipe_error
from pipelines.core.cluster import connect
from pipelines.core.uris import strip_userinfo
from pipelines.training.loop import BEST_DIR, BEST_INFO_FILE, DIVERGED_FILE, train_loop_per_worker
from pipelines.training.recipe import TrainRecipe
from pipelines.training.step import LoopSettings

logger = logging.getLogger(__name__)
STAGE = "pretrain"
# Fields that say where to record or how to retry, not what is trained: they stay out of the run identity.
_NOT_IDENTITY = {"tracking_uri", "experiment", "parent_run_id", "ingest_run_id", "max_failures"}


class TrainingDivergedError(VitpipeError):
    """The loss or gradients became NaN/inf; the last good checkpoint is kept."""


class PretrainConfig(TrainRecipe):
    """Pretraining stage config; defaults follow the ViT paper's pretraining recipe."""

    data: str = Field(description="ingest output (local dir or s3://bucket/prefix) holding manifest.json")
    model: str = "ViT-B/16"
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    augment: bool = True
    eval_batch_size: int | None = Field(None, gt=0)
    # The paper's pretraining recipe where it differs from the shared defaults.
    num_workers: int = Field(2, gt=0)
    batch_size_per_worker: int = Field(64, gt=0)
    warmup_steps: int = Field(10_000, ge=0)
    schedule: Literal["linear", "cosine"] = "linear"  # the paper decays linearly when pretraining
    weight_decay: float = Field(0.1, ge=0)
    eval_interval: int = Field(1000, ge=0)  # 0: only at the end
    checkpoint_interval: int = Field(1000, ge=0)  # 0: only at the end


class PretrainResult(BaseModel):
    """What the stage hands to the next one."""

    run_id: str
    final_checkpoint: str  # runs:/<id>/checkpoints/final — a vit checkpoint dir
    best_checkpoint: str  # runs:/<id>/checkpoints/best
    model_uri: str | None  # the logged MLflow PyTorch model
    storage_path: str  # the Ray Train run directory (resumable checkpoints)
    metrics: dict[str, float]
    resumed: bool = False  # True when training restarted from a checkpoint (worker group restart or rerun)
    reused: bool = False  # True when the same config had already finished and nothing was trained


def load_config(source: str | os.PathLike[str] | dict[str, Any], **overrides: Any) -> PretrainConfig:
    """A `PretrainConfig` from a YAML/JSON file or a dict, with one-line errors."""
    return load_stage_config(PretrainConfig, "pretrain", source, overrides)


# ---------------------------------------------------------------- driver pieces


def model_overrides(config: PretrainConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """The model overrides completed from the ingest manifest, checked against it.

    The class count comes from the data unless set; a ViT takes the data's image
    size, and a plain ViT its patch size too (a hybrid's patch size is measured on
    its stem's feature map, so its preset keeps it). The model must then read
    exactly the stored patch sequences: same number of patches, same patch length.
    """
    import vit

    out = dict(config.model_overrides)
    out.setdefault("num_classes", int(manifest.get("num_classes") or len(manifest["classes"])))
    derived: dict[str, Any] = {}
    if vit.is_vit_name(config.model):  # other families (e.g. VTN) size their inputs their own way
        derived["image_size"] = manifest["image_size"]
        if not config.model.startswith("R50+"):
            derived["patch_size"] = manifest["patch_size"]
    for key, value in derived.items():
        if key in out and out[key] != value:
            raise ValueError(f"model_overrides.{key}={out[key]!r} does not match the ingest manifest ({value!r})")
        out[key] = value
    model_config = _model_config(config.model, out)
    expected = (manifest["num_patches"], manifest["patch_dim"])
    got = (getattr(model_config, "num_patches", None), getattr(model_config, "patch_dim", None))
    if None not in got and got != tuple(expected):
        raise ValueError(
            f"model {config.model} reads {got[0]} patches of length {got[1]}, "
            f"but the data holds {expected[0]} patches of length {expected[1]}"
        )
    return out


def _model_config(name: str, overrides: dict[str, Any]) -> Any:
    """The model's config without allocating its weights (bad names and fields raise ValueError)."""
    import torch

    import vit

    if vit.is_vit_name(name):
        return vit.preset_config(name, **overrides)
    with torch.device("meta"):  # any registered family: build shapes only
        return getattr(vit.create_model(name, **overrides), "config", None)


def loop_settings(
    config: PretrainConfig, overrides: dict[str, Any], has_val: bool, run_id: str | None, tracking_uri: str | None,
    train_rows: int | None = None,
) -> LoopSettings:
    """What every worker receives (no credentials: Ray exports it to its state API)."""
    return config.loop_settings(
        has_val=has_val, run_id=run_id, tracking_uri=tracking_uri, train_rows=train_rows,
        model_name=config.model, model_overrides=overrides, eval_batch_size=config.eval_batch_size,
    )


def run_identity(config: PretrainConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """The part of a config (plus the data's content hash) that decides what is trained."""
    tree = tracking.redact(config.model_dump(mode="json", exclude=_NOT_IDENTITY))
    tree["data_content_hash"] = manifest.get("content_hash")
    return tree


def storage_location(config: Any) -> tuple[str, Any]:
    """`(storage_path, storage_filesystem)` for Ray Train's RunConfig."""
    from pipelines.core import storage

    return storage.ray_storage(config.storage, endpoint_url=config.endpoint_url)


def build_trainer(config: Any, settings: LoopSettings, run_name: str, datasets: dict[str, Any] | None = None) -> Any:
    """The `TorchTrainer` of this stage: datasets, scaling, storage, failure and checkpoint policy.

    `datasets` defaults to the image patch datasets of `config.data`; another
    modality's stage (e.g. `pipelines.video.train`) passes its own.
    """
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    if datasets is None:
        from pipelines.image.data import patch_dataset

        # Reproducible: every pass over the data has its own seeded file order and crops, chained
        # into one dataset that covers the run.
        datasets = {"train": patch_dataset(config.data, "train", augment=config.augment, seed=config.seed,
                                           epochs=config.passes_over(settings.train_rows),
                                           endpoint_url=config.endpoint_url)}
        if settings.val_dataset:
            datasets["val"] = patch_dataset(config.data, "val", augment=False, shuffle=False, endpoint_url=config.endpoint_url)
    # Ray Data keeps the rows in the datasets' order (so a seeded run streams the same batches); the
    # context's own options otherwise, as Train's defaults. Copied, since Ray's helper for this
    # passes a deprecated field and warns on every run.
    options = copy.copy(ray.data.DataContext.get_current().execution_options)
    options.preserve_order = True
    dataset_config = ray.train.DataConfig(execution_options=options)
    storage_path, filesystem = storage_location(config)
    resources = config.resources_per_worker or ({"CPU": 1, "GPU": 1} if config.use_gpu else {"CPU": 1})
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=settings.model_dump(mode="json"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.num_workers, use_gpu=config.use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            failure_config=ray.train.FailureConfig(max_failures=config.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.keep_last),
        ),
        datasets=datasets,
        dataset_config=dataset_config,
    )


def _log_outputs(client: Any, tracking_uri: str, run_id: str, result: Any) -> str | None:
    """Log the final and best checkpoints, the learning curve and the model; returns the model URI."""
    import pyarrow.fs as pafs

    import vit

    with result.checkpoint.as_directory() as final_dir:
        tracking.log_checkpoint_dir(client, run_id, final_dir, "checkpoints/final")
        model = vit.load_checkpoint(final_dir)
    best_path = f"{result.path}/{BEST_DIR}"
    with tempfile.TemporaryDirectory() as tmp:
        if result.filesystem.get_file_info(best_path).type == pafs.FileType.Directory:
            pafs.copy_files(best_path, tmp, source_filesystem=result.filesystem)
            tracking.log_checkpoint_dir(client, run_id, tmp, "checkpoints/best")
            client.log_artifact(run_id, str(Path(tmp, BEST_INFO_FILE)), "checkpoints/best")
        else:  # no validation split: the final model is the best one known
            with result.checkpoint.as_directory() as final_dir:
                tracking.log_checkpoint_dir(client, run_id, final_dir, "checkpoints/best")
    tracking.log_learning_curve(client, run_id)
    return tracking.log_torch_model(tracking_uri, run_id, model)


def _read_diverged(result: Any) -> dict[str, Any] | None:
    """The divergence note the workers left in the run dir, or None."""
    import pyarrow.fs as pafs

    path = f"{result.path}/{DIVERGED_FILE}"
    if result.filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with result.filesystem.open_input_stream(path) as f:
        return json.loads(f.read())


def _clear_diverged(storage_path: str, filesystem: Any, run_name: str) -> None:
    """Remove a divergence note left by an earlier execution of this run (it is judged afresh)."""
    import pyarrow.fs as pafs

    fs = filesystem or pafs.LocalFileSystem()
    path = f"{storage_path}/{run_name}/{DIVERGED_FILE}"
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


def fit_trainer(trainer: Any, config: Any, client: Any, run_id: str, run_name: str, *, stage: str = STAGE) -> Any:
    """`trainer.fit()` with the stage's error policy; returns Ray Train's Result.

    Worker errors become one `VitpipeError` line; a run whose loss went NaN/inf
    raises `TrainingDivergedError` naming the last good checkpoint. `config`
    needs `storage`, `endpoint_url` and `max_failures`.
    """
    _clear_diverged(*storage_location(config), run_name)
    try:
        result = trainer.fit()
    except Exception as err:  # Ray wraps worker errors; give the user one line
        known = find_vitpipe_error(err)
        if known is not None:
            raise known from err
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise VitpipeError(f"{stage}: training failed (max_failures={config.max_failures}): {first}") from err
    tracking.set_tags(client, run_id, {"vitpipe.storage_path": str(result.path)})
    diverged = _read_diverged(result)
    if diverged is not None:
        last = result.checkpoint.path if result.checkpoint else "none (it diverged before the first checkpoint)"
        raise TrainingDivergedError(
            f"{stage} stopped: loss/gradients became non-finite at step {diverged['step']}; "
            f"the last good checkpoint is kept: {last}"
        )
    return result


def _result_from_run(client: Any, run_id: str, reused: bool) -> PretrainResult:
    run = client.get_run(run_id)
    return PretrainResult(
        run_id=run_id,
        final_checkpoint=f"runs:/{run_id}/checkpoints/final",
        best_checkpoint=f"runs:/{run_id}/checkpoints/best",
        model_uri=run.data.tags.get("vitpipe.model_uri"),
        storage_path=run.data.tags.get("vitpipe.storage_path", ""),
        metrics=dict(run.data.metrics),
        resumed="vitpipe.resumed_from_step" in run.data.tags,
        reused=reused,
    )


def run_pretrain(config: PretrainConfig, *, ray_address: str | None = None) -> PretrainResult:
    """Run (or resume) the pretrain stage; returns the MLflow run and checkpoint URIs.

    Raises `TrainingDivergedError` when the loss goes NaN/inf and `VitpipeError`
    when training fails beyond `max_failures` restarts.
    """
    from mlflow.tracking import MlflowClient

    from pipelines.core.shards import read_manifest

    manifest = read_manifest(config.data, endpoint_url=config.endpoint_url)
    overrides = model_overrides(config, manifest)
    has_val = int(manifest.get("counts", {}).get("val", 0)) > 0
    digest = tracking.config_hash(run_identity(config, manifest))
    run_name = config.run_name or f"{STAGE}-{digest[:12]}"
    tracking_uri = tracking.resolve_tracking_uri(config.tracking_uri)
    client = MlflowClient(tracking_uri)

    connect(ray_address)
    tags = {
        "vitpipe.data_uri": strip_userinfo(config.data),
        "vitpipe.manifest_hash": str(manifest.get("content_hash", "")),
        **({"vitpipe.ingest_run_id": config.ingest_run_id} if config.ingest_run_id else {}),
        **tracking.system_info(config.num_workers, config.use_gpu),
    }
    run_id, previous = tracking.start_stage_run(
        client, config.experiment, STAGE, digest, run_name=run_name, parent_run_id=config.parent_run_id, tags=tags
    )
    if previous == "FINISHED":
        logger.info("pretrain: run %s already finished with this config; not training again", run_id)
        return _result_from_run(client, run_id, reused=True)
    if previous:
        logger.info("pretrain: resuming run %s (was %s)", run_id, previous)

    settings = loop_settings(config, overrides, has_val, run_id, tracking_uri,
                             train_rows=int(manifest.get("counts", {}).get("train", 0)) or None)
    resolved = {**config.model_dump(mode="json"), "model_overrides": overrides, "grad_accum_steps": config.grad_accum_steps}
    tracking.log_params(client, run_id, resolved)
    tracking.log_dict_artifact(client, run_id, resolved, "config.yaml")
    ok = False
    try:
        trainer = build_trainer(config, settings, run_name)
        result = fit_trainer(trainer, config, client, run_id, run_name, stage=STAGE)
        model_uri = _log_outputs(client, tracking_uri, run_id, result)
        tracking.set_tags(client, run_id, {"vitpipe.model_uri": model_uri or ""})
        ok = True
    finally:
        tracking.end_run(client, run_id, ok)
    return _result_from_run(client, run_id, reused=False)
