"""How a `vitpipe` command fails: one line on stderr naming the cause and where the command's log is, exit status 1.

Every command logs to its own file (`pipelines.core.logfile`); the traceback
goes there, not to the terminal. Set `VITPIPE_DEBUG=1` to see it raised instead.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click
import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from pipelines.core.errors import VitpipeError
from pipelines.core.logfile import ray_logs_dir, redact_argv, start_log_file
from pipelines.core.stopping import handle_sigterm, stop_signal
from pipelines.core.uris import scrub_userinfo


def one_line(err: BaseException) -> str:
    """The message a user sees for an error raised by a command."""
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or err.title
        message = str(first.get("msg", err)).removeprefix("Value error, ")
        return f"{where}: {message}"
    return " ".join(str(err).split())


class ErrorReportingGroup(TyperGroup):
    """Turns user-facing errors of any subcommand into `error: <one line>` and exit status 1, and a stop
    (SIGTERM, Ctrl-C) into `stopped by <signal>: ...` and exit status 128 + its number."""

    def invoke(self, ctx: click.Context) -> Any:
        global _log_file
        _log_file = start_log_file()
        handle_sigterm()  # before Ray is joined too, so that a stop always ends as one
        try:
            return super().invoke(ctx)
        except _CLI_EXITS:
            raise
        except (KeyboardInterrupt, SystemExit) as err:  # SIGTERM or Ctrl-C (pipelines.core.stopping)
            if os.environ.get("VITPIPE_DEBUG"):
                raise
            stopped(err)
        except Exception as err:
            if os.environ.get("VITPIPE_DEBUG"):
                raise
            logging.getLogger("vitpipe").debug("vitpipe %s failed", " ".join(redact_argv(sys.argv[1:])), exc_info=True)
            expected = isinstance(err, (VitpipeError, ValidationError, ValueError))
            # Anything else is a bug or an outage: name its type, keep the first line, the log has the rest.
            fail(one_line(err) if expected else f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}")


# Exits and usage errors that the CLI framework reports itself (typer.Exit is a RuntimeError).
_CLI_EXITS = (typer.Exit, typer.Abort, typer.TyperException, click.exceptions.Exit, click.ClickException, click.Abort)
_log_file: Path | None = None  # this command's log (pipelines.core.logfile)


def fail(message: str) -> None:
    """Print `error: <message>` (any URL's `user:password@` removed) and where the details are, and exit with
    status 1."""
    # The last point before the terminal: a library's error quotes the URL it was given, password and all.
    typer.echo(f"error: {scrub_userinfo(message)}{_where()}", err=True)
    raise typer.Exit(1)


def stopped(err: BaseException) -> None:
    """Print `stopped by <signal>:` and the runs the stop left KILLED, and exit with 128 + the signal's number."""
    logging.getLogger("vitpipe").debug("vitpipe %s stopped", " ".join(redact_argv(sys.argv[1:])), exc_info=err)
    sig = stop_signal(err)
    runs = "; ".join(getattr(err, "__notes__", []))  # added by stage_run and the runner as the stop unwound them
    what = f": {runs}; the same command resumes it" if runs else " before any run started"
    # On a line of its own: a stop comes mid-output (a progress bar, the terminal's ^C).
    typer.echo(f"\nstopped by {sig.name}{what}{_where()}", err=True)
    raise typer.Exit(128 + sig)


def _where() -> str:
    """` (log: <this command's log>; Ray logs: <dir>)`, for the parts that exist."""
    where = [f"log: {_log_file}"] if _log_file else []
    ray_logs = ray_logs_dir()
    if ray_logs:
        where.append(f"Ray logs: {ray_logs}")
        logging.getLogger("vitpipe").debug("Ray logs: %s", ray_logs)
    return f" ({'; '.join(where)})" if where else ""


__all__ = ["ErrorReportingGroup", "fail", "one_line", "stopped"]
