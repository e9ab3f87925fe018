"""The Ray Train worker loop shared by pretraining and fine-tuning.

`train_loop_per_worker` is what Ray Train runs on every worker: it streams the
worker's dataset shard, runs `pipelines.training.step.TrainStep`, evaluates,
checkpoints to the run's storage and logs from rank 0.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipelines.training.step import (
    LoopSettings,
    TrainStep,
    build_loop_optimizer,
    build_model,
    build_scheduler,
    evaluate,
    load_train_state,
    resolve_precision,
    save_train_state,
    seed_everything,
)

BEST_DIR = "best"  # <run dir>/best/: the best model by validation top-1
BEST_INFO_FILE = "best.json"
DIVERGED_FILE = "diverged.json"  # <run dir>/diverged.json: written when training diverged


# ---------------------------------------------------------------- the Ray Train worker loop


def train_batches(shard: Any, s: LoopSettings, rank: int, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
    """Yield `(epoch, batches consumed in it, batch)` forever, epoch after epoch.

    On resume the first `skip` batches of the resumed epoch are read and dropped,
    so the worker continues from its data position rather than the epoch start.
    """
    while True:
        seen = 0
        shuffle = {}
        if s.shuffle_buffer:  # a different, reproducible row order per epoch and rank
            shuffle = {"local_shuffle_buffer_size": s.shuffle_buffer, "local_shuffle_seed": s.seed + 7919 * epoch + rank}
        batches = shard.iter_torch_batches(batch_size=s.batch_size_per_worker, drop_last=True, **shuffle)
        for i, batch in enumerate(batches):
            seen += 1
            if i >= skip:
                yield epoch, i + 1, batch
        if seen == 0:
            raise ValueError(
                f"the {s.train_dataset!r} split gives worker {rank} no full batch of {s.batch_size_per_worker}; "
                "use a smaller batch_size_per_worker or fewer workers"
            )
        epoch, skip = epoch + 1, 0


def batch_inputs(batch: dict[str, torch.Tensor], modality: str) -> tuple[Any, torch.Tensor]:
    """`(model inputs, labels)` of one batch: patches for images, `(clip, frame indices)` for videos,
    `(frame features, frame indices)` for features."""
    if modality == "video":
        from pipelines.video.data import clip_inputs

        return clip_inputs(batch), batch["label"].long()
    if modality == "features":
        from pipelines.video.feature_data import feature_inputs

        return feature_inputs(batch), batch["label"].long()
    return batch["patches"], batch["label"].long()


def _val_batches(shard: Any, batch_size: int, modality: str = "image") -> Iterator[tuple[Any, torch.Tensor]]:
    for batch in shard.iter_torch_batches(batch_size=batch_size):
        yield batch_inputs(batch, modality)


def _build_start_model(s: LoopSettings) -> nn.Module:
    """`build_model(s)`, with `init_checkpoint` read from the run's storage filesystem (a driver staged it there)."""
    if not s.init_checkpoint:
        return build_model(s)
    import pyarrow.fs as pafs

    fs, _ = _run_dir()
    with tempfile.TemporaryDirectory() as tmp:
        pafs.copy_files(s.init_checkpoint, tmp, source_filesystem=fs)
        return build_model(s.model_copy(update={"init_checkpoint": tmp}))


def _forward_model(model: nn.Module, modality: str) -> nn.Module:
    """What the step calls: the model, or for "features" the VTN through `feature_data.FromFrameFeatures`."""
    if modality != "features":
        return model
    from pipelines.video.feature_data import FromFrameFeatures

    return FromFrameFeatures(model)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return t


def gather_rng(device: torch.device) -> list[dict[str, torch.Tensor | None]]:
    """Every rank's RNG state (a collective: all ranks must call it)."""
    mine = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [mine]
    states: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, mine)
    return states


class Rank0Log:
    """MLflow logging from rank 0 into the run the driver opened; a no-op elsewhere."""

    def __init__(self, s: LoopSettings, rank: int) -> None:
        self.buffer = None
        if rank == 0 and s.mlflow_run_id and s.tracking_uri:
            from mlflow.tracking import MlflowClient

            from pipelines.core.tracking import MetricBuffer

            self.buffer = MetricBuffer(MlflowClient(s.tracking_uri), s.mlflow_run_id)

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.buffer is not None:
            self.buffer.add(values, step)

    def tags(self, values: dict[str, str]) -> None:
        if self.buffer is not None:
            from pipelines.core.tracking import set_tags

            set_tags(self.buffer.client, self.buffer.run_id, values)

    def flush(self) -> None:
        if self.buffer is not None:
            self.buffer.flush()


def _run_dir() -> tuple[Any, str]:
    """The run's storage filesystem and directory, as Ray Train configured them."""
    import ray.train

    storage = ray.train.get_context().get_storage()  # DeveloperAPI: the RunConfig's filesystem and run path
    return storage.storage_filesystem, storage.experiment_fs_path


def _write_best(model: nn.Module, info: dict[str, float]) -> None:
    """Copy the best model so far to `<run dir>/best/` in the run's storage (rank 0 only).

    Ray keeps the last N resumable checkpoints; the best one by validation
    top-1 lives beside them so a later, worse checkpoint never evicts it.
    """
    import json

    import pyarrow.fs as pafs

    import vit

    fs, run_dir = _run_dir()
    target = f"{run_dir}/{BEST_DIR}"
    with tempfile.TemporaryDirectory() as tmp:
        vit.save_checkpoint(model, tmp)
        Path(tmp, BEST_INFO_FILE).write_text(json.dumps(info))
        fs.create_dir(target)
        pafs.copy_files(tmp, target, destination_filesystem=fs)


def _write_diverged(info: dict[str, float]) -> None:
    """Leave `<run dir>/diverged.json` for the driver (rank 0 only).

    Ray's Result only carries the metrics of the last checkpoint, so a report
    without one would not reach the driver; a file in the run dir does.
    """
    import json

    fs, run_dir = _run_dir()
    with fs.open_output_stream(f"{run_dir}/{DIVERGED_FILE}") as f:
        f.write(json.dumps(info).encode())


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: train `LoopSettings(**config)` data-parallel from the latest checkpoint.

    Every rank reports the same number of times (evaluations, checkpoints, the
    end); rank 0 attaches checkpoints and logs step metrics to MLflow.
    """
    import ray.train
    import ray.train.torch

    s = LoopSettings.model_validate(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if s.torch_threads:
        torch.set_num_threads(s.torch_threads)
    device = ray.train.torch.get_device()
    amp_dtype = resolve_precision(s.precision, device)

    seed_everything(s.seed)  # identical init everywhere; DDP also broadcasts rank 0's weights
    model = _build_start_model(s).to(device)
    optimizer = build_loop_optimizer(model, s)
    scheduler = build_scheduler(optimizer, s)
    pos: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_val_top1": -1.0}
    resumed_from = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_train_state(d, model, optimizer, scheduler)
        pos.update(state["position"])
        resumed_from = int(pos["step"])
    seed_everything(s.seed + rank + 1_000_003 * int(pos["step"]))  # per-rank streams for dropout etc.
    if checkpoint is not None and len(state["rng"]) == world:
        torch.set_rng_state(state["rng"][rank]["cpu"])
        if device.type == "cuda" and state["rng"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"][rank]["cuda"], device)
    # On features the VTN runs without its backbone: the step and evaluation call it through a wrapper whose
    # forward is `forward_features_from_frames`; checkpoints still hold the VTN itself.
    forward = _forward_model(model, s.modality)
    ddp_model = ray.train.torch.prepare_model(forward)
    step_fn = TrainStep(
        ddp_model, optimizer, scheduler, device=device, amp_dtype=amp_dtype,
        clip_grad_norm=s.clip_grad_norm, label_smoothing=s.label_smoothing,
    )

    log = Rank0Log(s, rank)
    precision = str(amp_dtype or torch.float32).replace("torch.", "")
    log.tags({"vitpipe.precision": precision, "vitpipe.worker_device": str(device)})
    if resumed_from is not None:
        log.metrics({"resumed_from_step": resumed_from}, resumed_from)
        log.tags({"vitpipe.resumed_from_step": str(resumed_from)})

    train_shard = ray.train.get_dataset_shard(s.train_dataset)
    val_shard = ray.train.get_dataset_shard(s.val_dataset) if s.val_dataset else None
    batches = train_batches(train_shard, s, rank, int(pos["epoch"]), int(pos["batch_in_epoch"]))
    eval_batch = s.eval_batch_size or s.batch_size_per_worker
    global_batch = s.batch_size_per_worker * s.grad_accum_steps * world
    step = int(pos["step"])
    unlogged: list[tuple[int, torch.Tensor]] = []  # (step, local loss) not yet averaged over ranks
    losses: list[float] = []  # rank-mean losses since the last report
    seconds = 0.0  # step time since the last report
    last_eval: dict[str, float] = {}

    while step < s.steps:
        t0 = time.perf_counter()
        micro = []
        for _ in range(s.grad_accum_steps):
            epoch, in_epoch, batch = next(batches)
            micro.append(batch_inputs(batch, s.modality))
        stats = step_fn(micro)
        finite = bool(torch.isfinite(stats.grad_norm))  # identical on all ranks: grads are all-reduced
        dt = time.perf_counter() - t0
        if not finite:
            # Stop everywhere (the norm is the same on every rank) and leave the checkpoints as they are.
            if rank == 0:
                _write_diverged({"step": step + 1, "grad_norm": float(stats.grad_norm), "loss": float(stats.loss)})
            log.metrics({"diverged": 1.0}, step + 1)
            log.tags({"vitpipe.diverged_at_step": str(step + 1)})
            log.flush()
            return
        step += 1
        seconds += dt
        pos.update(step=step, epoch=epoch, batch_in_epoch=in_epoch)
        unlogged.append((step, stats.loss))
        log.metrics(
            {"lr": stats.lr, "grad_norm": float(stats.grad_norm), "images_per_s": global_batch / dt,
             "epoch": step * global_batch / s.train_rows if s.train_rows else epoch}, step
        )

        do_eval = val_shard is not None and (step == s.steps or bool(s.eval_interval and step % s.eval_interval == 0))
        do_ckpt = step == s.steps or bool(s.checkpoint_interval and step % s.checkpoint_interval == 0)
        if step % s.log_interval == 0 or do_eval or do_ckpt:
            # Rank-mean loss of the steps since the last flush: one small all-reduce, not one per step.
            mean = all_reduce_sum(torch.stack([loss for _, loss in unlogged]).float()) / world
            for (st, _), value in zip(unlogged, mean.tolist()):
                log.metrics({"train_loss": value}, st)
                losses.append(value)
            unlogged = []
            log.flush()
        if not (do_eval or do_ckpt):
            continue

        report: dict[str, float] = {
            "step": step, "epoch": epoch, "lr": stats.lr, "train_loss": sum(losses) / len(losses),
            "images_per_s": global_batch * len(losses) / seconds,  # the mean rate since the last report
        }
        losses, seconds = [], 0.0
        if resumed_from is not None:
            report["resumed_from_step"] = resumed_from
        if do_eval:
            sums = all_reduce_sum(evaluate(forward, _val_batches(val_shard, eval_batch, s.modality), device, amp_dtype))
            last_eval = {"val_loss": float(sums[0] / sums[2]), "val_top1": float(sums[1] / sums[2])}
            log.metrics(last_eval, step)
            log.flush()
            if rank == 0 and last_eval["val_top1"] > pos["best_val_top1"]:
                _write_best(model, {"step": step, **last_eval})
            pos["best_val_top1"] = max(pos["best_val_top1"], last_eval["val_top1"])
        report.update(last_eval)
        if not do_ckpt:
            ray.train.report(report)
            continue
        rng = gather_rng(device)
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                save_train_state(tmp, model, optimizer, scheduler, pos, rng)
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
                ray.train.report(report, checkpoint=checkpoint, checkpoint_dir_name=f"checkpoint_{step:08d}")
        else:
            ray.train.report(report)
