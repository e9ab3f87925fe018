"""A real `mlflow server` for tests: SQL backend, artifacts on the session's S3 server.

Registered for every test module in `tests/conftest.py`.

The server proxies artifacts (`mlflow-artifacts:`), so clients need no S3
credentials: only the server process gets them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ARTIFACT_BUCKET = "mlflow-artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"mlflow server did not answer {url}/health within {timeout:.0f}s")


@pytest.fixture(scope="session")
def mlflow_server(s3_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start `mlflow server` on a free loopback port; yields its tracking URI (http://127.0.0.1:PORT)."""
    s3_server.client().create_bucket(Bucket=ARTIFACT_BUCKET)
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    # Only the server process sees the S3 credentials.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    env.update(s3_server.env)
    env["MLFLOW_S3_ENDPOINT_URL"] = s3_server.endpoint_url
    # No background job runner (eight huey processes, ~2 GB): tracking tests use none of its jobs.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
        "--artifacts-destination", f"s3://{ARTIFACT_BUCKET}/",
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]
    with open(log, "wb") as out:
        # A session of its own, so teardown can stop the server and its gunicorn/uvicorn workers together.
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # The server offers clients presigned S3 URLs for downloads; moto answers those GETs
    # (they carry response-content-disposition) with HTTP 500 and the client retries for
    # minutes. Make clients in this process download through the server instead.
    patch = pytest.MonkeyPatch()
    patch.setenv("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", "false")
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        patch.undo()
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
