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
from pathlib import Path
from typing import Any

from pipelines.core import run_open, run_owner, tracking
from pipelines.core.errors import VitpipeError, error_line
from pipelines.core.cluster import connect
from pipelines.core.uris import resolve_tracking_uri, scrub_userinfo, strip_userinfo
from pipelines.spec import PipelineSpec, check_forced
from pipelines.stages import STAGES

logger = logging.getLogger("vitpipe.runner")

PIPELINE_STAGE = "pipeline"
TAG_PIPELINE = "vitpipe.pipeline"
TAG_STAGE_NAME = "vitpipe.stage_name"
TAG_UPSTREAM = "vitpipe.upstream_runs"  # "stage=run_id,..." of the stage's upstream stages
# On the pipeline run, per forced stage that has not finished: the stamp naming its forced run, so that
# the same command run again resumes that run rather than forcing yet another one.
TAG_FORCED = "vitpipe.forced."


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
    tracking_uri: str  # where the runs are recorded (as the spec resolved it)
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


def run_pipeline(spec: PipelineSpec, *, ray_address: str | None = None, force: Iterable[str] = ()) -> PipelineResult:
    """Run every stage of `spec` in dependency order; returns the summary (also printed by the CLI and logged).

    Stages named in `force` run again even when a finished run has their identity:
    an ingest rewrites its shards, a tracked stage starts a new run under a new
    name (so its dependents, whose inputs changed, run again too).
    """
    from mlflow.tracking import MlflowClient

    forced_stages = check_forced(spec, force)
    tracking_uri = spec.resolved_tracking_uri()
    tracking.check_server(tracking_uri)  # before Ray starts: a server that is not there is answered at once
    connect(ray_address)
    client = MlflowClient(tracking_uri)
    result = PipelineResult(spec.name, _start_pipeline_run(client, spec), tracking_uri)
    context = _Context(spec, client, result, ray_address)
    pipeline = context.pipeline
    try:
        with run_owner.heartbeat(client, pipeline.run_id):
            stamps = forced_stamps(client, pipeline.run_id, forced_stages)
            for name in spec.order():
                pipeline.rows.append(_stage_row(context, name, forced=stamps.get(name, "")))
                if name in stamps and pipeline.rows[-1].status == "done":  # finished: a later --force is new work
                    client.delete_tag(pipeline.run_id, TAG_FORCED + name)
    except BaseException as err:  # a stop, or the driver's own failure: the pipeline run must not stay RUNNING
        tracking.end_unfinished_run(client, pipeline.run_id, err, f"pipeline run {pipeline.run_id}")
        raise
    summary = [vars(row) for row in pipeline.rows]
    tracking.log_dict_artifact(client, pipeline.run_id, {"stages": summary}, "summary.json")
    client.log_text(pipeline.run_id, pipeline.table() + "\n", "summary.txt")
    tracking.end_run(client, pipeline.run_id, pipeline.ok)
    return pipeline


def forced_stamps(client: Any, pipeline_run_id: str, forced: Iterable[str]) -> dict[str, str]:
    """Forced stage -> the stamp that names its forced run: the one a stopped or failed invocation left on
    the pipeline run (so its run resumes), else a new one, recorded there before the stage starts."""
    tags = client.get_run(pipeline_run_id).data.tags
    now = time.strftime("%Y%m%d-%H%M%S")
    stamps = {name: tags.get(TAG_FORCED + name) or now for name in forced}
    if stamps:
        tracking.set_tags(client, pipeline_run_id, {TAG_FORCED + name: stamp for name, stamp in stamps.items()})
    return stamps


@dataclass
class _Context:
    """What every stage of one pipeline run shares."""

    spec: PipelineSpec
    client: Any  # MlflowClient
    pipeline: PipelineResult  # the rows so far and the finished stages' results
    ray_address: str | None

    def run_ids(self) -> dict[str, str]:
        """Finished (done or reused) stage name -> its run id."""
        return {row.stage: row.run_id for row in self.pipeline.rows if row.status in ("done", "reused")}


def _start_pipeline_run(client: Any, spec: PipelineSpec) -> str:
    """Start (or reopen, for the same resolved spec) the pipeline's parent run; returns its id."""
    resolved = {name: spec.resolved_config(name) for name in spec.order()}
    inputs = {name: [s.ref for s in spec.inputs_of(name)] for name in spec.order()}
    digest = tracking.config_hash({"name": spec.name, "stages": resolved, "inputs": inputs})
    parent, previous = run_open.start_stage_run(
        client, spec.experiment, PIPELINE_STAGE, digest, run_name=spec.name, tags={TAG_PIPELINE: spec.name}
    )
    if previous != "FINISHED":
        tracking.log_dict_artifact(client, parent, spec.model_dump(mode="json"), "spec.yaml")
    return parent


def _stage_row(context: _Context, name: str, forced: str) -> StageRow:
    """Run stage `name` (its result goes to the pipeline's outputs) unless an upstream stage did not finish;
    returns its summary row. `forced` (a timestamp, or empty) makes it run again under a new identity."""
    spec, pipeline = context.spec, context.pipeline
    kind = spec.stages[name].kind
    blocked = [up for up in spec.upstream(name) if up not in pipeline.outputs]
    if blocked:
        return StageRow(name, kind, "skipped", error=f"upstream {', '.join(blocked)} did not finish")
    start = time.monotonic()
    logger.info("stage %s (%s): starting", name, kind)
    try:
        result, run_id = _run_stage(context, name, forced)
        runs = context.run_ids()
        upstream = ",".join(f"{up}={runs[up]}" for up in spec.upstream(name))
        tracking.set_tags(context.client, run_id,
                          {TAG_STAGE_NAME: name, **({TAG_UPSTREAM: upstream} if upstream else {})})
    except Exception as err:  # noqa: BLE001  (one stage's failure, whatever it is, must not stop the others)
        known = isinstance(err, (VitpipeError, ValueError))  # already one line naming the thing
        message = (str(err).splitlines() or [type(err).__name__])[0] if known else error_line(err)
        message = scrub_userinfo(message)  # it goes to the printed table and MLflow's summary.txt and .json
        logger.error("stage %s failed: %s", name, message)
        logger.debug("stage %s failed", name, exc_info=True)  # the traceback goes to the command's log file
        return StageRow(name, kind, "failed", time.monotonic() - start, error=message)
    pipeline.outputs[name] = result
    stage = STAGES[kind]
    status = "reused" if stage.reused(result) else "done"
    logger.info("stage %s (%s): %s in %.1fs, run %s", name, kind, status, time.monotonic() - start, run_id)
    return StageRow(name, kind, status, time.monotonic() - start, stage.metric(result), run_id)


def _run_stage(context: _Context, name: str, forced: str) -> tuple[Any, str]:
    """Run one stage on its inputs' outputs; returns its result and its run id."""
    spec = context.spec
    kind = spec.stages[name].kind
    stage = STAGES[kind]
    config = spec.config_for(name, context.pipeline.outputs)
    kwargs: dict[str, Any] = {}
    if stage.takes_force:
        kwargs["force"] = bool(forced)
    if stage.takes_ray_address:
        kwargs["ray_address"] = context.ray_address
    if stage.shards:
        result = stage.run(config, **kwargs)
        return result, _record_shards(context, kind, config, result, forced)
    update: dict[str, Any] = {"parent_run_id": context.pipeline.run_id}
    if forced:  # a new name is a new identity: a new run, new checkpoints, nothing resumed
        update["run_name"] = f"{name}-forced-{forced}"
    runs = context.run_ids()
    ingest_runs = [runs[up] for up in spec.upstream(name) if STAGES[spec.stages[up].kind].shards]
    if stage.takes_ingest_run and ingest_runs:
        update["ingest_run_id"] = ingest_runs[0]
    result = stage.run(config.model_copy(update=update), **kwargs)
    return result, result.run_id


def _record_shards(context: _Context, kind: str, config: Any, result: Any, forced: str) -> str:
    """A stage that writes shards has no tracking of its own: record it as a child run with its manifest."""
    manifest = result.manifest
    identity = {"output": config.output, "content_hash": manifest.get("content_hash", "")}
    digest = tracking.config_hash({**identity, "forced": forced} if forced else identity)
    client = context.client
    run_id, previous = run_open.start_stage_run(
        client, context.spec.experiment, kind, digest, run_name=f"{kind}-{digest[:12]}",
        parent_run_id=context.pipeline.run_id,
        tags={"vitpipe.data_uri": strip_userinfo(config.output),
              "vitpipe.manifest_hash": str(manifest.get("content_hash", ""))},
    )
    if previous != "FINISHED":
        tracking.log_params(client, run_id, config.model_dump(mode="json"))
        tracking.log_dict_artifact(client, run_id, manifest, "manifest.json")
        tracking.end_run(client, run_id, ok=True)
    return run_id


def pipeline_runs(tracking_uri: str | None = None, limit: int = 50) -> list[dict[str, str]]:
    """The newest pipeline runs in the tracking store, across experiments: name, status, start, stages, run id.

    A RUNNING run whose process is gone shows as INTERRUPTED (rerun the spec to resume it).
    """
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    _refuse_missing_store(uri)
    tracking.check_server(uri)
    client = MlflowClient(uri)
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
            "status": run_owner.shown_status(run.info.status, run.data.tags),
            "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(run.info.start_time / 1000)),
            "stages": str(len(children)),
            "run_id": run.info.run_id,
        })
    return rows


def _refuse_missing_store(uri: str) -> None:
    """A one-line VitpipeError for a `sqlite:///` store whose file does not exist: MLflow would create an empty
    one, and a mistyped path would then read as "no pipeline runs"."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        if not path.is_file():
            raise VitpipeError(f"tracking store {strip_userinfo(uri)}: no such database file {path} "
                               "(--tracking-uri or MLFLOW_TRACKING_URI names the store)")


__all__ = ["PipelineResult", "StageRow", "format_table", "pipeline_runs", "run_pipeline"]
