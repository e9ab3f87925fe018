"""A fine-tuning sweep interrupted, then run again: `vitpipe finetune` in a subprocess on the session's real
local cluster and `mlflow server`, stopped by a real SIGKILL or SIGINT of its driver.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from pyarrow.fs import LocalFileSystem

from pipelines.image.configs import FinetuneConfig
from pipelines.image.finetune_trial import checkpoint_step, latest_checkpoint
from tests.process_output import result_json
from tests.run_files import run_dir
from tests.transfer_fixtures import sweep_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]



def _experiment_trials(path: Path) -> dict[str, str]:
    """Trial id -> status, from the newest experiment state Tune wrote."""
    files = sorted(glob.glob(str(path / "experiment_state-*.json")))
    if not files:
        return {}
    try:
        state = json.loads(Path(files[-1]).read_text())
    except ValueError:  # caught mid-write
        return {}
    trials = [json.loads(t[0]) if isinstance(t[0], str) else t[0] for t in state["trial_data"]]
    return {t["trial_id"]: t["status"] for t in trials}


def _start_vitpipe_finetune(config: FinetuneConfig, tmp: Path, address: str,
                            env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str], Path]:
    """`vitpipe finetune` of `config` started in a session of its own; returns it, its command and its log."""
    config_file = tmp / "finetune.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    log = tmp / "stage.log"
    command = [sys.executable, "-m", "pipelines.cli", "finetune", str(config_file), "--address", address]
    with open(log, "ab") as out:
        driver = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, **(env or {})})
    return driver, command, log


def _wait_for_the_second_trial(driver: subprocess.Popen, sweep_dir: Path, log: Path) -> None:
    """Until the first of two trials run one after the other has finished and the second is recorded, not finished."""
    deadline = time.monotonic() + 400
    while sorted(_experiment_trials(sweep_dir).values()) not in (["PENDING", "TERMINATED"], ["RUNNING", "TERMINATED"]):
        assert driver.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no interruption point in time: {_experiment_trials(sweep_dir)}"
        time.sleep(0.5)


def _snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file()}


def test_a_sweep_killed_midway_resumes_without_rerunning_finished_trials(digits_data, pretrained, ray_cluster, tmp_path):
    # Two trials one after the other: a short one that finishes, then a longer one the kill interrupts.
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp_path, run_name="killed",
                          search_space={"lr": 0.02, "steps": {"grid": [4, 24]}}, scheduler="fifo",
                          max_concurrent_trials=1, registry_model=None, experiment="finetune-resume")
    first, command, log = _start_vitpipe_finetune(config, tmp_path, ray_cluster.address)
    sweep_dir = run_dir(config)
    try:
        _wait_for_the_second_trial(first, sweep_dir, log)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver mid-sweep
        first.wait()
    before = _experiment_trials(sweep_dir)
    finished = [t for t, status in before.items() if status == "TERMINATED"]
    trial_dirs = {t: run_dir(config, "killed-work") / "trials" / t for t in finished}
    snapshots = {t: _snapshot(d) for t, d in trial_dirs.items()}

    with open(log, "ab") as out:
        second = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=500)
    assert second.returncode == 0, log.read_text()[-3000:]
    result = result_json(log.read_text())

    assert set(result["trial_status"]) == set(before) and len(before) == 2  # no trial was added or replaced
    assert set(result["trial_status"].values()) == {"completed"}
    for trial, directory in trial_dirs.items():
        assert _snapshot(directory) == snapshots[trial]  # the finished trial's Train run was not touched
    client = MlflowClient(config.tracking_uri)
    experiment = client.get_experiment_by_name(config.experiment).experiment_id
    stage_runs = client.search_runs([experiment], filter_string="tags.`vitpipe.stage` = 'finetune'")
    assert [r.info.run_id for r in stage_runs] == [result["run_id"]]  # the rerun reopened the killed run
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{result['run_id']}'")
    assert sorted(r.data.tags["vitpipe.trial_id"] for r in children) == sorted(before)


def _wait_for_a_finished_train_run_and_the_next(driver: subprocess.Popen, trials: Path, steps: int, log: Path) -> str:
    """Until one trial's Train run holds its checkpoint at `steps` and the next trial's Train run has begun."""
    fs, deadline = LocalFileSystem(), time.monotonic() + 400
    while True:
        assert driver.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no interruption point in time"
        runs = [d for d in trials.glob("*") if d.is_dir()] if trials.is_dir() else []
        finished = [d.name for d in runs if (c := latest_checkpoint(fs, str(d))) and checkpoint_step(fs, c) >= steps]
        if finished and len(runs) == 2:
            return finished[0]
        time.sleep(0.2)


@pytest.mark.parametrize("scheduler", ["fifo", "pbt"])
def test_a_trial_whose_train_run_ended_after_tune_last_saved_its_state_reports_its_result_on_resume(
        digits_data, pretrained, ray_cluster, tmp_path, scheduler):
    # Tune saves its state every few seconds; a driver killed in between leaves a trial unfinished there
    # whose Train run has already written its last checkpoint. A long period makes that window certain.
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp_path,
                          run_name=f"lagging-{scheduler}", search_space={"lr": {"grid": [0.02, 0.01]}, "steps": 4},
                          scheduler=scheduler, perturbation_interval=4, max_concurrent_trials=1, registry_model=None,
                          experiment=f"finetune-lagging-{scheduler}")
    first, command, log = _start_vitpipe_finetune(config, tmp_path, ray_cluster.address,
                                                  env={"TUNE_GLOBAL_CHECKPOINT_S": "3600"})
    try:
        trials = run_dir(config, f"lagging-{scheduler}-work") / "trials"
        ended = _wait_for_a_finished_train_run_and_the_next(first, trials, 4, log)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert _experiment_trials(run_dir(config))[ended] != "TERMINATED"  # what makes this case

    with open(log, "ab") as out:
        second = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=500)
    assert second.returncode == 0, log.read_text()[-3000:]
    result = result_json(log.read_text())

    assert result["trial_status"][ended] == "completed"
    client = MlflowClient(config.tracking_uri)
    experiment = client.get_experiment_by_name(config.experiment).experiment_id
    [run] = client.search_runs([experiment], filter_string=f"tags.`vitpipe.trial_id` = '{ended}'")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_loss")}
    assert run.data.metrics["final_val_loss"] == history[4]  # its last report, made before the kill


def test_a_sweep_stopped_by_ctrl_c_ends_killed_with_its_trials_says_so_in_one_line_and_registers_nothing(
        digits_data, pretrained, ray_cluster, tmp_path):
    # Tune returns from `fit` on SIGINT, its state saved, with the second trial unfinished (400 steps).
    config = sweep_config(digits_data, pretrained.run_id, pretrained.tracking_uri, tmp_path, run_name="ctrl-c",
                          search_space={"lr": 0.02, "steps": {"grid": [4, 400]}}, scheduler="fifo",
                          max_concurrent_trials=1, registry_model="ctrl-c-digits", experiment="finetune-ctrl-c")
    driver, _, log = _start_vitpipe_finetune(config, tmp_path, ray_cluster.address)
    try:
        _wait_for_the_second_trial(driver, run_dir(config), log)
        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=120) == 128 + signal.SIGINT
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    stops = [line for line in log.read_text().splitlines() if line.startswith(("stopped", "error:"))]
    assert len(stops) == 1, log.read_text()[-3000:]
    assert stops[0].startswith("stopped by SIGINT: finetune: the sweep ended 1 of 2 trials; finetune run ctrl-c is "
                               "KILLED; the same command resumes it")
    client = MlflowClient(config.tracking_uri)
    experiment = client.get_experiment_by_name(config.experiment).experiment_id
    [stage_run] = client.search_runs([experiment], filter_string="tags.`vitpipe.stage` = 'finetune'")
    assert stage_run.info.status == "KILLED" and "vitpipe.best_trial" not in stage_run.data.tags
    trials = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{stage_run.info.run_id}'")
    assert trials and "RUNNING" not in {t.info.status for t in trials}  # none left looking alive
    assert client.search_registered_models(filter_string="name = 'ctrl-c-digits'") == []


