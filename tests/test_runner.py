"""The pipeline runner on the session's real local Ray: a whole spec, ingest → pretrain → fine-tune → evaluate.

One tiny pipeline runs once (module fixture), tracked on the session's real
`mlflow server`, then again; the tests read both outcomes, through `MlflowClient`
and through the MLflow UI in headless Chromium. A second spec fails in its
pretrain stage; a third is killed mid-pretrain and run again.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

import vit

from pipelines.core import tracking
from pipelines.core.errors import VitpipeError
from pipelines.runner import TAG_FORCED, PipelineResult, forced_stamps, run_pipeline
from pipelines.spec import PipelineSpec
from pipelines.spec_file import load_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}


def write_spec(tmp: Path, corpus: Path, tracking_uri: str | None = None, only: tuple[str, ...] = (), **pretrain_fields) -> Path:
    spec = {
        "name": "tiny",
        "storage": {"root": str(tmp / "work")},
        "tracking_uri": tracking_uri or f"sqlite:///{tmp}/mlflow.db",
        "experiment": "runner-tests",
        "stages": {
            "corpus": {"kind": "ingest", "source": str(corpus), "image_size": 16, "patch_size": 4,
                       "val_fraction": 0.2, "test_fraction": 0.2, "shard_size": 100},
            "pretrain": {"kind": "pretrain", "inputs": ["corpus"], "model": "ViT-Ti/16", "model_overrides": TINY,
                         "num_workers": 1, "batch_size_per_worker": 16, "steps": 6, "warmup_steps": 1,
                         "log_interval": 2, "augment": False, **pretrain_fields},
            "finetune": {"kind": "finetune", "inputs": ["corpus", "pretrain"], "batch_size": 16, "eval_interval": 3,
                         "search_space": {"lr": 0.01, "steps": 6}, "max_concurrent_trials": 1},
            # From the fine-tune's logged model (`models:/m-…`), which failed before the stage could start.
            "fewshot": {"kind": "evaluate", "inputs": ["corpus", "finetune"], "shots": [1, 2], "repeats": 1},
        },
    }
    if only:
        spec["stages"] = {name: stage for name, stage in spec["stages"].items() if name in only}
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from pipelines.corpora.images import synth_corpus

    root = tmp_path_factory.mktemp("runner-corpus")
    synth_corpus(str(root), images=150, classes=3, size=16, seed=3)
    return root


@pytest.fixture(scope="module")
def tiny_spec(mlflow_server, corpus, tmp_path_factory) -> PipelineSpec:
    """The tiny pipeline, tracked on the real `mlflow server` (artifacts on the S3 server)."""
    return load_spec(write_spec(tmp_path_factory.mktemp("runner"), corpus, tracking_uri=mlflow_server))


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_spec) -> tuple[PipelineResult, PipelineResult, MlflowClient]:
    """The pipeline run twice."""
    first = run_pipeline(tiny_spec)
    second = run_pipeline(tiny_spec)
    return first, second, MlflowClient(tiny_spec.resolved_tracking_uri())


@pytest.fixture(scope="module")
def forced(runs, tiny_spec) -> PipelineResult:
    """The same pipeline a third time, with `--force fewshot`."""
    return run_pipeline(tiny_spec, force=["fewshot"])


def test_every_stage_runs_in_dependency_order(runs):
    first, _, _ = runs
    assert [(r.stage, r.status) for r in first.rows] == [
        ("corpus", "done"), ("pretrain", "done"), ("finetune", "done"), ("fewshot", "done")]
    assert first.ok


def test_each_stage_is_a_child_run_of_one_pipeline_run_with_lineage_tags(runs):
    first, _, client = runs
    by_stage = {r.stage: r.run_id for r in first.rows}
    for stage, run_id in by_stage.items():
        tags = client.get_run(run_id).data.tags
        assert tags["mlflow.parentRunId"] == first.run_id, stage
        assert tags["vitpipe.stage_name"] == stage
    assert client.get_run(by_stage["finetune"]).data.tags["vitpipe.upstream_runs"] == (
        f"corpus={by_stage['corpus']},pretrain={by_stage['pretrain']}")
    assert client.get_run(by_stage["pretrain"]).data.tags["vitpipe.ingest_run_id"] == by_stage["corpus"]
    assert client.get_run(by_stage["fewshot"]).data.tags["vitpipe.upstream_runs"] == (
        f"corpus={by_stage['corpus']},finetune={by_stage['finetune']}")


def test_the_pipeline_run_holds_the_resolved_spec_and_the_latest_summary(runs):
    first, second, client = runs
    parent = client.get_run(first.run_id)
    assert parent.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(first.run_id)}
    assert {"spec.yaml", "summary.json", "summary.txt"} <= artifacts
    summary = client.download_artifacts(first.run_id, "summary.txt")
    assert Path(summary).read_text() == second.table() + "\n"
    assert "test_accuracy=" in first.table() and "1-shot=" in first.table()


def test_running_the_same_spec_again_reuses_every_stage_and_the_pipeline_run(runs):
    first, second, _ = runs
    assert [r.status for r in second.rows] == ["reused"] * 4
    assert second.run_id == first.run_id
    assert [r.run_id for r in second.rows] == [r.run_id for r in first.rows]


def test_force_reruns_the_named_stage_as_a_new_run_and_reuses_the_others(runs, forced):
    first, _, client = runs
    assert [(r.stage, r.status) for r in forced.rows] == [
        ("corpus", "reused"), ("pretrain", "reused"), ("finetune", "reused"), ("fewshot", "done")]
    before = {r.stage: r.run_id for r in first.rows}
    after = {r.stage: r.run_id for r in forced.rows}
    assert after["fewshot"] != before["fewshot"] and after["pretrain"] == before["pretrain"]
    assert client.get_run(after["fewshot"]).data.tags["mlflow.parentRunId"] == forced.run_id


def test_a_finished_forced_stage_leaves_no_stamp_so_forcing_it_again_is_new_work(runs, forced):
    _, _, client = runs
    assert TAG_FORCED + "fewshot" not in client.get_run(forced.run_id).data.tags


def test_a_forced_stage_that_did_not_finish_keeps_its_stamp_so_the_same_command_resumes_its_run(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = client.create_run(client.create_experiment("e"), tags={TAG_FORCED + "pretrain": "20261207-014700"}).info.run_id
    stamps = forced_stamps(client, run_id, ["pretrain", "fewshot"])
    assert stamps["pretrain"] == "20261207-014700"  # the stopped invocation's: same run name, same identity
    assert re.fullmatch(r"\d{8}-\d{6}", stamps["fewshot"]) and stamps["fewshot"] != stamps["pretrain"]
    assert client.get_run(run_id).data.tags[TAG_FORCED + "fewshot"] == stamps["fewshot"]  # kept for a rerun


def test_forcing_a_stage_the_spec_lacks_is_refused_by_name(tiny_spec):
    with pytest.raises(VitpipeError, match=r"--force fewshots: pipeline 'tiny' has no such stage; its stages are corpus,"):
        run_pipeline(tiny_spec, force=["fewshots"])


def test_a_failing_stage_stops_its_dependents_and_keeps_finished_outputs(ray_cluster, corpus, tmp_path):
    # 32 is not divisible into 5 heads: the pretrain stage fails before training starts.
    spec = load_spec(write_spec(tmp_path, corpus, model_overrides={**TINY, "num_heads": 5}))
    result = run_pipeline(spec)
    assert [(r.stage, r.status) for r in result.rows] == [
        ("corpus", "done"), ("pretrain", "failed"), ("finetune", "skipped"), ("fewshot", "skipped")]
    assert "num_heads" in result.rows[1].error
    assert (tmp_path / "work" / "data" / "corpus" / "manifest.json").exists()
    client = MlflowClient(spec.resolved_tracking_uri())
    assert client.get_run(result.run_id).info.status == "FAILED"


def test_an_unexpected_error_fails_its_stage_alone_and_the_others_still_run(ray_cluster, corpus, tmp_path):
    from pipelines.image.ingest import run_ingest
    from pipelines.image.configs import IngestConfig

    # Few-shot evaluation of a damaged shard: pyarrow raises in the driver, not a vitpipe error.
    data = run_ingest(IngestConfig(source=str(corpus), output=str(tmp_path / "damaged"), image_size=16,
                                   patch_size=4, val_fraction=0.2, test_fraction=0.2)).output
    for shard in Path(data, "shards").glob("*.parquet"):
        raw = shard.read_bytes()
        shard.write_bytes(raw[:64] + bytes(len(raw) // 2 - 64) + raw[len(raw) // 2:])
    vit.save_checkpoint(vit.create_model("ViT-Ti/16", image_size=16, patch_size=4, **TINY), tmp_path / "ckpt")
    path = write_spec(tmp_path, corpus, only=("corpus",))
    spec = yaml.safe_load(path.read_text())
    spec["stages"] = {"fewshot": {"kind": "evaluate", "data": data, "init": str(tmp_path / "ckpt"), "shots": [1]},
                      **spec["stages"]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = run_pipeline(load_spec(path))
    assert [(r.stage, r.status) for r in result.rows] == [("fewshot", "failed"), ("corpus", "done")]
    assert re.match(r"\w+(Error|Exception): ", result.rows[0].error), result.rows[0].error
    assert MlflowClient(load_spec(path).resolved_tracking_uri()).get_run(result.run_id).info.status == "FAILED"


def test_the_fine_tune_trials_are_nested_below_the_fine_tune_stage(runs):
    first, _, client = runs
    finetune = next(r.run_id for r in first.rows if r.stage == "finetune")
    experiment = client.get_run(finetune).info.experiment_id
    trials = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{finetune}'")
    assert len(trials) == 1 and trials[0].data.tags["vitpipe.stage"] == "finetune-trial"


def test_the_fine_tune_run_holds_its_trials_learning_curves_and_each_trial_its_system_metrics(runs):
    first, _, client = runs
    finetune = next(r.run_id for r in first.rows if r.stage == "finetune")
    assert "trial_curves.png" in {a.path for a in client.list_artifacts(finetune)}
    experiment = client.get_run(finetune).info.experiment_id
    trial = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{finetune}'")[0]
    assert "system/cpu_utilization_percentage" in trial.data.metrics


def _chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "headless Chromium is needed (Debian package chromium; .ci/run installs it)"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=30000"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=timeout)


def test_the_mlflow_ui_opens_the_experiment_on_its_runs_table(runs, mlflow_server, tmp_path):
    first, _, client = runs
    experiment = client.get_run(first.run_id).info.experiment_id
    assert client.get_experiment(experiment).tags["mlflow.experimentKind"] == "custom_model_development"
    # MLflow 3.17's UI takes the kind from its GenAI / Model training switch, not from the tag: the address's
    # `workflowType`, else the browser's last choice, GenAI in a fresh one (its overview lists no run).
    # The link that `vitpipe run` prints opens a fresh browser on the runs table.
    page = tracking.browse_hint(first.tracking_uri, first.run_id).removeprefix("browse the runs: ")
    assert page == tracking.experiment_page(mlflow_server, experiment)
    dom = _chromium(f"--user-data-dir={tmp_path / 'profile-dom'}", "--dump-dom", page).stdout
    assert "Run Name" in dom and "tiny" in dom  # the runs table's header, and the pipeline run's name in it
    shot = tmp_path / "runs.png"
    _chromium(f"--user-data-dir={tmp_path / 'profile-shot'}", f"--screenshot={shot}", "--window-size=1400,900", page)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_the_link_printed_for_a_local_store_names_mlflow_ui_and_the_runs_table_page(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("local")
    run = client.create_run(experiment).info.run_id
    assert tracking.browse_hint(uri, run) == (
        f"browse the runs: mlflow ui --backend-store-uri {uri}, "
        f"then http://127.0.0.1:5000/#/experiments/{experiment}?workflowType=machine_learning")


def test_a_pipeline_killed_during_pretrain_reuses_its_ingest_and_resumes_pretraining(ray_cluster, corpus, tmp_path):
    spec_file = write_spec(tmp_path, corpus, only=("corpus", "pretrain"), steps=12, checkpoint_interval=4)
    log = tmp_path / "run.log"
    first, command = _start_vitpipe_run(spec_file, ray_cluster.address, log)
    try:
        deadline = time.monotonic() + 300
        # Recorded by Ray Train (in its snapshot), not merely being written.
        while not any("checkpoint_00000004" in f.read_text()
                      for f in (tmp_path / "work" / "runs").glob("*/*/checkpoint_manager_snapshot.json")):
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "pretraining wrote no checkpoint in time"
            time.sleep(0.5)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the runner and everything it started, mid-pretrain
        first.wait()
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in again.stdout.splitlines()[1:3]}
    assert rows["corpus"][2] == "reused"
    assert rows["pretrain"][2] == "done"
    client = MlflowClient(load_spec(spec_file).resolved_tracking_uri())
    pretrain_run = client.get_run(rows["pretrain"][-1])
    assert int(pretrain_run.data.tags["vitpipe.resumed_from_step"]) >= 4  # from its checkpoint, not from step 0
    assert pretrain_run.info.status == "FINISHED"
    assert max(m.step for m in client.get_metric_history(pretrain_run.info.run_id, "train_loss")) == 12
    # The rerun reopened the killed runs rather than starting new ones beside them.
    experiment = client.get_experiment_by_name("runner-tests").experiment_id
    pretrain_runs = client.search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` = 'pretrain'")
    assert [r.info.run_id for r in pretrain_runs] == [pretrain_run.info.run_id]
    assert len(_pipeline_runs(client)) == 1


def test_a_second_run_of_a_pipeline_that_is_still_running_is_refused_in_one_line(ray_cluster, corpus, tmp_path):
    spec_file = write_spec(tmp_path, corpus, only=("corpus", "pretrain"), steps=10_000)
    log = tmp_path / "first.log"
    client = MlflowClient(load_spec(spec_file).resolved_tracking_uri())
    client.search_experiments()  # the store's tables made here, not raced with the first run's
    first, command = _start_vitpipe_run(spec_file, ray_cluster.address, log)
    try:
        deadline = time.monotonic() + 120
        while not (runs := _pipeline_runs(client)):
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run opened no pipeline run in time"
            time.sleep(0.5)
        second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode != 0 and len(errors) == 1, second.stderr[-2000:]
        assert (f"pipeline run {runs[0].info.run_id} is being executed by another vitpipe (pid {first.pid} on "
                in errors[0])
        assert first.poll() is None  # the first run goes on
        assert client.get_run(runs[0].info.run_id).info.status == "RUNNING"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def _start_vitpipe_run(spec_file: Path, address: str, log: Path) -> tuple[subprocess.Popen, list[str]]:
    """`vitpipe run` of `spec_file` started in a session of its own, its output to `log`; returns it and its command."""
    command = [sys.executable, "-m", "pipelines.cli", "run", str(spec_file), "--address", address]
    with open(log, "ab") as out:
        driver = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return driver, command


def _pipeline_runs(client: MlflowClient) -> list:
    """The pipeline runs of the runner tests' experiment; none before the experiment is made."""
    experiment = client.get_experiment_by_name("runner-tests")
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], f"tags.`{tracking.TAG_STAGE}` = 'pipeline'")
