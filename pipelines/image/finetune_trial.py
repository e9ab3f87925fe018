"""One fine-tuning trial: its settings, its hooks into the worker loop, and the Tune function that runs it.

`run_trial` is what Ray Tune calls for each trial. It opens (or, after an
interruption, reopens) the trial's nested MLflow run and fits a `TorchTrainer`
whose workers run the one worker loop (`pipelines.training.loop`) with
`TrialHooks`. Metrics reach Tune through `TuneReportCallback`, so ASHA can stop
a trial between two evaluations. Under PBT the trial instead runs in segments
of `segment_steps` and reports its Ray Train checkpoint to Tune after each (the
callback carries metrics only), so PBT can clone a better trial's weights.

What the hooks change from pretraining: the model (pretrained backbone at the
trial's resolution, zero-initialised head, optionally frozen), PBT's starting
state and segment end, in-memory training rows and a minival handed over by
object ref, a divergence that fails the trial, `position.json` beside each
checkpoint, and brief reports (Tune reads `val_top1` at every one).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from mlflow.tracking import MlflowClient
from torch import nn

import vit
from pipelines.core import tracking
from pipelines.image.labeled_rows import (
    DataSpec, augment_config, load_rows, memory_batches, memory_rows, train_dataset, training_rows,
)
from pipelines.training.hooks import DRIVER_INPUTS, Batches, LoopHooks, Window
from pipelines.training.recipe import LoopSettings, Workers
from pipelines.training.step import StepStats, build_loop_optimizer, load_train_state
from pipelines.training.trainer import TrainingDivergedError, build_trainer
from pipelines.training.worker import Rank0Log, Worker

TRIAL_STAGE = "finetune-trial"
TAG_TRIAL_ID = "vitpipe.trial_id"
VAL_ROWS = "val_rows"  # DRIVER_INPUTS keys of object refs: the minival, and in-memory training rows
TRAIN_ROWS = "train_rows"
POSITION_FILE = "position.json"  # beside train_state.pt: the step and the report, readable without torch


class TrialSettings(LoopSettings):
    """What each worker of a trial receives (no credentials: Ray shows it in its state API).

    `init_checkpoint` is a vit checkpoint directory in the run's storage filesystem.
    """

    image_size: int
    num_classes: int
    optimizer: Literal["sgd", "adamw"] = "sgd"  # the paper fine-tunes with SGD and momentum
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
    with tempfile.TemporaryDirectory() as tmp:
        base = vit.load_checkpoint(_download(fs, s.init_checkpoint, tmp))
    model = vit.at_resolution(base, s.image_size, s.num_classes, s.model_overrides)
    if s.freeze_backbone:
        vit.freeze_backbone(model)
    return model


# ---------------------------------------------------------------- the worker loop's hooks


def _val_batches(rows: tuple[np.ndarray, np.ndarray], rank: int, world: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's share of the validation rows (every `world`-th), in batches; summed over ranks later."""
    patches, labels = (torch.from_numpy(np.array(a[rank::world])) for a in rows)  # a copy: object-store arrays are read-only
    return [(patches[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, len(labels), batch_size)]


class TrialHooks(LoopHooks):
    """A trial in the one worker loop: reports (every `eval_interval` steps and at the end) carry `step`,
    `train_loss` (the last step's), `lr`, `val_loss` and `val_top1`; a checkpoint rides along every
    `checkpoint_interval` steps and at the end. A non-finite gradient norm raises `TrainingDivergedError`,
    which fails this trial only."""

    settings_model = TrialSettings
    keep_best = False  # the sweep picks the best trial; within one, its last checkpoint is what counts
    checkpoint_at_evaluations_only = True

    def start_model(self, s: TrialSettings, worker: Worker) -> nn.Module:
        return build_trial_model(s, worker.fs)

    def start_state(self, s: TrialSettings, worker: Worker, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> dict[str, Any] | None:
        """PBT's exploit: the cloned trial's train state, with this trial's own lr and weight decay."""
        if not s.start_from:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            state = load_train_state(_download(worker.fs, s.start_from, tmp), model, optimizer, scheduler)
        retarget(optimizer, scheduler, s)
        return state

    def end_step(self, s: TrialSettings) -> int:
        return min(s.steps, s.stop_at_step or s.steps)

    def train_batches(self, s: TrialSettings, worker: Worker, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
        import ray

        if TRAIN_ROWS not in worker.inputs:
            return super().train_batches(s, worker, epoch, skip)
        return memory_batches(ray.get(worker.inputs[TRAIN_ROWS]), batch_size=s.batch_size_per_worker,
                              rank=worker.rank, world=worker.world, seed=s.seed, epoch=epoch, skip=skip)

    def val_batches(self, s: TrialSettings, worker: Worker) -> Batches | None:
        import ray

        if VAL_ROWS not in worker.inputs:
            return None
        batches = _val_batches(ray.get(worker.inputs[VAL_ROWS]), worker.rank, worker.world, s.eval_batch_size or 256)
        return lambda: batches

    def on_start(self, log: Rank0Log, amp_dtype: torch.dtype | None, device: torch.device,
                 resumed_from: int | None) -> None:
        """Nothing: a trial's run records its hyper-parameters and metrics only."""

    def step_metrics(self, s: LoopSettings, stats: StepStats, step: int, epoch: int, global_batch: int,
                     seconds: float) -> dict[str, float]:
        return {"lr": stats.lr, "grad_norm": float(stats.grad_norm)}

    def report(self, step: int, epoch: int, stats: StepStats, window: Window, global_batch: int,
               resumed_from: int | None) -> dict[str, float]:
        return {"step": step, "epoch": epoch, "lr": stats.lr, "train_loss": window.losses[-1]}

    def on_diverged(self, worker: Worker, info: dict[str, float], log: Rank0Log) -> None:
        log.tags({"vitpipe.diverged_at_step": str(int(info["step"]))})
        log.flush()
        raise TrainingDivergedError(
            f"trial diverged at step {int(info['step'])}: gradient norm {info['grad_norm']}, loss {info['loss']}"
        )

    def write_checkpoint(self, directory: str, position: dict[str, Any], report: dict[str, float]) -> None:
        Path(directory, POSITION_FILE).write_text(json.dumps({**position, "report": report}))


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
    workers: Workers  # per trial; `resources_per_worker` resolved
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
    import ray

    size = int(config["resolution"])
    aug = augment_config(float(config["aug_strength"]), ctx.hflip)
    # The minival goes by object ref, not Ray Data: it is small, read at every evaluation, and a second
    # streaming dataset per trial would compete with the training reads for the few CPUs trials leave free.
    inputs = {VAL_ROWS: ray.put(load_rows(ctx.data, "val", size=size))}
    datasets = {}
    if ctx.in_memory:
        inputs[TRAIN_ROWS] = ray.put(memory_rows(ctx.data, size=size, aug=aug))
    else:  # passes enough for every step, read in order: a trial repeats, and a resumed one skips what it trained on
        global_batch = settings.batch_size_per_worker * ctx.workers.num_workers * settings.grad_accum_steps
        passes = max(1, -(-settings.steps * global_batch // max(1, training_rows(ctx.data))))
        datasets["train"] = train_dataset(ctx.data, size=size, aug=aug, seed=settings.seed, epochs=passes)
    trainer = build_trainer(
        {**settings.model_dump(mode="json"), DRIVER_INPUTS: inputs}, run_name=name,
        location=(ctx.storage_path, ctx.filesystem), workers=ctx.workers, max_failures=ctx.max_failures,
        keep=ctx.keep_checkpoints, datasets=datasets, hooks=TrialHooks(), callbacks=callbacks,
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
        fs = ctx.filesystem or _local_fs()
        ended = _report_at_end(fs, latest_checkpoint(fs, f"{ctx.storage_path}/{trial_id}"), int(config["steps"]))
        if ended is not None:  # see `_report_at_end`
            tune.report(ended)
            return
        _fit(ctx, trial_settings(ctx, config, run_id), config, trial_id, [TuneReportCallback()])
        return
    _run_segments(ctx, config, trial_id, run_id)


def _local_fs() -> Any:
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def _position(fs: Any, path: str) -> dict[str, Any]:
    with fs.open_input_stream(f"{path}/{POSITION_FILE}") as f:
        return json.loads(f.read())


def checkpoint_step(fs: Any, path: str) -> int:
    """The step a train-state checkpoint was written at (its `position.json`)."""
    return int(_position(fs, path)["step"])


def checkpoint_report(fs: Any, path: str) -> dict[str, float]:
    """The report a train-state checkpoint was written with (its `position.json`): the metrics of its very
    weights; empty for a checkpoint written without one."""
    return dict(_position(fs, path).get("report") or {})


def _report_at_end(fs: Any, checkpoint: str | None, steps: int) -> dict[str, float] | None:
    """The report a checkpoint at or past `steps` was written with; None when training is still to do.

    Tune saves its state every few seconds: a driver killed between a trial's last checkpoint and the next
    save restores the trial unfinished. Training it again would step nothing and report nothing, and Tune
    fails a trial that ends without its metric; handing Tune the last report again ends it as it ended.
    """
    if checkpoint is None:
        return None
    position = _position(fs, checkpoint)
    return position.get("report") if int(position["step"]) >= steps else None


def _run_segments(ctx: SweepContext, config: dict[str, Any], trial_id: str, run_id: str) -> None:
    """PBT: train `segment_steps` at a time and hand Tune the segment's checkpoint after each.

    Tune keeps a copy of each reported checkpoint. When PBT makes this trial
    clone a better one (or Tune restores it), `tune.get_checkpoint()` is that
    copy: training goes on from it in a new Train run named after it, with
    this trial's own (possibly mutated) hyper-parameters.
    """
    from ray import tune

    fs = ctx.filesystem or _local_fs()
    name, start_from = trial_id, None
    start = tune.get_checkpoint()
    if start is not None:
        start_from = start.path
        name = f"{trial_id}-from-{hashlib.sha1(start_from.encode()).hexdigest()[:8]}"
    steps = int(config["steps"])
    reported = False
    while True:
        latest = latest_checkpoint(fs, f"{ctx.storage_path}/{name}") or start_from
        at = checkpoint_step(fs, latest) if latest else 0
        if at >= steps:
            ended = None if reported else _report_at_end(fs, latest, steps)
            if ended is not None:
                tune.report(ended, checkpoint=tune.Checkpoint(latest, filesystem=fs))
            return
        stop = min(steps, (at // ctx.segment_steps + 1) * ctx.segment_steps)
        result = _fit(ctx, trial_settings(ctx, config, run_id, stop_at_step=stop, start_from=start_from), config, name, [])
        path = latest_checkpoint(fs, f"{ctx.storage_path}/{name}")
        tune.report(dict(result.metrics), checkpoint=tune.Checkpoint(path, filesystem=fs))
        reported = True


