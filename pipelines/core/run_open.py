"""Opening the MLflow run of one stage execution: found by its identity, reused, reopened or created,
and executed by one process at a time.

A stage execution is found again by its stage and config digest (tags): a finished run is reused, an
unfinished one reopened (its owner, `pipelines.core.run_owner`, must be gone), and otherwise a run is
created. Two vitpipes may open the same identity at the same moment (a spec submitted twice), and
MLflow has no compare-and-set, so opening writes first and checks after:

- a new run is created, then the identity's runs are listed again: another one means a twin created
  one too;
- a run taken over first gets this process's claim tag (one key per process: claims never overwrite
  each other), then its tags are read again: another live claim, or a live owner other than the one
  found, means a twin is taking it over too.

A process that sees a twin backs off (deletes its new run, or its claim) and opens again after a
random pause; it then finds the twin's run, and reuses it, or is refused while the twin executes it.
Of two twins at most one goes on: each checks after its own write, so whichever checks last sees the
other's write. Both may back off; the random pauses let one of them through on the next try.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from typing import Any

from mlflow.tracking import MlflowClient

from pipelines.core import run_owner, tracking
from pipelines.core.errors import RunInUse
from pipelines.core.run_owner import Owner

# Under "vitpipe", whose handlers (the command log, stderr) scrub URLs' passwords; a `pipelines.*` logger
# reached only the root logger, which printed them as they were and kept them out of the command log.
logger = logging.getLogger("vitpipe.run_open")
OPEN_TRIES = 5


class _Twin(Exception):
    """Another process opened the same run at the same moment; `owner` is that process, when known."""

    def __init__(self, owner: Owner | None) -> None:
        super().__init__()
        self.owner = owner


def find_stage_run(client: MlflowClient, experiment_id: str, stage: str, digest: str) -> Any | None:
    """The newest run of `stage` tagged with `digest`, or None."""
    runs = _identity_runs(client, experiment_id, stage, digest, 1)
    return runs[0] if runs else None


def start_stage_run(
    client: MlflowClient,
    experiment: str,
    stage: str,
    digest: str,
    *,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """Open the run of one stage execution; returns `(run_id, previous_status)`.

    A run tagged with the same stage and config digest that did not finish is reopened (a resumed
    execution stays one run); `previous_status` is then its old status ("RUNNING", "FAILED", "KILLED"),
    "FINISHED" for a finished run that is returned untouched, or "" for a new run. A RUNNING run whose
    owner still runs is refused (`RunInUse`, one line); the run opened records this process as its owner.
    """
    experiment_id = tracking.get_or_create_experiment(client, experiment)
    new_tags = {tracking.TAG_STAGE: stage, tracking.TAG_CONFIG_HASH: digest, **(tags or {})}
    if parent_run_id:
        new_tags[tracking.TAG_PARENT] = parent_run_id
    twin = None
    for attempt in range(1, OPEN_TRIES + 1):
        try:
            return _open(client, experiment_id, stage, digest, run_name, new_tags)
        except _Twin as seen:
            twin = seen.owner
            logger.info("%s: another vitpipe (%s) opened the same run at the same moment; trying again",
                        stage, _process(twin))
            time.sleep(random.uniform(0.05, 0.3) * attempt)
    raise RunInUse(f"{stage} run with config digest {digest[:12]}: another vitpipe ({_process(twin)}) opened it "
                   f"at the same moment {OPEN_TRIES} times in a row; run again")


def _open(client: MlflowClient, experiment_id: str, stage: str, digest: str, run_name: str | None,
          new_tags: Mapping[str, str]) -> tuple[str, str]:
    """One try of `start_stage_run`; `_Twin` when a twin opened the run at the same moment."""
    previous = find_stage_run(client, experiment_id, stage, digest)
    if previous is None:
        return _create(client, experiment_id, stage, digest, run_name, new_tags), ""
    status, run_id = previous.info.status, previous.info.run_id
    if status == "FINISHED":
        return run_id, status
    if status == "RUNNING":
        run_owner.refuse_if_in_use(stage, run_id, previous.data.tags)
    _take_over(client, run_id, previous.data.tags)
    return run_id, status


def _create(client: MlflowClient, experiment_id: str, stage: str, digest: str, run_name: str | None,
            new_tags: Mapping[str, str]) -> str:
    """A new run owned by this process; `_Twin` (the new run deleted) when another run of the identity appeared."""
    run_id = client.create_run(experiment_id, run_name=run_name, tags={**new_tags, **Owner.me().tag()}).info.run_id
    # Any run of the identity besides ours is a twin's; of any two runs listed, one is not ours.
    twins = [run for run in _identity_runs(client, experiment_id, stage, digest, 2) if run.info.run_id != run_id]
    if twins:
        client.delete_run(run_id)
        raise _Twin(Owner.from_tags(twins[0].data.tags))
    return run_id


def _take_over(client: MlflowClient, run_id: str, found: Mapping[str, str]) -> None:
    """Make this process the owner of the unfinished run `run_id` (whose tags read `found`) and mark it RUNNING;
    `_Twin` (nothing changed) when another live process claimed it or became its owner meanwhile."""
    me = Owner.me()
    claim = me.claim_key()
    client.set_tag(run_id, claim, me.value())
    try:
        rival = run_owner.rival(client.get_run(run_id).data.tags, found, claim)
        if rival is not None:
            raise _Twin(rival)
        tracking.set_tags(client, run_id, me.tag())
        client.update_run(run_id, status="RUNNING")
    finally:
        client.delete_tag(run_id, claim)


def _identity_runs(client: MlflowClient, experiment_id: str, stage: str, digest: str, limit: int) -> list[Any]:
    """The newest `limit` runs of `stage` tagged with `digest` (deleted ones left out)."""
    return client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{tracking.TAG_STAGE}` = '{stage}' and tags.`{tracking.TAG_CONFIG_HASH}` = '{digest}'",
        order_by=["attributes.start_time DESC"],
        max_results=limit,
    )


def _process(owner: Owner | None) -> str:
    return f"pid {owner.pid} on {owner.host}" if owner is not None else "its process unknown"
