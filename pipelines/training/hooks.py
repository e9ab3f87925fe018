"""What a stage changes in the one worker loop (`pipelines.training.loop`), and the defaults.

The defaults (`LoopHooks` itself) are the pretrain stage's: image patches, the
model `LoopSettings` names (from a staged checkpoint when set), Ray Data shards,
a divergence left as `diverged.json` for the driver, the best model copied
beside the checkpoints, and reports with throughput and the resume point. A
stage subclasses `LoopHooks` in its own package (`pipelines.video.loop_hooks`,
`pipelines.image.finetune_trial.TrialHooks`) and hands an instance to Ray Train
with `functools.partial(train_loop_per_worker, hooks=...)`: hooks must pickle.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vit
from pipelines.training.recipe import LoopSettings
from pipelines.training.step import StepStats, build_model, load_vit_weights
from pipelines.training.worker import Rank0Log, Worker, train_batches

BEST_DIR = "best"  # <run dir>/best/: the best model by validation top-1
BEST_INFO_FILE = "best.json"
DIVERGED_FILE = "diverged.json"  # <run dir>/diverged.json: written when training diverged
DRIVER_INPUTS = "driver_inputs"  # loop-config key: object refs the driver put in the object store for the hooks

Batches = Callable[[], Iterable[tuple[Any, torch.Tensor]]]


@dataclass
class Window:
    """What happened since the last report: rank-mean losses and seconds spent in steps."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


class LoopHooks:
    """The pretrain stage's worker loop on image patches; subclasses change what differs."""

    settings_model: type[LoopSettings] = LoopSettings
    keep_best = True  # copy the best model by validation top-1 to <run dir>/best/
    # A report without validation metrics would confuse a scheduler that ranks them (Tune): then
    # checkpoints ride only on evaluation reports.
    checkpoint_at_evaluations_only = False

    # ------------------------------------------------------------ the model and where it starts

    def start_model(self, s: LoopSettings, worker: Worker) -> nn.Module:
        """`build_model(s)`, with `init_checkpoint` read from the run's storage (a driver staged it there)."""
        if not s.init_checkpoint:
            return build_model(s)
        import pyarrow.fs as pafs

        with tempfile.TemporaryDirectory() as tmp:
            pafs.copy_files(s.init_checkpoint, tmp, source_filesystem=worker.fs)
            return build_model(s.model_copy(update={"init_checkpoint": tmp}))

    def start_state(self, s: LoopSettings, worker: Worker, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> dict[str, Any] | None:
        """A train state to continue from when Ray Train has no checkpoint of this run (None: the start)."""
        return None

    def forward_model(self, model: nn.Module) -> nn.Module:
        """What the step and evaluation call; checkpoints hold `model` itself."""
        return model

    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor] | None:
        """The step's loss of the forward model's output and the labels; None: cross-entropy of logits."""
        return None

    def save_weights(self, model: nn.Module, directory: Path) -> None:
        """Write `model`'s weights into a checkpoint directory: a vit checkpoint."""
        vit.save_checkpoint(model, directory)

    def load_weights(self, model: nn.Module, directory: Path) -> None:
        """Load weights that `save_weights` wrote into `model`."""
        load_vit_weights(model, directory)

    def end_step(self, s: LoopSettings) -> int:
        """The step this run stops at (evaluated and checkpointed)."""
        return s.steps

    # ------------------------------------------------------------ data

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """`(model inputs, labels)` of one batch: here patches `(B, N, P·P·C)`."""
        return batch["patches"], batch["label"].long()

    def train_batches(self, s: LoopSettings, worker: Worker, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
        """`(epoch, batches consumed in it, batch)` from the data position `(epoch, skip)` on, forever."""
        import ray.train

        return train_batches(ray.train.get_dataset_shard(s.train_dataset), s, worker.rank, epoch, skip)

    def val_batches(self, s: LoopSettings, worker: Worker) -> Batches | None:
        """A fresh pass over this worker's validation `(inputs, labels)` per call; None without validation."""
        if not s.val_dataset:
            return None
        import ray.train

        shard = ray.train.get_dataset_shard(s.val_dataset)
        size = s.eval_batch_size or s.batch_size_per_worker
        return lambda: (self.inputs(batch) for batch in shard.iter_torch_batches(batch_size=size))

    # ------------------------------------------------------------ what is logged and reported

    def on_start(self, log: Rank0Log, amp_dtype: torch.dtype | None, device: torch.device,
                 resumed_from: int | None) -> None:
        """Tag the run with the precision and device; record a resume."""
        precision = str(amp_dtype or torch.float32).replace("torch.", "")
        log.tags({"vitpipe.precision": precision, "vitpipe.worker_device": str(device)})
        if resumed_from is not None:
            log.metrics({"resumed_from_step": resumed_from}, resumed_from)
            log.tags({"vitpipe.resumed_from_step": str(resumed_from)})

    def step_metrics(self, s: LoopSettings, stats: StepStats, step: int, epoch: int, global_batch: int,
                     seconds: float) -> dict[str, float]:
        """Metrics logged at every step."""
        return {"lr": stats.lr, "grad_norm": float(stats.grad_norm), "images_per_s": global_batch / seconds,
                "epoch": step * global_batch / s.train_rows if s.train_rows else epoch}

    def report(self, step: int, epoch: int, stats: StepStats, window: Window, global_batch: int,
               resumed_from: int | None) -> dict[str, float]:
        """A report's training metrics: the mean loss and rate since the last report (validation is added)."""
        out = {"step": step, "epoch": epoch, "lr": stats.lr, "train_loss": sum(window.losses) / len(window.losses),
               "images_per_s": global_batch * len(window.losses) / window.seconds}
        if resumed_from is not None:
            out["resumed_from_step"] = resumed_from
        return out

    def on_diverged(self, worker: Worker, info: dict[str, float], log: Rank0Log) -> None:
        """Leave `<run dir>/diverged.json` for the driver and stop (the checkpoints stay as they are).

        Ray's Result only carries the metrics of the last checkpoint, so a report
        without one would not reach the driver; a file in the run dir does.
        """
        if worker.rank == 0:
            with worker.fs.open_output_stream(f"{worker.run_dir}/{DIVERGED_FILE}") as f:
                f.write(json.dumps(info).encode())
        log.metrics({"diverged": 1.0}, int(info["step"]))
        log.tags({"vitpipe.diverged_at_step": str(int(info["step"]))})
        log.flush()

    def write_checkpoint(self, directory: str, position: dict[str, Any], report: dict[str, float]) -> None:
        """Add files to a checkpoint beside the train state (nothing here); `report` is what it is reported with."""


def write_best(worker: Worker, model: nn.Module, info: dict[str, float]) -> None:
    """Copy the best model so far to `<run dir>/best/` in the run's storage (rank 0 only).

    Ray keeps the last N resumable checkpoints; the best one by validation
    top-1 lives beside them so a later, worse checkpoint never evicts it.
    """
    import pyarrow.fs as pafs

    target = f"{worker.run_dir}/{BEST_DIR}"
    with tempfile.TemporaryDirectory() as tmp:
        vit.save_checkpoint(model, tmp)
        Path(tmp, BEST_INFO_FILE).write_text(json.dumps(info))
        worker.fs.create_dir(target)
        pafs.copy_files(tmp, target, destination_filesystem=worker.fs)
