"""The pretrain stage: ViT pretraining, supervised or as a masked autoencoder (`objective: mae`),
data-parallel on Ray Train, tracked in MLflow.

The driver validates the config against the ingest manifest, opens the stage's
single MLflow run, builds a `TorchTrainer` whose workers run
`pipelines.training.loop.train_loop_per_worker`, and after training logs the final
and best checkpoints, the model, a learning curve and an attention picture into the run
(an MAE run: its encoder as the model, its decoder beside it, and a reconstruction picture).

Running the same config again resumes: Ray Train finds the latest checkpoint
under the same `(storage, run name)`, and the unfinished MLflow run tagged with
the same config hash is reopened, so an execution stays one run however often
its driver dies. A config whose run already finished is not trained again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

import vit
from vit.mae import DECODER_FILE, MAE_CONFIG_FILE, load_mae, num_visible
from pipelines.core import tracking
from pipelines.core.cluster import connect
from pipelines.core.registry import TAG_MODEL_URI
from pipelines.core.shards import IMAGES, num_classes, read_manifest, require_labels
from pipelines.core.uris import resolve_tracking_uri, strip_userinfo
from pipelines.core.stage_config import load_stage_config
from pipelines.core.stage_run import finished_run_id, stage_run
from pipelines.image.attention_map import log_attention_picture
from pipelines.image.data import patch_dataset
from pipelines.image.mae_hooks import MAEHooks, MAEOptions
from pipelines.image.reconstruction import log_reconstruction_picture
from pipelines.training.augment import augment_patch_batches
from pipelines.training.hooks import LoopHooks
from pipelines.training.recipe import TRAIN_NOT_IDENTITY, AugmentConfig, LoopSettings, pinned_identity
from pipelines.training.trainer import build_trainer, fit_trainer, log_outputs, storage_location
from pipelines.training.worker import Worker
from pipelines.image.configs import PretrainConfig

STAGE = "pretrain"
# Fields added after runs were recorded: left out at their default, so those runs keep their identity.
LATER_FIELDS = {"augment_on": "cpu", "objective": "supervised", "mask_ratio": 0.75, "decoder_dim": 512,
                "decoder_depth": 8, "decoder_heads": 16, "norm_pix_loss": True}
# Fields that do not change what is trained, so they stay out of the run identity; every other field is in it.
NOT_IDENTITY = TRAIN_NOT_IDENTITY
# Left out of the identity later: held at their defaults in it (`pinned_identity`).
PINNED = ("torch_threads", "keep_last")


class PretrainResult(BaseModel):
    """What the stage hands to the next one."""

    run_id: str
    final_checkpoint: str  # runs:/<id>/checkpoints/final — a vit checkpoint dir
    best_checkpoint: str  # runs:/<id>/checkpoints/best
    model_uri: str | None  # the logged MLflow model (pyfunc over safetensors, no pickle)
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
    out = dict(config.model_overrides)
    if config.objective == "mae":
        if not vit.is_vit_name(config.model) or config.model.startswith("R50+"):
            raise ValueError(f"objective mae needs a plain ViT encoder, got model {config.model!r}")
        out["num_classes"] = 0  # the encoder's head goes unused: fine-tuning puts one on
        num_visible(manifest["num_patches"], config.mask_ratio)  # here, not in every worker (with its retries)
    out.setdefault("num_classes", num_classes(manifest))
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
        model_name=config.model, model_overrides=overrides,
    )


def run_identity(config: PretrainConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """The part of a config (plus the data's content hash) that decides what is trained: a function of the
    config and the manifest only, so it is known before anything runs."""
    tree = pinned_identity(tracking.redact(config.model_dump(mode="json", exclude=NOT_IDENTITY)), config, PINNED)
    for name, default in LATER_FIELDS.items():
        if tree.get(name) == default:
            del tree[name]
    tree["data_content_hash"] = manifest.get("content_hash")
    return tree


def patch_datasets(config: PretrainConfig, settings: LoopSettings) -> dict[str, Any]:
    """The image patch datasets of `config.data` the workers stream.

    Reproducible: every pass over the data has its own seeded file order and
    crops, chained into one dataset that covers the run.
    """
    on_device = config.augments_on_device  # then the worker normalises the uint8 pixels too
    datasets = {"train": patch_dataset(config.data, "train", augment=config.augment and not on_device, raw=on_device,
                                       shuffle=config.augment, seed=config.seed,
                                       epochs=config.passes_over(settings.train_rows),
                                       endpoint_url=config.endpoint_url)}
    if settings.val_dataset:
        datasets["val"] = patch_dataset(config.data, "val", augment=False, shuffle=False, endpoint_url=config.endpoint_url)
    return datasets


class PretrainHooks(LoopHooks):
    """The default worker loop; with `aug`, each training batch is augmented on the worker's device."""

    def __init__(self, aug: AugmentConfig | None, patch_size: int, grid: tuple[int, int]) -> None:
        self.aug, self.patch_size, self.grid = aug, patch_size, grid

    def train_batches(self, s: LoopSettings, worker: Worker, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
        """The shard's batches, augmented on `worker.device` when the recipe asks for it there."""
        batches = super().train_batches(s, worker, epoch, skip)
        if self.aug is None:
            return batches
        return augment_patch_batches(batches, patch_size=self.patch_size, grid=self.grid, aug=self.aug, seed=s.seed,
                                     rank=worker.rank, device=worker.device)


def pretrain_hooks(config: PretrainConfig, manifest: dict[str, Any]) -> LoopHooks:
    """The hooks of a pretraining run: device-side augmentation when `augment_on` is "device"; the masked
    autoencoder around them for `objective: mae`."""
    aug = AugmentConfig() if config.augments_on_device else None
    hooks = PretrainHooks(aug, manifest["patch_size"], tuple(manifest["grid"]))
    if config.objective == "mae":
        return MAEHooks(mae_options(config), hooks)
    return hooks


def mae_options(config: PretrainConfig) -> MAEOptions:
    """The MAE fields of `config`."""
    return MAEOptions(config.mask_ratio, config.decoder_dim, config.decoder_depth, config.decoder_heads,
                      config.norm_pix_loss)


def check_labels(config: PretrainConfig, manifest: dict[str, Any]) -> None:
    """Supervised pretraining needs labels: refuse an unlabeled ingest output (`"labeled": false`) up front."""
    if config.objective == "supervised":
        require_labels(manifest, config.data, "supervised pretraining", "use objective: mae")


def log_mae_outputs(client: Any, run_id: str, config: PretrainConfig, manifest: dict[str, Any], final_dir: str) -> None:
    """The decoder beside the logged encoder checkpoints, and the reconstruction picture."""
    for name in (DECODER_FILE, MAE_CONFIG_FILE):
        for artifact_path in ("checkpoints/final", "checkpoints/best"):
            client.log_artifact(run_id, os.path.join(final_dir, name), artifact_path)
    log_reconstruction_picture(client, run_id, load_mae(final_dir), config.data, manifest,
                               endpoint_url=config.endpoint_url, seed=config.seed)


def _result_from_run(client: Any, run_id: str, reused: bool) -> PretrainResult:
    run = client.get_run(run_id)
    return PretrainResult(
        run_id=run_id,
        final_checkpoint=f"runs:/{run_id}/checkpoints/final",
        best_checkpoint=f"runs:/{run_id}/checkpoints/best",
        model_uri=run.data.tags.get(TAG_MODEL_URI),
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
    manifest = read_manifest(config.data, endpoint_url=config.endpoint_url, expect=IMAGES)
    check_labels(config, manifest)
    overrides = model_overrides(config, manifest)
    # An MAE run validates nothing while it trains (validation top-1 needs labels and a head).
    has_val = config.objective == "supervised" and int(manifest.get("counts", {}).get("val", 0)) > 0
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    client = MlflowClient(tracking_uri)
    identity = run_identity(config, manifest)
    # A finished run is handed back before Ray is started or joined: nothing of it is needed.
    finished = finished_run_id(client, STAGE, config, identity)
    if finished:
        return _result_from_run(client, finished, reused=True)
    connect(ray_address)
    tags = {
        "vitpipe.data_uri": strip_userinfo(config.data),
        "vitpipe.manifest_hash": str(manifest.get("content_hash", "")),
        **({"vitpipe.ingest_run_id": config.ingest_run_id} if config.ingest_run_id else {}),
        **tracking.system_info(config.num_workers, config.use_gpu),
    }
    with stage_run(client, STAGE, config, identity, tags=tags) as run:
        if run.finished:  # finished by another vitpipe since the look above
            return _result_from_run(client, run.run_id, reused=True)
        settings = loop_settings(config, overrides, has_val, run.run_id, tracking_uri,
                                 train_rows=int(manifest.get("counts", {}).get("train", 0)) or None)
        run.log_config({**config.model_dump(mode="json"), "model_overrides": overrides,
                        "grad_accum_steps": config.grad_accum_steps})
        location = storage_location(config, run.experiment_id)
        trainer = build_trainer(
            settings.model_dump(mode="json"), run_name=run.name, location=location, workers=config,
            max_failures=config.max_failures, keep=config.keep_last, datasets=patch_datasets(config, settings),
            hooks=pretrain_hooks(config, manifest),
        )
        result = fit_trainer(trainer, config, client, run.run_id, run.name, stage=STAGE, location=location)
        run.set_tags({TAG_MODEL_URI: log_outputs(client, run.run_id, result) or ""})
        with result.checkpoint.as_directory() as final_dir:
            if config.objective == "mae":
                log_mae_outputs(client, run.run_id, config, manifest, final_dir)
            else:
                log_attention_picture(client, run.run_id, vit.load_checkpoint(final_dir), config.data, manifest,
                                      endpoint_url=config.endpoint_url)
    return _result_from_run(client, run.run_id, reused=False)
