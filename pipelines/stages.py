"""The stage registry: every stage kind, the code that runs it, what it consumes and what it produces.

The spec (`pipelines.spec`), the runner (`pipelines.runner`) and the CLI
(`pipelines.cli`) all read `STAGES`; nothing else turns a kind into code. Stage
modules import torch and Ray, so each kind names a small loader that imports
its module on first use: `vitpipe --help` and spec validation stay fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel

RUN = "run"  # the pseudo-kind of an input that is an existing MLflow run or model, not a stage


class Fill(NamedTuple):
    """What an input gives its stage: `field` set from the upstream result's `source` attribute."""

    field: str
    source: str  # attribute of the upstream stage's result; "ref" = the input string itself


Loaded = tuple[type[BaseModel], Callable[..., Any]]  # a stage's config model and run function


@dataclass(frozen=True)
class Stage:
    """One stage kind.

    `inputs` says which config field each input fills, by the input's kind; a kind
    missing from it cannot be an input of this stage. A stage with `shards` writes
    shards plus a manifest and has no tracking of its own (the runner records it as
    a child run, and `result.skipped` says it was reused); any other stage tracks its
    own MLflow run (`result.run_id`, `result.reused`).
    """

    load: Callable[[], Loaded]  # imports the stage module on first call (later calls are cheap)
    inputs: dict[str, Fill]
    metric: Callable[[Any], str]  # the summary table's key figure of a result
    shards: bool = False
    takes_ray_address: bool = True  # run(config, ray_address=...)
    takes_force: bool = False  # run(config, force=...): rewrite a finished output
    takes_ingest_run: bool = False  # its config records the run id of its ingest input (`ingest_run_id`)
    from_file: bool = True  # `vitpipe <kind> CONFIG` reads a config file; ingests take options instead

    @property
    def config_model(self) -> type[BaseModel]:
        """The stage's pydantic config model."""
        return self.load()[0]

    @property
    def run(self) -> Callable[..., Any]:
        """The stage's run function: `run(config, [ray_address=...], [force=...]) -> result`."""
        return self.load()[1]

    def reused(self, result: Any) -> bool:
        """True when `result` came from an earlier finished run rather than new work."""
        return bool(result.skipped if self.shards else result.reused)


# ------------------------------------------------------------ loaders


def _ingest() -> Loaded:
    from pipelines.image import ingest  # deferred: stage modules import torch and Ray

    return ingest.IngestConfig, ingest.run_ingest


def _pretrain() -> Loaded:
    from pipelines.image import pretrain  # deferred: stage modules import torch and Ray

    return pretrain.PretrainConfig, pretrain.run_pretrain


def _finetune() -> Loaded:
    from pipelines.image import finetune  # deferred: stage modules import torch and Ray

    return finetune.FinetuneConfig, finetune.run_finetune


def _evaluate() -> Loaded:
    from pipelines.image import evaluate  # deferred: stage modules import torch and Ray

    return evaluate.EvaluateConfig, evaluate.run_evaluate


def _embed() -> Loaded:
    from pipelines.image import embed  # deferred: stage modules import torch and Ray

    return embed.EmbedConfig, embed.run_embed


def _video_ingest() -> Loaded:
    from pipelines.video import ingest  # deferred: stage modules import torch and Ray

    return ingest.VideoIngestConfig, ingest.run_video_ingest


def _video_features() -> Loaded:
    from pipelines.video import features  # deferred: stage modules import torch and Ray

    return features.VideoFeaturesConfig, features.run_video_features


def _video_train() -> Loaded:
    from pipelines.video import train  # deferred: stage modules import torch and Ray

    return train.VideoTrainConfig, train.run_video_train


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


# ------------------------------------------------------------ the registry

STAGES: dict[str, Stage] = {
    "ingest": Stage(_ingest, {}, _counted("images"), shards=True, takes_ray_address=False, takes_force=True,
                    from_file=False),
    "pretrain": Stage(_pretrain, {"ingest": Fill("data", "output")}, _pretrain_metric, takes_ingest_run=True),
    "finetune": Stage(_finetune, {"ingest": Fill("data", "output"), "pretrain": Fill("init", "final_checkpoint"),
                                  RUN: Fill("init", "ref")}, _finetune_metric),
    "evaluate": Stage(_evaluate, {"ingest": Fill("data", "output"), "pretrain": Fill("init", "final_checkpoint"),
                                  "finetune": Fill("init", "model_uri"), RUN: Fill("init", "ref")},
                      _evaluate_metric, takes_ray_address=False),
    # The pooled features of every image of an ingest output, from a pretrain or fine-tune run (or any reference).
    "embed": Stage(_embed, {"ingest": Fill("data", "output"), "pretrain": Fill("init", "final_checkpoint"),
                            "finetune": Fill("init", "model_uri"), RUN: Fill("init", "ref")},
                   _embed_metric, takes_force=True),
    "video_ingest": Stage(_video_ingest, {}, _counted("videos"), shards=True, takes_ray_address=False,
                          takes_force=True, from_file=False),
    # Per-frame features of a video ingest output, from the backbone of a pretrain run (or any run/model reference).
    "video_features": Stage(_video_features, {"video_ingest": Fill("data", "output"),
                                              "pretrain": Fill("init", "final_checkpoint"), RUN: Fill("init", "ref")},
                            _features_metric, shards=True, takes_force=True),
    # A VTN's 2-D backbone starts from an image pretrain run (or any run/model reference); its data are
    # frames (video_ingest) or precomputed features (video_features: the temporal encoder trains alone).
    "video_train": Stage(_video_train, {"video_ingest": Fill("data", "output"), "video_features": Fill("data", "output"),
                                        "pretrain": Fill("init", "final_checkpoint"), RUN: Fill("init", "ref")},
                         _video_train_metric, takes_ingest_run=True),
}
KINDS: tuple[str, ...] = tuple(STAGES)


__all__ = ["KINDS", "RUN", "STAGES", "Fill", "Stage"]
