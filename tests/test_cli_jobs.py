"""The job commands' options, checked before any cluster is reached: one flag for the cluster, the version,
and credentials refused in one line."""

from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from pipelines import __version__, jobs
from pipelines.cli import app
from pipelines.cli_jobs import follow_job


@pytest.fixture
def tracked_spec(tmp_path):
    spec = {"name": "p", "storage": {"root": str(tmp_path / "work")}, "tracking_uri": "http://127.0.0.1:9",
            "stages": {"corpus": {"kind": "ingest", "source": str(tmp_path / "corpus")}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _commands(group, prefix: str = "") -> dict:
    found = {}
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group of subcommands
            found.update(_commands(command, f"{prefix}{name} "))
        else:
            found[prefix + name] = command
    return found


def test_version_prints_vitpipes_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"vitpipe {__version__}"


def test_every_command_names_the_cluster_address_and_none_shows_ray_address() -> None:
    commands = _commands(typer.main.get_command(app))
    flags = {name: {o for p in c.params for o in p.opts} for name, c in commands.items()}
    with_cluster = {name for name, opts in flags.items() if any("address" in o for o in opts)}
    assert {"submit", "jobs", "status", "logs", "stop", "run", "ingest", "pretrain", "corpus synth"} <= with_cluster
    assert all("--address" in flags[name] and "--ray-address" not in flags[name] for name in with_cluster)


def test_an_env_naming_a_credential_is_refused_in_one_line(tracked_spec) -> None:
    result = CliRunner().invoke(app, ["submit", str(tracked_spec), "--address", "http://127.0.0.1:9",
                                      "--env", "AWS_SECRET_ACCESS_KEY=hunter2"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: --env: AWS_SECRET_ACCESS_KEY is a credential; jobs never carry credentials")
    assert "hunter2" not in result.output


def test_a_runtime_env_file_with_a_credential_is_refused_in_one_line(tracked_spec, tmp_path) -> None:
    runtime_env = tmp_path / "runtime_env.yaml"
    runtime_env.write_text(yaml.safe_dump({"env_vars": {"MLFLOW_TRACKING_TOKEN": "t0ken"}}))
    result = CliRunner().invoke(app, ["submit", str(tracked_spec), "--address", "http://127.0.0.1:9",
                                      "--runtime-env", str(runtime_env)])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"error: --runtime-env {runtime_env}: MLFLOW_TRACKING_TOKEN is a credential")
    assert "t0ken" not in result.output


def test_a_relative_sqlite_tracking_uri_is_refused_for_a_cluster(tracked_spec) -> None:
    result = CliRunner().invoke(app, ["submit", str(tracked_spec), "--address", "http://127.0.0.1:9",
                                      "--set", "tracking_uri=sqlite:///mlflow.db"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert "tracking URI sqlite:///mlflow.db is a relative path" in line


def test_a_set_carrying_a_password_is_refused_before_it_reaches_the_jobs_entrypoint(tracked_spec) -> None:
    result = CliRunner().invoke(app, ["submit", str(tracked_spec), "--address", "http://127.0.0.1:9",
                                      "--set", "tracking_uri=http://bob:hunter2@mlflow:5000"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert "tracking URI http://mlflow:5000 carries user:password@; jobs never carry credentials" in line
    assert "hunter2" not in result.output


def test_a_stage_argument_carrying_a_password_is_refused_before_submitting(tmp_path) -> None:
    path = tmp_path / "evaluate.yaml"
    path.write_text(yaml.safe_dump({"data": str(tmp_path / "shards"), "init": "0" * 32,
                                    "tracking_uri": "http://127.0.0.1:9"}))
    result = CliRunner().invoke(app, ["stage", "evaluate", str(path), "--address", "http://127.0.0.1:9",
                                      "--set", "endpoint_url=http://bob:hunter2@minio:9000"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert "job argument endpoint_url=http://minio:9000 carries a credential" in line
    assert "hunter2" not in result.output


def test_a_stage_config_without_a_tracking_uri_is_refused_before_submitting(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "evaluate.yaml"
    path.write_text(yaml.safe_dump({"data": str(tmp_path / "shards"), "init": "0" * 32}))
    result = CliRunner().invoke(app, ["stage", "evaluate", str(path), "--address", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert f"config {path}: no tracking URI" in line


def test_a_bad_stage_config_is_refused_before_submitting(tmp_path) -> None:
    path = tmp_path / "evaluate.yaml"
    path.write_text(yaml.safe_dump({"data": str(tmp_path / "shards"), "init": "0" * 32, "shots": [],
                                    "tracking_uri": "http://127.0.0.1:9"}))
    result = CliRunner().invoke(app, ["stage", "evaluate", str(path), "--address", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert "evaluate config: shots is empty" in line


def _log_file(output: str) -> Path:
    return Path(output.split("(log: ", 1)[1].split(")", 1)[0].split(";")[0])


def test_an_env_value_with_a_password_in_a_later_url_is_refused_in_one_line(tracked_spec, tmp_path,
                                                                              monkeypatch) -> None:
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(tmp_path / "logs"))
    urls = "https://pypi.org/simple https://alice:s3cret@pkgs.example.com/simple"
    result = CliRunner().invoke(app, ["submit", str(tracked_spec), "--address", "http://127.0.0.1:9",
                                      "--env", f"PIP_EXTRA_INDEX_URL={urls}"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: --env: PIP_EXTRA_INDEX_URL=https://pypi.org/simple https://pkgs.example.com/simple "
                           "carries user:password@")
    assert "s3cret" not in result.output and "s3cret" not in _log_file(line).read_text()


def test_a_runtime_env_pip_url_with_a_password_is_refused_in_one_line(tracked_spec, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(tmp_path / "logs"))
    runtime_env = tmp_path / "runtime_env.yaml"
    runtime_env.write_text(yaml.safe_dump({"pip": ["numpy", "git+https://alice:ghp_SECRET@github.com/org/x.git"]}))
    result = CliRunner().invoke(app, ["submit", str(tracked_spec), "--address", "http://127.0.0.1:9",
                                      "--runtime-env", str(runtime_env)])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"error: --runtime-env {runtime_env}: pip[1] carries user:password@")
    assert "ghp_SECRET" not in result.output and "ghp_SECRET" not in _log_file(line).read_text()


def test_an_unfinished_job_points_at_its_logs_without_the_address_password(monkeypatch, capsys) -> None:
    monkeypatch.setattr(jobs, "follow", lambda address, job_id, show: None)
    monkeypatch.setattr(jobs, "status", lambda address, job_id: "FAILED")
    with pytest.raises(typer.Exit):
        follow_job("http://u:s3cret@head:8265", "j1")
    err = capsys.readouterr().err
    assert "vitpipe logs j1 --address http://head:8265" in err and "s3cret" not in err


def test_a_jobs_stop_grace_is_vitpipes_unless_its_env_or_runtime_env_sets_one() -> None:
    grace = "RAY_JOB_STOP_WAIT_TIME_S"  # read by Ray's job supervisor from the job's own env vars
    assert jobs.job_runtime_env()["env_vars"][grace] == str(jobs.STOP_GRACE_S)
    assert jobs.job_runtime_env({"env_vars": {grace: "5"}})["env_vars"][grace] == "5"
    assert jobs.job_runtime_env({"env_vars": {grace: "5"}}, jobs.parse_env([f"{grace}=90"]))["env_vars"][grace] == "90"
