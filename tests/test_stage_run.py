"""The stage skeleton: one MLflow run per stage identity, reused when finished, reopened when interrupted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from pipelines.core.stage_run import finished_run_id, stage_run


@pytest.fixture
def client(tmp_path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")


def _config(run_name: str | None = None, experiment: str = "skeleton") -> SimpleNamespace:
    return SimpleNamespace(experiment=experiment, parent_run_id=None, run_name=run_name)


def test_a_new_identity_opens_a_new_run_that_ends_finished(client: MlflowClient) -> None:
    with stage_run(client, "pretrain", _config(), {"lr": 0.1}) as run:
        assert (run.finished, run.resumed) == (False, False)
    assert client.get_run(run.run_id).info.status == "FINISHED"
    assert run.name == f"pretrain-{run.digest[:12]}"


def test_a_finished_identity_is_handed_back_untouched(client: MlflowClient) -> None:
    with stage_run(client, "pretrain", _config(), {"lr": 0.1}) as first:
        pass
    end = client.get_run(first.run_id).info.end_time
    with stage_run(client, "pretrain", _config(), {"lr": 0.1}) as again:
        assert again.finished
    assert again.run_id == first.run_id
    assert client.get_run(first.run_id).info.end_time == end


def test_only_a_finished_run_of_the_identity_is_found_before_opening_and_the_look_creates_nothing(
        client: MlflowClient) -> None:
    assert finished_run_id(client, "pretrain", _config(), {"lr": 0.1}) is None
    assert client.get_experiment_by_name("skeleton") is None  # looking made no experiment
    with pytest.raises(RuntimeError), stage_run(client, "pretrain", _config(), {"lr": 0.1}):
        raise RuntimeError("worker lost")
    assert finished_run_id(client, "pretrain", _config(), {"lr": 0.1}) is None  # FAILED: to be resumed, not reused
    with stage_run(client, "pretrain", _config(), {"lr": 0.1}) as done:
        pass
    assert finished_run_id(client, "pretrain", _config(), {"lr": 0.1}) == done.run_id
    assert finished_run_id(client, "pretrain", _config(), {"lr": 0.2}) is None
    assert finished_run_id(client, "finetune", _config(), {"lr": 0.1}) is None


def test_a_failing_body_ends_the_run_failed_and_a_rerun_reopens_it(client: MlflowClient) -> None:
    with pytest.raises(RuntimeError), stage_run(client, "finetune", _config(), {"lr": 0.1}) as failed:
        raise RuntimeError("worker lost")
    assert client.get_run(failed.run_id).info.status == "FAILED"
    with stage_run(client, "finetune", _config(), {"lr": 0.1}) as rerun:
        assert (rerun.run_id, rerun.resumed, rerun.previous) == (failed.run_id, True, "FAILED")
    assert client.get_run(failed.run_id).info.status == "FINISHED"


def test_a_stopped_body_ends_the_run_killed_names_it_in_the_stop_and_a_rerun_reopens_it(client: MlflowClient) -> None:
    with pytest.raises(KeyboardInterrupt) as stop, stage_run(client, "pretrain", _config(), {"lr": 0.1}) as stopped:
        raise KeyboardInterrupt
    assert client.get_run(stopped.run_id).info.status == "KILLED"
    assert stop.value.__notes__ == [f"pretrain run {stopped.name} is KILLED"]  # for the CLI's one line
    with stage_run(client, "pretrain", _config(), {"lr": 0.1}) as rerun:
        assert (rerun.run_id, rerun.resumed, rerun.previous) == (stopped.run_id, True, "KILLED")


def test_a_run_that_does_not_finish_ends_its_nested_runs_still_running_the_same_way(client: MlflowClient) -> None:
    with pytest.raises(SystemExit), stage_run(client, "finetune", _config(), {"lr": 0.1}) as sweep:
        experiment = client.get_run(sweep.run_id).info.experiment_id
        trials = [client.create_run(experiment, tags={"mlflow.parentRunId": sweep.run_id}).info.run_id
                  for _ in range(2)]
        client.set_terminated(trials[0], status="FINISHED")
        raise SystemExit(143)
    assert [client.get_run(t).info.status for t in trials] == ["FINISHED", "KILLED"]


def test_another_identity_or_stage_is_another_run(client: MlflowClient) -> None:
    with stage_run(client, "pretrain", _config(), {"lr": 0.1}) as a:
        pass
    with stage_run(client, "pretrain", _config(), {"lr": 0.2}) as b:
        pass
    with stage_run(client, "evaluate", _config(), {"lr": 0.1}) as c:
        pass
    assert len({a.run_id, b.run_id, c.run_id}) == 3


def test_the_config_names_the_run_and_the_resolved_config_is_logged_without_credentials(client: MlflowClient) -> None:
    with stage_run(client, "pretrain", _config("my-run"), {"lr": 0.1}) as run:
        run.log_config({"lr": 0.1, "aws_secret_access_key": "hunter2"})
    logged = client.get_run(run.run_id)
    assert logged.info.run_name == "my-run"
    assert logged.data.params["lr"] == "0.1"
    assert "hunter2" not in str(logged.data.params)
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.run_id)]


def test_a_named_run_whose_config_changed_is_refused_naming_the_changed_fields(client: MlflowClient) -> None:
    with stage_run(client, "pretrain", _config("named"), {"lr": 0.1, "model_overrides": {"class_token": True}}):
        pass
    changed = {"lr": 0.2, "model_overrides": {"class_token": False}}
    with pytest.raises(ValueError) as err, stage_run(client, "pretrain", _config("named"), changed):
        pytest.fail("the changed config must not open a run under the old name")
    message = str(err.value)
    assert "\n" not in message
    assert "run_name 'named'" in message and "changed: lr, model_overrides.class_token" in message
    assert len(client.search_runs([client.get_experiment_by_name("skeleton").experiment_id])) == 1
    with stage_run(client, "pretrain", _config("named"), {"lr": 0.1, "model_overrides": {"class_token": True}}) as same:
        assert same.finished  # the unchanged config still finds its run


def test_a_named_run_with_its_own_config_resumes_even_when_the_name_also_holds_another(client: MlflowClient) -> None:
    with pytest.raises(RuntimeError), stage_run(client, "pretrain", _config("both"), {"lr": 0.1}) as failed:
        raise RuntimeError("worker lost")
    run_id = client.create_run(client.get_experiment_by_name("skeleton").experiment_id, run_name="both",
                               tags={"vitpipe.stage": "pretrain", "vitpipe.config_hash": "older"}).info.run_id
    assert run_id != failed.run_id  # an older run under the same name, as made before names were checked
    with stage_run(client, "pretrain", _config("both"), {"lr": 0.1}) as rerun:
        assert (rerun.run_id, rerun.resumed) == (failed.run_id, True)


def test_a_run_name_holding_both_kinds_of_quote_is_refused_in_one_line_naming_it(client: MlflowClient) -> None:
    name = """it's "best\""""
    with pytest.raises(ValueError) as err, stage_run(client, "pretrain", _config(name), {"lr": 0.1}):
        pytest.fail("no run may open under a name that cannot be searched for")
    assert str(err.value).startswith(f"run_name {name!r}: ") and "\n" not in str(err.value)


def test_a_run_name_already_naming_another_stages_run_is_refused(client: MlflowClient) -> None:
    # Checkpoints, Tune state and the staged starting weights live in the storage under the run's name
    # (`<storage>/<name>`, `<storage>/<name>-work/init`): a video-train named as a pretrain would start from its files.
    with stage_run(client, "pretrain", _config("exp1"), {"lr": 0.1}) as pretrain:
        pass
    with pytest.raises(ValueError) as err, stage_run(client, "video-train", _config("exp1"), {"lr": 0.1}):
        pytest.fail("no run may open under a name that already names another stage's run")
    message = str(err.value)
    assert message.startswith(f"run_name 'exp1' already names pretrain run {pretrain.run_id}") and "\n" not in message
    runs = client.search_runs([client.get_experiment_by_name("skeleton").experiment_id])
    assert [r.info.run_id for r in runs] == [pretrain.run_id]


def test_a_run_name_may_name_another_config_or_stage_in_another_experiment(client: MlflowClient) -> None:
    # Each experiment keeps its runs' files in its own folder of the storage: nothing under the name is shared.
    with stage_run(client, "pretrain", _config("nightly"), {"lr": 0.1}) as first:
        pass
    with stage_run(client, "pretrain", _config("nightly", "other"), {"lr": 0.2}) as changed:
        assert not changed.finished and changed.run_id != first.run_id
    with stage_run(client, "video-train", _config("nightly", "third"), {"lr": 0.1}) as video:
        assert not video.finished
    assert client.get_run(video.run_id).info.run_name == "nightly"


def test_a_run_name_shared_with_a_run_that_is_no_stage_run_is_allowed(client: MlflowClient) -> None:
    # A pipeline's parent run is named after its spec and holds no files under that name.
    experiment_id = client.create_experiment("skeleton")
    client.create_run(experiment_id, run_name="nightly", tags={"vitpipe.stage": "pipeline", "vitpipe.config_hash": "p"})
    with stage_run(client, "pretrain", _config("nightly"), {"lr": 0.1}) as run:
        assert not run.finished
    assert client.get_run(run.run_id).info.status == "FINISHED"
