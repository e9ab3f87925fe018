"""Pipelines as Ray jobs on a real multi-node cluster with token authentication on.

`cluster/local_cluster.sh` starts a head and one worker node on loopback (its own
ports and temp dir, beside the session's in-process cluster); every client here
is a real `vitpipe` or `ray` process that finds the token where Ray's tools do.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import _free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TokenCluster:
    address: str  # the dashboard / Jobs API
    token: str
    env: dict[str, str]  # a client environment that finds the token (through RAY_AUTH_TOKEN_PATH)


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory) -> TokenCluster:
    tmp = tmp_path_factory.mktemp("token-cluster")
    token = secrets.token_hex(32)
    token_file = tmp / "auth_token"
    token_file.write_text(token)
    port, dashboard = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH"))}
    env.update(RAY_AUTH_TOKEN_PATH=str(token_file), RAY_PORT=str(port), DASHBOARD_PORT=str(dashboard),
               RAY_TMP=f"/tmp/vp-ray-{port}", HEAD_CPUS="2", WORKER_CPUS="1", OBJECT_STORE_MB="200")
    script = [str(REPO / "cluster" / "local_cluster.sh")]
    subprocess.run([*script, "start", "1"], env=env, check=True, timeout=300, capture_output=True)
    try:
        yield TokenCluster(f"http://127.0.0.1:{dashboard}", token, env)
    finally:
        subprocess.run([*script, "stop"], env=env, timeout=120, capture_output=True)


@pytest.fixture(scope="module")
def ingest_spec(tmp_path_factory) -> Path:
    """A one-stage pipeline (ingest of 60 images) with absolute paths: a local cluster sees this filesystem."""
    from pipelines.corpora.images import synth_corpus

    tmp = tmp_path_factory.mktemp("job-spec")
    synth_corpus(str(tmp / "corpus"), images=60, classes=3, size=16, seed=5)
    spec = {
        "name": "job-ingest",
        "storage": {"root": str(tmp / "work")},
        "tracking_uri": f"sqlite:///{tmp}/mlflow.db",
        "stages": {"corpus": {"kind": "ingest", "source": str(tmp / "corpus"), "image_size": 16, "patch_size": 4}},
    }
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def vitpipe(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def wait_for(address: str, job_id: str, env: dict[str, str], states: tuple[str, ...], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = vitpipe("status", job_id, "--address", address, env=env).stdout.strip()
        if state in states or time.monotonic() > deadline:
            return state
        time.sleep(1)


def test_vitpipe_submit_runs_a_pipeline_to_succeeded_and_never_prints_the_token(token_cluster, ingest_spec):
    done = vitpipe("submit", str(ingest_spec), "--address", token_cluster.address, "--wait", env=token_cluster.env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    job_id = done.stdout.splitlines()[0]
    assert re.search(r"^corpus\s+ingest\s+(done|reused)\s", done.stdout, re.M), done.stdout
    assert vitpipe("status", job_id, "--address", token_cluster.address, env=token_cluster.env).stdout.strip() == "SUCCEEDED"
    logs = vitpipe("logs", job_id, "--address", token_cluster.address, env=token_cluster.env).stdout
    assert "pipeline run" in logs
    assert token_cluster.token not in done.stdout + done.stderr + logs


def test_rays_own_job_submit_runs_the_same_spec(token_cluster, ingest_spec):
    command = ["ray", "job", "submit", "--address", token_cluster.address, "--working-dir", str(REPO),
               "--", "python", "-m", "pipelines.cli", "run", str(ingest_spec)]
    env = {**token_cluster.env, "RAY_AUTH_MODE": "token"}  # Ray's own CLI sends the token only in token mode
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    output = done.stdout + done.stderr
    assert re.search(r"Job '\w+' succeeded", output), output[-2000:]
    assert re.search(r"^corpus\s+ingest\s+(done|reused)\s", output, re.M)  # the pipeline's own summary


def test_stop_stops_a_running_job(token_cluster, tmp_path):
    # A corpus big enough to still be writing when the stop arrives.
    command = ["ray", "job", "submit", "--no-wait", "--address", token_cluster.address, "--working-dir", str(REPO),
               "--", "python", "-m", "pipelines.cli", "corpus", "synth", str(tmp_path / "big"), "--images", "200000"]
    env = {**token_cluster.env, "RAY_AUTH_MODE": "token"}
    submitted = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    job_id = re.search(r"(raysubmit_\w+)", submitted.stdout + submitted.stderr).group(1)
    assert wait_for(token_cluster.address, job_id, token_cluster.env, ("RUNNING",)) == "RUNNING"
    stopped = vitpipe("stop", job_id, "--address", token_cluster.address, env=token_cluster.env)
    assert stopped.returncode == 0 and stopped.stdout.strip() == "stopping"
    assert wait_for(token_cluster.address, job_id, token_cluster.env, ("STOPPED", "FAILED", "SUCCEEDED")) == "STOPPED"


@pytest.mark.parametrize("token", ["wrong", None], ids=["wrong-token", "no-token"])
def test_a_client_without_the_right_token_is_refused_in_one_line(token_cluster, ingest_spec, tmp_path, token):
    env = {k: v for k, v in token_cluster.env.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    refused = vitpipe("submit", str(ingest_spec), "--address", token_cluster.address, env=env)
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "token is missing or wrong" in lines[0], refused.stderr
    assert token_cluster.address in lines[0]
    assert token_cluster.token not in refused.stdout + refused.stderr
