"""Pipelines as Ray jobs on a real multi-node cluster with token authentication on.

`cluster/local_cluster.sh` starts a head and one worker node on loopback (its own
ports and temp dir, beside the session's in-process cluster); every client here
is a real `vitpipe` or `ray` process that finds the token where Ray's tools do.
Each submission costs seconds, so two jobs serve most tests: one followed to
SUCCEEDED (`followed_job`), one submitted with --no-wait that fails (`failed_job`).
"""

from __future__ import annotations

import json
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
    # The cluster's own environment: no AWS or MLflow settings, so whatever a job sees came with it.
    drop = ("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH", "AWS_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
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


# On the job's PYTHONPATH (through --runtime-env): every Python process of the job prints the settings it sees.
_PROBE = """
import json, os
seen = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "MLFLOW_", "VITPIPE_PROBE"))}
print("VITPIPE-PROBE " + json.dumps(seen, sort_keys=True), flush=True)
"""
_KEY_ID, _SECRET, _SESSION = "AKIAVITPIPETESTKEY01", "s3cr3t-" + secrets.token_hex(8), "sess-" + secrets.token_hex(8)


@dataclass(frozen=True)
class FollowedJob:
    done: subprocess.CompletedProcess  # the `vitpipe submit` that followed the job to its end
    submission_id: str
    tracking_db: Path  # MLFLOW_TRACKING_URI on the submitting side only

    @property
    def seen(self) -> dict[str, str]:
        """The settings the job's driver saw (its first probe line)."""
        return json.loads(re.search(r"^VITPIPE-PROBE (\{.*\})$", self.done.stdout, re.M).group(1))


@pytest.fixture(scope="module")
def untracked_spec(ingest_spec) -> Path:
    """The ingest spec without a tracking URI: the job needs MLFLOW_TRACKING_URI from the submitter."""
    spec = yaml.safe_load(ingest_spec.read_text())
    del spec["tracking_uri"]
    path = ingest_spec.with_name("untracked.yaml")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def followed_job(token_cluster, untracked_spec, tmp_path_factory) -> FollowedJob:
    """One job submitted the default way (following it) with a submission id, --runtime-env, --env, the tracking
    URI and AWS settings in the submitter's environment, and AWS keys there too."""
    tmp = tmp_path_factory.mktemp("followed-job")
    (tmp / "sitecustomize.py").write_text(_PROBE)
    runtime_env = tmp / "runtime_env.yaml"
    runtime_env.write_text(yaml.safe_dump({"env_vars": {"PYTHONPATH": str(tmp)}}))
    env = {**token_cluster.env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "AWS_REGION": "eu-west-3",
           "AWS_DEFAULT_REGION": "eu-west-3", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9", "AWS_PROFILE": "laptop",
           "AWS_ACCESS_KEY_ID": _KEY_ID, "AWS_SECRET_ACCESS_KEY": _SECRET, "AWS_SESSION_TOKEN": _SESSION}
    submission_id = f"vitpipe-test-{secrets.token_hex(4)}"
    done = vitpipe("submit", str(untracked_spec), "--address", token_cluster.address, "--submission-id",
                   submission_id, "--runtime-env", str(runtime_env), "--env", "VITPIPE_PROBE=hello", env=env)
    return FollowedJob(done, submission_id, tmp / "mlflow.db")


@pytest.fixture(scope="module")
def failed_job(token_cluster, ingest_spec) -> tuple[subprocess.CompletedProcess, str]:
    """A job submitted with --no-wait whose ingest source does not exist: it fails on the cluster."""
    done = vitpipe("submit", str(ingest_spec), "--address", token_cluster.address, "--no-wait",
                   "--set", "corpus.source=/nonexistent/vitpipe-corpus", env=token_cluster.env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, done.stdout.strip()


def test_vitpipe_submit_runs_a_pipeline_to_succeeded_and_never_prints_the_token(token_cluster, followed_job):
    done = followed_job.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    job_id = done.stdout.splitlines()[0]
    assert re.search(r"^corpus\s+ingest\s+(done|reused)\s", done.stdout, re.M), done.stdout
    assert vitpipe("status", job_id, "--address", token_cluster.address, env=token_cluster.env).stdout.strip() == "SUCCEEDED"
    logs = vitpipe("logs", job_id, "--address", token_cluster.address, env=token_cluster.env).stdout
    assert "pipeline run" in logs
    assert token_cluster.token not in done.stdout + done.stderr + logs


def test_submit_follows_the_jobs_logs_until_it_ends(followed_job):
    done = followed_job.done
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"following job {followed_job.submission_id}" in done.stderr
    assert "VITPIPE-PROBE" in done.stdout  # printed by the job's processes, streamed back while it ran
    assert re.search(r"^corpus\s+ingest\s+(done|reused)\s", done.stdout, re.M)  # the job's last words


def test_submit_gives_the_job_its_submission_id(token_cluster, followed_job):
    assert followed_job.done.stdout.splitlines()[0] == followed_job.submission_id
    state = vitpipe("status", followed_job.submission_id, "--address", token_cluster.address, env=token_cluster.env)
    assert state.stdout.strip() == "SUCCEEDED"


def test_submit_forwards_the_tracking_uri_and_the_non_secret_aws_settings(followed_job):
    seen = followed_job.seen
    assert seen["MLFLOW_TRACKING_URI"] == f"sqlite:///{followed_job.tracking_db}"
    assert followed_job.tracking_db.is_file()  # the job's runs went to the submitter's store
    assert seen["AWS_REGION"] == seen["AWS_DEFAULT_REGION"] == "eu-west-3"
    assert seen["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9"
    assert "AWS_PROFILE" not in seen  # a profile of the laptop's ~/.aws, unknown on the nodes


def test_env_and_runtime_env_options_reach_the_job(followed_job):
    assert followed_job.seen["VITPIPE_PROBE"] == "hello"  # --env; the probe itself came by --runtime-env


def test_no_aws_key_or_session_token_reaches_the_job(token_cluster, followed_job):
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(followed_job.seen)
    logs = vitpipe("logs", followed_job.submission_id, "--address", token_cluster.address, env=token_cluster.env).stdout
    for secret in (_KEY_ID, _SECRET, _SESSION):
        assert secret not in followed_job.done.stdout + followed_job.done.stderr + logs


def test_jobs_lists_the_clusters_jobs(token_cluster, followed_job):
    listed = vitpipe("jobs", "--address", token_cluster.address, env=token_cluster.env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split() == ["id", "status", "start", "time", "entrypoint"]
    row = next(line for line in listed.stdout.splitlines() if line.startswith(followed_job.submission_id))
    started = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.search(rf"\sSUCCEEDED\s+{started}\s+python -m pipelines.cli run \S+untracked.yaml$", row), row


def test_submit_no_wait_returns_at_once_with_only_the_job_id(token_cluster, failed_job):
    done, job_id = failed_job
    assert done.stdout.splitlines() == [job_id]  # no logs: following this job would have exited 1
    assert wait_for(token_cluster.address, job_id, token_cluster.env, ("FAILED", "SUCCEEDED", "STOPPED")) == "FAILED"


def test_following_a_failed_job_exits_1_naming_its_status(token_cluster, failed_job):
    _, job_id = failed_job
    followed = vitpipe("logs", job_id, "--follow", "--address", token_cluster.address, env=token_cluster.env)
    assert followed.returncode == 1
    assert "/nonexistent/vitpipe-corpus" in followed.stdout  # the job's own error, streamed
    assert followed.stderr.strip().splitlines()[-1].startswith(f"error: job {job_id} FAILED")


def test_a_spec_without_a_tracking_uri_is_refused_before_submitting(token_cluster, untracked_spec):
    refused = vitpipe("submit", str(untracked_spec), "--address", token_cluster.address, env=token_cluster.env)
    assert refused.returncode == 1 and refused.stdout == ""
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith(f"error: spec {untracked_spec}: no tracking URI: set tracking_uri in the spec or "
                           "MLFLOW_TRACKING_URI"), line


def test_job_commands_take_the_address_from_RAY_ADDRESS(token_cluster, followed_job):
    env = {**token_cluster.env, "RAY_ADDRESS": token_cluster.address}
    assert vitpipe("status", followed_job.submission_id, env=env).stdout.strip() == "SUCCEEDED"


def test_the_old_ray_address_flag_still_names_the_cluster(token_cluster, followed_job):
    address = token_cluster.address
    state = vitpipe("status", followed_job.submission_id, "--ray-address", address, env=token_cluster.env)
    assert state.stdout.strip() == "SUCCEEDED", state.stderr


def test_rays_own_job_submit_runs_the_same_spec(token_cluster, ingest_spec):
    command = ["ray", "job", "submit", "--address", token_cluster.address, "--working-dir", str(REPO),
               "--", "python", "-m", "pipelines.cli", "run", str(ingest_spec)]
    env = {**token_cluster.env, "RAY_AUTH_MODE": "token"}  # Ray's own CLI sends the token only in token mode
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    output = done.stdout + done.stderr
    assert re.search(r"Job '\w+' succeeded", output), output[-2000:]
    assert re.search(r"^corpus\s+ingest\s+(done|reused)\s", output, re.M)  # the pipeline's own summary


def test_a_stopped_pipeline_job_ends_its_runs_killed_and_its_log_says_so(token_cluster, ingest_spec, tmp_path):
    from mlflow.tracking import MlflowClient

    spec = yaml.safe_load(ingest_spec.read_text())
    spec.update(name="job-stop", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage={"root": str(tmp_path / "work")})
    spec["stages"]["pretrain"] = {  # long enough to be mid-training when the stop arrives
        "kind": "pretrain", "inputs": ["corpus"], "model": "ViT-Ti/16", "steps": 100_000, "warmup_steps": 1,
        "model_overrides": {"depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}, "num_workers": 1,
        "batch_size_per_worker": 8, "log_interval": 1, "augment": False}
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    submitted = vitpipe("submit", str(spec_file), "--address", token_cluster.address, "--no-wait", env=token_cluster.env)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    job_id = submitted.stdout.strip()
    client = MlflowClient(spec["tracking_uri"])
    deadline = time.monotonic() + 240
    while not _pretrain_steps(client):  # Ray Train is training, not starting up
        assert vitpipe("status", job_id, "--address", token_cluster.address, env=token_cluster.env).stdout.strip() \
            in ("PENDING", "RUNNING") and time.monotonic() < deadline
        time.sleep(1)

    stopped = vitpipe("stop", job_id, "--address", token_cluster.address, env=token_cluster.env)
    assert stopped.returncode == 0 and stopped.stdout.strip() == "stopping"
    assert wait_for(token_cluster.address, job_id, token_cluster.env, ("STOPPED", "FAILED", "SUCCEEDED")) == "STOPPED"
    runs = {r.data.tags["vitpipe.stage"]: r for r in client.search_runs(
        [client.get_experiment_by_name("vitpipe").experiment_id])}
    assert {stage: run.info.status for stage, run in runs.items()} == {
        "pipeline": "KILLED", "ingest": "FINISHED", "pretrain": "KILLED"}
    logs = vitpipe("logs", job_id, "--address", token_cluster.address, env=token_cluster.env).stdout
    [line] = [line for line in logs.splitlines() if line.startswith("stopped")]
    assert line.startswith(f"stopped by SIGTERM: pretrain run {runs['pretrain'].info.run_name} is KILLED; pipeline run "
                           f"{runs['pipeline'].info.run_id} is KILLED; the same command resumes it")


# A job whose SIGTERM handler needs 6 s to end its work (as ending runs KILLED may on a busy head).
_SLOW_STOP = """
import pathlib, signal, sys, time
def end(*_):
    time.sleep(6)
    pathlib.Path(sys.argv[1]).write_text("ended")
    sys.exit(143)
signal.signal(signal.SIGTERM, end)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_stopped_job_has_time_to_end_its_work_before_rays_sigkill(token_cluster, tmp_path):
    # Ray's supervisor SIGKILLs a stopped job RAY_JOB_STOP_WAIT_TIME_S after its SIGTERM, 3 s unless the job's
    # env says otherwise; vitpipe's job env does (ray job submit with that env, so no upload is needed).
    from pipelines.jobs import job_runtime_env

    program, marker = tmp_path / "slow_stop.py", tmp_path / "ended"
    program.write_text(_SLOW_STOP)
    env_json = json.dumps({"env_vars": job_runtime_env().get("env_vars", {})})
    command = ["ray", "job", "submit", "--address", token_cluster.address, "--no-wait", "--runtime-env-json",
               env_json, "--", sys.executable, str(program), str(marker)]
    done = subprocess.run(command, env={**token_cluster.env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [job_id] = re.findall(r"Job '(\w+)' submitted", done.stdout + done.stderr)
    deadline = time.monotonic() + 120
    while "ready" not in vitpipe("logs", job_id, "--address", token_cluster.address, env=token_cluster.env).stdout:
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(1)
    assert vitpipe("stop", job_id, "--address", token_cluster.address, env=token_cluster.env).returncode == 0
    assert wait_for(token_cluster.address, job_id, token_cluster.env, ("STOPPED", "FAILED", "SUCCEEDED")) == "STOPPED"
    assert marker.read_text() == "ended"


def _pretrain_steps(client) -> int:
    """The steps the job's pretrain run has logged so far (0 before the run exists)."""
    experiment = client.get_experiment_by_name("vitpipe")
    runs = client.search_runs([experiment.experiment_id], "tags.`vitpipe.stage` = 'pretrain'") if experiment else []
    return len(client.get_metric_history(runs[0].info.run_id, "train_loss")) if runs else 0


def test_the_jobs_api_sends_the_token_from_a_program_that_used_ray_before(token_cluster, followed_job):
    # Ray caches its config at first use: RAY_AUTH_MODE set later is not seen unless the config is reloaded.
    program = ("import sys; from ray._private.authentication.authentication_utils import is_token_auth_enabled; "
               "assert not is_token_auth_enabled(); from pipelines import jobs; "
               "print([j['id'] for j in jobs.list_jobs(sys.argv[1])])")
    env = {k: v for k, v in token_cluster.env.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run([sys.executable, "-c", program, token_cluster.address], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert followed_job.submission_id in done.stdout


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
