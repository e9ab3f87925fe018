"""A RUNNING run is executed by one process: a live owner is refused, a dead one taken over.

The owners here are real processes: a Python process that opens the run through
`run_open.start_stage_run` and then waits, SIGKILLed where the test needs a dead one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import psutil
import pytest
from mlflow.tracking import MlflowClient

from pipelines.core import run_open, run_owner
from pipelines.core.errors import RunInUse
from pipelines.core.run_owner import Owner

OPEN_AND_WAIT = textwrap.dedent("""
    import sys, time
    from mlflow.tracking import MlflowClient
    from pipelines.core import run_open
    run_id, _ = run_open.start_stage_run(MlflowClient(sys.argv[1]), "owners", sys.argv[2], "abc",
                                         tags={"vitpipe.pipeline": "nightly"})
    print(run_id, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def _owner(uri: str, stage: str) -> Iterator[tuple[subprocess.Popen, str]]:
    process = subprocess.Popen([sys.executable, "-c", OPEN_AND_WAIT, uri, stage], stdout=subprocess.PIPE, text=True)
    try:
        run_id = process.stdout.readline().strip()
        assert run_id, "the owner process did not open the run"
        yield process, run_id
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def owner(uri) -> Iterator[tuple[subprocess.Popen, str]]:
    """A live process that opened a pretrain run; returns it and the run's id."""
    yield from _owner(uri, "pretrain")


@pytest.fixture
def pipeline_owner(uri) -> Iterator[tuple[subprocess.Popen, str]]:
    """A live process that opened a pipeline run (named "nightly"); returns it and the run's id."""
    yield from _owner(uri, "pipeline")


def vitpipe_runs(uri: str) -> dict[str, list[str]]:
    """`vitpipe runs`' table: run id -> its row's cells."""
    shown = subprocess.run([sys.executable, "-m", "pipelines.cli", "runs", "--tracking-uri", uri],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    return {line.split()[-1]: line.split() for line in shown.stdout.splitlines()[1:]}


def test_a_running_run_whose_owner_is_alive_is_refused_in_one_line_naming_run_and_process(uri, owner):
    process, run_id = owner
    with pytest.raises(RunInUse) as refused:
        run_open.start_stage_run(MlflowClient(uri), "owners", "pretrain", "abc")
    message = str(refused.value)
    assert f"pretrain run {run_id} is being executed by another vitpipe (pid {process.pid} on " in message
    assert "\n" not in message
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"  # the live run is left as it was


def test_a_running_run_whose_owner_was_sigkilled_is_taken_over_at_once(uri, owner):
    process, run_id = owner
    process.send_signal(signal.SIGKILL)
    process.wait()
    again, previous = run_open.start_stage_run(MlflowClient(uri), "owners", "pretrain", "abc")
    assert (again, previous) == (run_id, "RUNNING")
    recorded = Owner.from_tags(MlflowClient(uri).get_run(run_id).data.tags)
    assert (recorded.host, recorded.pid) == (socket.gethostname(), os.getpid())


def test_a_process_that_reuses_the_owners_pid_is_not_the_owner():
    started = psutil.Process().create_time()
    assert Owner(socket.gethostname(), os.getpid(), started, time.time()).alive()
    assert not Owner(socket.gethostname(), os.getpid(), started - 3600, time.time()).alive()


def test_an_owner_on_another_host_is_alive_while_its_heartbeat_is_younger_than_the_stale_limit():
    now = time.time()
    assert Owner("another-host", 1, now - 3600, now - run_owner.STALE_AFTER_S + 10).alive()
    assert not Owner("another-host", 1, now - 3600, now - run_owner.STALE_AFTER_S - 10).alive()


def test_a_refusal_for_an_owner_on_another_host_says_when_the_run_can_be_taken_over():
    tags = Owner("another-host", 7, time.time() - 3600, time.time() - 20).tag()
    with pytest.raises(RunInUse, match=r"pid 7 on another-host, heartbeat 20 s ago\); wait for it to end, "
                                       r"or, if it is gone, run again in 100 s to resume"):
        run_owner.refuse_if_in_use("pretrain", "abc123", tags)


def test_a_run_with_an_unreadable_owner_tag_is_taken_over(uri):
    client = MlflowClient(uri)
    run_id, _ = run_open.start_stage_run(client, "owners", "pretrain", "abc")
    client.set_tag(run_id, run_owner.TAG_OWNER, "not json")
    assert run_open.start_stage_run(client, "owners", "pretrain", "abc") == (run_id, "RUNNING")


def test_the_owners_heartbeat_advances_while_its_block_runs(uri, monkeypatch):
    monkeypatch.setattr(run_owner, "HEARTBEAT_S", 0.05)
    client = MlflowClient(uri)
    run_id, _ = run_open.start_stage_run(client, "owners", "pretrain", "abc")

    def beat() -> float:
        return json.loads(client.get_run(run_id).data.tags[run_owner.TAG_OWNER])["heartbeat"]

    opened = beat()
    with run_owner.heartbeat(client, run_id):
        deadline = time.monotonic() + 10
        while beat() == opened:
            assert time.monotonic() < deadline, "no heartbeat was recorded"
            time.sleep(0.05)
    assert beat() > opened


def test_vitpipe_runs_shows_a_pipeline_whose_process_lives_as_running(uri, pipeline_owner):
    _, run_id = pipeline_owner
    row = vitpipe_runs(uri)[run_id]
    assert (row[0], row[1]) == ("nightly", "RUNNING")


def test_vitpipe_runs_shows_a_pipeline_whose_process_was_sigkilled_as_interrupted(uri, pipeline_owner):
    process, run_id = pipeline_owner
    process.send_signal(signal.SIGKILL)
    process.wait()
    row = vitpipe_runs(uri)[run_id]
    assert (row[0], row[1]) == ("nightly", "INTERRUPTED")
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"  # shown so, not rewritten in the store


MISSED_HEARTBEAT = textwrap.dedent("""
    import sys, time
    from mlflow.tracking import MlflowClient
    from pipelines.core import logfile, run_owner
    logfile.start_log_file()  # the handlers every vitpipe command installs
    run_owner.HEARTBEAT_S = 0.2
    with run_owner.heartbeat(MlflowClient(sys.argv[1]), "0" * 32):
        time.sleep(3)
""")


def test_a_missed_heartbeat_is_logged_to_the_command_log_without_the_tracking_uris_password(tmp_path):
    # The tracking server is not there: a loopback port nothing listens on; MLflow's error quotes the URL it was given.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        server = f"http://bob:hunter2@127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "VITPIPE_LOG_DIR": str(tmp_path / "logs"), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "PYTHONPATH": os.getcwd()}
    child = subprocess.run([sys.executable, "-c", MISSED_HEARTBEAT, server], capture_output=True, text=True, env=env,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    logged = "".join(p.read_text() for p in (tmp_path / "logs").iterdir()) if (tmp_path / "logs").exists() else ""
    assert "heartbeat not recorded" in logged and "127.0.0.1" in logged
    assert "hunter2" not in logged + child.stderr
