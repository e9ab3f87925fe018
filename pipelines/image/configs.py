"""The image stages' configs: what a user writes for `ingest`, `pretrain`, `finetune`,
`evaluate` and `embed`, validated at the edge.

This module imports pydantic and the light config modules below it (no torch, Ray
or MLflow): the CLI, the pipeline spec and `vitpipe submit` check a config before
a stage module, and what it imports, is loaded. Each stage's module
(`pipelines.image.<stage>`) runs its config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipelines.core.stage_config import DataToOutput, RegistryName, ShardedIngestConfig
from pipelines.image.search_space import SearchSpace, Searcher
from pipelines.training.recipe import OptimizerChoice, Recipe, Recorded, TrainRecipe, Workers

__all__ = ["EmbedConfig", "EvaluateConfig", "FinetuneConfig", "IngestConfig", "PretrainConfig"]


# ---------------------------------------------------------------- ingest


PILLOW_MAX_PIXELS = 89_478_485  # Pillow's own decompression-bomb threshold
# Fields added after outputs were made: left out of the identity at these defaults, so those outputs keep theirs.
INGEST_LATER_FIELDS: dict[str, Any] = {"labeled": True, "input_format": "objects", "label_field": None,
                                       "image_column": "image", "label_column": "label"}


class IngestConfig(ShardedIngestConfig):
    """Configuration of the image ingest stage (validated at construction; holds no credentials)."""

    image_size: int = Field(224, ge=8, le=4096)
    patch_size: int = Field(16, ge=1, le=512)
    max_pixels: int = Field(PILLOW_MAX_PIXELS, ge=1)
    labeled: bool = True  # False: no classes, `label` null in the shards, `"labeled": false` in the manifest
    # objects: one object per image; webdataset: tar shards of samples; parquet: tables of image bytes
    input_format: Literal["objects", "webdataset", "parquet"] = "objects"
    label_field: str | None = None  # webdataset: the label is this field of a sample's json, not its cls
    image_column: str = "image"  # parquet: image bytes, or a {"bytes", "path"} struct (Hugging Face)
    label_column: str = "label"  # parquet: the class number of a labeled ingest

    @model_validator(mode="after")
    def _consistent(self) -> IngestConfig:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        if not self.labeled and self.manifest:
            raise ValueError(f"manifest {self.manifest} gives labels, but the ingest is unlabeled (labeled: false)")
        if self.manifest and self.input_format != "objects":
            raise ValueError(f"a label manifest names objects; {self.input_format} input carries its labels inside")
        return self

    def identity(self) -> dict[str, Any]:
        """As every ingest's, less the later fields left at their defaults (`INGEST_LATER_FIELDS`)."""
        later = INGEST_LATER_FIELDS
        return {k: v for k, v in super().identity().items() if not (k in later and v == later[k])}


# ---------------------------------------------------------------- pretrain


# The MAE paper's recipe (He et al. 2021, Table 8), applied to an `objective: mae` config where it sets no value.
MAE_RECIPE = {"betas": (0.9, 0.95), "weight_decay": 0.05, "schedule": "cosine"}
MAE_BASE_LR = 1.5e-4  # per 256 images of global batch: lr = base × global batch / 256


class PretrainConfig(TrainRecipe):
    """Pretraining stage config; defaults follow the ViT paper's pretraining recipe."""

    data: str = Field(description="ingest output (local dir or s3://bucket/prefix) holding manifest.json")
    model: str = "ViT-B/16"
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    augment: bool = True
    # Where the random-resized crop and flip run: per image on the Ray Data CPU workers, or per batch on the
    # training worker's device once the batch is there (a GPU then needs far fewer CPU cores to stay fed).
    augment_on: Literal["cpu", "device"] = "cpu"
    eval_batch_size: int | None = Field(None, gt=0)
    # The paper's pretraining recipe where it differs from the shared defaults.
    num_workers: int = Field(2, gt=0)
    batch_size_per_worker: int = Field(64, gt=0)
    warmup_steps: int = Field(10_000, ge=0)
    schedule: Literal["linear", "cosine"] = "linear"  # the paper decays linearly when pretraining
    weight_decay: float = Field(0.1, ge=0)
    eval_interval: int = Field(1000, ge=0)  # 0: only at the end
    checkpoint_interval: int = Field(1000, ge=0)  # 0: only at the end
    # What is learnt: labels (`supervised`), or masked patches' pixels (`mae`, which needs no labels).
    objective: Literal["supervised", "mae"] = "supervised"
    # MAE only; the paper's defaults: 75% of patches masked, a 512-wide 8-block decoder, per-patch normalised targets.
    mask_ratio: float = Field(0.75, gt=0, lt=1)
    decoder_dim: int = Field(512, gt=0, multiple_of=4)
    decoder_depth: int = Field(8, gt=0)
    decoder_heads: int = Field(16, gt=0)
    norm_pix_loss: bool = True

    @model_validator(mode="after")
    def _mae_recipe(self) -> PretrainConfig:
        """An MAE run takes the paper's optimizer and schedule, and its scaled learning rate, unless set."""
        if self.objective != "mae":
            return self
        for name, value in MAE_RECIPE.items():
            if name not in self.model_fields_set:
                setattr(self, name, value)
        if "lr" not in self.model_fields_set:
            self.lr = MAE_BASE_LR * self.global_batch / 256
            # TrainRecipe checked min_lr against the default lr, before this one replaced it.
            if self.min_lr > self.lr:
                raise ValueError(f"min_lr ({self.min_lr:g}) must not exceed lr ({self.lr:g}), the MAE recipe's "
                                 f"{MAE_BASE_LR:g} × global batch {self.global_batch} / 256")
        if self.decoder_dim % self.decoder_heads:
            raise ValueError(f"decoder_dim {self.decoder_dim} is not a multiple of decoder_heads {self.decoder_heads}")
        return self

    @property
    def augments_on_device(self) -> bool:
        """Whether the training worker crops and flips each batch on its device (and normalises it there)."""
        return self.augment and self.augment_on == "device"


# ---------------------------------------------------------------- finetune


# What trials report, each with its better direction (a sweep's default `mode`).
METRICS = {"val_top1": "max", "val_loss": "min", "train_loss": "min"}
_DEFAULT_SPACE = {"lr": {"grid": [0.001, 0.003, 0.01, 0.03]}, "steps": 500}


class FinetuneConfig(Recipe, OptimizerChoice, Workers, Recorded):
    """Fine-tuning stage config; defaults follow the ViT paper's fine-tuning recipe.

    Steps, lr and weight decay are not fields: each trial takes them from the search space.
    """

    data: str = Field(description="ingest output (local dir or s3://bucket/prefix) of the target task")
    init: str | None = None  # starting weights; see pipelines.training.starting_weights (None: from scratch)
    model: str | None = None  # architecture; required from scratch and for timm/HF files, checked otherwise
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    freeze_backbone: bool = False  # True: linear probe (head only)
    # The paper's fine-tuning recipe where it differs from the shared defaults.
    optimizer: Literal["sgd", "adamw"] = "sgd"
    batch_size: int | None = Field(None, gt=0)  # global; default: 512, or less for small data
    hflip: bool = True  # with augmentation (aug_strength > 0)
    holdout_fraction: float = Field(0.1, gt=0, lt=1)  # minival taken from train when the data has no val split
    train_data: Literal["auto", "memory", "stream"] = "auto"  # auto: in memory up to memory_limit_mb, else Ray Data
    memory_limit_mb: int = Field(512, ge=0)  # raw (uint8) training rows a trial may hold in the object store
    # Trials report to Tune at evaluations only, so there must be some.
    eval_interval: int = Field(100, gt=0)  # steps between evaluations (and Tune reports)
    checkpoint_interval: int | None = Field(None, gt=0)  # default: every evaluation
    # The sweep.
    search_space: dict[str, Any] = Field(default_factory=lambda: dict(_DEFAULT_SPACE))
    searcher: Searcher = "grid"
    scheduler: Literal["asha", "pbt", "fifo"] = "asha"
    grace_period: int | None = Field(None, gt=0)  # ASHA: steps before a trial can be stopped (default: eval_interval)
    reduction_factor: float = Field(2.0, gt=1)  # ASHA
    perturbation_interval: int | None = Field(None, gt=0)  # PBT: steps between exploits (default: eval_interval)
    num_samples: int = Field(1, gt=0)
    max_concurrent_trials: int | None = Field(None, gt=0)  # default: as many as the cluster holds
    metric: str = "val_top1"
    mode: Literal["max", "min"] | None = None  # default: the metric's natural direction
    # Resources, per trial (workers: `Workers`).
    trial_driver_cpus: float = Field(0.25, ge=0)  # the Tune function that waits on each trial's Train run
    ray_data_cpus: float = Field(1.0, ge=0)  # CPUs kept free of trials so Ray Data can feed them
    # Where things go (run records: `Recorded`).
    registry_model: RegistryName = None  # register the best model as a new version of this name
    keep_checkpoints: int = Field(1, gt=0)  # per trial
    max_failures: int = Field(0, ge=-1)  # Ray Train restarts per trial (a diverged trial fails at once anyway)

    @field_validator("search_space", mode="before")
    @classmethod
    def _space(cls, value: Any) -> Any:
        SearchSpace.parse(value)  # one-line errors naming the parameter
        return value

    @field_validator("metric")
    @classmethod
    def _metric(cls, value: str) -> str:
        if value not in METRICS:
            raise ValueError(f"unknown metric {value!r}; trials report {', '.join(METRICS)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        space = self.space
        space.check_searcher(self.searcher)
        if self.scheduler == "pbt":
            space.pbt_mutations()
        steps = min(space.values_of("steps") or (500,))
        if self.warmup_steps >= steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than the fewest steps searched ({steps})")
        if self.batch_size is not None and self.batch_size % self.num_workers:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of num_workers {self.num_workers}")
        if self.init is None and not self.model:
            raise ValueError("model: required when training from scratch (no init)")
        return self

    @property
    def space(self) -> SearchSpace:
        """The parsed search space."""
        return SearchSpace.parse(self.search_space)

    @property
    def sweep_mode(self) -> str:
        """`mode`, or the metric's natural direction."""
        return self.mode or METRICS[self.metric]


# ---------------------------------------------------------------- evaluate


class EvaluateConfig(BaseModel):
    """Few-shot linear evaluation config."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="ingest output of the target dataset")
    init: str | None = Field(description="weights to evaluate: a pretrain run id, runs:/, models:/, a checkpoint, a timm/HF file")
    model: str | None = None  # architecture (checked against the checkpoint; required for timm/HF files)
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    shots: list[int] = Field(default_factory=lambda: [1, 5, 10, 25])
    repeats: int = Field(3, gt=0)  # random support sets per k
    l2_reg: float = Field(0.01, gt=0)  # ridge strength, relative to the support features' mean squared norm
    resolution: int | None = Field(None, gt=0)  # default: the model's own (pretraining) resolution
    support_split: Literal["train", "val"] = "train"
    query_split: Literal["test", "val"] = "test"
    batch_size: int = Field(256, gt=0)
    seed: int = 0  # draws the support sets, and a from-scratch model's weights (init none)
    endpoint_url: str | None = None
    tracking_uri: str | None = None
    experiment: str = "vitpipe"
    run_name: str | None = None
    parent_run_id: str | None = None

    @field_validator("shots")
    @classmethod
    def _shots(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("shots is empty")
        bad = [k for k in value if k < 1]
        if bad:
            raise ValueError(f"shots must be positive, got {bad[0]}")
        return sorted(set(value))

    @model_validator(mode="after")
    def _distinct_splits(self) -> EvaluateConfig:
        if self.support_split == self.query_split:  # its support images would be scored as queries too
            raise ValueError(f"support_split and query_split are both {self.query_split!r}: the few-shot "
                             "support must come from another split than the images it is scored on")
        return self


# ---------------------------------------------------------------- embed


class EmbedConfig(DataToOutput):
    """Configuration of the embed stage (validated at construction; holds no credentials)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str = Field(description="ingest output (local dir or s3://bucket/prefix)")
    output: str = Field(description="where the embedding shards go (local dir or s3://bucket/prefix)")
    init: str | None = None  # the weights: a run id, runs:/, models:/, a checkpoint dir, a timm/HF file
    model: str | None = None  # architecture (checked against the checkpoint; required for scratch and timm/HF)
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    resolution: int | None = Field(None, gt=0)  # default: the model's own resolution
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # of the forward ("auto": bf16 where native)
    batch_size: int = Field(64, gt=0)  # images per actor call
    num_workers: int = Field(1, gt=0)  # actors in the pool, each with its own copy of the model
    cpus_per_worker: float = Field(1.0, gt=0)  # also the actor's torch threads (rounded, at least 1)
    num_gpus: float | None = Field(None, ge=0)  # per actor; default: 1 where the cluster has GPUs, else 0
    compression: Literal["none", "snappy", "lz4", "zstd"] = "lz4"
    seed: int = 0  # draws a from-scratch model's weights (init none)
    endpoint_url: str | None = None  # S3-compatible endpoint for s3:// data and output
    tracking_uri: str | None = None  # the run, and runs:/ and models:/ inits; default $MLFLOW_TRACKING_URI
    experiment: str = "vitpipe"
    run_name: str | None = None
    parent_run_id: str | None = None

    @model_validator(mode="after")
    def _apart(self) -> EmbedConfig:
        self.check_output_apart("embeddings")
        return self
