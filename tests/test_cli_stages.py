"""The stage subcommands validate their config at the edge and fail with one line."""

from typer.testing import CliRunner

from pipelines.cli import app


def test_pretrain_with_a_misspelt_field_fails_with_one_line_naming_it(tmp_path) -> None:
    spec = tmp_path / "pretrain.yaml"
    spec.write_text("data: /nowhere\nmodel: ViT-Ti/16\nsteps: 10\nnum_workrs: 2\n")
    result = CliRunner().invoke(app, ["pretrain", str(spec)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: pretrain config: num_workrs")


def test_a_missing_config_file_is_named(tmp_path) -> None:
    missing = tmp_path / "finetune.yaml"
    result = CliRunner().invoke(app, ["finetune", str(missing)])
    assert result.exit_code == 1
    assert f"finetune config {missing} does not exist" in result.output


def test_a_config_file_that_is_not_yaml_is_one_line_naming_the_file_and_the_place(tmp_path) -> None:
    spec = tmp_path / "pretrain.yaml"
    spec.write_text("data: [unclosed\nsteps: 3\n")
    result = CliRunner().invoke(app, ["pretrain", str(spec)])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"error: pretrain config {spec}: YAML syntax error at line 2, column 6: ")


def test_set_without_equals_is_refused() -> None:
    result = CliRunner().invoke(app, ["evaluate", "x.yaml", "--set", "lr"])
    assert result.exit_code == 1
    assert "--set expects KEY=VALUE, got 'lr'" in result.output


def test_video_train_with_a_misspelt_field_fails_with_one_line_naming_it(tmp_path) -> None:
    spec = tmp_path / "video_train.yaml"
    spec.write_text("data: /nowhere\nbackbone: ViT-Ti/16\nsteps: 10\ntrain_frams: 8\n")
    result = CliRunner().invoke(app, ["stage", "video_train", str(spec)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: video_train config: train_frams")
