"""The one Ray Train worker loop: pretraining, fine-tuning trials and video training all run it.

`train_loop_per_worker` is what Ray Train runs on every worker: it streams the
worker's batches, runs `pipelines.training.step.TrainStep`, evaluates,
checkpoints to the run's storage and logs from rank 0. What differs between
stages comes in a `LoopHooks` object (`pipelines.training.hooks`); the loop
itself knows no stage.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipelines.core.errors import VitpipeError
from pipelines.core.uris import Unprinted
from pipelines.training.hooks import DRIVER_INPUTS, Batches, LoopHooks, Window, write_best
from pipelines.training.recipe import LoopSettings
from pipelines.training.step import (
    TrainStep,
    build_loop_optimizer,
    build_scheduler,
    evaluate,
    load_train_state,
    resolve_precision,
    save_train_state,
    seed_everything,
)
from pipelines.training.worker import Progress, Rank0Log, Worker, all_reduce_sum, gather_rng, restore_rng


@dataclass
class _Run:
    """One worker's training, set up and (when resumed) restored."""

    s: LoopSettings
    worker: Worker
    model: nn.Module  # what checkpoints hold
    forward: nn.Module  # what the step and evaluation call (`LoopHooks.forward_model`)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step_fn: TrainStep
    amp_dtype: torch.dtype | None
    log: Rank0Log
    pos: dict[str, Any]  # step, data position (epoch, batches consumed in it), best validation top-1
    resumed_from: int | None


def train_loop_per_worker(config: dict[str, Any], hooks: LoopHooks | None = None) -> None:
    """Ray Train entry point: train `hooks.settings_model(**config)` data-parallel from the latest checkpoint.

    Every rank reports the same number of times (evaluations, checkpoints, the
    end); rank 0 attaches checkpoints and logs step metrics to MLflow.
    """
    hooks = hooks or LoopHooks()
    run = _start(config, hooks)
    try:
        _train(run, hooks)
    finally:
        run.log.close()  # the metrics sent in the background are stored before the driver ends the run


def _start(config: dict[str, Any], hooks: LoopHooks) -> _Run:
    """Settings, device, model, optimizer and schedule, restored from the latest checkpoint when there is one."""
    import ray.train
    import ray.train.torch

    config = dict(config)
    inputs = config.pop(DRIVER_INPUTS, None) or {}
    if isinstance(config.get("tracking_uri"), Unprinted):
        config["tracking_uri"] = config["tracking_uri"].value
    s = hooks.settings_model.model_validate(config)
    ctx = ray.train.get_context()
    storage = ctx.get_storage()  # DeveloperAPI: the RunConfig's filesystem and run path
    if s.torch_threads:
        torch.set_num_threads(s.torch_threads)
    device = ray.train.torch.get_device()
    worker = Worker(ctx.get_world_rank(), ctx.get_world_size(), device, storage.storage_filesystem,
                    storage.experiment_fs_path, inputs, ctx.get_experiment_name())
    amp_dtype = resolve_precision(s.precision, device)

    seed_everything(s.seed)  # identical init everywhere; DDP also broadcasts rank 0's weights
    model = hooks.start_model(s, worker).to(device)
    optimizer = build_loop_optimizer(model, s)
    scheduler = build_scheduler(optimizer, s)
    pos: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0}
    if hooks.keep_best:
        pos["best_val_top1"] = -1.0
    resumed_from = _resume(s, worker, hooks, model, optimizer, scheduler, pos)
    forward = hooks.forward_model(model)
    step_fn = TrainStep(
        ray.train.torch.prepare_model(forward), optimizer, scheduler, device=device, amp_dtype=amp_dtype,
        clip_grad_norm=s.clip_grad_norm, label_smoothing=s.label_smoothing, compile=s.compile,
        loss_fn=hooks.loss_fn(),
    )
    global_batch = s.batch_size_per_worker * s.grad_accum_steps * worker.world
    log = Rank0Log(s, worker.rank, Progress(worker.name, hooks.end_step(s), global_batch, int(pos["step"])))
    hooks.on_start(log, amp_dtype, device, resumed_from)
    return _Run(s, worker, model, forward, optimizer, scheduler, step_fn, amp_dtype, log, pos, resumed_from)


def _resume(s: LoopSettings, worker: Worker, hooks: LoopHooks, model: nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: Any, pos: dict[str, Any]) -> int | None:
    """Restore Ray Train's latest checkpoint (else the hooks' starting state) and seed this rank's streams.

    Returns the step resumed from, or None when this run starts afresh.
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_train_state(d, model, optimizer, scheduler, load_weights=hooks.load_weights)
    else:
        state = hooks.start_state(s, worker, model, optimizer, scheduler)
    if state is not None:
        pos.update(state["position"])
    seed_everything(s.seed + worker.rank + 1_000_003 * int(pos["step"]))  # per-rank streams for dropout etc.
    if checkpoint is None:
        return None
    restore_rng(state["rng"], worker)
    return int(pos["step"])


def _train(run: _Run, hooks: LoopHooks) -> None:
    """Step until `hooks.end_step`; flush losses every `log_interval`, evaluate, report and checkpoint."""
    s, worker, pos = run.s, run.worker, run.pos
    batches = hooks.train_batches(s, worker, int(pos["epoch"]), int(pos["batch_in_epoch"]))
    val = hooks.val_batches(s, worker)
    end = hooks.end_step(s)
    global_batch = s.batch_size_per_worker * s.grad_accum_steps * worker.world
    step = int(pos["step"])
    unlogged: list[tuple[int, torch.Tensor]] = []  # (step, local loss) not yet averaged over ranks
    window = Window()
    last_eval: dict[str, float] = {}
    while step < end:
        t0 = time.perf_counter()
        micro = []
        for _ in range(s.grad_accum_steps):
            epoch, in_epoch, batch = next(batches)
            micro.append(hooks.inputs(batch))
        stats = run.step_fn(micro)
        dt = time.perf_counter() - t0
        if not bool(torch.isfinite(stats.grad_norm)):  # identical on all ranks: grads are all-reduced
            hooks.on_diverged(worker, {"step": step + 1, "grad_norm": float(stats.grad_norm),
                                       "loss": float(stats.loss)}, run.log)
            return
        step += 1
        window.seconds += dt
        pos.update(step=step, epoch=epoch, batch_in_epoch=in_epoch)
        unlogged.append((step, stats.loss))
        run.log.metrics(hooks.step_metrics(s, stats, step, epoch, global_batch, dt), step)

        do_eval = val is not None and (step == end or bool(s.eval_interval and step % s.eval_interval == 0))
        do_ckpt = step == end or bool(s.checkpoint_interval and step % s.checkpoint_interval == 0)
        if hooks.checkpoint_at_evaluations_only:
            do_ckpt = do_ckpt and do_eval
        if step % s.log_interval == 0 or do_eval or do_ckpt:
            window.losses += _flush_losses(run, unlogged)
            unlogged = []
        if do_eval or do_ckpt:
            report = hooks.report(step, epoch, stats, window, global_batch, run.resumed_from)
            window = Window()
            if do_eval:
                last_eval = _evaluate(run, hooks, val, step)
            _report(run, hooks, {**report, **last_eval}, checkpoint=do_ckpt)


def _flush_losses(run: _Run, unlogged: list[tuple[int, torch.Tensor]]) -> list[float]:
    """Log the rank-mean loss of each step since the last flush: one small all-reduce, not one per step."""
    mean = all_reduce_sum(torch.stack([loss for _, loss in unlogged]).float()) / run.worker.world
    values = mean.tolist()
    for (step, _), value in zip(unlogged, values):
        run.log.metrics({"train_loss": value}, step)
    run.log.flush()
    run.log.show(unlogged[-1][0], values[-1])
    return values


def _evaluate(run: _Run, hooks: LoopHooks, val: Batches, step: int) -> dict[str, float]:
    """Validation loss and top-1 over all ranks; the best model so far is copied when the hooks keep it."""
    sums = all_reduce_sum(evaluate(run.forward, val(), run.worker.device, run.amp_dtype))
    if float(sums[2]) == 0:
        raise VitpipeError("the validation set is empty")
    result = {"val_loss": float(sums[0] / sums[2]), "val_top1": float(sums[1] / sums[2])}
    run.log.metrics(result, step)
    run.log.flush()
    if hooks.keep_best:
        if run.worker.rank == 0 and result["val_top1"] > run.pos["best_val_top1"]:
            write_best(run.worker, run.model, {"step": step, **result})
        run.pos["best_val_top1"] = max(run.pos["best_val_top1"], result["val_top1"])
    return result


def _report(run: _Run, hooks: LoopHooks, report: dict[str, float], *, checkpoint: bool) -> None:
    """`ray.train.report` on every rank; with `checkpoint`, rank 0 attaches the train state.

    Rank 0's metrics are stored first: Tune may stop a trial as soon as it sees a report (ASHA at a rung,
    or at `max_t` on the last step), and stopping kills this process with whatever is still queued.
    """
    import ray.train

    run.log.wait()
    if not checkpoint:
        ray.train.report(report)
        return
    rng = gather_rng(run.worker.device)
    if run.worker.rank != 0:
        ray.train.report(report)
        return
    step = int(run.pos["step"])
    with tempfile.TemporaryDirectory() as tmp:
        save_train_state(tmp, run.model, run.optimizer, run.scheduler, run.pos, rng, save_weights=hooks.save_weights)
        hooks.write_checkpoint(tmp, run.pos, report)
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"checkpoint_{step:08d}")
