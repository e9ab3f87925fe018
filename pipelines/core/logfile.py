"""The full log of one `vitpipe` command, so that a one-line error can point at the details.

Every command writes vitpipe's own log records (DEBUG and up, tracebacks included)
to `$VITPIPE_LOG_DIR/vitpipe-<time>-<pid>.log` (default `~/.vitpipe/logs`). Only
the `vitpipe` logger goes there, never the root logger, so that third-party debug
output (request headers of S3 clients, for one) cannot carry credentials into it;
and every record is scrubbed of URLs' `user:password@` (`ScrubCredentials`), in the
file and on stderr, whatever library error it quotes.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import TextIO

from pipelines.core.uris import scrub_userinfo

LOG_DIR_ENV = "VITPIPE_LOG_DIR"
ARTIFACT_BARS_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A credential's name: one of its words (split at `_`, `-`, `.`) names a password, secret, token or
# credentials, or a kind of key that is one (`access_key`, `api_key`). Whole words, any case: `num_tokens`
# and `patch_key` are no secrets, and neither are the tokens of a model (`class_token`, `mask_token`).
_SECRET_WORD = re.compile(
    r"(?:^|[_.-])(?:password|passwd|secret|token|credentials?|connection_?string"
    r"|(?:access|secret|api|private|session|signing|account|storage)_?key)"
    r"(?:[_.-]|$)",
    re.IGNORECASE,
)
_MODEL_TOKEN = re.compile(r"(?:^|[_.-])(?:class|cls|mask|pad|bos|eos|sep|unk|dist|register|prefix)_tokens?$",
                          re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether `name` (an environment variable, a config key) names a credential, as `AWS_SECRET_ACCESS_KEY`,
    `MLFLOW_TRACKING_TOKEN` or `db.password` do; `class_token` or `num_tokens` do not."""
    return bool(_SECRET_WORD.search(name)) and not _MODEL_TOKEN.search(name)


def redact_argv(argv: list[str]) -> list[str]:
    """`argv` fit for a log: URI userinfo removed, values of `KEY=VALUE` arguments whose key names a credential
    replaced by `***`."""
    return [scrub_userinfo(_redact_pair(arg)) for arg in argv]


def _redact_pair(arg: str) -> str:
    """`arg` with its value replaced by `***` when it is `KEY=VALUE` and KEY names a credential; an option
    spelled `--set=KEY=VALUE` (click's other spelling of `--set KEY=VALUE`) has its `KEY=VALUE` judged so."""
    key, sep, value = arg.partition("=")
    if not sep:
        return arg
    if is_secret_name(key.lstrip("-").rsplit(".", 1)[-1]):
        return f"{key}=***"
    return f"{key}={_redact_pair(value)}" if key.startswith("--") else arg


class ScrubCredentials(logging.Filter):
    """Removes the `user:password@` of every URL from a record's message, traceback and stack before a
    handler writes it: a library's error (MLflow's, Ray's) quotes the URL it was given, password and all."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = scrub_userinfo(record.getMessage()), None
        except Exception:  # a malformed record: logging reports it itself when the handler formats it
            return True
        if record.exc_info and not record.exc_text:
            record.exc_text = _TRACEBACKS.formatException(record.exc_info)  # as the handler would, then scrubbed
        if record.exc_text:
            record.exc_text = scrub_userinfo(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub_userinfo(record.stack_info)
        return True


_TRACEBACKS = logging.Formatter()


def log_dir() -> Path:
    """Where command logs go: `$VITPIPE_LOG_DIR`, else `~/.vitpipe/logs`."""
    return Path(os.environ.get(LOG_DIR_ENV) or Path.home() / ".vitpipe" / "logs")


def quiet_artifact_bars(stream: TextIO | None = None, environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn MLflow's artifact progress bars off where no one watches them: stderr (`stream`) is no terminal but
    a job's log, a file or a pipe, where every redraw became more text (even copying a model's two local files
    drew one). A user's own `MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR` is kept."""
    if not (stream or sys.stderr).isatty():
        environ.setdefault(ARTIFACT_BARS_ENV, "false")


def console_handler() -> logging.Handler:
    """The `vitpipe` logger's stderr handler (WARNING and up unless a command shows progress)."""
    logger = logging.getLogger("vitpipe")
    for handler in logger.handlers:
        if getattr(handler, "_vitpipe_console", False):
            return handler
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.WARNING)
    handler.addFilter(ScrubCredentials())
    handler._vitpipe_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.propagate = False  # a root handler (some libraries add one) would print every line twice
    return handler


def start_log_file() -> Path | None:
    """Send the `vitpipe` logger's records to a new file for this command; returns its path.

    The file appears with the first record. Also installs the stderr handler.
    Returns None when the directory cannot be made: a read-only home must not
    stop a command from running.
    """
    console_handler()
    directory = log_dir()
    path = directory / f"vitpipe-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8", delay=True)  # no file until something is logged
    except OSError:
        return None
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(ScrubCredentials())
    handler.setLevel(logging.DEBUG)
    logger = logging.getLogger("vitpipe")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # each handler keeps its own threshold
    return path


def ray_logs_dir() -> str | None:
    """This process's Ray session log directory, when Ray is initialised here."""
    ray = sys.modules.get("ray")  # not imported means not initialised: importing it here costs a second
    try:
        if ray is None or not ray.is_initialized():
            return None
        # No public API names the directory; the node object has known it since Ray 1.x.
        return str(ray._private.worker._global_node.get_logs_dir_path())  # noqa: SLF001
    except Exception:  # an unexpected Ray layout must not turn an error report into a crash
        return None
