"""What a user sees while a stage trains: progress lines on the console, system metrics and every step
metric in MLflow, experiments that open on the runs table.

The pretrain run here is one short real run through `vitpipe run` on the
session's Ray cluster and `mlflow server`: its console is the CLI's output.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.core import tracking
from pipelines.core.logfile import ARTIFACT_BARS_ENV, quiet_artifact_bars
from pipelines.core.registry import TAG_MODEL_URI
from pipelines.image.attention_map import ATTENTION_FIGURE
from pipelines.training.worker import Progress

STEPS = 8
PROGRESS = re.compile(r"\[pretrain-\w+\] step (\d+)/8 loss [\d.]+ [\d,.]+ images/s ETA \d+:\d\d:\d\d")


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> MlflowClient:
    return MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db")


@pytest.fixture(scope="module")
def pretrain_run(ray_cluster, mlflow_server, tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    """A short pretrain through the CLI: its console output and its MLflow run id."""
    from pipelines.corpora.images import synth_corpus

    tmp = tmp_path_factory.mktemp("progress")
    synth_corpus(str(tmp / "corpus"), images=60, classes=3, size=16, seed=5)
    spec = {
        "name": "progress", "storage": {"root": str(tmp / "work")}, "tracking_uri": mlflow_server,
        "experiment": "progress-tests",
        "stages": {
            "corpus": {"kind": "ingest", "source": str(tmp / "corpus"), "image_size": 16, "patch_size": 4,
                       "val_fraction": 0.2, "shard_size": 100},
            "pretrain": {"kind": "pretrain", "inputs": ["corpus"], "model": "ViT-Ti/16",
                         "model_overrides": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64},
                         "num_workers": 1, "batch_size_per_worker": 8, "steps": STEPS, "warmup_steps": 1,
                         "log_interval": 2, "augment": False},
        },
    }
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    command = [sys.executable, "-m", "pipelines.cli", "run", str(tmp / "spec.yaml"), "--address", ray_cluster.address]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("pretrain"))
    return done, row[-1]


def test_pretraining_prints_step_loss_images_per_second_and_eta_to_the_console(pretrain_run):
    done, _ = pretrain_run
    steps = [int(m.group(1)) for m in PROGRESS.finditer(done.stderr)]
    assert steps and set(steps) <= {2, 4, 6, 8}, done.stderr[-3000:]
    assert not PROGRESS.search(done.stdout)  # stdout keeps only the result table


def test_training_reads_draw_no_ray_data_progress_bars_over_the_step_lines(pretrain_run):
    done, _ = pretrain_run
    console = done.stdout + done.stderr
    assert "Starting execution of Dataset train_" in console  # the training read did run through Ray Data
    assert "Running Dataset: train_" not in console and "split(1, equal=True):" not in console


def test_a_console_that_is_no_terminal_gets_no_mlflow_artifact_bars(pretrain_run, mlflow_server):
    done, run_id = pretrain_run
    assert MlflowClient(mlflow_server).get_run(run_id).data.tags[TAG_MODEL_URI]  # a model's files were copied
    assert "Downloading artifacts" not in done.stdout + done.stderr, done.stderr[-3000:]


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_mlflows_artifact_bars_are_off_without_a_terminal_and_kept_at_one():
    piped: dict[str, str] = {}
    quiet_artifact_bars(_Stream(tty=False), piped)
    terminal: dict[str, str] = {}
    quiet_artifact_bars(_Stream(tty=True), terminal)
    assert piped == {ARTIFACT_BARS_ENV: "false"} and terminal == {}


def test_a_users_own_artifact_bar_setting_is_kept():
    chosen = {ARTIFACT_BARS_ENV: "true"}
    quiet_artifact_bars(_Stream(tty=False), chosen)
    assert chosen == {ARTIFACT_BARS_ENV: "true"}


def test_pretraining_logs_system_metrics_into_its_run(pretrain_run, mlflow_server):
    metrics = MlflowClient(mlflow_server).get_run(pretrain_run[1]).data.metrics
    assert "system/cpu_utilization_percentage" in metrics
    assert metrics["system/system_memory_usage_megabytes"] > 0


def test_every_step_loss_sent_asynchronously_is_stored_before_the_run_ends(pretrain_run, mlflow_server):
    client = MlflowClient(mlflow_server)
    assert client.get_run(pretrain_run[1]).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(pretrain_run[1], "train_loss")) == list(range(1, STEPS + 1))


def test_the_pretrain_run_holds_a_picture_of_the_vits_attention(pretrain_run, mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    picture = Path(client.download_artifacts(pretrain_run[1], ATTENTION_FIGURE, str(tmp_path)))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_progress_line_measures_images_per_second_and_eta_since_the_previous_line():
    progress = Progress("pretrain-abc", end=100, global_batch=32, start_step=0)
    progress.line(10, 2.5, now=1000.0)
    line = progress.line(20, 1.25, now=1005.0)  # 10 steps of 32 images in 5 s; 80 steps left
    assert line == "[pretrain-abc] step 20/100 loss 1.2500 64.0 images/s ETA 0:00:40"


def test_asynchronous_metrics_are_all_stored_once_waited_for(client):
    run_id = client.create_run(tracking.get_or_create_experiment(client, "async")).info.run_id
    buffer = tracking.MetricBuffer(client, run_id, asynchronous=True)
    for step in range(1, 301):
        buffer.add({"train_loss": 1.0 / step, "lr": 0.1}, step)
        if step % 50 == 0:
            buffer.flush()
    buffer.wait()
    assert len(client.get_metric_history(run_id, "train_loss")) == 300
    buffer.close()  # stops MLflow's logging threads, which would hold up this process's exit


def test_closing_an_asynchronous_buffer_stops_mlflows_logging_threads_and_a_later_one_starts_them_again(client):
    run_id = client.create_run(tracking.get_or_create_experiment(client, "async-close")).info.run_id
    queue = client._tracking_client.store._async_logging_queue
    for attempt in (1, 2):
        buffer = tracking.MetricBuffer(client, run_id, asynchronous=True)
        buffer.add({"train_loss": 1.0}, attempt)
        buffer.wait()
        assert queue.is_active()  # `wait` leaves the threads running: stopping them costs up to 1 s
        buffer.close()
        assert not queue.is_active()
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == [1, 2]


def test_new_experiments_are_marked_as_model_training_for_the_mlflow_ui(client):
    experiment = client.get_experiment(tracking.get_or_create_experiment(client, "kind-new"))
    assert experiment.tags[tracking.TAG_EXPERIMENT_KIND] == "custom_model_development"


def test_a_new_experiment_of_a_sqlite_store_keeps_its_artifacts_beside_the_database(tmp_path, monkeypatch):
    store, started_in = tmp_path / "store", tmp_path / "cwd"
    store.mkdir(), started_in.mkdir()
    monkeypatch.chdir(started_in)
    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    run_id = client.create_run(tracking.get_or_create_experiment(client, "beside")).info.run_id
    tracking.log_dict_artifact(client, run_id, {"a": 1}, "config.json")
    assert list(started_in.iterdir()) == []  # MLflow's own default is ./mlruns of the creating process
    assert client.get_run(run_id).info.artifact_uri.startswith((store / "mlartifacts").as_uri())
    assert [p.name for p in (store / "mlartifacts").rglob("*.json")] == ["config.json"]


def test_clients_making_the_same_experiment_at_once_all_get_the_one_experiment(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(uri).search_experiments()  # the schema first: its creation is not what is raced here
    start, ids = threading.Barrier(8), []

    def make() -> None:
        client = MlflowClient(uri)
        start.wait()
        ids.append(tracking.get_or_create_experiment(client, "raced"))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 8 and set(ids) == {MlflowClient(uri).get_experiment_by_name("raced").experiment_id}


def test_an_existing_experiment_without_a_kind_gets_one_and_a_chosen_kind_is_kept(client):
    bare = client.create_experiment("kind-bare")
    chosen = client.create_experiment("kind-chosen", tags={tracking.TAG_EXPERIMENT_KIND: "finetuning"})
    tracking.get_or_create_experiment(client, "kind-bare")
    tracking.get_or_create_experiment(client, "kind-chosen")
    assert client.get_experiment(bare).tags[tracking.TAG_EXPERIMENT_KIND] == "custom_model_development"
    assert client.get_experiment(chosen).tags[tracking.TAG_EXPERIMENT_KIND] == "finetuning"
