"""The MLflow prologue and epilogue every tracked stage shares.

A stage execution is one MLflow run, found again by the stage name and the hash
of the config's identity: a rerun of a finished identity returns that run
untouched, an interrupted one is reopened and resumed, anything else is a new
run. The run ends FINISHED when the stage's body returns and FAILED when it
raises.

    with stage_run(client, "pretrain", config, identity, tags=tags) as run:
        if run.finished:
            return result_from(run.run_id, reused=True)
        run.log_config(resolved)
        ...  # train into run.run_id, named run.name
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from mlflow.tracking import MlflowClient

from pipelines.core import tracking

logger = logging.getLogger(__name__)
FINISHED = "FINISHED"


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
    A finished run is handed over as it is and left as it is.
    """
    digest = tracking.config_hash(identity)
    name = config.run_name or f"{stage}-{digest[:12]}"
    run_id, previous = tracking.start_stage_run(
        client, config.experiment, stage, digest, run_name=name, parent_run_id=config.parent_run_id, tags=tags
    )
    run = StageRun(client, stage, run_id, name, digest, previous)
    if run.finished:
        logger.info("%s: run %s already finished with this config; not running again", stage, run_id)
        yield run
        return
    if run.resumed:
        logger.info("%s: resuming run %s (was %s)", stage, run_id, previous)
    ok = False
    try:
        yield run
        ok = True
    finally:
        tracking.end_run(client, run_id, ok)
