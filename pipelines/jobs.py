"""Pipelines and single stages as Ray jobs: submit, follow, list, status, logs, stop (a cluster's Jobs API).

The job's entrypoint is the same `vitpipe` command a user would type, run on the
head node with this project as its working directory. The Ray auth token is
found where Ray's own tools find it (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`,
`~/.ray/auth_token`) by Ray's client itself; vitpipe never reads, prints or
passes it on. Unlike `ray job submit`, it needs no `RAY_AUTH_MODE=token`: with
a token at hand it is sent.

A job sees the cluster's environment, not the submitter's: the tracking URI and
the non-secret AWS settings (`FORWARDED_ENV`) travel with it; credentials never
do (`check_env`), the cluster has its own (an instance role, a Kubernetes secret).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from pipelines.core.cluster import send_token_when_at_hand
from pipelines.core.errors import VitpipeError
from pipelines.core.logfile import is_secret_name, redact_argv
from pipelines.core.uris import scrub_userinfo, strip_userinfo

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Shipped to the cluster: code, specs, configs. Not history, data, runs or build output.
UPLOAD_EXCLUDES = [".git", "**/__pycache__", "*.egg-info", "vitpipe-work", "mlflow.db", "mlruns", "build", "dist",
                   ".venv", "docs", "*.png"]
AGENT_WAIT_S = 60.0
# Settings a job needs to find the same tracking store and S3 as the submitter. AWS_PROFILE is left out on
# purpose: it names a profile in the submitter's ~/.aws, and botocore fails on a node that lacks that profile
# instead of using the node's own credentials. Pass it with --env where the nodes have the profile.
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
# Ray's job supervisor SIGKILLs a stopped job this long after its SIGTERM, reading RAY_JOB_STOP_WAIT_TIME_S from
# the job's own env vars (Ray's default: 3 s). Ending the runs KILLED took longer on a busy head and left the
# pipeline run RUNNING; the supervisor stops waiting as soon as the job has exited.
STOP_GRACE_S = 30


class JobError(VitpipeError):
    """A Jobs API request that failed: one line naming the address and the cause."""


def _client(address: str) -> Any:
    # Ray's client sends the token only in token mode; with a token at hand, send it
    # (clusters keep auth on, and Ray itself defaults to it from 2.61).
    send_token_when_at_hand()
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as err:  # connection refused, 401 without/with a wrong token, bad address
        raise JobError(f"Ray cluster at {strip_userinfo(address)}: {_cause(err)}") from None


def _cause(err: BaseException) -> str:
    text = scrub_userinfo(" ".join(str(err).split())) or type(err).__name__  # Ray's errors repeat the address
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
        raise JobError(f"Ray cluster at {strip_userinfo(address)}: {what}: {_cause(err)}") from None


def check_env(env: Mapping[str, str], where: str) -> dict[str, str]:
    """`env` as strings, refused in one line if a name is a credential's or a value carries `user:password@`."""
    for name, value in env.items():
        if is_secret_name(str(name)):
            raise JobError(f"{where}: {name} is a credential; jobs never carry credentials "
                           "(give the cluster its own: an instance role or a secret on its nodes)")
        if scrub_userinfo(str(value)) != str(value):  # anywhere in it: PIP_EXTRA_INDEX_URL holds several URLs
            raise JobError(f"{where}: {name}={scrub_userinfo(str(value))} carries user:password@; jobs never "
                           "carry credentials (use MLflow's or the server's own auth on the cluster)")
    return {str(name): str(value) for name, value in env.items()}


def check_command(command: Sequence[str]) -> list[str]:
    """`command` (a job's vitpipe arguments), refused in one line if an argument carries `user:password@`
    or sets a credential: Ray keeps the entrypoint and shows it to anyone who lists jobs."""
    command = list(map(str, command))
    for arg, shown in zip(command, redact_argv(command)):
        if shown != arg:
            raise JobError(f"job argument {shown} carries a credential; jobs never carry credentials "
                           "(use MLflow's or the server's own auth, an instance role or a secret on the cluster)")
    return command


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """`--env KEY=VALUE` options as a dict (checked by `check_env`)."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise JobError(f"--env expects KEY=VALUE, got {pair!r}")
        env[name.strip()] = value
    return check_env(env, "--env")


def load_runtime_env(path: str) -> dict[str, Any]:
    """A runtime env from a YAML/JSON file (Ray's own keys: pip, env_vars, py_modules, ...), refused in one line
    if any of its strings carries a credential: Ray shows a job's runtime env to anyone who lists jobs."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise JobError(f"--runtime-env {path}: no such file") from None
    except (OSError, yaml.YAMLError) as err:
        raise JobError(f"--runtime-env {path}: cannot read it ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise JobError(f"--runtime-env {path}: expected a mapping of runtime env keys, got {type(data).__name__}")
    env_vars = data.get("env_vars", {})
    if not isinstance(env_vars, dict):
        raise JobError(f"--runtime-env {path}: env_vars must be a mapping of NAME: value")
    checked = {**data, "env_vars": check_env(env_vars, f"--runtime-env {path}")} if env_vars else data
    field = _field_with_userinfo(checked)  # pip, conda, py_modules...: Ray shows the whole runtime env too
    if field:
        raise JobError(f"--runtime-env {path}: {field} carries user:password@; jobs never carry credentials "
                       "(give the cluster its own: a pip.conf, a netrc or a secret on its nodes)")
    return checked


def _field_with_userinfo(value: Any, where: str = "") -> str | None:
    """The first place in `value` (nested mappings and lists) where a string holds a URL's `user:password@`,
    as `pip[0]` or `conda.channels[1]`; None when there is none."""
    if isinstance(value, str):
        return where if scrub_userinfo(value) != value else None
    if isinstance(value, dict):
        items = [(f"{where}.{key}" if where else str(key), item) for key, item in value.items()]
        items += [(f"{where} key" if where else "a key", key) for key in value]  # keys are shown as well
    elif isinstance(value, (list, tuple)):
        items = [(f"{where}[{i}]", item) for i, item in enumerate(value)]
    else:
        return None
    return next((found for place, item in items if (found := _field_with_userinfo(item, place))), None)


def job_runtime_env(extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job's runtime env: this project as working dir, then `extra` (a --runtime-env file) over it;
    env vars are the stop grace (`STOP_GRACE_S`), the forwarded settings, then `extra`'s, then `env` (--env),
    later ones winning."""
    extra = dict(extra or {})
    forwarded = check_env({k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}, "environment")
    grace = {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S)}
    env_vars = {**grace, **forwarded, **extra.pop("env_vars", {}), **(env or {})}
    runtime_env: dict[str, Any] = {"working_dir": str(PROJECT_ROOT), **extra}
    runtime_env["excludes"] = [*UPLOAD_EXCLUDES, *extra.get("excludes", [])]
    runtime_env["env_vars"] = env_vars
    return runtime_env


def check_tracking_uri(uri: str | None, where: str) -> str:
    """`uri` (the spec's, else the job's MLFLOW_TRACKING_URI), refused for a pipeline submitted from `where` when
    the job would write it into its throwaway working directory (none given, or a relative local path), or
    when it carries a password (the spec is uploaded with the job)."""
    if uri and strip_userinfo(uri) != uri:
        raise JobError(f"{where}: tracking URI {strip_userinfo(uri)} carries user:password@; jobs never carry "
                       "credentials (use MLflow's or the server's own auth on the cluster)")
    if not uri:
        raise JobError(f"{where}: no tracking URI: set tracking_uri in the spec or MLFLOW_TRACKING_URI "
                       "(an MLflow server, e.g. http://MLFLOW:5000); on a cluster the default sqlite:///mlflow.db "
                       "would land in the job's throwaway working directory")
    path = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else uri.removeprefix("file:")
    if uri.startswith(("sqlite:///", "file:")) and not path.removeprefix("//").startswith("/"):
        raise JobError(f"{where}: tracking URI {strip_userinfo(uri)} is a relative path: on a cluster it would land "
                       "in the job's throwaway working directory; use an MLflow server or an absolute shared path")
    return uri


def submit(address: str, command: Sequence[str], *, job_id: str | None = None,
           runtime_env: Mapping[str, Any] | None = None) -> str:
    """Submit `vitpipe <command...>` as a Ray job in `runtime_env` (see `job_runtime_env`); returns the job id."""
    # `python -m pipelines.cli` runs the uploaded code, whatever vitpipe the head node has installed.
    entrypoint = shlex.join(["python", "-m", "pipelines.cli", *check_command(command)])
    client = _client(address)
    runtime_env = dict(runtime_env) if runtime_env is not None else job_runtime_env()
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=job_id)
        except Exception as err:
            # A head that has just started answers before its job agent is up: wait for it, briefly.
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise JobError(f"Ray cluster at {strip_userinfo(address)}: submit: {_cause(err)}") from None
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


def list_jobs(address: str) -> list[dict[str, str]]:
    """Every job the cluster knows, oldest first: id, status, start time (UTC) and entrypoint."""
    details = _call(address, "list jobs", _client(address).list_jobs)
    rows = []
    for job in sorted(details, key=lambda j: j.start_time or 0):
        started = datetime.fromtimestamp(job.start_time / 1000, timezone.utc) if job.start_time else None
        rows.append({"id": job.submission_id or job.job_id or "?", "status": str(job.status.value),
                     "start time": started.strftime("%Y-%m-%d %H:%M:%S") if started else "-",
                     "entrypoint": job.entrypoint or ""})
    return rows


def follow(address: str, job_id: str, show: Callable[[str], None]) -> None:
    """Pass the job's log text to `show` as it is written, until the job ends (Ray's log stream, not a re-fetch).

    Ctrl-C cancels the stream cleanly (asyncio.run's own handling) and raises KeyboardInterrupt; the job runs on.
    """
    client = _client(address)
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # not "WebSocket closed" at the end

    async def tail() -> None:
        try:
            async for chunk in client.tail_job_logs(job_id):
                show(chunk)
        except Exception as err:  # an unknown job, a lost connection, a refused token
            raise JobError(f"Ray cluster at {strip_userinfo(address)}: logs of job {job_id}: {_cause(err)}") from None

    asyncio.run(tail())


__all__ = ["FORWARDED_ENV", "JobError", "check_env", "check_tracking_uri", "follow",
           "job_path", "job_runtime_env", "list_jobs", "load_runtime_env", "logs", "parse_env", "status", "stop",
           "submit"]
