"""Two vitpipes that open the same run at the same moment: at most one executes it.

The twin is a real process that opens the run through `run_open.start_stage_run` and then waits. The
moment is forced: the twin opens the run right after this process has searched for it, before this
process writes anything (the window in which MLflow, with no compare-and-set, lets both go on).
The last test forces nothing: four processes released at once (it failed in 5 of 6 runs with the
checks of `run_open` taken out).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from pipelines.core import run_open, run_owner, tracking
from pipelines.core.errors import RunInUse
from pipelines.core.run_owner import Owner

OPEN_AND_WAIT = textwrap.dedent("""
    import sys, time
    from mlflow.tracking import MlflowClient
    from pipelines.core import run_open
    run_id, _ = run_open.start_stage_run(MlflowClient(sys.argv[1]), "twins", "pretrain", "abc")
    print(run_id, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts; killed after it."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def open_in_a_process(uri: str, processes: list[subprocess.Popen]) -> tuple[subprocess.Popen, str]:
    """A live process that opened the run ("twins", pretrain, "abc"); it and the run's id."""
    process = subprocess.Popen([sys.executable, "-c", OPEN_AND_WAIT, uri], stdout=subprocess.PIPE, text=True)
    processes.append(process)
    run_id = process.stdout.readline().strip()
    assert run_id, "the process did not open the run"
    return process, run_id


def twin_opens_after_our_search(monkeypatch, uri: str, processes: list[subprocess.Popen]) -> dict[str, Any]:
    """From now on, the first search for the run is followed at once by a twin process opening it.
    Returns what the twin did: `process` and `run_id`, once it has."""
    twin: dict[str, Any] = {}
    search: Callable[..., Any] = run_open.find_stage_run

    def search_then_twin_opens(*args: Any) -> Any:
        found = search(*args)
        if not twin:
            twin["process"], twin["run_id"] = open_in_a_process(uri, processes)
        return found

    monkeypatch.setattr(run_open, "find_stage_run", search_then_twin_opens)
    return twin


def live_runs(uri: str) -> list[Any]:
    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name("twins").experiment_id])


def other_process(processes: list[subprocess.Popen]) -> Owner:
    """A live process on this host other than this one, as an owner."""
    process = subprocess.Popen(["sleep", "600"])
    processes.append(process)
    return Owner(socket.gethostname(), process.pid, psutil.Process(process.pid).create_time(), time.time())


def test_a_twin_that_creates_the_new_run_at_the_same_moment_executes_it_alone(uri, monkeypatch, processes):
    twin = twin_opens_after_our_search(monkeypatch, uri, processes)
    with pytest.raises(RunInUse) as refused:
        run_open.start_stage_run(MlflowClient(uri), "twins", "pretrain", "abc")
    assert (f"pretrain run {twin['run_id']} is being executed by another vitpipe (pid {twin['process'].pid} on "
            in str(refused.value))
    assert [run.info.run_id for run in live_runs(uri)] == [twin["run_id"]]
    client = MlflowClient(uri)
    ours = client.search_runs([client.get_experiment_by_name("twins").experiment_id],
                              run_view_type=ViewType.DELETED_ONLY)
    assert len(ours) == 1 and ours[0].data.tags[tracking.TAG_CONFIG_HASH] == "abc"  # created, seen the twin, deleted


def test_a_twin_that_takes_over_a_dead_owners_run_at_the_same_moment_executes_it_alone(uri, monkeypatch, processes):
    dead, run_id = open_in_a_process(uri, processes)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    twin = twin_opens_after_our_search(monkeypatch, uri, processes)
    with pytest.raises(RunInUse) as refused:
        run_open.start_stage_run(MlflowClient(uri), "twins", "pretrain", "abc")
    assert twin["run_id"] == run_id
    assert f"pretrain run {run_id} is being executed by another vitpipe (pid {twin['process'].pid} on " in str(refused.value)
    assert Owner.from_tags(MlflowClient(uri).get_run(run_id).data.tags).pid == twin["process"].pid


def test_a_live_claim_of_another_process_makes_the_opener_back_off_and_say_so_in_one_line(uri, processes,
                                                                                          monkeypatch):
    monkeypatch.setattr(run_open, "OPEN_TRIES", 2)  # each try backs off a random pause more
    dead, run_id = open_in_a_process(uri, processes)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    claimant = other_process(processes)  # claimed the run and has not yet checked: it holds it for now
    client = MlflowClient(uri)
    client.set_tag(run_id, claimant.claim_key(), claimant.value())
    with pytest.raises(RunInUse) as refused:
        run_open.start_stage_run(client, "twins", "pretrain", "abc")
    assert str(refused.value) == (f"pretrain run with config digest abc: another vitpipe (pid {claimant.pid} on "
                                  f"{claimant.host}) opened it at the same moment {run_open.OPEN_TRIES} times in a "
                                  "row; run again")
    tags = client.get_run(run_id).data.tags
    assert Owner.from_tags(tags).pid == dead.pid  # nothing taken over
    assert [key for key in tags if key.startswith(run_owner.TAG_CLAIM)] == [claimant.claim_key()]


def test_a_claim_left_by_a_dead_process_does_not_stop_a_takeover_and_the_taker_leaves_no_claim(uri, processes):
    dead, run_id = open_in_a_process(uri, processes)
    claimant = Owner.from_tags(MlflowClient(uri).get_run(run_id).data.tags)
    client = MlflowClient(uri)
    client.set_tag(run_id, claimant.claim_key(), claimant.value())
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    assert run_open.start_stage_run(client, "twins", "pretrain", "abc") == (run_id, "RUNNING")
    tags = client.get_run(run_id).data.tags
    assert Owner.from_tags(tags).is_me()
    assert [key for key in tags if key.startswith(run_owner.TAG_CLAIM)] == [claimant.claim_key()]


OPEN_AT_THE_SIGNAL = textwrap.dedent("""
    import sys, time
    from mlflow.tracking import MlflowClient
    from pipelines.core import run_open
    from pipelines.core.errors import RunInUse
    client = MlflowClient(sys.argv[1])
    client.search_experiments()  # connected: what is left to do after the signal is the opening alone
    print("ready", flush=True)
    sys.stdin.read()  # the signal: the test closes every opener's stdin at once
    try:
        run_open.start_stage_run(client, "twins", "pretrain", "abc")
        print("opened", flush=True)
        time.sleep(30)  # executing it: alive while the others look
    except RunInUse:
        print("refused", flush=True)
""")


def test_of_four_vitpipes_that_open_the_same_new_run_at_once_one_executes_it_and_three_are_refused(uri, processes):
    MlflowClient(uri).create_experiment("twins")  # made by hand: each of the four also tags it
    four = [subprocess.Popen([sys.executable, "-c", OPEN_AT_THE_SIGNAL, uri], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    processes.extend(four)
    assert [process.stdout.readline().strip() for process in four] == ["ready"] * 4
    for process in four:
        process.stdin.close()
    said = [process.stdout.readline().strip() or process.stderr.read()[-2000:] for process in four]
    assert sorted(said) == ["opened", "refused", "refused", "refused"]
    assert len(live_runs(uri)) == 1
