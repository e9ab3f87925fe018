"""The config fields and checks shared by the stages that train on Ray Train (`pretrain`, `video_train`).

Each stage's config subclasses `TrainRecipe` and re-declares the fields whose
defaults follow its own paper (the ViT pretraining recipe, the VTN recipe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from pipelines.training.step import LoopSettings


class TrainRecipe(BaseModel):
    """Workers, batch, optimizer schedule, precision, checkpoints and where a training run is recorded."""

    model_config = ConfigDict(extra="forbid")

    # Workers and batch.
    num_workers: int = Field(1, gt=0)
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None  # default: 1 CPU (or 1 GPU) per worker
    torch_threads: int | None = Field(None, gt=0)  # default: the worker's CPU count
    batch_size_per_worker: int = Field(8, gt=0)
    global_batch_size: int | None = Field(None, gt=0)  # default: workers × per-worker batch (no accumulation)
    shuffle_buffer: int = Field(0, ge=0)  # rows in each worker's local shuffle buffer; 0 = off
    # The schedule.
    steps: int = Field(gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["linear", "cosine"] = "cosine"
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    clip_grad_norm: float | None = Field(1.0, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # Evaluation, checkpoints, logs.
    eval_interval: int = Field(0, ge=0)  # 0: only at the end
    checkpoint_interval: int = Field(500, ge=0)  # 0: only at the end
    keep_last: int = Field(2, gt=0)  # resumable checkpoints kept; the best model is kept besides
    log_interval: int = Field(10, gt=0)
    # Where things go.
    storage: str = "vitpipe-work/runs"  # local dir or s3://bucket/prefix
    endpoint_url: str | None = None  # S3-compatible endpoint for s3:// data and storage; credentials from the AWS chain
    run_name: str | None = None  # default: <stage>-<config hash>
    seed: int = 0
    max_failures: int = Field(2, ge=-1)
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str = "vitpipe"
    parent_run_id: str | None = None
    ingest_run_id: str | None = None

    @model_validator(mode="after")
    def _check_recipe(self) -> TrainRecipe:
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple of "
                             f"num_workers × batch_size_per_worker = {self.micro_batch}")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self

    @property
    def micro_batch(self) -> int:
        """Rows all workers process in one forward/backward pass."""
        return self.num_workers * self.batch_size_per_worker

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step that make up the global batch."""
        return (self.global_batch_size or self.micro_batch) // self.micro_batch

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step, across all workers."""
        return self.micro_batch * self.grad_accum_steps

    def passes_over(self, train_rows: int | None) -> int:
        """Passes over `train_rows` rows that cover every step of the run (1 when unknown)."""
        if not train_rows:
            return 1
        return max(1, -(-self.steps * self.global_batch // train_rows))

    def loop_settings(self, *, has_val: bool, run_id: str | None, tracking_uri: str | None,
                      train_rows: int | None = None, **specific: Any) -> LoopSettings:
        """What every worker receives: this recipe's fields plus the stage's own (`specific`: model, modality, ...).

        No credentials go in: Ray exports the settings to its state API.
        """
        from pipelines.training.step import LoopSettings  # imports torch: configs load and validate without it

        threads = self.torch_threads
        if threads is None and not self.use_gpu:  # the CPUs the worker reserved, not every core of its node
            threads = max(1, int((self.resources_per_worker or {}).get("CPU", 1)))
        return LoopSettings(
            steps=self.steps, warmup_steps=self.warmup_steps, schedule=self.schedule, lr=self.lr, min_lr=self.min_lr,
            weight_decay=self.weight_decay, betas=self.betas, clip_grad_norm=self.clip_grad_norm,
            label_smoothing=self.label_smoothing, precision=self.precision,
            batch_size_per_worker=self.batch_size_per_worker, grad_accum_steps=self.grad_accum_steps,
            eval_interval=self.eval_interval, checkpoint_interval=self.checkpoint_interval,
            log_interval=self.log_interval, shuffle_buffer=self.shuffle_buffer, torch_threads=threads, seed=self.seed,
            train_rows=train_rows, val_dataset="val" if has_val else None, mlflow_run_id=run_id,
            tracking_uri=tracking_uri, **specific,
        )
