"""What one Ray Train worker knows about its run: its place, its batches, the collectives, rank-0 logging."""

from __future__ import annotations

import datetime
import sys
import time
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
    name: str = ""  # the Ray Train run's name, which progress lines start with


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


# How often rank 0 samples CPU, memory, disk, network (and GPU, with nvidia-ml-py) into the run.
SYSTEM_METRICS_INTERVAL_S = 5.0


class Progress:
    """One console line per log interval on rank 0: step, loss, images/s and the time left.

    Rank 0 writes them to its stderr, which Ray's worker log forwarding copies
    to the driver's stderr, so `vitpipe run` and `ray job logs` show them without
    a callback or polling, and stdout keeps only the stage's result table.
    """

    def __init__(self, name: str, end: int, global_batch: int, start_step: int) -> None:
        self.name, self.end, self.global_batch = name, end, global_batch
        self._since = (start_step, time.monotonic())

    def line(self, step: int, loss: float, now: float | None = None) -> str:
        """The progress line at `step`, rates measured since the previous line."""
        now = time.monotonic() if now is None else now
        last_step, last_time = self._since
        self._since = (step, now)
        steps, seconds = step - last_step, max(now - last_time, 1e-9)
        rate = steps * self.global_batch / seconds
        eta = datetime.timedelta(seconds=round((self.end - step) * seconds / max(steps, 1)))
        return (f"[{self.name}] step {step}/{self.end} loss {loss:.4f} "
                f"{rate:,.1f} images/s ETA {eta}")


class Rank0Log:
    """MLflow logging from rank 0 into the run the driver opened, with system metrics; a no-op elsewhere.

    Step metrics are sent asynchronously; `close` waits for them and stops the
    system metrics monitor, so the run holds everything before the driver ends it.
    """

    def __init__(self, s: LoopSettings, rank: int, progress: Progress | None = None) -> None:
        self.buffer = None
        self.monitor = None
        self.progress = progress if rank == 0 else None
        if rank == 0 and s.mlflow_run_id and s.tracking_uri:
            self.buffer = MetricBuffer(MlflowClient(s.tracking_uri), s.mlflow_run_id, asynchronous=True)
            self.monitor = _system_metrics(s.mlflow_run_id, s.tracking_uri)

    def show(self, step: int, loss: float) -> None:
        """Write the progress line at `step` to stderr (rank 0)."""
        if self.progress is not None:
            # Not print(): Train V2 patches it into its own logger, and this line belongs on stderr.
            sys.stderr.write(self.progress.line(step, loss) + "\n")
            sys.stderr.flush()

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

    def wait(self) -> None:
        """Block until every metric queued so far is stored."""
        if self.buffer is not None:
            self.buffer.wait()

    def close(self) -> None:
        """Wait until every queued metric is stored; stop sampling system metrics."""
        if self.monitor is not None:
            self.monitor.finish()
            # The monitor publishes only whole intervals: add the state at the end, so even a short run has a point.
            self.monitor.collect_metrics()
            self.monitor.publish_metrics(self.monitor.aggregate_metrics())
            self.monitor.mlflow_logger.flush()
            self.monitor = None
        if self.buffer is not None:
            self.buffer.close()


def _system_metrics(run_id: str, tracking_uri: str) -> Any:
    """MLflow's system metrics monitor (`system/cpu_utilization_percentage`, ...) sampling into `run_id`."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, resume_logging=True,
                                   tracking_uri=tracking_uri)
    monitor.start()
    return monitor
