"""Pipelines and single stages as Ray jobs: submit, status, logs, stop (the Jobs API of a cluster's dashboard).

The job's entrypoint is the same `vitpipe` command a user would type, run on the
head node with this project as its working directory. The Ray auth token is
found where Ray's own tools find it (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`,
`~/.ray/auth_token`) by Ray's client itself; vitpipe never reads, prints or
passes it on. Unlike `ray job submit`, it needs no `RAY_AUTH_MODE=token`: with
a token at hand it is sent.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pipelines.core.errors import VitpipeError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Shipped to the cluster: code, specs, configs. Not history, data, runs or build output.
UPLOAD_EXCLUDES = [".git", "**/__pycache__", "*.egg-info", "vitpipe-work", "mlflow.db", "mlruns", "build", "dist",
                   ".venv", "docs", "*.png"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
AGENT_WAIT_S = 60.0


class JobError(VitpipeError):
    """A Jobs API request that failed: one line naming the address and the cause."""


def _has_token() -> bool:
    """True when one of Ray's token sources is set (its value is never read here)."""
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                or (Path.home() / ".ray" / "auth_token").is_file())


def _client(address: str) -> Any:
    # Ray's client sends the token only in token mode; with a token at hand, send it
    # (clusters keep auth on, and Ray itself defaults to it from 2.61).
    if _has_token():
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as err:  # connection refused, 401 without/with a wrong token, bad address
        raise JobError(f"Ray cluster at {address}: {_cause(err)}") from None


def _cause(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    lowered = text.lower()
    if "401" in text or "unauthorized" in lowered or ("auth" in lowered and "token" in lowered):
        return "refused: the Ray auth token is missing or wrong (set RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
    return text[:300]


def _call(address: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except VitpipeError:
        raise
    except Exception as err:
        raise JobError(f"Ray cluster at {address}: {what}: {_cause(err)}") from None


def submit(address: str, command: Sequence[str], *, job_id: str | None = None, env: dict[str, str] | None = None) -> str:
    """Submit `vitpipe <command...>` as a Ray job running in a copy of this project; returns the job id."""
    client = _client(address)
    runtime_env: dict[str, Any] = {"working_dir": str(PROJECT_ROOT), "excludes": UPLOAD_EXCLUDES}
    if env:
        runtime_env["env_vars"] = dict(env)
    # `python -m pipelines.cli` runs the uploaded code, whatever vitpipe the head node has installed.
    entrypoint = shlex.join(["python", "-m", "pipelines.cli", *command])
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=job_id)
        except Exception as err:
            # A head that has just started answers before its job agent is up: wait for it, briefly.
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise JobError(f"Ray cluster at {address}: submit: {_cause(err)}") from None
            time.sleep(2)


def job_path(path: str) -> str:
    """`path` as a job sees it: relative to the uploaded project when inside it, else as given
    (an absolute path is then the cluster's: a shared filesystem, or a local cluster)."""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(PROJECT_ROOT):
        return str(resolved.relative_to(PROJECT_ROOT))
    return str(resolved)


def status(address: str, job_id: str) -> str:
    """The job's status: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    return str(_call(address, f"job {job_id}", _client(address).get_job_status, job_id).value)


def logs(address: str, job_id: str) -> str:
    """Everything the job has printed so far."""
    return _call(address, f"job {job_id}", _client(address).get_job_logs, job_id)


def stop(address: str, job_id: str) -> bool:
    """Ask the job to stop; True if it was running."""
    return bool(_call(address, f"job {job_id}", _client(address).stop_job, job_id))


def follow(address: str, job_id: str, poll_s: float = 1.0) -> Iterator[str]:
    """Yield the job's new log text until it reaches a terminal status."""
    client = _client(address)
    shown = 0
    while True:
        state = str(_call(address, f"job {job_id}", client.get_job_status, job_id).value)
        text = _call(address, f"job {job_id}", client.get_job_logs, job_id)
        if len(text) > shown:
            yield text[shown:]
            shown = len(text)
        if state in TERMINAL:
            return
        time.sleep(poll_s)


__all__ = ["JobError", "TERMINAL", "follow", "job_path", "logs", "status", "stop", "submit"]
