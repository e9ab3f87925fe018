"""Run a pipeline spec: its stages in dependency order, on the Ray cluster this process is connected to.

One MLflow parent run per pipeline (reopened when the same resolved spec runs
again); every stage is a child run of it, fine-tune trials nested one level
lower. A stage whose resolved config and inputs match a finished run is reused,
not rerun: each stage keys its run on a hash of its config, and its inputs enter
that config (data URI and manifest hash, `runs:/<upstream run>/...`), so a
changed upstream changes every dependent's identity. A stage that fails stops
its dependents; finished outputs stay as they are, and the next run of the
pipeline starts where this one stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipelines.core import tracking
from pipelines.core.errors import VitpipeError
from pipelines.core.cluster import connect
from pipelines.core.uris import strip_userinfo
from pipelines.spec import INGEST_KINDS, PipelineSpec

logger = logging.getLogger("vitpipe.runner")

PIPELINE_STAGE = "pipeline"
TAG_PIPELINE = "vitpipe.pipeline"
TAG_STAGE_NAME = "vitpipe.stage_name"
TAG_UPSTREAM = "vitpipe.upstream_runs"  # "stage=run_id,..." of the stage's upstream stages


@dataclass
class StageRow:
    """One line of the summary table."""

    stage: str
    kind: str
    status: str  # done | reused | failed | skipped
    seconds: float = 0.0
    metric: str = ""  # the stage's key figure, e.g. "test_accuracy=0.95"
    run_id: str = ""
    error: str = ""


@dataclass
class PipelineResult:
    """What a pipeline run did, stage by stage."""

    name: str
    run_id: str
    rows: list[StageRow] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.status in ("done", "reused") for r in self.rows)

    def table(self) -> str:
        """The summary as aligned text columns."""
        header = ("stage", "kind", "status", "duration", "key metric", "run id")
        return format_table(header, [
            (r.stage, r.kind, r.status, f"{r.seconds:.1f}s", r.metric or r.error, r.run_id) for r in self.rows
        ])


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Rows of text as left-aligned columns under `header`."""
    lines = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _key_metric(kind: str, result: Any) -> str:
    if kind == "video_features":
        return f"videos={result.counts['videos']} feature_dim={result.manifest['feature_dim']}"
    if kind in INGEST_KINDS:
        noun = "videos" if kind == "video_ingest" else "images"
        return f"{noun}={result.counts[noun]} rejected={result.counts['rejected']}"
    if kind == "pretrain":
        top1 = result.metrics.get("val_top1")
        return f"val_top1={top1:.4f}" if top1 is not None else f"train_loss={result.metrics.get('train_loss', float('nan')):.4f}"
    if kind == "finetune":
        return f"test_accuracy={result.test_accuracy:.4f}" if result.test_accuracy is not None else ""
    if kind == "evaluate":
        return " ".join(f"{k}-shot={v:.3f}" for k, v in sorted(result.accuracy.items()))
    if kind == "video_train":
        return " ".join(f"{key}={result.metrics[key]:.4f}" for key in ("full_video_top1", "multiview_top1")
                        if key in result.metrics)
    return ""


def _reused(kind: str, result: Any) -> bool:
    return bool(result.skipped if kind in INGEST_KINDS else result.reused)


def _run_ingest_stage(kind: str, config: Any, client: Any, experiment: str, parent_run_id: str,
                      forced: str = "") -> tuple[Any, str]:
    """Ingests (and the video features stage) have no tracking of their own: the runner records each as a
    child run with its manifest."""
    if kind == "video_ingest":
        from pipelines.video.ingest import run_video_ingest as run
    elif kind == "video_features":
        from pipelines.video.features import run_video_features as run
    else:
        from pipelines.image.ingest import run_ingest as run

    result = run(config, force=bool(forced))
    manifest = result.manifest
    identity = {"output": config.output, "content_hash": manifest.get("content_hash", "")}
    digest = tracking.config_hash({**identity, "forced": forced} if forced else identity)
    run_id, previous = tracking.start_stage_run(
        client, experiment, kind, digest, run_name=f"{kind}-{digest[:12]}", parent_run_id=parent_run_id,
        tags={"vitpipe.data_uri": strip_userinfo(config.output),
              "vitpipe.manifest_hash": str(manifest.get("content_hash", ""))},
    )
    if previous != "FINISHED":
        tracking.log_params(client, run_id, config.model_dump(mode="json"))
        tracking.log_dict_artifact(client, run_id, manifest, "manifest.json")
        tracking.end_run(client, run_id, ok=True)
    return result, run_id


def _run_stage(kind: str, config: Any, ray_address: str | None) -> Any:
    if kind == "pretrain":
        from pipelines.image.pretrain import run_pretrain

        return run_pretrain(config, ray_address=ray_address)
    if kind == "finetune":
        from pipelines.image.finetune import run_finetune

        return run_finetune(config, ray_address=ray_address)
    if kind == "video_train":
        from pipelines.video.train import run_video_train

        return run_video_train(config, ray_address=ray_address)
    from pipelines.image.evaluate import run_evaluate

    return run_evaluate(config)


def check_forced(spec: PipelineSpec, force: Iterable[str]) -> set[str]:
    """The stage names given to `--force`, each checked to be a stage of `spec`."""
    names = set(force)
    unknown = sorted(names - set(spec.stages))
    if unknown:
        raise VitpipeError(f"--force {unknown[0]}: pipeline {spec.name!r} has no such stage; "
                           f"its stages are {', '.join(spec.stages)}")
    return names


def run_pipeline(spec: PipelineSpec, *, ray_address: str | None = None, force: Iterable[str] = ()) -> PipelineResult:
    """Run every stage of `spec` in dependency order; returns the summary (also printed by the CLI and logged).

    Stages named in `force` run again even when a finished run has their identity:
    an ingest rewrites its shards, a tracked stage starts a new run under a new
    name (so its dependents, whose inputs changed, run again too).
    """
    from mlflow.tracking import MlflowClient

    forced_stages = check_forced(spec, force)
    stamp = time.strftime("%Y%m%d-%H%M%S")  # names this invocation's forced runs

    connect(ray_address)
    tracking_uri = spec.resolved_tracking_uri()
    client = MlflowClient(tracking_uri)
    resolved = {name: spec.resolved_config(name) for name in spec.order()}
    inputs = {name: [s.ref for s in spec.inputs_of(name)] for name in spec.order()}
    digest = tracking.config_hash({"name": spec.name, "stages": resolved, "inputs": inputs})
    parent, previous = tracking.start_stage_run(
        client, spec.experiment, PIPELINE_STAGE, digest, run_name=spec.name, tags={TAG_PIPELINE: spec.name}
    )
    if previous != "FINISHED":
        tracking.log_dict_artifact(client, parent, spec.model_dump(mode="json"), "spec.yaml")
    pipeline = PipelineResult(spec.name, parent)
    stage_runs: dict[str, str] = {}
    for name in spec.order():
        kind = spec.stages[name].kind
        blocked = [up for up in spec.upstream(name) if up not in pipeline.outputs]
        if blocked:
            pipeline.rows.append(StageRow(name, kind, "skipped", error=f"upstream {', '.join(blocked)} did not finish"))
            continue
        start = time.monotonic()
        logger.info("stage %s (%s): starting", name, kind)
        try:
            config = spec.config_for(name, pipeline.outputs)
            forced = stamp if name in forced_stages else ""
            if kind in INGEST_KINDS:
                result, run_id = _run_ingest_stage(kind, config, client, spec.experiment, parent, forced)
            else:
                update: dict[str, Any] = {"parent_run_id": parent}
                if forced:  # a new name is a new identity: a new run, new checkpoints, nothing resumed
                    update["run_name"] = f"{name}-forced-{forced}"
                ingest_runs = [stage_runs[up] for up in spec.upstream(name) if spec.stages[up].kind in INGEST_KINDS]
                if kind in ("pretrain", "video_train") and ingest_runs:
                    update["ingest_run_id"] = ingest_runs[0]
                result = _run_stage(kind, config.model_copy(update=update), ray_address)
                run_id = result.run_id
            upstream = ",".join(f"{up}={stage_runs[up]}" for up in spec.upstream(name))
            tracking.set_tags(client, run_id, {TAG_STAGE_NAME: name, **({TAG_UPSTREAM: upstream} if upstream else {})})
        except (VitpipeError, ValueError) as err:
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            logger.error("stage %s failed: %s", name, message)
            logger.debug("stage %s failed", name, exc_info=True)  # the traceback goes to the command's log file
            pipeline.rows.append(StageRow(name, kind, "failed", time.monotonic() - start, error=message))
            continue
        stage_runs[name] = run_id
        pipeline.outputs[name] = result
        status = "reused" if _reused(kind, result) else "done"
        logger.info("stage %s (%s): %s in %.1fs, run %s", name, kind, status, time.monotonic() - start, run_id)
        pipeline.rows.append(StageRow(name, kind, status, time.monotonic() - start, _key_metric(kind, result), run_id))
    summary = [vars(row) for row in pipeline.rows]
    tracking.log_dict_artifact(client, parent, {"stages": summary}, "summary.json")
    client.log_text(parent, pipeline.table() + "\n", "summary.txt")
    tracking.end_run(client, parent, pipeline.ok)
    return pipeline


def pipeline_runs(tracking_uri: str | None = None, limit: int = 50) -> list[dict[str, str]]:
    """The newest pipeline runs in the tracking store, across experiments: name, status, start, stages, run id."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking.resolve_tracking_uri(tracking_uri))
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    if not experiments:
        return []
    runs = client.search_runs(experiments, filter_string=f"tags.`{tracking.TAG_STAGE}` = '{PIPELINE_STAGE}'",
                              order_by=["attributes.start_time DESC"], max_results=limit)
    rows = []
    for run in runs:
        children = client.search_runs([run.info.experiment_id],
                                      filter_string=f"tags.`{tracking.TAG_PARENT}` = '{run.info.run_id}'")
        rows.append({
            "pipeline": run.data.tags.get(TAG_PIPELINE, run.info.run_name or ""),
            "status": run.info.status,
            "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(run.info.start_time / 1000)),
            "stages": str(len(children)),
            "run_id": run.info.run_id,
        })
    return rows


__all__ = ["PipelineResult", "StageRow", "format_table", "pipeline_runs", "run_pipeline"]
