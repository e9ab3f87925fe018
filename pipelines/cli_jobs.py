"""The job commands, as Ray users know them from `ray job`: submit, jobs, status, logs, stop.

`--address` is the cluster's dashboard (its Jobs API), e.g. http://HEAD:8265,
and defaults to `RAY_ADDRESS`, as for `ray job`. `vitpipe submit` follows the
job's logs until it ends and exits with its outcome; `--no-wait` prints the job
id and returns. `pipelines.cli` registers these commands (`COMMANDS`).
"""

from __future__ import annotations

from typing import Optional

import typer

from pipelines import jobs
from pipelines.core.uris import strip_userinfo

_ADDRESS = typer.Option(..., "--address", envvar="RAY_ADDRESS",
                       help="The cluster's dashboard, e.g. http://HEAD:8265 (default: RAY_ADDRESS).")
WAIT = typer.Option(True, "--wait/--no-wait",
                    help="Follow the job's logs until it ends and exit with its outcome, or print its id and return.")
_SUBMISSION_ID = typer.Option(None, "--submission-id", help="The job's id (default: one that Ray makes up).")
_RUNTIME_ENV = typer.Option(None, "--runtime-env",
                            help="YAML/JSON runtime env merged into the job's (pip, env_vars...).")
_ENV = typer.Option([], "--env", help="KEY=VALUE in the job's environment (repeatable); never a credential.")


def repeat(flag: str, values: list[str]) -> list[str]:
    """`--set`, ["a=1", "b=2"] -> ["--set", "a=1", "--set", "b=2"]."""
    return [arg for value in values for arg in (flag, value)]


def submit(
    spec: str = typer.Argument(..., help="Pipeline spec: inside this project (uploaded with it), or a path the cluster sees."),
    address: str = _ADDRESS,
    sets: list[str] = typer.Option([], "--set", help="Override a field: STAGE.FIELD=VALUE."),
    force: list[str] = typer.Option([], "--force", help="Run this stage again even if it already finished (repeatable)."),
    wait: bool = WAIT,
    submission_id: Optional[str] = _SUBMISSION_ID,
    runtime_env: Optional[str] = _RUNTIME_ENV,
    env: list[str] = _ENV,
) -> None:
    """Run a pipeline spec as a Ray job on a cluster, following its logs until it ends (as `ray job submit`)."""
    from pipelines.spec import check_forced  # deferred: pydantic models, not needed by the other commands
    from pipelines.spec_file import load_spec

    pipeline_spec = load_spec(spec, sets)
    check_forced(pipeline_spec, force)  # a bad spec fails here, not minutes later on the cluster
    extra = jobs.load_runtime_env(runtime_env) if runtime_env else None
    job_env = jobs.job_runtime_env(extra, jobs.parse_env(env))
    fallback = job_env["env_vars"].get("MLFLOW_TRACKING_URI")
    jobs.check_tracking_uri(pipeline_spec.tracking_uri or fallback, f"spec {spec}")
    command = ["run", jobs.job_path(spec), *repeat("--set", sets), *repeat("--force", force)]
    submit_job(address, command, wait, submission_id=submission_id, runtime_env=job_env)


def submit_job(address: str, command: list[str], wait: bool, *, submission_id: Optional[str] = None,
               runtime_env: Optional[dict] = None) -> None:
    """Submit `vitpipe <command...>` as a Ray job and print its id; with `wait`, follow it to its end."""
    job_id = jobs.submit(address, command, job_id=submission_id, runtime_env=runtime_env)
    typer.echo(job_id)
    if wait:
        typer.echo(f"following job {job_id} until it ends (Ctrl-C stops following, not the job)", err=True)
        follow_job(address, job_id)


def follow_job(address: str, job_id: str) -> None:
    """Print the job's logs as they come; exit 1 with one line unless it SUCCEEDED."""
    try:
        jobs.follow(address, job_id, lambda chunk: typer.echo(chunk, nl=False))
    except KeyboardInterrupt:
        typer.echo(f"\nstopped following job {job_id}; it keeps running (vitpipe stop {job_id})", err=True)
        raise typer.Exit(130) from None
    final = jobs.status(address, job_id)
    if final != "SUCCEEDED":
        typer.echo(f"error: job {job_id} {final}; logs: vitpipe logs {job_id} --address {strip_userinfo(address)}", err=True)
        raise typer.Exit(1)


def list_jobs(address: str = _ADDRESS) -> None:
    """The cluster's jobs, oldest first: id, status, start time (UTC) and entrypoint."""
    from pipelines.runner import format_table  # deferred: the runner imports MLflow

    rows = jobs.list_jobs(address)
    if not rows:
        typer.echo("no jobs")
        return
    typer.echo(format_table(list(rows[0]), [list(r.values()) for r in rows]))


def status(job_id: str = typer.Argument(...), address: str = _ADDRESS) -> None:
    """A submitted job's status."""
    typer.echo(jobs.status(address, job_id))


def logs(job_id: str = typer.Argument(...), address: str = _ADDRESS,
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends.")) -> None:
    """A submitted job's output."""
    if follow:
        follow_job(address, job_id)
    else:
        typer.echo(jobs.logs(address, job_id), nl=False)


def stop(job_id: str = typer.Argument(...), address: str = _ADDRESS) -> None:
    """Stop a submitted job."""
    typer.echo("stopping" if jobs.stop(address, job_id) else "not running")


COMMANDS = {"submit": submit, "jobs": list_jobs, "status": status, "logs": logs, "stop": stop}

__all__ = ["COMMANDS", "WAIT", "follow_job", "repeat", "submit_job"]
