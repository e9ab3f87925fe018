"""Shared test fixtures: real parts, started once per session.

* `ray_cluster`: one local Ray cluster (4 logical CPUs, dashboard on, bound to
  127.0.0.1) for the whole session.
* `s3_server`: moto's S3 server over HTTP on a free loopback port, with IAM
  authentication enforced: requests must carry the fixture's credentials, so a
  wrong key or secret fails as it would on AWS. `s3_bucket` makes a fresh bucket
  per test; `s3_env` puts the server's endpoint and credentials in the environment
  for one test only (monkeypatch), for code that reads the standard AWS chain.
* `tiny_dataset`: a small ingested fractal dataset (local), for stages downstream
  of ingest.

Every process uses its own AWS credential chain; nothing hands the driver's
credentials to Ray workers. As on a real cluster, where each node has its own
(an instance role, a profile), the session cluster's workers read a shared
credentials file of their own (`AWS_SHARED_CREDENTIALS_FILE`, set for the raylet
only); `s3_server` writes the server's keys into it. The test process itself
never sees that variable.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REGION = "us-east-1"

# Ray Train V2's controller polls its workers every 2 s, so a finished run or a killed worker waits for the next
# poll. The suite runs dozens of short runs; every cluster it starts (they inherit this environment) polls at
# 0.25 s (measured: 130-132 s against 151-152 s for five of test_pretrain.py's Train tests).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would every
# command it starts (an ignored signal survives exec): the Ctrl-C tests stand for a terminal's Ctrl-C, so
# take SIGINT back; the commands then start with its default, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# moto's own server entry point with two wire-level fixes, so the server behaves
# like S3 for the clients we use:
# * werkzeug's `request.url` percent-decodes the path and the query ("prefix=a%2F" -> "prefix=a/",
#   "lr%3D0.1" -> "lr=0.1"), so moto's signature check fails for any listing whose prefix holds a
#   "/" and for any key with a character that clients encode (Tune's trial dirs hold "=").
#   Hand moto the URL as sent.
# * moto answers CompleteMultipartUpload with a <CompleteMultipartUploadResponse>
#   root where S3 sends <CompleteMultipartUploadResult>; boto3 does not mind, but
#   the AWS C++ SDK inside pyarrow (Ray Train's checkpoint uploads) rejects it.
_MOTO_LAUNCHER = """
import sys
from moto.core import serialize
from moto.server import main
from werkzeug.wrappers import Request

def _url_as_sent(self):
    return self.host_url.rstrip("/") + self.environ["RAW_URI"]  # werkzeug's server: path and query as sent

Request.url = property(_url_as_sent)

_wrapped = serialize.S3Serializer._serialized_result_to_response

def _fixed(self, resp, result, shape, serialized_result):
    resp = _wrapped(self, resp, result, shape, serialized_result)
    if self.operation_model.name == "CompleteMultipartUpload" and isinstance(resp.get("body"), str):
        resp["body"] = resp["body"].replace("CompleteMultipartUploadResponse", "CompleteMultipartUploadResult")
    return resp

serialize.S3Serializer._serialized_result_to_response = _fixed
sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RayCluster:
    """The session's Ray cluster."""

    address: str
    dashboard_url: str


@pytest.fixture(scope="session", autouse=True)
def command_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`vitpipe` commands run by tests (in this process or as subprocesses) log here, not in ~/.vitpipe."""
    directory = tmp_path_factory.mktemp("vitpipe-logs")
    os.environ["VITPIPE_LOG_DIR"] = str(directory)
    return directory


def _node_credentials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The credentials file of the session cluster's workers (written by `s3_server`)."""
    return tmp_path_factory.getbasetemp() / "ray-node-aws" / "credentials"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """One real local Ray cluster for the session (dashboard on: Train/Tune need its state API)."""
    import ray

    # Starting Ray on a busy 2-core machine can take longer than the default wait.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
    # Train V2's placement-group cleaner finds the state API through RAY_API_SERVER_ADDRESS;
    # with other Ray clusters on the machine its guess can be another cluster's, and
    # finished trials' placement groups then leak. Pin it to this cluster's dashboard.
    dashboard_port = _free_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
    # The raylet (and so every worker) inherits this; the test process drops it again right after.
    node_env = {"AWS_SHARED_CREDENTIALS_FILE": str(_node_credentials(tmp_path_factory)), "AWS_CONFIG_FILE": os.devnull}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            mp.delenv(name, raising=False)
        for name, value in node_env.items():
            mp.setenv(name, value)
        context = ray.init(
            address="local",  # always a fresh cluster, never one that `ray start` left running
            _node_ip_address="127.0.0.1",
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=dashboard_port,
            num_cpus=4,
        )
    # Ray Data binds its log handler to whatever sys.stderr is on its first run; run it once
    # now, so a CLI test (CliRunner swaps stderr, then closes it) is not where that happens.
    import ray.data

    ray.data.range(1).take(1)
    try:
        yield RayCluster(address=context.address_info["gcs_address"], dashboard_url=f"http://{context.dashboard_url}")
    finally:
        ray.shutdown()
        os.environ.pop("RAY_API_SERVER_ADDRESS", None)


@dataclass(frozen=True)
class S3Server:
    """A running S3-compatible server and credentials it accepts."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = REGION

    def client(self, service: str = "s3", **overrides: Any) -> Any:
        """A boto3 client for this server (override `aws_secret_access_key` etc. to test failures)."""
        import boto3

        kwargs: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "region_name": self.region,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
        }
        kwargs.update(overrides)
        return boto3.client(service, **kwargs)

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables pointing at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"S3 test server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{url}/moto-api/reset-auth", timeout=2)
        except urllib.error.HTTPError:
            return  # it answered (400: reset-auth wants a POST)
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"S3 test server did not answer on {url} within {timeout:.0f}s")


def _enforce_auth(url: str) -> tuple[str, str]:
    """Create an IAM user allowed everything, then make the server check every request's signature."""
    import boto3

    iam = boto3.client(
        "iam", endpoint_url=url, region_name=REGION, aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap"
    )
    iam.create_user(UserName="vitpipe-tests")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="vitpipe-tests", PolicyName="all", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="vitpipe-tests")["AccessKey"]
    request = urllib.request.Request(
        f"{url}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(request, timeout=10)
    return key["AccessKeyId"], key["SecretAccessKey"]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server over HTTP on 127.0.0.1:<free port>, with authentication enforced."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("s3-server") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _MOTO_LAUNCHER, "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    try:
        _wait_until_up(url, proc, log)
        access_key, secret_key = _enforce_auth(url)
        node = _node_credentials(tmp_path_factory)  # the session cluster's workers' own chain
        node.parent.mkdir(parents=True, exist_ok=True)
        node.write_text(f"[default]\naws_access_key_id = {access_key}\naws_secret_access_key = {secret_key}\n")
        yield S3Server(url, access_key, secret_key)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket; emptied and removed after the test."""
    client = s3_server.client()
    name = f"test-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=name)
    yield name
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=name, Delete={"Objects": objects})
    client.delete_bucket(Bucket=name)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server's endpoint and credentials in the AWS environment variables, for this test only."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)  # no stray profile settings
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture(scope="session")
def tiny_dataset(ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A finished local ingest output: 120 fractal images in 4 classes, 16×16 pixels, patch 4.

    Splits by key hash: val 0.2, test 0.1. Returns the output directory.
    """
    from pipelines.corpora.images import synth_corpus
    from pipelines.image.ingest import run_ingest
    from pipelines.image.configs import IngestConfig

    root = tmp_path_factory.mktemp("tiny-dataset")
    synth_corpus(str(root / "corpus"), images=120, classes=4, size=24, seed=0)
    config = IngestConfig(
        source=str(root / "corpus"), output=str(root / "out"), image_size=16, patch_size=4,
        val_fraction=0.2, test_fraction=0.1, shard_size=32,
    )
    return run_ingest(config).output


# Session fixtures that live in their own modules; registered here so each starts once per session.
from tests.mlflow_server import mlflow_server  # noqa: E402,F401
from tests.transfer_fixtures import digits_data, digits_export, pretrained  # noqa: E402,F401
