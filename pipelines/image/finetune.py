"""The transfer stage: fine-tune a pretrained ViT on a small task with a Ray Tune sweep.

The driver fetches the starting weights (see `pipelines.training.starting_weights`),
checks them against the data, stages them in the storage, opens the stage's
MLflow run and runs the sweep: each trial a Ray Train run (see
`pipelines.image.finetune_trial`) logging into a nested child run. Afterwards the best
trial (by the `metric` stored with its last checkpoint, `mode`; see
`finetune_results.score_trial`) is evaluated on the test split, logged with the sweep
and confusion-matrix figures, and registered in the MLflow Model Registry with
tags linking it to its pretrain run and data manifest.

Defaults follow the paper's fine-tuning recipe (§3.2, App. B.1.1): SGD with
momentum 0.9, no weight decay, cosine decay, gradient clipping at norm 1, batch
512 (smaller when the data is small), a zero-initialised head.

Running the same config again resumes: an interrupted sweep is restored with
`Tuner.restore` (finished trials are not rerun; unfinished ones continue from
their last checkpoint) inside the same MLflow run; a finished one is returned.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from mlflow.tracking import MlflowClient
from pydantic import BaseModel, Field

from pipelines.core import tracking
from pipelines.core.cluster import connect
from pipelines.core.registry import TAG_MODEL_URI, TAG_REGISTERED_MODEL, TAG_REGISTERED_VERSION
from pipelines.core.shards import IMAGES, num_classes, read_manifest, require_labels
from pipelines.core.uris import is_s3_uri, resolve_tracking_uri, strip_userinfo
from pipelines.core.stage_config import load_stage_config
from pipelines.core.stage_run import StageRun, finished_run_id, stage_run
from pipelines.core.stopping import signal_handlers_restored
from pipelines.core.storage import S3Settings
from pipelines.image.labeled_rows import DataSpec, raw_bytes
from pipelines.image.finetune_results import check_sweep_ended, register_best_model, report_sweep, sweep_score
from pipelines.image.finetune_trial import SweepContext, TrialSettings, run_trial
from pipelines.image.search_space import ClipToRanges, build_search_alg
from pipelines.training.recipe import (
    RECIPE_NOT_IDENTITY, Workers, pinned_identity, shared_fields,
)
from pipelines.training.starting_weights import (ARCH_FIELDS, Origin, StartingWeights, fetch_starting_weights,
                                                 built_at, origin_identity, starting_origin)
from pipelines.training.trainer import stage_init, storage_location
from pipelines.image.configs import FinetuneConfig

logger = logging.getLogger("vitpipe.finetune")  # under "vitpipe": its handlers scrub credentials
STAGE = "finetune"
TAG_PRETRAIN_RUN = "vitpipe.pretrain_run_id"
TAG_MANIFEST = "vitpipe.manifest_hash"
# Fields that do not change what is trained, so they stay out of the run identity; every other field is in it.
NOT_IDENTITY = RECIPE_NOT_IDENTITY | {
    "max_concurrent_trials", "ray_data_cpus", "trial_driver_cpus",  # how fast
    "train_data", "memory_limit_mb",  # how rows reach the trials (in memory or streamed), not which rows
    "keep_checkpoints",  # how many checkpoints trials keep
    "registry_model",  # where the best model is registered: a reused sweep is registered there too
}
PINNED = ("registry_model",)  # left out of the identity later: held at its default in it (`pinned_identity`)


class FinetuneResult(BaseModel):
    """What the stage hands on."""

    run_id: str
    best_config: dict[str, Any]
    best_metric: float | None
    test_accuracy: float | None
    model_uri: str | None
    registered_model: str | None = None
    registered_version: str | None = None
    num_trials: int = 0
    trial_status: dict[str, str] = Field(default_factory=dict)  # trial id -> completed | early_stopped | failed
    experiment_path: str = ""
    reused: bool = False


def load_config(source: str | os.PathLike[str] | dict[str, Any], **overrides: Any) -> FinetuneConfig:
    """A `FinetuneConfig` from a YAML/JSON file or a dict, with one-line errors."""
    return load_stage_config(FinetuneConfig, "finetune", source, overrides)


# ---------------------------------------------------------------- driver pieces


def default_batch_size(train_images: int) -> int:
    """The paper's batch of 512, or the largest power of two up to a quarter of the data when that is less."""
    quarter = max(1, train_images // 4)
    return min(512, 2 ** int(math.log2(quarter)))


def check_resolutions(config: FinetuneConfig, model: Any, manifest: dict[str, Any]) -> list[int]:
    """The fine-tune resolutions the sweep may use, checked against the model's and the data's patch size."""
    patch = model.config.pixel_patch_size
    if patch != manifest["patch_size"] or model.config.patch_dim != manifest["patch_dim"]:
        raise ValueError(
            f"model reads {patch}-pixel patches of length {model.config.patch_dim}, but {config.data} holds "
            f"{manifest['patch_size']}-pixel patches of length {manifest['patch_dim']}"
        )
    sizes = [int(v) for v in config.space.values_of("resolution")] or [int(manifest["image_size"])]
    for size in sizes:
        if size % patch:
            raise ValueError(f"search_space.resolution: {size} is not a multiple of the patch size {patch}")
    return sizes


def training_data(config: FinetuneConfig, manifest: dict[str, Any]) -> tuple[Any, bool, int]:
    """The trials' data spec, whether training rows fit in memory, and the global batch size."""
    has_val = int(manifest.get("counts", {}).get("val", 0)) > 0
    settings = S3Settings.resolve(config.endpoint_url) if is_s3_uri(config.data) else None
    data = DataSpec(config.data, manifest, settings, 0.0 if has_val else config.holdout_fraction)
    in_memory = config.train_data == "memory" or (config.train_data == "auto" and raw_bytes(data) <= config.memory_limit_mb * 2**20)
    train_images = int(manifest["counts"]["train"] * (1 if has_val else 1 - config.holdout_fraction))
    return data, in_memory, config.batch_size or default_batch_size(train_images)


def trial_capacity(config: FinetuneConfig, streaming: bool) -> tuple[dict[str, float], int]:
    """Resources of one trial's workers, and how many trials fit the cluster at once.

    A trial holds its driver function's CPUs plus its workers'. When training
    rows stream through Ray Data, `ray_data_cpus` stay free, or Ray Data could
    not schedule the reads that feed the workers.
    """
    import ray

    per_worker = config.worker_resources()
    per_trial = config.trial_driver_cpus + config.num_workers * float(per_worker.get("CPU", 0))
    cpus = float(ray.cluster_resources().get("CPU", 0))
    reserved = config.ray_data_cpus if streaming else 0.0
    free = cpus - reserved
    if per_trial > free:
        raise ValueError(
            f"a trial needs {per_trial:g} CPUs ({config.num_workers} workers + driver), but the cluster has "
            f"{cpus:g} with {reserved:g} kept for Ray Data"
        )
    fits = max(1, int(free // per_trial)) if per_trial else 1
    if config.max_concurrent_trials is not None and config.max_concurrent_trials > fits:
        raise ValueError(
            f"max_concurrent_trials={config.max_concurrent_trials} needs {config.max_concurrent_trials * per_trial:g} CPUs; "
            f"the cluster holds {fits} such trials ({cpus:g} CPUs, {reserved:g} kept for Ray Data)"
        )
    return per_worker, config.max_concurrent_trials or fits


def build_scheduler(config: FinetuneConfig) -> Any:
    """ASHA (stops weak trials at rungs), PBT (clones strong trials, mutates hyper-parameters) or FIFO."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if config.scheduler == "fifo":
        return FIFOScheduler()
    if config.scheduler == "pbt":
        return PopulationBasedTraining(
            time_attr="step", perturbation_interval=config.perturbation_interval or config.eval_interval,
            hyperparam_mutations=config.space.pbt_mutations(),
            custom_explore_fn=ClipToRanges(config.space.pbt_ranges()),
        )
    max_t = int(config.space.max_value("steps") or 500)
    grace = min(config.grace_period or config.eval_interval, max_t)
    return ASHAScheduler(time_attr="step", max_t=max_t, grace_period=grace, reduction_factor=config.reduction_factor)


def _reused(client: Any, config: FinetuneConfig, run_id: str, lineage: dict[str, str]) -> FinetuneResult:
    """A finished sweep of this config, registered under `registry_model` if asked (a version exists once per run
    and name, so registering again is a no-op)."""
    if config.registry_model:
        score = sweep_score(client.get_run(run_id).data.metrics, config.metric, config.sweep_mode)
        register_best_model(client, run_id, config.registry_model, lineage, score)
    return _result_from_run(client, run_id, reused=True)


def _result_from_run(client: Any, run_id: str, reused: bool) -> FinetuneResult:
    run = client.get_run(run_id)
    tags, metrics = run.data.tags, run.data.metrics
    best = json.loads(tags.get("vitpipe.best_config", "{}"))
    statuses = json.loads(tags.get("vitpipe.trial_statuses", "{}"))
    return FinetuneResult(
        run_id=run_id, best_config=best, best_metric=metrics.get("best_metric"), test_accuracy=metrics.get("test_top1"),
        model_uri=tags.get(TAG_MODEL_URI), registered_model=tags.get(TAG_REGISTERED_MODEL),
        registered_version=tags.get(TAG_REGISTERED_VERSION), num_trials=len(statuses), trial_status=statuses,
        experiment_path=tags.get("vitpipe.experiment_path", ""), reused=reused,
    )


# ---------------------------------------------------------------- the stage


def run_finetune(config: FinetuneConfig, *, ray_address: str | None = None) -> FinetuneResult:
    """Run (or resume) the fine-tuning sweep, evaluate and register its best trial.

    Raises ValueError for bad input (one line naming the field, run or URI) and
    `VitpipeError` when every trial failed.
    """
    manifest = read_manifest(config.data, endpoint_url=config.endpoint_url, expect=IMAGES)
    require_labels(manifest, config.data, "fine-tuning, which trains a classifier on its labels,")
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    client = MlflowClient(tracking_uri)
    origin = starting_origin(config.init, tracking_uri, config.endpoint_url)
    tags = {
        "vitpipe.data_uri": strip_userinfo(config.data),
        TAG_MANIFEST: str(manifest.get("content_hash", "")),
        "vitpipe.init": origin.source,
        "vitpipe.init_kind": origin.kind,
        **({TAG_PRETRAIN_RUN: origin.run_id} if origin.run_id else {}),
    }
    identity = run_identity(config, manifest, origin)
    # A finished sweep is handed back before the starting weights are downloaded (ViT-L's are 1.2 GB).
    finished = finished_run_id(client, STAGE, config, identity)
    if finished:
        return _reused(client, config, finished, tags)
    start = starting_weights(config, manifest, tracking_uri, origin)
    resolutions = check_resolutions(config, start.model, manifest)
    data, in_memory, batch_size = training_data(config, manifest)
    connect(ray_address)
    per_worker, concurrent = trial_capacity(config, streaming=not in_memory)
    with stage_run(client, STAGE, config, identity,
                   tags={**tags, **tracking.system_info(config.num_workers, config.use_gpu)}) as run:
        if run.finished:  # finished by another vitpipe since the look above
            return _reused(client, config, run.run_id, tags)
        run.log_config({**config.model_dump(mode="json"), "batch_size": batch_size,
                        "pretrain_resolution": start.model.config.image_size})
        storage_path, filesystem = storage_location(config, run.experiment_id)
        ctx = _sweep_context(config, run, tracking_uri, data=data, in_memory=in_memory, batch_size=batch_size,
                             init_path=stage_init(start.model, storage_path, filesystem, run.name),
                             location=(storage_path, filesystem), per_worker=per_worker)
        result_grid = _run_sweep(config, ctx, storage_path, filesystem, run.name, concurrent, resolutions[0])
        check_sweep_ended(result_grid, config.space.num_trials(config.searcher, config.num_samples), filesystem)
        report_sweep(client, run.run_id, ctx, result_grid, metric=config.metric, mode=config.sweep_mode,
                     searched=[n for n, p in config.space.params.items() if p.kind is not None] or ["lr"],
                     registry_model=config.registry_model, lineage=tags)
    return _result_from_run(client, run.run_id, reused=False)


def starting_weights(config: FinetuneConfig, manifest: dict[str, Any], tracking_uri: str,
                     origin: Origin) -> StartingWeights:
    """The model the sweep starts from (see `pipelines.training.starting_weights`; `origin`: `init`'s, already
    looked up); one built here starts at the data's image size."""
    return fetch_starting_weights(
        config.init, model_name=config.model, model_overrides=built_at(config.init, config.model_overrides,
                                                                       manifest["image_size"]),
        tracking_uri=tracking_uri,
        endpoint_url=config.endpoint_url, seed=config.seed, origin=origin,
    )


def run_identity(config: FinetuneConfig, manifest: dict[str, Any], origin: Origin) -> dict[str, Any]:
    """The part of a config (plus the data's content hash and what names the starting weights: their run or
    their files' digest) that decides what is trained; known before anything runs."""
    identity = pinned_identity(tracking.redact(config.model_dump(mode="json", exclude=NOT_IDENTITY)), config, PINNED)
    identity.update(data_content_hash=manifest.get("content_hash"), **origin_identity(origin))
    return identity


def _sweep_context(config: FinetuneConfig, run: StageRun, tracking_uri: str, *, data: DataSpec, in_memory: bool,
                   batch_size: int, init_path: str, location: tuple[str, Any], per_worker: dict[str, float]) -> SweepContext:
    """What every trial shares: data, staged weights, the worker settings that do not vary, where to log."""
    threads = config.torch_threads or (None if config.use_gpu else max(1, int(per_worker.get("CPU", 1))))
    base = {
        **shared_fields(config, TrialSettings, exclude=("tracking_uri",)),  # each trial logs to its own run
        "model_name": config.model or "checkpoint",
        # Only fields without weights may be overridden on a pretrained model.
        "model_overrides": {k: v for k, v in config.model_overrides.items()
                            if k not in (*ARCH_FIELDS, "image_size", "num_classes")},
        "init_checkpoint": init_path, "num_classes": num_classes(data.manifest),
        "batch_size_per_worker": batch_size // config.num_workers,
        "checkpoint_interval": config.checkpoint_interval or config.eval_interval, "torch_threads": threads,
        "val_dataset": None,
    }
    storage_path, filesystem = location
    return SweepContext(
        data=data, base=base, hflip=config.hflip, in_memory=in_memory, storage_path=f"{storage_path}/{run.name}-work/trials",
        filesystem=filesystem, workers=Workers(num_workers=config.num_workers, use_gpu=config.use_gpu,
                                               resources_per_worker=per_worker),
        max_failures=config.max_failures, keep_checkpoints=config.keep_checkpoints, tracking_uri=tracking_uri,
        experiment_id=run.experiment_id, parent_run_id=run.run_id,
        segment_steps=(config.perturbation_interval or config.eval_interval) if config.scheduler == "pbt" else None,
    )


def _run_sweep(config: FinetuneConfig, ctx: SweepContext, storage_path: str, filesystem: Any, sweep: str,
               concurrent: int, default_resolution: int) -> Any:
    from ray import tune

    trainable = tune.with_resources(tune.with_parameters(run_trial, ctx=ctx), {"CPU": config.trial_driver_cpus})
    path = f"{storage_path}/{sweep}"
    if tune.Tuner.can_restore(path, storage_filesystem=filesystem):
        logger.info("finetune: restoring the interrupted sweep at %s", path)
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=False,
                                   restart_errored=False, storage_filesystem=filesystem)
    else:
        mode = config.sweep_mode
        search_alg = build_search_alg(config.searcher, config.metric, mode, config.seed, concurrent)
        tuner = tune.Tuner(
            trainable,
            param_space=config.space.to_tune(config.searcher, {"resolution": default_resolution}),
            tune_config=tune.TuneConfig(
                metric=config.metric, mode=mode, scheduler=build_scheduler(config),
                search_alg=search_alg, num_samples=config.num_samples,
                # Grid and random: the variant generator holds the limit (Tune would ignore this one and warn).
                max_concurrent_trials=concurrent if config.searcher == "bayes" else None,
                # No reuse_actors (PBT's warning asks for it): a trial's Train run lives in its actor's thread,
                # and Tune waits 2 s for that thread before reusing the actor; an early-stopped trial's run
                # outlives that, and the next trial on the actor fails (seen with ASHA).
            ),
            run_config=tune.RunConfig(
                name=sweep, storage_path=storage_path, storage_filesystem=filesystem,
                # verbose=1: Tune's trial table (status, step, the metric) on the console now and then, not
                # every result; each trial's own worker lines are the step-level progress.
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False), verbose=1,
            ),
        )
    with signal_handlers_restored():  # Tune's Ctrl-C handler would swallow the next stage's first Ctrl-C
        return tuner.fit()
