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
over. A process about to take a run over first claims it (a tag `vitpipe.claim.<key>` of
its own, so that claims never overwrite each other): `pipelines.core.run_open` uses the
claims to keep two processes that open one run at the same moment from both executing it.
"""

from __future__ import annotations

import hashlib
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
from pipelines.core.uris import scrub_userinfo

# Under "vitpipe", whose handlers (the command log, stderr) scrub URLs' passwords; a `pipelines.*` logger
# reached only the root logger, which printed them as they were and kept them out of the command log.
logger = logging.getLogger("vitpipe.run_owner")
TAG_OWNER = "vitpipe.owner"
TAG_CLAIM = "vitpipe.claim."  # + a claimant's key; its value is the claimant, as in `vitpipe.owner`
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
        return cls.parse(tags.get(TAG_OWNER))

    @classmethod
    def parse(cls, value: str | None) -> Owner | None:
        """The owner a tag's value records; None when it cannot be read."""
        try:
            return cls(**json.loads(value))
        except (TypeError, ValueError):
            return None

    def tag(self) -> dict[str, str]:
        """The tag that records this owner."""
        return {TAG_OWNER: self.value()}

    def value(self) -> str:
        """This owner as a tag's value."""
        return json.dumps(asdict(self), sort_keys=True)

    def claim_key(self) -> str:
        """The key of this process's claim tag: one per process, so that claims never overwrite each other."""
        return TAG_CLAIM + hashlib.sha256(f"{self.host}\0{self.pid}\0{self.started}".encode()).hexdigest()[:16]

    def is_me(self) -> bool:
        """Whether this owner is the calling process."""
        return (self.host, self.pid) == (socket.gethostname(), os.getpid())

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
    if owner is None or owner.is_me() or not owner.alive():
        return
    age = time.time() - owner.heartbeat
    then = ("or stop it and run again to resume" if owner.host == socket.gethostname() else
            f"or, if it is gone, run again in {STALE_AFTER_S - age:.0f} s to resume")
    raise RunInUse(f"{kind} run {run_id} is being executed by another vitpipe (pid {owner.pid} on {owner.host}, "
                   f"heartbeat {age:.0f} s ago); wait for it to end, {then}")


def rival(tags: Mapping[str, str], found: Mapping[str, str], mine: str) -> Owner | None:
    """A live process other than this one that claimed the run (a claim tag other than `mine`), or that became
    its owner since its tags read `found`; None when there is none."""
    for key, value in tags.items():
        claimant = Owner.parse(value) if key.startswith(TAG_CLAIM) and key != mine else None
        if claimant is not None and claimant.alive():
            return claimant
    owner = Owner.from_tags(tags)
    changed = tags.get(TAG_OWNER) != found.get(TAG_OWNER)
    return owner if changed and owner is not None and not owner.is_me() and owner.alive() else None


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
                client.set_tag(run_id, TAG_OWNER, Owner.me().value())
            except Exception as err:  # noqa: BLE001  (a missed heartbeat must not end the run)
                logger.warning("run %s: heartbeat not recorded (%s)", run_id, scrub_userinfo(str(err)))

    thread = threading.Thread(target=beat, name=f"vitpipe-heartbeat-{run_id[:8]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
