"""Which process executes a run now, so that two vitpipes never execute one run at once.

A rerun reopens a RUNNING run as interrupted and resumes it: right after a crash,
wrong while the first process still runs (the same spec submitted twice, two users).
MLflow has no lock, so the executing process records itself on the run, in the tag
`vitpipe.owner`: its host, pid and start time, and a heartbeat it refreshes while it
runs. A process that finds the run RUNNING judges that owner:

- on the same host, alive exactly while that pid runs with that start time (a SIGKILLed
  driver is taken over at once, not after a timeout);
- on another host, alive while its heartbeat is younger than `STALE_AFTER_S`.

A live owner is refused in one line; a dead one, or a run without the tag, is taken
over. Two processes that open the same run at the very same moment (a new run, or a
dead owner's) can both execute it: MLflow has no compare-and-set.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import psutil
from mlflow.tracking import MlflowClient

from pipelines.core.errors import RunInUse

logger = logging.getLogger(__name__)
TAG_OWNER = "vitpipe.owner"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0  # four heartbeats missed: the owner on another host is gone


@dataclass(frozen=True)
class Owner:
    """The process executing a run: host, pid, that process's start time and its last heartbeat (Unix s)."""

    host: str
    pid: int
    started: float
    heartbeat: float

    @classmethod
    def me(cls) -> Owner:
        """This process, with a heartbeat now."""
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), time.time())

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Owner | None:
        """The owner recorded in a run's tags; None when there is none (or it cannot be read)."""
        try:
            return cls(**json.loads(tags[TAG_OWNER]))
        except (KeyError, TypeError, ValueError):
            return None

    def tag(self) -> dict[str, str]:
        """The tag that records this owner."""
        return {TAG_OWNER: json.dumps(asdict(self), sort_keys=True)}

    def alive(self) -> bool:
        """Whether this owner still runs, judged as the module docstring says."""
        if self.host != socket.gethostname():
            return time.time() - self.heartbeat < STALE_AFTER_S
        try:
            process = psutil.Process(self.pid)
            # A pid the OS reused belongs to a process started later; a zombie has already ended.
            return (abs(process.create_time() - self.started) < 1.0
                    and process.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False


def refuse_if_in_use(kind: str, run_id: str, tags: Mapping[str, str]) -> None:
    """Raise `RunInUse` (one line) when the RUNNING run `run_id` of `kind` has a live owner other than us."""
    owner = Owner.from_tags(tags)
    if owner is None or (owner.host, owner.pid) == (socket.gethostname(), os.getpid()) or not owner.alive():
        return
    age = time.time() - owner.heartbeat
    then = ("or stop it and run again to resume" if owner.host == socket.gethostname() else
            f"or, if it is gone, run again in {STALE_AFTER_S - age:.0f} s to resume")
    raise RunInUse(f"{kind} run {run_id} is being executed by another vitpipe (pid {owner.pid} on {owner.host}, "
                   f"heartbeat {age:.0f} s ago); wait for it to end, {then}")


def shown_status(status: str, tags: Mapping[str, str]) -> str:
    """A run's status as a person should read it: a RUNNING run whose owner is gone is "INTERRUPTED"."""
    owner = Owner.from_tags(tags)
    return "INTERRUPTED" if status == "RUNNING" and owner is not None and not owner.alive() else status


@contextmanager
def heartbeat(client: MlflowClient, run_id: str) -> Iterator[None]:
    """Refresh this process's owner tag on `run_id` every `HEARTBEAT_S` until the block ends.

    A heartbeat that fails (the tracking server restarting) is logged and retried at the next one.
    """
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                client.set_tag(run_id, TAG_OWNER, Owner.me().tag()[TAG_OWNER])
            except Exception as err:  # noqa: BLE001  (a missed heartbeat must not end the run)
                logger.warning("run %s: heartbeat not recorded (%s)", run_id, err)

    thread = threading.Thread(target=beat, name=f"vitpipe-heartbeat-{run_id[:8]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
