"""The MLflow prologue and epilogue every tracked stage shares.

A stage execution is one MLflow run, found again by the stage name and the hash
of the config's identity: a rerun of a finished identity returns that run
untouched, an interrupted one is reopened and resumed, anything else is a new
run. The run ends FINISHED when the stage's body returns, FAILED when it
raises, and KILLED when the process is stopped (`pipelines.core.stopping`).

A run's name also names its checkpoints and Tune state in its experiment's
folder of the storage (`<storage>/<experiment id>/<name>`: the default name is
the config's hash, and the same config may run in several experiments). A
named run (`run_name` set) whose identity changed would therefore restore the
old config's checkpoints into the new one: that is refused, in one line naming
the changed fields (each run records its identity in the tag `vitpipe.identity`);
so is a name that already names another stage's run (its files would seed this
one). Both within the experiment: another one's runs keep their files apart.

    with stage_run(client, "pretrain", config, identity, tags=tags) as run:
        if run.finished:
            return result_from(run.run_id, reused=True)
        run.log_config(resolved)
        ...  # train into run.run_id, named run.name
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from pipelines.core import run_open, run_owner, tracking

# Under "vitpipe", whose handlers (the command log, stderr) scrub URLs' passwords; a `pipelines.*` logger
# reached only the root logger, which printed them as they were and kept them out of the command log.
logger = logging.getLogger("vitpipe.stage_run")
FINISHED = "FINISHED"
TAG_IDENTITY = "vitpipe.identity"
_MAX_TAG = 8000  # MLflow's limit on a tag value; a longer identity is not recorded (the refusal then names no field)


class Recorded(Protocol):
    """What a stage config says about where its run is recorded."""

    experiment: str
    parent_run_id: str | None
    run_name: str | None


@dataclass(frozen=True)
class StageRun:
    """One execution's MLflow run: `previous` is "" for a new run, else the status the run had when found."""

    client: MlflowClient
    stage: str
    run_id: str
    name: str
    digest: str
    previous: str
    experiment_id: str  # its files' folder in the storage (`pipelines.training.trainer.storage_location`)

    @property
    def finished(self) -> bool:
        """True when a run with this identity had already finished: nothing is to be done again."""
        return self.previous == FINISHED

    @property
    def resumed(self) -> bool:
        """True when an interrupted run with this identity was reopened."""
        return self.previous not in ("", FINISHED)

    def log_config(self, resolved: Mapping[str, Any]) -> None:
        """The resolved config as params and as `config.yaml`, credentials removed."""
        tracking.log_params(self.client, self.run_id, resolved)
        tracking.log_dict_artifact(self.client, self.run_id, resolved, "config.yaml")

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set several tags on the run."""
        tracking.set_tags(self.client, self.run_id, tags)


@contextmanager
def stage_run(
    client: MlflowClient,
    stage: str,
    config: Recorded,
    identity: Mapping[str, Any],
    *,
    tags: Mapping[str, str] | None = None,
) -> Iterator[StageRun]:
    """Open (or reopen) the run of `stage` whose identity is `identity`; end it FINISHED or FAILED.

    The run is named `config.run_name`, else `<stage>-<first 12 hex digits of the identity hash>`.
    A finished run is handed over as it is and left as it is. A ValueError (one line) when `config.run_name`
    already names a run of `stage` with another identity: its checkpoints must not seed this config.
    """
    digest = tracking.config_hash(identity)
    name = config.run_name or f"{stage}-{digest[:12]}"
    experiment_id = tracking.get_or_create_experiment(client, config.experiment)
    if config.run_name and run_open.find_stage_run(client, experiment_id, stage, digest) is None:  # else it resumes
        refuse_changed_named_run(client, experiment_id, stage, name, digest, identity)  # or is reused
    recorded = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    all_tags = {**(tags or {}), **({TAG_IDENTITY: recorded} if len(recorded) <= _MAX_TAG else {})}
    run_id, previous = run_open.start_stage_run(
        client, config.experiment, stage, digest, run_name=name, parent_run_id=config.parent_run_id, tags=all_tags
    )
    run = StageRun(client, stage, run_id, name, digest, previous, experiment_id)
    if run.finished:
        logger.info("%s: run %s already finished with this config; not running again", stage, run_id)
        yield run
        return
    if run.resumed:
        logger.info("%s: resuming run %s (was %s)", stage, run_id, previous)
    try:
        with run_owner.heartbeat(client, run_id):  # so that a second vitpipe sees this one is alive
            yield run
    except BaseException as err:
        tracking.end_unfinished_run(client, run_id, err, f"{stage} run {name}")
        raise
    tracking.end_run(client, run_id, True)


def finished_run_id(client: MlflowClient, stage: str, config: Recorded, identity: Mapping[str, Any]) -> str | None:
    """The FINISHED run of `stage` whose identity is `identity`, or None, found without opening or creating
    anything: a stage asks before preparation that only new work needs (`stage_run` hands that run over too)."""
    experiment = client.get_experiment_by_name(config.experiment)
    if experiment is None:
        return None
    found = run_open.find_stage_run(client, experiment.experiment_id, stage, tracking.config_hash(identity))
    return found.info.run_id if found is not None and found.info.status == "FINISHED" else None


def refuse_changed_named_run(client: MlflowClient, experiment_id: str, stage: str, name: str, digest: str,
                             identity: Mapping[str, Any]) -> None:
    """Raise a one-line ValueError when a run named `name` in experiment `experiment_id` (deleted runs too: their
    checkpoints stay in the storage) is a run of `stage` with an identity other than `digest`, or a run of
    another stage: in the experiment's folder of the storage the name names the checkpoints, Tune state and
    staged starting weights of both. Another experiment's runs keep their files in its own folder."""
    if "'" in name and '"' in name:  # MLflow's filter strings have no escapes: such a name cannot be looked up
        raise ValueError(f"run_name {name!r}: a run name may hold ' or \", not both")
    quoted = f'"{name}"' if "'" in name else f"'{name}'"
    named = f"attributes.run_name = {quoted} and tags.`{tracking.TAG_STAGE}`"
    # Only runs of this skeleton (they record `vitpipe.identity`) keep files under their name; a
    # pipeline's parent run, named after its spec, does not.
    other = _newest(client, experiment_id, f"{named} != '{stage}' and tags.`{TAG_IDENTITY}` LIKE '%'")
    if other is not None:
        raise ValueError(f"run_name {name!r} already names {other.data.tags[tracking.TAG_STAGE]} run "
                         f"{other.info.run_id}; a run's name names its checkpoints and work files in the storage, "
                         f"so that run's would seed this {stage} run: choose another run_name")
    old = _newest(client, experiment_id, f"{named} = '{stage}' and tags.`{tracking.TAG_CONFIG_HASH}` != '{digest}'")
    if old is None:
        return
    stored = old.data.tags.get(TAG_IDENTITY)
    if stored is None:
        what = "its identity was not recorded"
    else:
        before = tracking.flatten(json.loads(stored))
        after = tracking.flatten(json.loads(json.dumps(identity, default=str)))
        what = "changed: " + ", ".join(sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)))
    raise ValueError(f"run_name {name!r} already names {stage} run {old.info.run_id} with another config ({what}); "
                     "its checkpoints would seed this one: choose another run_name, or restore that config")


def _newest(client: MlflowClient, experiment_id: str, filter_string: str) -> Any | None:
    """The newest run of the experiment (deleted ones too) that `filter_string` selects, or None."""
    runs = client.search_runs([experiment_id], filter_string=filter_string, run_view_type=ViewType.ALL,
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None
