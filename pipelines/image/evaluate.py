"""The evaluate stage: few-shot linear evaluation of a pretrained ViT (paper §4, "few-shot accuracy").

The cheap probe of a representation: freeze the model, take its pooled
features, and for k images per class (k = 1, 5, 10, 25) fit a ridge regression
to {-1, 1} one-hot targets in closed form; accuracy is that of the argmax on
the query split. Each k is repeated over several random support sets.

Features are computed on the driver in plain PyTorch (no Ray): only the sampled
support images and the query split are read. The stage is one MLflow run that
logs the table, a metric per k, and tags linking the run that produced the
weights and the data manifest.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

import vit
from pipelines.core import tracking
from pipelines.core.errors import VitpipeError
from pipelines.core.uris import is_s3_uri, resolve_tracking_uri, strip_userinfo
from pipelines.core.stage_config import load_stage_config
from pipelines.core.stage_run import finished_run_id, stage_run
from pipelines.core.storage import S3Settings, open_store
from pipelines.core.shards import IMAGES, read_manifest, require_labels
from pipelines.image.labeled_rows import DataSpec, decode_batch, iter_rows
from pipelines.image.frozen_model import frozen_origin, load_frozen_model
from pipelines.training.starting_weights import Origin, origin_identity
from pipelines.core.shards import class_labels, class_names
from pipelines.image.configs import EvaluateConfig

logger = logging.getLogger("vitpipe.evaluate")  # under "vitpipe": its handlers scrub credentials
STAGE = "evaluate"
# Fields that do not change what is measured, so they stay out of the run identity; every other field is in it.
NOT_IDENTITY = {
    "tracking_uri", "experiment", "parent_run_id",  # where the run is recorded
    "batch_size",  # how fast features are computed
}


class EvaluateResult(BaseModel):
    """Few-shot top-1 per k (mean and standard deviation over the repeats)."""

    run_id: str
    accuracy: dict[int, float]
    std: dict[int, float]
    chance: float
    reused: bool = False


# ---------------------------------------------------------------- the probe


def ridge_fit(features: torch.Tensor, labels: torch.Tensor, num_classes: int, l2_reg: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form ridge regression of {-1, 1} one-hot targets on centred features; returns `(W, b)`.

    Solved in whichever of the primal (d×d) or dual (n×n) forms is smaller, in
    float64. `l2_reg` is scaled by the features' mean squared norm, so one value
    fits models of any width and feature scale.
    """
    x = features.double()
    mean = x.mean(0, keepdim=True)
    x = x - mean
    y = -torch.ones(len(labels), num_classes, dtype=torch.float64)
    y[torch.arange(len(labels)), labels] = 1.0
    n, d = x.shape
    lam = l2_reg * float((x * x).sum(1).mean().clamp_min(1e-12))
    if d <= n:
        w = torch.linalg.solve(x.T @ x + lam * torch.eye(d, dtype=x.dtype), x.T @ y)
    else:
        w = x.T @ torch.linalg.solve(x @ x.T + lam * torch.eye(n, dtype=x.dtype), y)
    b = y.mean(0) - (mean @ w).squeeze(0)
    return w, b


def few_shot_accuracy(support: tuple[torch.Tensor, torch.Tensor], query: tuple[torch.Tensor, torch.Tensor],
                      num_classes: int, l2_reg: float) -> float:
    """Top-1 on `query` of the ridge probe fitted on `support` (each a `(features, labels)` pair)."""
    w, b = ridge_fit(support[0], support[1], num_classes, l2_reg)
    predicted = (query[0].double() @ w + b).argmax(-1)
    return float((predicted == query[1]).double().mean())


def sample_support(labels: np.ndarray, shots: int, rng: np.random.Generator, classes: Mapping[int, str]) -> np.ndarray:
    """Indices of `shots` random images of every class in `classes` (label → name: the classes there are,
    `shards.class_labels`); a ValueError names a class with too few."""
    chosen = []
    for c, name in classes.items():
        idx = np.flatnonzero(labels == c)
        if len(idx) < shots:
            raise ValueError(f"shots: {shots}-shot needs {shots} support images of every class; class {name!r} has {len(idx)}")
        chosen.append(rng.choice(idx, size=shots, replace=False))
    return np.concatenate(chosen)


@torch.no_grad()
def embed(model: torch.nn.Module, patches: np.ndarray, batch_size: int) -> torch.Tensor:
    """Pooled features of patch sequences, in batches, on the CPU."""
    model.eval()
    out = [model.pooled_features(torch.from_numpy(patches[i : i + batch_size])) for i in range(0, len(patches), batch_size)]
    return torch.cat(out).float() if out else torch.zeros(0)


def _support_pool(data: Any, split: str) -> tuple[list[str], np.ndarray]:
    """Keys and labels of a split, in key order (labels only: no pixels are read here)."""
    import pyarrow as pa
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    store = open_store(data.uri, data.settings)
    tables = []
    for entry in data.manifest["shards"]:
        if entry.get("split", {}).get(split, 0) > 0:
            fs, path = store.arrow(entry["path"])
            tables.append(pq.read_table(path, filesystem=fs, columns=["key", "label"], filters=pads.field("split") == split))
    if not tables:
        raise VitpipeError(f"{data.uri}: split {split!r} has no images")
    table = pa.concat_tables(tables).sort_by("key")
    return table.column("key").to_pylist(), table.column("label").to_numpy().astype(np.int64)


def _rows_for_keys(data: Any, split: str, keys: list[str], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Decoded rows of `keys` (in that order) from `split`."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    store = open_store(data.uri, data.settings)
    wanted = set(keys)
    found: dict[str, tuple[np.ndarray, int]] = {}
    for entry in data.manifest["shards"]:
        if entry.get("split", {}).get(split, 0) <= 0:
            continue
        fs, path = store.arrow(entry["path"])
        table = pq.read_table(path, filesystem=fs, columns=["patches", "label", "key"], filters=pads.field("split") == split)
        table = table.filter(pc.is_in(table.column("key"), value_set=pa.array(sorted(wanted))))
        if table.num_rows:
            rows = decode_batch(table, manifest=data.manifest, keep="all", holdout=0.0, size=size, aug=None)
            for key, patches, label in zip(table.column("key").to_pylist(), rows["patches"], rows["label"]):
                found[key] = (patches, int(label))
    return np.stack([found[k][0] for k in keys]), np.array([found[k][1] for k in keys], dtype=np.int64)


def few_shot_table(model: torch.nn.Module, data: Any, config: EvaluateConfig, size: int) -> dict[int, list[float]]:
    """Top-1 of every repeat for every k: `{k: [acc, ...]}`."""
    names = class_names(data.manifest)
    present = class_labels(data.manifest)  # support comes from the classes there are: labels may skip ids
    for split in {config.query_split, config.support_split}:
        if int(data.manifest.get("counts", {}).get(split, 0)) == 0:
            raise ValueError(f"{data.uri} has no {split!r} split to use as the {'query' if split == config.query_split else 'support'} set")
    query_parts = [(embed(model, b["patches"], config.batch_size), torch.from_numpy(b["label"]))
                   for b in iter_rows(data, config.query_split, size=size, batch_size=config.batch_size)]
    if not query_parts:
        raise VitpipeError(f"{data.uri}: split {config.query_split!r} has no images")
    query = (torch.cat([q[0] for q in query_parts]), torch.cat([q[1] for q in query_parts]))
    keys, labels = _support_pool(data, config.support_split)
    rng = np.random.default_rng(config.seed)
    plans = {k: [sample_support(labels, k, rng, present) for _ in range(config.repeats)] for k in config.shots}
    needed = sorted({keys[i] for picks in plans.values() for idx in picks for i in idx})
    patches, _ = _rows_for_keys(data, config.support_split, needed, size)
    features = dict(zip(needed, embed(model, patches, config.batch_size)))
    table: dict[int, list[float]] = {}
    for k, picks in plans.items():
        table[k] = []
        for idx in picks:
            support = (torch.stack([features[keys[i]] for i in idx]), torch.from_numpy(labels[idx]))
            table[k].append(few_shot_accuracy(support, query, len(names), config.l2_reg))
    return table


# ---------------------------------------------------------------- the stage


def load_config(source: str | os.PathLike[str] | dict[str, Any], **overrides: Any) -> EvaluateConfig:
    """A `EvaluateConfig` from a YAML/JSON file or a dict, with one-line errors."""
    return load_stage_config(EvaluateConfig, "evaluate", source, overrides)


def _result_from_run(client: Any, run_id: str, reused: bool) -> EvaluateResult:
    metrics = client.get_run(run_id).data.metrics
    shots = sorted(int(k.split("_")[1].removesuffix("shot")) for k in metrics if k.startswith("fewshot_") and k.endswith("shot_top1"))
    return EvaluateResult(
        run_id=run_id, accuracy={k: metrics[f"fewshot_{k}shot_top1"] for k in shots},
        std={k: metrics.get(f"fewshot_{k}shot_top1_std", 0.0) for k in shots}, chance=metrics.get("chance_top1", 0.0),
        reused=reused,
    )


def _log_table(client: Any, run_id: str, table: dict[int, list[float]], num_classes: int) -> None:
    """The few-shot table as metrics (mean and std per k, and chance) and as `fewshot_table.json`."""
    metrics = {"chance_top1": 1.0 / num_classes}
    for k, accs in table.items():
        metrics[f"fewshot_{k}shot_top1"] = float(np.mean(accs))
        metrics[f"fewshot_{k}shot_top1_std"] = float(np.std(accs))
    buffer = tracking.MetricBuffer(client, run_id)
    buffer.add(metrics, 0)
    buffer.flush()
    client.log_table(run_id, {
        "shots": list(table), "top1_mean": [float(np.mean(v)) for v in table.values()],
        "top1_std": [float(np.std(v)) for v in table.values()], "repeats": [len(v) for v in table.values()],
    }, "fewshot_table.json")
    logger.info("evaluate: %s", ", ".join(f"{k}-shot {np.mean(v):.3f}" for k, v in table.items()))


def run_identity(config: EvaluateConfig, manifest: dict[str, Any], origin: Origin, resolution: int) -> dict[str, Any]:
    """What decides the measurement: the config, the data's content hash, what names the weights (their run or
    their files' digest) and the resolution they are evaluated at."""
    identity = tracking.redact(config.model_dump(mode="json", exclude=NOT_IDENTITY))
    identity.update(data_content_hash=manifest.get("content_hash"), **origin_identity(origin), resolution=resolution)
    return identity


def run_evaluate(config: EvaluateConfig) -> EvaluateResult:
    """Run the few-shot evaluation of `config.init` on `config.data`; one MLflow run, returned as a result."""
    manifest = read_manifest(config.data, endpoint_url=config.endpoint_url, expect=IMAGES)
    # Up front: with no classes the probe failed deep inside, after opening a run, naming neither data nor cause.
    require_labels(manifest, config.data, "few-shot evaluation, which scores class labels,")
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    client = MlflowClient(tracking_uri)
    origin, size = frozen_origin(config, manifest, tracking_uri)
    identity = run_identity(config, manifest, origin, size)
    # A finished evaluation is handed back before the weights are downloaded: only their config was read.
    finished = finished_run_id(client, STAGE, config, identity)
    if finished:
        return _result_from_run(client, finished, reused=True)
    start, size = load_frozen_model(config, manifest, tracking_uri, origin)
    tags = {
        "vitpipe.data_uri": strip_userinfo(config.data), "vitpipe.manifest_hash": str(manifest.get("content_hash", "")),
        "vitpipe.init": start.source, **({"vitpipe.pretrain_run_id": start.source_run_id} if start.source_run_id else {}),
    }
    with stage_run(client, STAGE, config, identity, tags=tags) as run:
        if run.finished:
            return _result_from_run(client, run.run_id, reused=True)
        run.log_config({**config.model_dump(mode="json"), "resolution": size})
        settings = S3Settings.resolve(config.endpoint_url) if is_s3_uri(config.data) else None
        data = DataSpec(config.data, manifest, settings)
        table = few_shot_table(vit.at_resolution(start.model, size, 0), data, config, size)
        _log_table(client, run.run_id, table, len(manifest["classes"]))
    return _result_from_run(client, run.run_id, reused=False)
