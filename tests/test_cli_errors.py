"""A failing command prints one line naming the cause and where its full log is, and exits 1."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines import cli
from pipelines.cli import app


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


def test_an_unexpected_failure_is_one_line_with_its_type(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(tmp_path))

    def broken(*args, **kwargs):
        raise RuntimeError("the object store went away\nsecond line of detail")

    monkeypatch.setattr(cli, "_run_stage", broken)
    result = CliRunner().invoke(app, ["evaluate", "x.yaml"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: RuntimeError: the object store went away (log: ")
    assert "second line of detail" in _log_file(line).read_text()


def test_an_unwritable_log_directory_does_not_stop_the_command(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("VITPIPE_LOG_DIR", str(blocker / "logs"))
    result = CliRunner().invoke(app, ["evaluate", "x.yaml", "--set", "lr"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: --set expects KEY=VALUE, got 'lr'") and "log: " not in line


@pytest.mark.parametrize("args", [["--help"], ["runs", "--help"]])
def test_help_exits_zero(args) -> None:
    assert CliRunner().invoke(app, args).exit_code == 0
