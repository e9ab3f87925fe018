"""The one training recipe, and the argument groups the stage configs are built from.

`Recipe` holds the optimisation fields every trainer shares. The others derive
from it, as litgpt composes its argument groups:

    Recipe ─ StepRecipe ─ LoopSettings        what every Ray Train worker receives
                        └ TrainRecipe          + Workers + Recorded: pretrain, video_train
           └ (FinetuneConfig)                  + Workers + Recorded: steps and lr are searched per trial

`OptimizerChoice` adds the optimizer to those that offer one. A subclass
re-declares a field only to change its default (each says why). This module
imports pydantic only: configs load and validate without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Precision = Literal["auto", "bf16", "fp32"]


@dataclass(frozen=True)
class AugmentConfig:
    """Random-resized-crop and flip parameters (crop area fraction and aspect ratio ranges), wherever they run:
    per image on the CPU data path, or per batch on the accelerator (`pipelines.training.augment`)."""

    scale: tuple[float, float] = (0.25, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True


class Recipe(BaseModel):
    """Schedule shape, clipping, smoothing, precision, compilation, evaluation and log cadence, seed."""

    model_config = ConfigDict(extra="forbid")

    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["linear", "cosine"] = "cosine"
    clip_grad_norm: float | None = Field(1.0, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    precision: Precision = "auto"
    eval_interval: int = Field(0, ge=0)  # 0: only at the end
    checkpoint_interval: int = Field(0, ge=0)  # 0: only at the end
    log_interval: int = Field(10, gt=0)
    torch_threads: int | None = Field(None, gt=0)  # per worker; default: the worker's CPU count
    # torch.compile the model for training steps: faster on GPUs after a compile of about a minute per worker;
    # checkpoints are the same either way.
    compile: bool = False
    seed: int = 0


class StepRecipe(Recipe):
    """A recipe whose length, learning rate and per-worker batch are fixed (not searched)."""

    steps: int = Field(gt=0)
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    batch_size_per_worker: int = Field(8, gt=0)
    shuffle_buffer: int = Field(0, ge=0)  # rows in each worker's local shuffle buffer; 0 = off


class OptimizerChoice(BaseModel):
    """AdamW (the pretraining optimizer) or SGD with momentum."""

    model_config = ConfigDict(extra="forbid")

    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = Field(0.9, ge=0, lt=1)  # SGD only


class Workers(BaseModel):
    """How many Ray Train workers, and what each holds."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(1, gt=0)
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None  # default: 1 CPU (or 1 GPU) per worker

    def worker_resources(self) -> dict[str, float]:
        """`resources_per_worker`, or 1 CPU (and 1 GPU with `use_gpu`)."""
        return self.resources_per_worker or ({"CPU": 1.0, "GPU": 1.0} if self.use_gpu else {"CPU": 1.0})


class Recorded(BaseModel):
    """Where a run keeps its checkpoints and its MLflow record, and how often it is retried."""

    model_config = ConfigDict(extra="forbid")

    storage: str = "vitpipe-work/runs"  # local dir or s3://bucket/prefix
    endpoint_url: str | None = None  # S3-compatible endpoint for s3:// data and storage; credentials from the AWS chain
    run_name: str | None = None  # default: <stage>-<config hash>
    max_failures: int = Field(2, ge=-1)
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str = "vitpipe"
    parent_run_id: str | None = None


# Fields of these groups that do not change what a run trains, so they stay out of its identity: where it
# is recorded, how often it is retried, how fast it runs. Each stage adds its own (`NOT_IDENTITY`).
RECIPE_NOT_IDENTITY = frozenset({"tracking_uri", "experiment", "parent_run_id", "max_failures", "torch_threads",
                                 "compile"})
# `TrainRecipe`'s: how many checkpoints are kept, and the ingest run (lineage: the data's hash is in the identity).
TRAIN_NOT_IDENTITY = RECIPE_NOT_IDENTITY | {"keep_last", "ingest_run_id"}


def pinned_identity(tree: dict[str, Any], config: BaseModel, pinned: tuple[str, ...]) -> dict[str, Any]:
    """`tree` with the `pinned` fields at their defaults, whatever `config` says: fields that counted in the
    identity of runs recorded before they were left out, so that those runs keep their identity."""
    return {**tree, **{name: type(config).model_fields[name].default for name in pinned}}


def shared_fields(source: BaseModel, target: type[BaseModel], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values of `source`'s fields that `target` also declares (minus `exclude`)."""
    names = (type(source).model_fields.keys() & target.model_fields.keys()) - set(exclude)
    return {name: getattr(source, name) for name in names}


class LoopSettings(StepRecipe, OptimizerChoice):
    """Everything a worker needs; built by the stage driver, holds no credentials."""

    model_name: str
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    # A vit checkpoint dir to start from: a local path for `build_model`; the Ray Train loop reads it
    # from the run's storage filesystem (local storage: the same path).
    init_checkpoint: str | None = None
    # Settings built by hand (tests, benchmarks) get the paper's pretraining schedule and decay.
    schedule: Literal["linear", "cosine"] = "linear"
    weight_decay: float = Field(0.1, ge=0)
    grad_accum_steps: int = Field(1, gt=0)
    eval_batch_size: int | None = None
    train_dataset: str = "train"
    train_rows: int | None = None  # rows of the train split: the logged epoch is the fraction of them seen
    val_dataset: str | None = "val"
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None


class TrainRecipe(StepRecipe, Workers, Recorded):
    """A stage that trains one run on Ray Train (`pretrain`, `video_train`): recipe, workers, records.

    Each stage's config subclasses it and re-declares the fields whose defaults
    follow its own paper (the ViT pretraining recipe, the VTN recipe).
    """

    global_batch_size: int | None = Field(None, gt=0)  # default: workers × per-worker batch (no accumulation)
    checkpoint_interval: int = Field(500, ge=0)  # a long run keeps resumable checkpoints; 0: only at the end
    keep_last: int = Field(2, gt=0)  # resumable checkpoints kept; the best model is kept besides
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
        """What every worker receives: every field this config shares with `LoopSettings`, then the stage's
        own (`specific`: model, overrides, starting checkpoint, ...).

        No credentials go in: Ray exports the settings to its state API. The tracking URI, which may hold
        a password, is hidden from it by `build_trainer`.
        """
        threads = self.torch_threads
        if threads is None and not self.use_gpu:  # the CPUs the worker reserved, not every core of its node
            threads = max(1, int((self.resources_per_worker or {}).get("CPU", 1)))
        return LoopSettings(**{
            **shared_fields(self, LoopSettings), "grad_accum_steps": self.grad_accum_steps, "torch_threads": threads,
            "train_rows": train_rows, "val_dataset": "val" if has_val else None, "mlflow_run_id": run_id,
            "tracking_uri": tracking_uri, **specific,
        })
