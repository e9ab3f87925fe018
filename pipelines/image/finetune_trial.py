"""One fine-tuning trial: its data, its model, its worker loop, and the Tune function that runs it.

`run_trial` is what Ray Tune calls for each trial. It opens (or, after an
interruption, reopens) the trial's nested MLflow run and fits a `TorchTrainer`
whose workers run `finetune_loop_per_worker`. Metrics reach Tune through
`TuneReportCallback`, so ASHA can stop a trial between two evaluations. Under
PBT the trial instead runs in segments of `segment_steps` and reports its Ray
Train checkpoint to Tune after each (the callback carries metrics only), so PBT
can clone a better trial's weights.

The worker loop reuses the pretrain loop's parts (`TrainStep`, `evaluate`,
train-state files, seeding, schedule); what differs is the model (pretrained
backbone at the trial's resolution, zero-initialised head, optionally frozen),
the optimizer (SGD with momentum by default, as in the paper) and the reports.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from pipelines.core.errors import VitpipeError
from pipelines.image.finetune_data import DataSpec, augment_config, load_rows, memory_batches, memory_rows, train_dataset
from pipelines.training.loop import Rank0Log, all_reduce_sum, gather_rng, train_batches
from pipelines.training.step import (
    LoopSettings,
    TrainStep,
    build_loop_optimizer,
    build_scheduler,
    evaluate,
    load_train_state,
    resolve_precision,
    save_train_state,
    seed_everything,
)

TRIAL_STAGE = "finetune-trial"
TAG_TRIAL_ID = "vitpipe.trial_id"
VAL_ROWS = "val_rows"  # train_loop_config keys of object refs: the minival, and in-memory training rows
TRAIN_ROWS = "train_rows"
POSITION_FILE = "position.json"  # beside train_state.pt: the step, readable without torch


class TrainingDivergedError(VitpipeError):
    """A trial's loss or gradients became NaN/inf."""


class TrialSettings(LoopSettings):
    """What each worker of a trial receives (no credentials: Ray shows it in its state API).

    `init_checkpoint` is a vit checkpoint directory in the run's storage filesystem.
    """

    image_size: int
    num_classes: int
    optimizer: Literal["sgd", "adamw"] = "sgd"
    momentum: float = 0.9
    freeze_backbone: bool = False
    stop_at_step: int | None = None  # PBT: end this segment here (a checkpoint is written)
    start_from: str | None = None  # PBT exploit: a train-state checkpoint (storage path) to continue from


# ---------------------------------------------------------------- model and optimizer


def build_finetune_optimizer(model: nn.Module, s: TrialSettings) -> torch.optim.Optimizer:
    """SGD with momentum (the paper's fine-tuning optimizer) or AdamW; weight decay on matrices only."""
    return build_loop_optimizer(model, s)


def retarget(optimizer: torch.optim.Optimizer, scheduler: Any, s: TrialSettings) -> None:
    """After PBT cloned another trial's state: apply this trial's (mutated) lr and weight decay."""
    optimizer.param_groups[0]["weight_decay"] = s.weight_decay
    for group in optimizer.param_groups:
        group["initial_lr"] = s.lr
    scheduler.base_lrs = [s.lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["lr"] = s.lr * factor


def _download(fs: Any, path: str, local: str) -> str:
    import pyarrow.fs as pafs

    pafs.copy_files(path, local, source_filesystem=fs)
    return local


def build_trial_model(s: TrialSettings, fs: Any) -> nn.Module:
    """The trial's starting model: the staged checkpoint at `s.image_size` with a new head."""
    import vit

    with tempfile.TemporaryDirectory() as tmp:
        base = vit.load_checkpoint(_download(fs, s.init_checkpoint, tmp))
    model = vit.at_resolution(base, s.image_size, s.num_classes, s.model_overrides)
    if s.freeze_backbone:
        vit.freeze_backbone(model)
    return model


# ---------------------------------------------------------------- the worker loop


def _val_batches(rows: tuple[np.ndarray, np.ndarray], rank: int, world: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's share of the validation rows (every `world`-th), in batches; summed over ranks later."""
    patches, labels = (torch.from_numpy(np.array(a[rank::world])) for a in rows)  # a copy: object-store arrays are read-only
    return [(patches[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, len(labels), batch_size)]


def finetune_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point of one trial: fine-tune from the staged checkpoint or the latest one.

    Reports (every `eval_interval` steps and at the end) carry `step`,
    `train_loss`, `lr`, `val_loss`, `val_top1`; a checkpoint rides along every
    `checkpoint_interval` steps and at the end. A non-finite gradient norm
    raises `TrainingDivergedError`, which fails this trial only.
    """
    import ray.train
    import ray.train.torch

    config = dict(config)
    val_rows = config.pop(VAL_ROWS, None)  # object refs the trial driver filled once
    train_rows = config.pop(TRAIN_ROWS, None)
    s = TrialSettings.model_validate(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if s.torch_threads:
        torch.set_num_threads(s.torch_threads)
    device = ray.train.torch.get_device()
    amp_dtype = resolve_precision(s.precision, device)
    fs = ctx.get_storage().storage_filesystem  # DeveloperAPI: the run's storage, where the init was staged

    seed_everything(s.seed)
    model = build_trial_model(s, fs).to(device)
    optimizer = build_finetune_optimizer(model, s)
    scheduler = build_scheduler(optimizer, s)
    pos: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0}
    state = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_train_state(d, model, optimizer, scheduler)
    elif s.start_from:
        with tempfile.TemporaryDirectory() as tmp:
            state = load_train_state(_download(fs, s.start_from, tmp), model, optimizer, scheduler)
        retarget(optimizer, scheduler, s)
    if state is not None:
        pos.update(state["position"])
    step = int(pos["step"])
    seed_everything(s.seed + rank + 1_000_003 * step)
    if checkpoint is not None and len(state["rng"]) == world:
        torch.set_rng_state(state["rng"][rank]["cpu"])
    step_fn = TrainStep(
        ray.train.torch.prepare_model(model), optimizer, scheduler, device=device, amp_dtype=amp_dtype,
        clip_grad_norm=s.clip_grad_norm, label_smoothing=s.label_smoothing,
    )
    log = Rank0Log(s, rank)
    if train_rows is not None:
        batches = memory_batches(ray.get(train_rows), batch_size=s.batch_size_per_worker, rank=rank, world=world,
                                 seed=s.seed, epoch=int(pos["epoch"]), skip=int(pos["batch_in_epoch"]))
    else:
        batches = train_batches(ray.train.get_dataset_shard(s.train_dataset), s, rank, int(pos["epoch"]), int(pos["batch_in_epoch"]))
    val = _val_batches(ray.get(val_rows), rank, world, s.eval_batch_size or 256) if val_rows is not None else None
    end = min(s.steps, s.stop_at_step or s.steps)
    losses: list[torch.Tensor] = []
    while step < end:
        micro = []
        for _ in range(s.grad_accum_steps):
            epoch, in_epoch, batch = next(batches)
            micro.append((batch["patches"], batch["label"].long()))
        stats = step_fn(micro)
        if not bool(torch.isfinite(stats.grad_norm)):  # identical on all ranks: gradients are all-reduced
            log.tags({"vitpipe.diverged_at_step": str(step + 1)})
            log.flush()
            raise TrainingDivergedError(f"trial diverged at step {step + 1}: gradient norm {float(stats.grad_norm)}, loss {float(stats.loss)}")
        step += 1
        pos.update(step=step, epoch=epoch, batch_in_epoch=in_epoch)
        losses.append(stats.loss)
        log.metrics({"lr": stats.lr, "grad_norm": float(stats.grad_norm)}, step)
        do_eval = step == end or step % s.eval_interval == 0
        if step % s.log_interval and not do_eval:
            continue
        mean = (all_reduce_sum(torch.stack(losses).float()) / world).tolist()
        for offset, value in enumerate(mean):
            log.metrics({"train_loss": value}, step - len(mean) + 1 + offset)
        losses = []
        log.flush()
        if not do_eval:
            continue
        report = {"step": step, "epoch": epoch, "lr": stats.lr, "train_loss": mean[-1]}
        if val is not None:
            sums = all_reduce_sum(evaluate(model, val, device, amp_dtype))
            if float(sums[2]) == 0:
                raise VitpipeError("the validation set is empty")
            report.update(val_loss=float(sums[0] / sums[2]), val_top1=float(sums[1] / sums[2]))
            log.metrics({"val_loss": report["val_loss"], "val_top1": report["val_top1"]}, step)
            log.flush()
        if not (step == end or (s.checkpoint_interval and step % s.checkpoint_interval == 0)):
            ray.train.report(report)
            continue
        rng = gather_rng(device)
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                save_train_state(tmp, model, optimizer, scheduler, pos, rng)
                Path(tmp, POSITION_FILE).write_text(json.dumps(pos))
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=f"checkpoint_{step:08d}")
        else:
            ray.train.report(report)


# ---------------------------------------------------------------- the Tune trainable


@dataclass
class SweepContext:
    """What every trial shares, handed over by `tune.with_parameters` (object store, not the config)."""

    data: DataSpec
    base: dict[str, Any]  # TrialSettings fields other than the searched ones and the run id
    hflip: bool
    in_memory: bool  # training rows via the object store (small data) rather than Ray Data
    storage_path: str  # where trial Train runs live: <storage_path>/<trial id>
    filesystem: Any  # pyarrow filesystem of storage_path (None: local)
    num_workers: int
    use_gpu: bool
    resources_per_worker: dict[str, float]
    max_failures: int
    keep_checkpoints: int
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    segment_steps: int | None = None  # PBT: steps per segment


def latest_checkpoint(fs: Any, run_dir: str) -> str | None:
    """The newest `checkpoint_<step>` directory of a Train run, or None."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True))
    except OSError:
        return None
    names = sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_"))
    return f"{run_dir}/{names[-1]}" if names else None


def open_trial_run(ctx: SweepContext, trial_id: str, trial_name: str, config: dict[str, Any]) -> str:
    """The trial's nested MLflow run: found by trial id under the stage run (a restored trial), else created."""
    from mlflow.tracking import MlflowClient

    from pipelines.core import tracking

    client = MlflowClient(ctx.tracking_uri)
    found = client.search_runs(
        [ctx.experiment_id],
        filter_string=f"tags.`{tracking.TAG_PARENT}` = '{ctx.parent_run_id}' and tags.`{TAG_TRIAL_ID}` = '{trial_id}'",
        max_results=1,
    )
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        tags = {tracking.TAG_PARENT: ctx.parent_run_id, tracking.TAG_STAGE: TRIAL_STAGE, TAG_TRIAL_ID: trial_id}
        run_id = client.create_run(ctx.experiment_id, run_name=trial_name, tags=tags).info.run_id
    tracking.log_params(client, run_id, config)
    return run_id


def trial_settings(ctx: SweepContext, config: dict[str, Any], run_id: str, **extra: Any) -> TrialSettings:
    """The worker settings of a trial with hyper-parameters `config`."""
    return TrialSettings(
        **ctx.base, lr=float(config["lr"]), steps=int(config["steps"]), weight_decay=float(config["weight_decay"]),
        image_size=int(config["resolution"]), mlflow_run_id=run_id, tracking_uri=ctx.tracking_uri, **extra,
    )


def _fit(ctx: SweepContext, settings: TrialSettings, config: dict[str, Any], name: str, callbacks: list[Any]) -> Any:
    import ray.train
    from ray.train.torch import TorchTrainer

    import ray
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False  # one bar per trial per epoch drowns the log
    size = int(config["resolution"])
    aug = augment_config(float(config["aug_strength"]), ctx.hflip)
    # The minival goes by object ref, not Ray Data: it is small, read at every evaluation, and a second
    # streaming dataset per trial would compete with the training reads for the few CPUs trials leave free.
    loop_config = {**settings.model_dump(mode="json"), VAL_ROWS: ray.put(load_rows(ctx.data, "val", size=size))}
    datasets = {}
    if ctx.in_memory:
        loop_config[TRAIN_ROWS] = ray.put(memory_rows(ctx.data, size=size, aug=aug))
    else:
        datasets["train"] = train_dataset(ctx.data, size=size, aug=aug)
    trainer = TorchTrainer(
        finetune_loop_per_worker,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=ctx.num_workers, use_gpu=ctx.use_gpu, resources_per_worker=ctx.resources_per_worker
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=ctx.storage_path,
            storage_filesystem=ctx.filesystem,
            failure_config=ray.train.FailureConfig(max_failures=ctx.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=ctx.keep_checkpoints),
            callbacks=callbacks,
        ),
        datasets=datasets,
    )
    return trainer.fit()


def run_trial(config: dict[str, Any], ctx: SweepContext) -> None:
    """Ray Tune function of one trial (see the module docstring)."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    tune_ctx = tune.get_context()
    trial_id = tune_ctx.get_trial_id()
    run_id = open_trial_run(ctx, trial_id, tune_ctx.get_trial_name(), config)
    if ctx.segment_steps is None:
        _fit(ctx, trial_settings(ctx, config, run_id), config, trial_id, [TuneReportCallback()])
        return
    _run_segments(ctx, config, trial_id, run_id)


def checkpoint_step(fs: Any, path: str) -> int:
    """The step a train-state checkpoint was written at (its `position.json`)."""
    with fs.open_input_stream(f"{path}/{POSITION_FILE}") as f:
        return int(json.loads(f.read())["step"])


def _run_segments(ctx: SweepContext, config: dict[str, Any], trial_id: str, run_id: str) -> None:
    """PBT: train `segment_steps` at a time and hand Tune the segment's checkpoint after each.

    Tune keeps a copy of each reported checkpoint. When PBT makes this trial
    clone a better one (or Tune restores it), `tune.get_checkpoint()` is that
    copy: training goes on from it in a new Train run named after it, with
    this trial's own (possibly mutated) hyper-parameters.
    """
    import hashlib

    import pyarrow.fs as pafs
    from ray import tune

    fs = ctx.filesystem or pafs.LocalFileSystem()
    name, start_from = trial_id, None
    start = tune.get_checkpoint()
    if start is not None:
        start_from = start.path
        name = f"{trial_id}-from-{hashlib.sha1(start_from.encode()).hexdigest()[:8]}"
    steps = int(config["steps"])
    while True:
        latest = latest_checkpoint(fs, f"{ctx.storage_path}/{name}") or start_from
        at = checkpoint_step(fs, latest) if latest else 0
        if at >= steps:
            return
        stop = min(steps, (at // ctx.segment_steps + 1) * ctx.segment_steps)
        result = _fit(ctx, trial_settings(ctx, config, run_id, stop_at_step=stop, start_from=start_from), config, name, [])
        path = latest_checkpoint(fs, f"{ctx.storage_path}/{name}")
        tune.report(dict(result.metrics), checkpoint=tune.Checkpoint(path, filesystem=fs))


__all__ = [
    "SweepContext",
    "TrainingDivergedError",
    "TrialSettings",
    "build_finetune_optimizer",
    "finetune_loop_per_worker",
    "latest_checkpoint",
    "run_trial",
]
