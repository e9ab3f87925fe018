"""What `vitpipe` prints and logs holds no credential: argv in the command log, the tracking URI
at the end of `vitpipe run`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.core.logfile import redact_argv


def test_redact_argv_strips_uri_userinfo_and_credential_values_but_not_lookalikes():
    argv = ["run", "s.yaml", "--set", "tracking_uri=http://bob:hunter2@mlflow:5000", "--set", "x.aws_secret_access_key=S3KR1T",
            "--set", "db.password=pw", "--set", "pretrain.model_overrides.class_token=false", "s3://AK:SK@bucket/p"]
    lookalikes = ["--set", "x.global_tokens=4", "--set", "x.num_tokens=8", "--set", "x.mask_token=true",
                  "--set", "x.patch_key=k", "--set", "x.max_tokens=9"]
    assert redact_argv(argv + lookalikes) == [
        "run", "s.yaml", "--set", "tracking_uri=http://mlflow:5000", "--set", "x.aws_secret_access_key=***", "--set",
        "db.password=***", "--set", "pretrain.model_overrides.class_token=false", "s3://bucket/p", *lookalikes]


def test_the_command_log_records_argv_without_secrets(tmp_path):
    env = {**os.environ, "VITPIPE_LOG_DIR": str(tmp_path / "logs"), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "evaluate", str(tmp_path / "missing.yaml"),
         "--set", "tracking_uri=http://bob:hunter2@127.0.0.1:1", "--set", "a.api_key=T0K3N"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 1
    [log] = (tmp_path / "logs").iterdir()
    text = log.read_text()
    assert "failed" in text and "tracking_uri=http://127.0.0.1:1" in text
    assert "hunter2" not in text and "T0K3N" not in text and "bob" not in text


def test_vitpipe_run_prints_the_tracking_uri_without_its_password(ray_cluster, mlflow_server, tmp_path):
    from pipelines.corpora.images import synth_corpus

    synth_corpus(str(tmp_path / "corpus"), images=16, classes=2, size=16, seed=0)
    with_password = mlflow_server.replace("http://", "http://bob:hunter2@")
    spec = {"name": "leak", "storage": {"root": str(tmp_path / "work")}, "tracking_uri": with_password,
            "experiment": "secret-leaks",
            "stages": {"corpus": {"kind": "ingest", "source": str(tmp_path / "corpus"), "image_size": 16,
                                  "patch_size": 4}}}
    path = Path(tmp_path / "spec.yaml")
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    assert f"in {mlflow_server}" in result.output and "hunter2" not in result.output


def _vitpipe(tmp_path: Path, *args: str) -> tuple[str, str]:
    """`vitpipe ARGS` in a fresh interpreter that fails fast on a closed port: its stderr and its command log."""
    env = {**os.environ, "VITPIPE_LOG_DIR": str(tmp_path / "logs"), "PYTHONPATH": os.getcwd(),
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    [log] = (tmp_path / "logs").iterdir()
    return proc.stderr, log.read_text()


def _spec(tmp_path: Path) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "storage": {"root": str(tmp_path / "work")},
                                    "tracking_uri": "http://127.0.0.1:1",
                                    "stages": {"corpus": {"kind": "ingest", "source": str(tmp_path / "corpus")}}}))
    return str(path)


def test_redact_argv_hides_every_kind_of_token_key_password_and_secret():
    argv = ["--env", "HF_TOKEN=t2", "--env", "MLFLOW_TRACKING_TOKEN=tok", "--set", "x.api_token=t3",
            "--env", "GITHUB_API_KEY=k1", "--set", "db.admin_password=p1", "--set", "x.client_secret=s1"]
    assert redact_argv(argv) == ["--env", "HF_TOKEN=***", "--env", "MLFLOW_TRACKING_TOKEN=***", "--set",
                                 "x.api_token=***", "--env", "GITHUB_API_KEY=***", "--set", "db.admin_password=***",
                                 "--set", "x.client_secret=***"]


def test_redact_argv_hides_azure_storage_keys_and_connection_strings():
    # An Azure connection string carries the account key itself.
    argv = ["--env", "AZURE_STORAGE_CONNECTION_STRING=AccountKey=k0", "--env", "AZURE_STORAGE_ACCOUNT_KEY=k1",
            "--env", "AZURE_STORAGE_KEY=k2", "--env", "AZURE_STORAGE_ACCOUNT=acct"]
    assert redact_argv(argv) == ["--env", "AZURE_STORAGE_CONNECTION_STRING=***", "--env", "AZURE_STORAGE_ACCOUNT_KEY=***",
                                 "--env", "AZURE_STORAGE_KEY=***", "--env", "AZURE_STORAGE_ACCOUNT=acct"]


def test_no_field_of_a_model_or_stage_config_counts_as_a_credential():
    from dataclasses import fields

    from pipelines.core.logfile import is_secret_name
    from pipelines.stages import STAGES
    from vit.config import ResNetStemConfig, ViTConfig

    names = {f.name for config in (ViTConfig, ResNetStemConfig) for f in fields(config)}
    names |= {name for stage in STAGES.values() for name in stage.config_model.model_fields}
    assert "class_token" in names and not [name for name in names if is_secret_name(name)]


class _Failing(BaseHTTPRequestHandler):
    """A server that is there but fails every request, as a tracking server whose database is down does."""

    def _fail(self) -> None:
        self.send_response(500)
        self.end_headers()

    do_GET = do_POST = _fail

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def failing_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_unexpected_error_shows_no_password_on_the_terminal_or_in_the_log(tmp_path, failing_server):
    # MLflow's own error quotes the tracking URI it was given, password included.
    stderr, log = _vitpipe(tmp_path, "runs", "--tracking-uri", f"http://alice:s3cret@{failing_server}")
    assert f"MlflowException: API request to http://{failing_server}/" in stderr
    assert "Traceback" in log and f"http://{failing_server}/" in log
    assert "s3cret" not in stderr and "s3cret" not in log


def test_a_spec_value_refused_by_validation_is_not_echoed_into_the_log(tmp_path):
    # pydantic's own error repeats the refused value; the one-line refusal does not.
    stderr, log = _vitpipe(tmp_path, "run", _spec(tmp_path), "--set", "corpus.manifest=s3://AKIAXXX:secretkey2@bucket/x")
    assert "field 'manifest': s3://bucket/x: credentials in the URI are refused" in stderr
    assert "credentials in the URI are refused" in log and "validation error for" not in log
    assert "secretkey2" not in stderr and "secretkey2" not in log


def test_an_ingest_option_refused_by_validation_is_not_echoed_into_the_log(tmp_path):
    stderr, log = _vitpipe(tmp_path, "ingest", str(tmp_path / "corpus"), str(tmp_path / "out"),
                           "--manifest", "s3://AKIAXXX:secretkey3@bucket/x")
    assert "error: ingest config: manifest: s3://bucket/x: credentials in the URI are refused" in stderr
    assert "credentials in the URI are refused" in log and "validation error for" not in log
    assert "secretkey3" not in stderr and "secretkey3" not in log


def test_an_unsupported_scheme_is_named_without_the_uris_password():
    from pipelines.core.storage import parse_uri

    with pytest.raises(ValueError, match="unsupported scheme") as refused:
        parse_uri("http://alice:pw1@h/m.csv")
    assert "http://h/m.csv" in str(refused.value) and "pw1" not in str(refused.value)


def test_a_jobs_api_error_names_the_cluster_without_its_password():
    from pipelines import jobs

    with pytest.raises(jobs.JobError, match=r"Ray cluster at http://127\.0\.0\.1:1: ") as refused:
        jobs.status("http://u:s3cret@127.0.0.1:1", "abc")  # a closed port: Ray's error repeats the address
    assert "s3cret" not in str(refused.value)


def test_a_failed_stage_keeps_no_password_in_its_summary_row(monkeypatch):
    from pipelines import runner

    def fail(*args):
        raise RuntimeError("API request to http://alice:s3cret@mlflow:5000/api failed")

    monkeypatch.setattr(runner, "_run_stage", fail)
    spec = SimpleNamespace(stages={"a": SimpleNamespace(kind="pretrain")}, upstream=lambda name: [])
    context = SimpleNamespace(spec=spec, pipeline=SimpleNamespace(outputs={}))
    row = runner._stage_row(context, "a", forced="")
    assert row.status == "failed" and "http://mlflow:5000/api" in row.error and "s3cret" not in row.error


def test_an_error_line_from_a_ray_failure_keeps_no_password():
    from pipelines.core.errors import error_line

    wrapped = RuntimeError("ray.exceptions.RayTaskError(OSError): ray::trial() (pid=1)\n  OSError: "
                           "When reading s3://b/k from https://minio:" + "p" * 290 + "@h:9000/b/k: timeout")
    line = error_line(wrapped)
    assert line.startswith("OSError: When reading s3://b/k from https://h:9000/b/k") and "ppp" not in line
