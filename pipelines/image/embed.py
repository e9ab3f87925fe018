"""The embed stage: the pooled features of every image of an ingest output, stored as Parquet shards.

The model comes from anything fine-tuning and few-shot evaluation start from
(`init`: a pretrain or fine-tune run, `runs:/`, `models:/`, a checkpoint
directory; `pipelines.image.frozen_model`). Ray Data reads the ingest's
shards and a pool of actors (a callable class, so each loads the model once,
on a GPU of its own where the cluster has GPUs) turns each batch of images
into `VisionTransformer.pooled_features`; the driver writes one embedding
shard per ingest shard, atomically. Images are prepared as few-shot
evaluation prepares them: resized to `resolution` when it differs from the
stored size, then normalised.

Layout under `output` (the ingest's conventions, `pipelines.core.shards`)::

    shards/shard-<name>.parquet   one row per image, named as the ingest shard it comes from
    manifest.json                 format "vitpipe-embeddings/1", model, dim, source, counts, shards, content hash
    _SUCCESS                      written last; holds the fingerprint of the finished run

Columns: `key`, `embedding` (fixed-size list of float32), `label` (int32;
only when the ingest is labeled), `split`. A rerun with the same data, model
weights and settings does nothing; an interrupted run reuses the shards it
finished. The stage is one MLflow run (params, images, images/s, the manifest).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import time
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel

import vit
from pipelines.core import shards, tracking
from pipelines.core.cluster import connect
from pipelines.core.datasets import read_each_shard
from pipelines.core.stage_config import load_stage_config
from pipelines.core.stage_run import stage_run
from pipelines.core.storage import S3Settings, open_store
from pipelines.core.uris import resolve_tracking_uri, strip_userinfo
from pipelines.image.data import normalize, patches_array
from pipelines.image.embeddings import FORMAT, rows_hash, schema
from pipelines.image.frozen_model import load_frozen_model
from pipelines.image.patches import resize_patches
from pipelines.training.step import resolve_precision
from pipelines.image.configs import EmbedConfig

logger = logging.getLogger("vitpipe.embed")  # under "vitpipe": its handlers scrub credentials
STAGE = "embed"
# Fields that do not change the embeddings stored, so they stay out of the run's identity. `num_gpus` enters
# as the device it resolves to; `data` as the source's content hash; `init` also as the weights' hash.
NOT_IDENTITY = {
    "endpoint_url", "tracking_uri", "experiment", "parent_run_id",  # where things are read and recorded
    "batch_size", "num_workers", "cpus_per_worker",  # how fast
    "compression",  # how shards are encoded on disk: the embeddings read back are the same
}
# What decides the rows written (the output's fingerprint): not where they go or how the run is named.
CONTENT = ("format", "data", "weights", "model_config", "resolution", "precision", "device")

__all__ = ["NOT_IDENTITY", "EmbedResult", "PooledFeatures", "load_config", "run_embed",
           "run_identity"]


class EmbedResult(BaseModel):
    """What the stage hands on: where the embeddings are, and its MLflow run."""

    run_id: str
    output: str
    manifest: dict[str, Any]
    counts: dict[str, int]
    shards_written: int
    shards_reused: int
    images_per_s: float | None  # of the images embedded by this execution; None when nothing was computed
    reused: bool  # a finished run with this identity, and its output intact: nothing was done


def load_config(source: str | os.PathLike[str] | dict[str, Any], **overrides: Any) -> EmbedConfig:
    """An `EmbedConfig` from a YAML/JSON file or a dict, with one-line errors."""
    return load_stage_config(EmbedConfig, STAGE, source, overrides)


# ---------------------------------------------------------------- the actors


class PooledFeatures:
    """Ray Data UDF (one per actor): ingest rows → `key`, `embedding`, [`label`,] `split`, `path` rows."""

    def __init__(self, model: list[Any], layout: dict[str, Any], size: int, device: str, bf16: bool, threads: int,
                 labeled: bool) -> None:
        import ray
        import torch

        torch.set_num_threads(threads)
        ref = model[0]  # in a list, so Ray hands over the reference and the actor fetches the model once
        self.device = torch.device(device)  # "cuda": Ray gave this actor a GPU and set CUDA_VISIBLE_DEVICES to it
        self.model = (ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref).eval().to(self.device)
        self.layout, self.size, self.bf16, self.labeled = layout, size, bf16, labeled

    def embed(self, stored: np.ndarray) -> np.ndarray:
        """float32 `(B, D)` pooled features of uint8 patch sequences as the ingest stored them."""
        import torch

        p, size = self.layout["patch_size"], self.size
        if size != self.layout["image_size"] and len(stored):
            stored = resize_patches(stored, p, tuple(self.layout["grid"]), size)
        x = torch.from_numpy(normalize(stored.reshape(len(stored), (size // p) ** 2, -1))).to(self.device)
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.model.pooled_features(x).float().cpu().numpy()

    def __call__(self, table: pa.Table) -> pa.Table:
        stored = patches_array(table.column("patches"), self.layout["num_patches"], self.layout["patch_dim"])
        features = self.embed(stored)
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1), pa.float32()),
                                                      int(self.model.num_features))
        columns = {"key": table.column("key"), "embedding": embedding}
        if self.labeled:
            columns["label"] = table.column("label")
        columns["split"] = table.column("split")
        # Which ingest shard each row came from (Ray Data's `include_paths`): the driver groups rows by it.
        columns["path"] = pa.array([posixpath.basename(p) for p in table.column("path").to_pylist()])
        return pa.table(columns)


# ---------------------------------------------------------------- identity


def run_identity(config: EmbedConfig, manifest: dict[str, Any], weights: str, model_config: dict[str, Any],
                 resolution: int, precision: str, device: str) -> dict[str, Any]:
    """What decides this execution: the config's identity fields, the data's content hash, the model's weights
    hash and architecture, and the resolution, precision and device they run at (resolved)."""
    identity = tracking.redact(config.model_dump(mode="json", exclude=NOT_IDENTITY | {"num_gpus"}))
    identity.update(format=FORMAT, data=manifest.get("content_hash"), weights=weights, model_config=model_config,
                    resolution=resolution, precision=precision, device=device)
    return identity


def _resolve_device(config: EmbedConfig) -> tuple[float, str, str]:
    """GPUs per actor, the device type they make, and the precision the forward runs at there."""
    import ray
    import torch

    gpus = config.num_gpus if config.num_gpus is not None else float(ray.cluster_resources().get("GPU", 0) > 0)
    device = "cuda" if gpus > 0 else "cpu"
    if config.precision != "auto" or device == "cpu":
        bf16 = resolve_precision(config.precision, torch.device("cpu")) is not None or config.precision == "bf16"
    else:
        bf16 = True  # CUDA GPUs that Ray schedules on compute bf16; the driver may have none to ask
    return gpus, device, "bf16" if bf16 else "fp32"


# ---------------------------------------------------------------- the stage


def run_embed(config: EmbedConfig, *, force: bool = False, ray_address: str | None = None) -> EmbedResult:
    """Embed every image of `config.data` into `config.output` (or find it done); one MLflow run.

    `force` recomputes every shard. Raises `VitpipeError`/`StorageError` (one line naming the URI) when the
    data is not a finished ingest output or the output cannot be written, and a one-line ValueError for a
    model that cannot read the data.
    """
    from mlflow.tracking import MlflowClient

    config.check_output_apart("embeddings")  # again: a config copied with another output is not revalidated
    manifest = shards.read_manifest(config.data, endpoint_url=config.endpoint_url, expect=shards.IMAGES)
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    start, size = load_frozen_model(config, manifest, tracking_uri)
    model = vit.at_resolution(start.model, size, 0)
    connect(ray_address)
    gpus, device, precision = _resolve_device(config)
    identity = run_identity(config, manifest, vit.weights_hash(start.model), model.config.to_dict(), size,
                            precision, device)
    tags = {"vitpipe.data_uri": strip_userinfo(config.data), "vitpipe.manifest_hash": str(manifest.get("content_hash")),
            "vitpipe.output_uri": strip_userinfo(config.output), "vitpipe.init": start.source,
            **({"vitpipe.pretrain_run_id": start.source_run_id} if start.source_run_id else {})}
    client = MlflowClient(tracking_uri)
    with stage_run(client, STAGE, config, identity, tags=tags) as run:
        if not run.finished:
            run.log_config({**config.model_dump(mode="json"), "resolution": size, "precision": precision,
                            "device": device, "num_gpus": gpus})
        work = _Work(config, manifest, start, model, identity, gpus)
        result = _produce(work, force=force)
        result = result.model_copy(update={"run_id": run.run_id, "reused": run.finished and result.shards_written == 0})
        if not run.finished:
            _log_result(client, run.run_id, result)
    return result


class _Work:
    """What one execution embeds, with what, and where it writes."""

    def __init__(self, config: EmbedConfig, manifest: dict[str, Any], start: Any, model: Any,
                 identity: dict[str, Any], gpus: float) -> None:
        self.config, self.manifest, self.start, self.model, self.identity, self.gpus = (
            config, manifest, start, model, identity, gpus)
        self.fingerprint = shards.fingerprint({k: identity[k] for k in CONTENT})
        self.labeled = bool(manifest.get("labeled", True))
        self.dim = int(model.num_features)


def _produce(work: _Work, *, force: bool) -> EmbedResult:
    """The output for `work.fingerprint`: found finished, or its missing shards computed and the manifest written."""
    config, began = work.config, time.perf_counter()
    source = open_store(config.data, endpoint_url=config.endpoint_url)
    out = open_store(config.output, endpoint_url=config.endpoint_url)
    shards.check_output(out, FORMAT)
    done = None if force else shards.finished_manifest(out, work.fingerprint)
    if done is not None:
        logger.info("%s: %s is complete for this model and data; nothing to do", STAGE, config.output)
        return EmbedResult(run_id="", output=config.output, manifest=done, counts=done["counts"], shards_written=0,
                           shards_reused=len(done["shards"]), images_per_s=None, reused=True)
    out.delete(shards.SUCCESS)  # whatever happens next, an older marker no longer describes the output
    keys = [entry["path"] for entry in work.manifest["shards"]]
    summaries: dict[str, dict[str, Any]] = {}
    for key in [] if force else keys:
        reused = shards.existing_summary(out, key, _shard_fingerprint(work.fingerprint, key))
        if reused is not None:  # finished by an earlier, interrupted execution
            summaries[key] = reused
    todo = [key for key in keys if key not in summaries]
    computing = time.perf_counter()
    if todo:
        summaries.update(_compute(work, source, out, todo))
    seconds = time.perf_counter() - computing
    ordered = [summaries[k] for k in keys]
    shards.remove_stale_shards(out, set(keys))
    manifest = _assemble_manifest(work, ordered)
    out.write(shards.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    shards.write_success(out, work.fingerprint, manifest["content_hash"])
    written = [s for s in ordered if not s.get("reused")]
    images = sum(s["rows"] for s in written)
    logger.info("%s: %d images in %d shards (%d written, %d reused) -> %s in %.1fs", STAGE,
                manifest["counts"]["images"], len(ordered), len(written), len(ordered) - len(written), config.output,
                time.perf_counter() - began)
    return EmbedResult(run_id="", output=config.output, manifest=manifest, counts=manifest["counts"],
                       shards_written=len(written), shards_reused=len(ordered) - len(written),
                       images_per_s=images / seconds if images and seconds > 0 else None, reused=False)


def _shard_fingerprint(fingerprint: str, key: str) -> str:
    return shards.fingerprint({"run": fingerprint, "source_shard": key})


def _compute(work: _Work, source: Any, out: Any, keys: list[str]) -> dict[str, dict[str, Any]]:
    """Embeddings of the ingest shards `keys` on the actor pool; each shard is written once all its rows came."""
    stream = functools.partial(_embedded_batches, work)
    return {key: _write(work, out, key, parts) for key, parts in shards.regroup(source, keys, stream, unit="images")}


def _embedded_batches(work: _Work, filesystem: Any, paths: list[str]) -> Any:
    """The embedding rows of the ingest shards at `paths` (with each row's shard `path`), as the actor pool
    streams them back."""
    import ray

    config, manifest = work.config, work.manifest
    layout = {k: manifest[k] for k in ("patch_size", "image_size", "grid", "num_patches", "patch_dim")}
    columns = ["patches", "key", "split", *(["label"] if work.labeled else [])]
    ds = read_each_shard(paths, filesystem, columns, readers=2 * config.num_workers)  # two shards ready per actor
    ds = ds.map_batches(
        PooledFeatures,
        fn_constructor_kwargs=dict(model=[ray.put(work.model)], layout=layout, size=work.identity["resolution"],
                                   device=work.identity["device"], bf16=work.identity["precision"] == "bf16",
                                   threads=max(1, round(config.cpus_per_worker)), labeled=work.labeled),
        batch_size=config.batch_size, batch_format="pyarrow", concurrency=config.num_workers,
        num_cpus=config.cpus_per_worker, num_gpus=work.gpus,
    )
    return ds.iter_batches(batch_format="pyarrow", batch_size=None)


def _write(work: _Work, out: Any, key: str, parts: list[pa.Table]) -> dict[str, Any]:
    """Write one embedding shard atomically (rows in key order), its summary in the Parquet footer."""
    target = schema(work.dim, work.labeled)
    table = pa.concat_tables(parts) if parts else target.empty_table()
    table = table.select(target.names).cast(target).sort_by("key")
    summary = {"key": key, "plan_fingerprint": _shard_fingerprint(work.fingerprint, key), "rows": table.num_rows,
               "split": dict(Counter(table.column("split").to_pylist())), "hash": rows_hash(table)}
    shards.write_shard(out, key, table, summary, work.config.compression)
    return summary


def _assemble_manifest(work: _Work, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    config, source, start = work.config, work.manifest, work.start
    counts = {"images": sum(s["rows"] for s in summaries)}
    for split in shards.SPLITS:
        counts[split] = sum(s["split"].get(split, 0) for s in summaries)
    tree = {"identity": {k: work.identity[k] for k in CONTENT}, "shards": [s["hash"] for s in summaries]}
    public = tracking.redact(config.model_dump(mode="json"))  # the manifest outlives the run: no `user:password@`
    public["endpoint_url"] = S3Settings.resolve(config.endpoint_url).public()["endpoint_url"]
    return {
        "format": FORMAT,
        "source": {"uri": strip_userinfo(config.data), "format": source.get("format"),
                   "content_hash": source.get("content_hash")},
        "model": {"init": start.source, "run_id": start.source_run_id, "weights_hash": work.identity["weights"],
                  "config": work.identity["model_config"]},
        "embedding_dim": work.dim,
        "resolution": work.identity["resolution"],
        "precision": work.identity["precision"],
        "device": work.identity["device"],
        "labeled": work.labeled,
        "classes": source.get("classes", {}),
        "counts": counts,
        "shards": [{"path": s["key"], "rows": s["rows"], "split": s["split"]} for s in summaries],
        "content_hash": "sha256:" + hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest(),
        "fingerprint": work.fingerprint,
        "config": public,
    }


def _log_result(client: Any, run_id: str, result: EmbedResult) -> None:
    """The row count, the dimension and the speed as metrics, and the manifest as an artifact."""
    metrics = {"images": float(result.counts["images"]), "embedding_dim": float(result.manifest["embedding_dim"]),
               "shards_written": float(result.shards_written), "shards_reused": float(result.shards_reused)}
    if result.images_per_s is not None:
        metrics["images_per_s"] = result.images_per_s
    buffer = tracking.MetricBuffer(client, run_id)
    buffer.add(metrics, 0)
    buffer.flush()
    tracking.log_dict_artifact(client, run_id, result.manifest, "manifest.json")
