"""MLflow helpers shared by the stages.

One MLflow run per stage execution: the driver creates (or, on a resumed
execution, reopens) the run, and only rank 0 of the training workers logs into
it by run id. Everything here talks to MLflow through an explicit tracking URI
and `MlflowClient`, not the fluent global run, so a worker can never end or
create a run by accident. Models are logged and read by `pipelines.core.registry`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.tracking import MlflowClient
from pydantic import SecretBytes, SecretStr

from pipelines.core import stopping
from pipelines.core.errors import VitpipeError
from pipelines.core.uris import resolve_tracking_uri, strip_userinfo

# Where a `sqlite:///` store's experiments keep their artifacts: this folder beside the database file.
SQLITE_ARTIFACTS = "mlartifacts"

TAG_STAGE = "vitpipe.stage"
TAG_CONFIG_HASH = "vitpipe.config_hash"
TAG_PARENT = "mlflow.parentRunId"
TAG_LATEST = "vitpipe.latest."  # + a param's key: the value a run logged again last ran with (params never change)
# The experiment's kind for MLflow 3's UI: model training, its `ExperimentKind.CUSTOM_MODEL_DEVELOPMENT`.
# MLflow 3.17's UI shows the kind its GenAI / Model training switch names instead (the address's
# `?workflowType=machine_learning`, else the browser's last choice, GenAI at first), so the links vitpipe
# prints (`experiment_page`) carry that query; the tag keeps the kind for the UIs and clients that read it.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

# The names of credential fields, matched whole (any case), wherever they sit in a config tree. A closed
# list, not a substring test: `class_token` or `global_tokens` name model architecture, and dropping them
# would hide them from the params and from the run identity (a changed model would reuse a finished run).
CREDENTIAL_KEYS = frozenset({
    "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "access_key", "secret_key",
    "session_token", "password", "passwd", "token", "api_key", "api_token", "access_token", "refresh_token",
    "auth_token", "secret", "client_secret", "private_key", "credentials",
    "mlflow_tracking_password", "mlflow_tracking_token", "ray_auth_token",
})
# MLflow limits a param value to 6000 characters; longer values are cut, not rejected.
_MAX_PARAM_LEN = 6000
# log_batch accepts at most 1000 metrics / 100 params per call.
_METRIC_BATCH = 1000
_PARAM_BATCH = 100


def local_artifact_root(tracking_uri: str) -> str | None:
    """The artifact root for a new experiment of a `sqlite:///` store: `mlartifacts/` beside the database.

    MLflow's own default is `./mlruns` of whichever process creates the experiment, so one store's
    artifacts would land in the directory each user (or test) happened to start from. None for a
    tracking server or a file store: they have artifact roots of their own.
    """
    uri = resolve_tracking_uri(tracking_uri)
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    return (database.parent / SQLITE_ARTIFACTS).as_uri()


def is_credential(key: Any, value: Any) -> bool:
    """True for a credential field: its name is in `CREDENTIAL_KEYS`, or its value is a pydantic secret."""
    return str(key).lower() in CREDENTIAL_KEYS or isinstance(value, (SecretStr, SecretBytes))


def redact(value: Any) -> Any:
    """A copy of a config tree without credential fields (`is_credential`) and with URI userinfo stripped."""
    if isinstance(value, Mapping):
        return {k: redact(v) for k, v in value.items() if not is_credential(k, v)}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return strip_userinfo(value)
    return value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into `a.b.c -> str(value)` pairs for MLflow params."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
            out[name] = text[:_MAX_PARAM_LEN]
    return out


def config_hash(tree: Mapping[str, Any]) -> str:
    """A stable SHA-256 of a JSON-able config tree (key order does not matter)."""
    blob = json.dumps(tree, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def system_info(num_workers: int, use_gpu: bool) -> dict[str, str]:
    """Tags describing where a stage ran: workers, devices and library versions."""
    import ray
    import torch

    tags = {
        "vitpipe.num_workers": str(num_workers),
        "vitpipe.use_gpu": str(use_gpu).lower(),
        "vitpipe.ray_version": ray.__version__,
        "vitpipe.torch_version": torch.__version__,
        "vitpipe.mlflow_version": mlflow.__version__,
        "vitpipe.python_version": platform.python_version(),
        "vitpipe.driver_host": platform.node(),
    }
    if ray.is_initialized():
        resources = ray.cluster_resources()
        tags["vitpipe.cluster_cpus"] = str(int(resources.get("CPU", 0)))
        tags["vitpipe.cluster_gpus"] = str(int(resources.get("GPU", 0)))
        tags["vitpipe.cluster_nodes"] = str(len([n for n in ray.nodes() if n.get("Alive")]))
    return tags


def experiment_page(ui_url: str, experiment_id: str) -> str:
    """The experiment's page in the MLflow UI at `ui_url`, on its runs table (see `TAG_EXPERIMENT_KIND`)."""
    return f"{strip_userinfo(ui_url).rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


def browse_hint(tracking_uri: str, run_id: str) -> str:
    """Where to see `run_id`'s experiment: the tracking server's page, or for a local store the
    `mlflow ui` command to start and the page it serves."""
    experiment = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
    if tracking_uri.startswith(("http://", "https://")):
        return f"browse the runs: {experiment_page(tracking_uri, experiment)}"
    return (f"browse the runs: mlflow ui --backend-store-uri {strip_userinfo(tracking_uri)}, "
            f"then {experiment_page('http://127.0.0.1:5000', experiment)}")


def check_server(uri: str, timeout_s: float = 10.0) -> None:
    """Raise a one-line VitpipeError when the tracking server at `uri` (http or https) takes no connection.

    MLflow's client retries a refused request with backoff for about 4 minutes before it gives up: right for
    a server lost mid-run, not for one that is not there (a mistyped host, a server not started). Anything
    listening passes, whatever it answers (an error page, a slow reply, a TLS handshake MLflow may accept).
    """
    if not uri.startswith(("http://", "https://")):
        return
    shown = strip_userinfo(uri)  # reachability needs no credentials, and urllib would take them for the host
    try:
        urllib.request.urlopen(f"{shown.rstrip('/')}/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except urllib.error.URLError as err:  # raised while connecting or sending; a reply's failure is an OSError
        if isinstance(err.reason, ssl.SSLError):
            return
        raise VitpipeError(f"tracking server {shown}: not reachable ({_connect_failure(err.reason, timeout_s)})") from None
    except OSError:
        return


def _connect_failure(reason: object, timeout_s: float) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused: is the server running, and on this port?"
    if isinstance(reason, TimeoutError):
        return f"no connection within {timeout_s:.0f} s"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return " ".join(str(reason).split())[:200] or type(reason).__name__


def get_or_create_experiment(client: MlflowClient, name: str) -> str:
    """The id of the named experiment, created if missing, marked as model training for MLflow's UI.

    An existing experiment without a kind gets one; a kind someone chose is kept. A new experiment of a
    `sqlite:///` store keeps its artifacts beside the database (`local_artifact_root`).
    """
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=local_artifact_root(client.tracking_uri),
                                            tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})
        except MlflowException as err:  # another process made it between the lookup and here
            if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage != "active":
        raise ValueError(f"MLflow experiment {name!r} is deleted; restore it or choose another name")
    if TAG_EXPERIMENT_KIND not in experiment.tags:
        try:
            client.set_experiment_tag(experiment.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
        except MlflowException:  # another process tagged it at the same moment (a SQL store then refuses ours)
            if TAG_EXPERIMENT_KIND not in client.get_experiment(experiment.experiment_id).tags:
                raise
    return experiment.experiment_id


def log_params(client: MlflowClient, run_id: str, config: Mapping[str, Any]) -> None:
    """Log a config tree as flattened params, credentials removed.

    A run logged again (a resumed execution, a PBT trial's next segment) keeps the params it has:
    MLflow never changes a param. A value that differs from the logged one (another `max_failures`
    on resume, an explored `lr`) is set as the tag `vitpipe.latest.<key>`, so the run shows what
    it last ran with.
    """
    params = [Param(k, str(v)) for k, v in sorted(flatten(redact(config)).items())]
    existing = client.get_run(run_id).data.params
    changed = {f"{TAG_LATEST}{p.key}": p.value for p in params if p.key in existing and existing[p.key] != p.value}
    params = [p for p in params if p.key not in existing]
    for i in range(0, len(params), _PARAM_BATCH):
        client.log_batch(run_id, params=params[i : i + _PARAM_BATCH])
    if changed:
        set_tags(client, run_id, changed)


def set_tags(client: MlflowClient, run_id: str, tags: Mapping[str, str]) -> None:
    """Set several tags in one call."""
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_dict_artifact(client: MlflowClient, run_id: str, data: Mapping[str, Any], artifact_file: str) -> None:
    """Log a JSON/YAML document (chosen by extension), credentials removed."""
    client.log_dict(run_id, redact(data), artifact_file)


class MetricBuffer:
    """Collects step metrics and sends them to MLflow in batches.

    One HTTP/database round trip per training step would cost more than a tiny
    model's step, so rank 0 buffers and flushes every few steps. With
    `asynchronous`, a flush hands the batch to MLflow's background logger and
    returns at once; `wait` blocks until every batch sent so far is stored, and
    `close` also stops the background logger.
    """

    def __init__(self, client: MlflowClient, run_id: str, *, asynchronous: bool = False) -> None:
        self.client = client
        self.run_id = run_id
        self.asynchronous = asynchronous
        self._pending: list[Metric] = []
        self._in_flight: list[Any] = []  # RunOperations of asynchronous batches not yet waited for

    def add(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Queue `metrics` for `step`."""
        ts = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())

    def flush(self) -> None:
        """Send everything queued (in the background when asynchronous)."""
        while self._pending:
            chunk, self._pending = self._pending[:_METRIC_BATCH], self._pending[_METRIC_BATCH:]
            operations = self.client.log_batch(self.run_id, metrics=chunk, synchronous=not self.asynchronous)
            if operations is not None:
                self._in_flight.append(operations)

    def wait(self) -> None:
        """Flush, then block until every batch is stored (raises what the background logger hit)."""
        self.flush()
        in_flight, self._in_flight = self._in_flight, []
        for operations in in_flight:
            operations.wait()

    def close(self) -> None:
        """`wait`, then stop the store's MLflow logging threads if they are running."""
        self.wait()
        # Left running, they hang the interpreter's exit (MLflow 3.17, checked here). Stopping them waits up
        # to 1 s for their queue poll, so `wait` alone leaves them be; the store starts them again on its
        # next asynchronous call.
        queue = getattr(self.client._tracking_client.store, "_async_logging_queue", None)
        if queue is not None and queue.is_active():
            queue.shut_down_async_logging()


def end_run(client: MlflowClient, run_id: str, ok: bool, *, stopped: bool = False) -> None:
    """Mark the stage run FINISHED or FAILED; KILLED when the process was `stopped` (SIGTERM, Ctrl-C).

    A run that does not finish ends its nested runs still RUNNING (trials a stopped sweep left) the same way.
    """
    status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.KILLED if stopped else RunStatus.FAILED)
    with _no_link_printing(client.tracking_uri):
        if not ok:
            experiment_id = client.get_run(run_id).info.experiment_id
            for child in client.search_runs(
                [experiment_id], f"tags.`{TAG_PARENT}` = '{run_id}' and attributes.status = 'RUNNING'", max_results=1000
            ):
                client.set_terminated(child.info.run_id, status=status)
        client.set_terminated(run_id, status=status)


def end_unfinished_run(client: MlflowClient, run_id: str, err: BaseException, label: str) -> None:
    """End a run whose body raised `err`: KILLED when `err` is a stop (`pipelines.core.stopping`), which then
    notes "`label` is KILLED" for the CLI's one line; FAILED otherwise."""
    stopped = stopping.is_stop(err)
    if stopped:
        err.add_note(f"{label} is KILLED")
    end_run(client, run_id, False, stopped=stopped)


@contextmanager
def _no_link_printing(uri: str | None) -> Iterator[None]:
    """MLflow prints "View run at" links built from the tracking URI, `user:password@` included:
    not for a URI that carries credentials."""
    if not uri or strip_userinfo(uri) == uri:
        yield
        return
    previous = os.environ.get(_NO_LINKS)
    os.environ[_NO_LINKS] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_NO_LINKS, None)
        else:
            os.environ[_NO_LINKS] = previous


_NO_LINKS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def log_learning_curve(
    client: MlflowClient,
    run_id: str,
    keys: Sequence[str] = ("train_loss", "val_loss", "val_top1"),
    artifact_file: str = "learning_curve.png",
) -> bool:
    """Plot the run's logged metric histories into a PNG artifact; False when none were logged."""
    import matplotlib

    matplotlib.use("Agg")  # headless: drivers run on servers without displays
    import matplotlib.pyplot as plt

    histories = {k: sorted(client.get_metric_history(run_id, k), key=lambda m: (m.step, m.timestamp)) for k in keys}
    histories = {k: v for k, v in histories.items() if v}
    if not histories:
        return False
    loss_keys = [k for k in histories if "loss" in k]
    other_keys = [k for k in histories if k not in loss_keys]
    ncols = 1 + bool(other_keys)
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
    for ax, group in zip(axes[0], [loss_keys, other_keys]):
        for key in group:
            # A resumed run re-logs the steps after its checkpoint; keep the latest value per step.
            by_step = {m.step: m.value for m in histories[key]}
            ax.plot(list(by_step), list(by_step.values()), label=key, marker="." if len(by_step) < 30 else None)
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    client.log_figure(run_id, fig, artifact_file)
    plt.close(fig)
    return True


def log_checkpoint_dir(client: MlflowClient, run_id: str, local_dir: str | Path, artifact_path: str) -> None:
    """Log a `vit.save_checkpoint` directory (weights + config only) under `artifact_path`."""
    local_dir = Path(local_dir)
    files = [p for p in local_dir.iterdir() if p.name in ("model.safetensors", "config.json")]
    if not files:
        raise ValueError(f"checkpoint directory {local_dir} holds no model.safetensors/config.json")
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path)
