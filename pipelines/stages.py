"""The stage registry: every stage kind, the code that runs it, what it consumes and what it produces.

The spec (`pipelines.spec`), the runner (`pipelines.runner`) and the CLI
(`pipelines.cli`) all read `STAGES`; nothing else turns a kind into code. Stage
modules import torch, Ray and MLflow, so each kind names two small loaders: its
config model, from the light `configs` module of its layer (so `vitpipe --help`
and config and spec validation stay fast), and its run function, from the stage
module on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel

RUN = "run"  # the pseudo-kind of an input that is an existing MLflow run or model, not a stage


class Fill(NamedTuple):
    """What an input gives its stage: `field` set from the upstream result's `source` attribute."""

    field: str
    source: str  # attribute of the upstream stage's result; "ref" = the input string itself


@dataclass(frozen=True)
class Stage:
    """One stage kind.

    `inputs` says which config field each input fills, by the input's kind; a kind
    missing from it cannot be an input of this stage. A stage with `shards` writes
    shards plus a manifest and has no tracking of its own (the runner records it as
    a child run, and `result.skipped` says it was reused); any other stage tracks its
    own MLflow run (`result.run_id`, `result.reused`).
    """

    config: Callable[[], type[BaseModel]]  # the config model (imports pydantic-only modules)
    load: Callable[[], Callable[..., Any]]  # the run function: imports the stage module on first call
    inputs: dict[str, Fill]
    metric: Callable[[Any], str]  # the summary table's key figure of a result
    shards: bool = False
    takes_ray_address: bool = True  # run(config, ray_address=...)
    takes_force: bool = False  # run(config, force=...): rewrite a finished output
    takes_ingest_run: bool = False  # its config records the run id of its ingest input (`ingest_run_id`)
    from_file: bool = True  # `vitpipe <kind> CONFIG` reads a config file; ingests take options instead
    needs_labels: Callable[[Mapping[str, Any]], bool] = lambda config: False  # of its config: reads labels

    @property
    def config_model(self) -> type[BaseModel]:
        """The stage's pydantic config model."""
        return self.config()

    @property
    def run(self) -> Callable[..., Any]:
        """The stage's run function: `run(config, [ray_address=...], [force=...]) -> result`."""
        return self.load()

    def reused(self, result: Any) -> bool:
        """True when `result` came from an earlier finished run rather than new work."""
        return bool(result.skipped if self.shards else result.reused)


# ------------------------------------------------------------ loaders


def _image_config(name: str) -> Callable[[], type[BaseModel]]:
    def load() -> type[BaseModel]:
        from pipelines.image import configs  # deferred: keeps `vitpipe --help` from loading pydantic models

        return getattr(configs, name)

    return load


def _video_config(name: str) -> Callable[[], type[BaseModel]]:
    def load() -> type[BaseModel]:
        from pipelines.video import configs  # deferred: keeps `vitpipe --help` from loading pydantic models

        return getattr(configs, name)

    return load


def _ingest() -> Callable[..., Any]:
    from pipelines.image import ingest  # deferred: stage modules import torch and Ray

    return ingest.run_ingest


def _pretrain() -> Callable[..., Any]:
    from pipelines.image import pretrain  # deferred: stage modules import torch and Ray

    return pretrain.run_pretrain


def _finetune() -> Callable[..., Any]:
    from pipelines.image import finetune  # deferred: stage modules import torch and Ray

    return finetune.run_finetune


def _evaluate() -> Callable[..., Any]:
    from pipelines.image import evaluate  # deferred: stage modules import torch and Ray

    return evaluate.run_evaluate


def _embed() -> Callable[..., Any]:
    from pipelines.image import embed  # deferred: stage modules import torch and Ray

    return embed.run_embed


def _video_ingest() -> Callable[..., Any]:
    from pipelines.video import ingest  # deferred: stage modules import torch and Ray

    return ingest.run_video_ingest


def _video_features() -> Callable[..., Any]:
    from pipelines.video import features  # deferred: stage modules import torch and Ray

    return features.run_video_features


def _video_train() -> Callable[..., Any]:
    from pipelines.video import train  # deferred: stage modules import torch and Ray

    return train.run_video_train


# ------------------------------------------------------------ key metrics


def _counted(noun: str) -> Callable[[Any], str]:
    return lambda result: f"{noun}={result.counts[noun]} rejected={result.counts['rejected']}"


def _features_metric(result: Any) -> str:
    return f"videos={result.counts['videos']} feature_dim={result.manifest['feature_dim']}"


def _pretrain_metric(result: Any) -> str:
    top1 = result.metrics.get("val_top1")
    return f"val_top1={top1:.4f}" if top1 is not None else f"train_loss={result.metrics.get('train_loss', float('nan')):.4f}"


def _finetune_metric(result: Any) -> str:
    return f"test_accuracy={result.test_accuracy:.4f}" if result.test_accuracy is not None else ""


def _evaluate_metric(result: Any) -> str:
    return " ".join(f"{k}-shot={v:.3f}" for k, v in sorted(result.accuracy.items()))


def _embed_metric(result: Any) -> str:
    return f"images={result.counts['images']} embedding_dim={result.manifest['embedding_dim']}"


def _video_train_metric(result: Any) -> str:
    return " ".join(f"{key}={result.metrics[key]:.4f}" for key in ("full_video_top1", "multiview_top1")
                    if key in result.metrics)


def _supervised(config: Mapping[str, Any]) -> bool:
    return config.get("objective", "supervised") != "mae"  # MAE reads pixels alone


# ------------------------------------------------------------ the registry

STAGES: dict[str, Stage] = {
    "ingest": Stage(_image_config("IngestConfig"), _ingest, {}, _counted("images"), shards=True,
                    takes_ray_address=False, takes_force=True, from_file=False),
    "pretrain": Stage(_image_config("PretrainConfig"), _pretrain, {"ingest": Fill("data", "output")},
                      _pretrain_metric, takes_ingest_run=True, needs_labels=_supervised),
    "finetune": Stage(_image_config("FinetuneConfig"), _finetune,
                      {"ingest": Fill("data", "output"), "pretrain": Fill("init", "final_checkpoint"),
                       RUN: Fill("init", "ref")}, _finetune_metric, needs_labels=lambda config: True),
    "evaluate": Stage(_image_config("EvaluateConfig"), _evaluate,
                      {"ingest": Fill("data", "output"), "pretrain": Fill("init", "final_checkpoint"),
                       "finetune": Fill("init", "model_uri"), RUN: Fill("init", "ref")},
                      _evaluate_metric, takes_ray_address=False, needs_labels=lambda config: True),
    # The pooled features of every image of an ingest output, from a pretrain or fine-tune run (or any reference).
    "embed": Stage(_image_config("EmbedConfig"), _embed,
                   {"ingest": Fill("data", "output"), "pretrain": Fill("init", "final_checkpoint"),
                    "finetune": Fill("init", "model_uri"), RUN: Fill("init", "ref")},
                   _embed_metric, takes_force=True),
    "video_ingest": Stage(_video_config("VideoIngestConfig"), _video_ingest, {}, _counted("videos"), shards=True,
                          takes_ray_address=False, takes_force=True, from_file=False),
    # Per-frame features of a video ingest output, from the backbone of a pretrain run (or any run/model reference).
    "video_features": Stage(_video_config("VideoFeaturesConfig"), _video_features,
                            {"video_ingest": Fill("data", "output"), "pretrain": Fill("init", "final_checkpoint"),
                             RUN: Fill("init", "ref")}, _features_metric, shards=True, takes_force=True),
    # A VTN's 2-D backbone starts from an image pretrain run (or any run/model reference); its data are
    # frames (video_ingest) or precomputed features (video_features: the temporal encoder trains alone).
    "video_train": Stage(_video_config("VideoTrainConfig"), _video_train,
                         {"video_ingest": Fill("data", "output"), "video_features": Fill("data", "output"),
                          "pretrain": Fill("init", "final_checkpoint"), RUN: Fill("init", "ref")},
                         _video_train_metric, takes_ingest_run=True),
}
KINDS: tuple[str, ...] = tuple(STAGES)


__all__ = ["KINDS", "RUN", "STAGES", "Fill", "Stage"]
