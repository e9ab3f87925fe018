"""What one Ray Train worker knows about its run: its place, its batches, the collectives, rank-0 logging."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from mlflow.tracking import MlflowClient

from pipelines.core.tracking import MetricBuffer, set_tags
from pipelines.training.recipe import LoopSettings


@dataclass
class Worker:
    """One worker's place in the run, as Ray Train set it up."""

    rank: int
    world: int
    device: torch.device
    fs: Any  # the run's storage filesystem (pyarrow), where the driver staged what workers read
    run_dir: str  # the run's directory in `fs`
    inputs: dict[str, Any] = field(default_factory=dict)  # object refs the driver handed over (`DRIVER_INPUTS`)


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


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over all ranks (in place; unchanged outside a process group)."""
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


def restore_rng(states: list[dict[str, torch.Tensor | None]], worker: Worker) -> None:
    """Put back this rank's RNG state from `gather_rng`'s list, when the run had as many ranks as now."""
    if len(states) != worker.world:
        return
    torch.set_rng_state(states[worker.rank]["cpu"])
    if worker.device.type == "cuda" and states[worker.rank]["cuda"] is not None:
        torch.cuda.set_rng_state(states[worker.rank]["cuda"], worker.device)


class Rank0Log:
    """MLflow logging from rank 0 into the run the driver opened; a no-op elsewhere."""

    def __init__(self, s: LoopSettings, rank: int) -> None:
        self.buffer = None
        if rank == 0 and s.mlflow_run_id and s.tracking_uri:
            self.buffer = MetricBuffer(MlflowClient(s.tracking_uri), s.mlflow_run_id)

    def metrics(self, values: dict[str, float], step: int) -> None:
        """Queue `values` at `step` (sent at the next flush)."""
        if self.buffer is not None:
            self.buffer.add(values, step)

    def tags(self, values: dict[str, str]) -> None:
        """Set tags on the run now."""
        if self.buffer is not None:
            set_tags(self.buffer.client, self.buffer.run_id, values)

    def flush(self) -> None:
        """Send the queued metrics."""
        if self.buffer is not None:
            self.buffer.flush()
