"""A failing command prints one line naming the cause and where its full log is, and exits 1; a stopped one
says so in one line and exits 128 + the signal's number."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines.cli import app

REPO = Path(__file__).resolve().parents[1]


def _log_file(output: str) -> Path:
    assert output.count("(log: ") == 1, output
    return Path(output.split("(log: ", 1)[1].split(")", 1)[0].split(";")[0])


def test_an_error_line_names_the_command_log(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(tmp_path))
    spec = tmp_path / "pretrain.yaml"
    spec.write_text("data: /nowhere\nmodel: ViT-Ti/16\nsteps: 10\nnum_workrs: 2\n")
    result = CliRunner().invoke(app, ["pretrain", str(spec)])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: pretrain config: num_workrs")
    assert _log_file(line).parent == tmp_path


def test_the_command_log_holds_the_traceback(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["finetune", str(tmp_path / "missing.yaml")])
    log = _log_file(result.output).read_text()
    assert "failed" in log.splitlines()[0]
    assert "Traceback (most recent call last)" in log and "does not exist" in log


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # its request log would land in the command's captured output
        pass


@pytest.fixture
def not_mlflow(tmp_path) -> Iterator[str]:
    """A plain web server where the tracking server should be: every API call gets a 404 page of HTML."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_unexpected_failure_is_one_line_with_its_type(tmp_path, monkeypatch, not_mlflow) -> None:
    # MLflow's own error, not a VitpipeError; its message holds the page's many lines.
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(tmp_path))
    data = tmp_path / "data"
    data.mkdir()
    (data / "_SUCCESS").write_text("{}")
    (data / "manifest.json").write_text(json.dumps({"image_size": 16, "patch_size": 4, "patch_dim": 48}))
    spec = tmp_path / "evaluate.yaml"
    spec.write_text(f"data: {data}\ninit: scratch\nmodel: ViT-Ti/16\nmodel_overrides: {{depth: 1, patch_size: 4}}\n"
                    f"tracking_uri: {not_mlflow}\n")
    result = CliRunner().invoke(app, ["evaluate", str(spec)])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: MlflowException: API request to endpoint /api/2.0/mlflow/"), line
    assert "404 != 200" in line and "Error code explanation" not in line
    assert "Error code explanation: 404" in _log_file(line).read_text()


def test_an_unwritable_log_directory_does_not_stop_the_command(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(blocker / "logs"))
    result = CliRunner().invoke(app, ["evaluate", "x.yaml", "--set", "lr"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: --set expects KEY=VALUE, got 'lr'") and "log: " not in line


def test_listing_the_runs_of_a_sqlite_store_that_does_not_exist_is_one_line_and_creates_no_store(tmp_path) -> None:
    store = tmp_path / "mlfow.db"  # a typo of the store's name
    result = CliRunner().invoke(app, ["runs", "--tracking-uri", f"sqlite:///{store}"])
    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"error: tracking store sqlite:///{store}: no such database file"), line
    assert not store.exists()


@pytest.fixture
def absent_server() -> str:
    """The address of a tracking server that is not there: a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _vitpipe_quickly(tmp_path: Path, *args: str) -> str:
    """`vitpipe ARGS` in a fresh interpreter, which must fail within 60 s (MLflow's own retries take minutes):
    its one line on stderr."""
    env = {**os.environ, "VITPIPE_LOG_DIR": str(tmp_path / "logs")}
    env.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
    child = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True,
                           cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, timeout=60)
    assert child.returncode == 1, child.stderr[-2000:]
    return child.stderr.strip().splitlines()[-1]


def test_listing_the_runs_of_a_tracking_server_that_is_not_there_is_one_line_at_once(tmp_path, absent_server):
    line = _vitpipe_quickly(tmp_path, "runs", "--tracking-uri", absent_server)
    assert line.startswith(f"error: tracking server {absent_server}: not reachable (connection refused"), line


def test_a_spec_whose_tracking_server_is_not_there_is_one_line_at_once(tmp_path, absent_server):
    (tmp_path / "spec.yaml").write_text(f"name: p\nstorage: {{root: out}}\ntracking_uri: {absent_server}\n"
                                        "stages:\n  raw: {kind: ingest, source: corpus}\n")
    line = _vitpipe_quickly(tmp_path, "run", "spec.yaml")
    assert line.startswith(f"error: tracking server {absent_server}: not reachable (connection refused"), line


def test_a_stage_whose_tracking_server_is_not_there_is_one_line_at_once(tmp_path, absent_server):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "_SUCCESS").write_text("{}")
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"image_size": 16, "patch_size": 4, "patch_dim": 48}))
    (tmp_path / "evaluate.yaml").write_text(f"data: data\ninit: scratch\nmodel: ViT-Ti/16\n"
                                            f"model_overrides: {{depth: 1, patch_size: 4}}\ntracking_uri: {absent_server}\n")
    line = _vitpipe_quickly(tmp_path, "evaluate", "evaluate.yaml")
    assert line.startswith(f"error: tracking server {absent_server}: not reachable (connection refused"), line


@pytest.mark.parametrize("args", [["--help"], ["runs", "--help"]])
def test_help_exits_zero(args) -> None:
    assert CliRunner().invoke(app, args).exit_code == 0


# In a fresh interpreter: which of the heavy frameworks the command imported before it answered.
_IMPORTED_BY = """
import sys
from typer.testing import CliRunner
from pipelines.cli import app
result = CliRunner().invoke(app, sys.argv[1:])
print(result.exit_code, [name for name in ("mlflow", "ray", "torch") if name in sys.modules])
print(result.output.strip())
"""


def _imported_by(tmp_path: Path, *args: str) -> tuple[str, str]:
    """`vitpipe ARGS` run in a fresh interpreter: its exit status with the frameworks it imported, its first line."""
    child = subprocess.run([sys.executable, "-c", _IMPORTED_BY, *args], capture_output=True, text=True, check=True,
                           cwd=tmp_path, env={**os.environ, "VITPIPE_LOG_DIR": str(tmp_path)})
    status, line, *_ = child.stdout.splitlines()
    return status, line


@pytest.mark.parametrize("command", [["run"], ["submit", "--address", "http://127.0.0.1:9"]], ids=["run", "submit"])
def test_a_bad_spec_is_refused_before_mlflow_ray_or_torch_is_imported(tmp_path, command) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: p\nstorage: {root: out}\nstages:\n  a: {kind: pretrian}\n")
    status, line = _imported_by(tmp_path, *command, str(spec))
    assert status == "1 []"
    assert line.startswith(f"error: spec {spec}: stage 'a' field 'kind': Input should be 'ingest', 'pretrain'")


# A pipeline whose every stage is valid but the last, whose field is refused by its own config model.
_BAD_STAGE_FIELD = """name: p
storage: {root: out}
stages:
  raw: {kind: ingest, source: corpus, image_size: 16, patch_size: 4}
  pre: {kind: pretrain, inputs: [raw], model: ViT-Ti/4, steps: 20, warmup_steps: 2}
  tune: {kind: finetune, inputs: [raw, pre], batch_size: 32}
  probe: {kind: evaluate, inputs: [raw, pre], shots: [0]}
"""


@pytest.mark.parametrize("command", [["run"], ["submit", "--address", "http://127.0.0.1:9"]], ids=["run", "submit"])
def test_a_bad_field_of_an_image_stage_is_refused_before_mlflow_ray_or_torch_is_imported(tmp_path, command) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(_BAD_STAGE_FIELD)
    status, line = _imported_by(tmp_path, *command, str(spec))
    assert status == "1 []"
    assert line.startswith(f"error: spec {spec}: stage 'probe'") and "shots must be positive, got 0" in line


def test_a_bad_field_in_a_stage_config_file_is_refused_before_mlflow_ray_or_torch_is_imported(tmp_path) -> None:
    (tmp_path / "pre.yaml").write_text("data: data\nsteps: 0\n")
    status, line = _imported_by(tmp_path, "pretrain", "pre.yaml")
    assert status == "1 []"
    assert line.startswith("error: pretrain config: steps: Input should be greater than 0")


def test_a_bad_backbone_of_a_video_stage_is_refused_before_mlflow_or_ray_is_imported(tmp_path) -> None:
    (tmp_path / "video.yaml").write_text("data: videos\nsteps: 1\nbackbone: ViT-Q/99\n")
    status, line = _imported_by(tmp_path, "video-train", "video.yaml")
    assert status == "1 ['torch']"  # the backbone is checked against vit's presets
    assert line.startswith("error: video_train config: backbone 'ViT-Q/99': unknown model")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_stopped_command_says_so_in_one_line_and_exits_128_plus_the_signal(tmp_path, signum) -> None:
    out = tmp_path / "corpus"
    command = [sys.executable, "-m", "pipelines.cli", "corpus", "synth", str(out), "--images", "200000"]
    env = {**os.environ, "VITPIPE_LOG_DIR": str(tmp_path / "logs")}
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as cli:
        try:
            deadline = time.monotonic() + 60
            while not any(out.rglob("*.jpg")):  # inside the command, not still starting up
                assert cli.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
            cli.send_signal(signum)
            _, stderr = cli.communicate(timeout=60)
        finally:  # a command the signal did not stop fails the test, not hangs the suite in Popen's exit
            cli.kill()
    assert cli.returncode == 128 + signum
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("stopped")]  # beside Ray's start-up lines
    assert line.startswith(f"stopped by {signum.name} before any run started (log: {tmp_path / 'logs'}")
