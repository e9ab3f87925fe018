"""MLflow helpers of the stages, against a real local SQLite tracking store."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from pipelines.core import registry, run_open, tracking, uris


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> MlflowClient:
    # One store for the module (creating a SQLite tracking DB costs about a second);
    # tests keep apart by experiment name.
    return MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db")


@pytest.fixture
def exp(request) -> str:
    return f"exp-{request.node.name}"


def test_tracking_uri_prefers_config_then_environment_then_local_sqlite(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert uris.resolve_tracking_uri("sqlite:////data/x.db") == "sqlite:////data/x.db"
    assert uris.resolve_tracking_uri(None) == "http://127.0.0.1:5999"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert uris.resolve_tracking_uri(None) == f"sqlite:///{tmp_path}/mlflow.db"


def test_relative_sqlite_paths_are_made_absolute_for_workers_in_other_directories(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert uris.resolve_tracking_uri("sqlite:///runs/x.db") == f"sqlite:///{tmp_path}/runs/x.db"


def test_redact_drops_credential_keys_and_uri_passwords():
    config = {
        "storage": "s3://bucket/runs",
        "tracking_uri": "http://alice:hunter2@mlflow.example:5000/x",
        "s3": {"aws_secret_access_key": "SECRET", "aws_access_key_id": "AKIA", "region": "us-east-1"},
        "api_token": "tok",
    }
    out = tracking.redact(config)
    assert out["storage"] == "s3://bucket/runs"
    assert out["tracking_uri"] == "http://mlflow.example:5000/x"
    assert out["s3"] == {"region": "us-east-1"}
    assert "api_token" not in out
    assert "hunter2" not in repr(out) and "SECRET" not in repr(out)


def test_config_hash_ignores_key_order_and_sees_values():
    a = tracking.config_hash({"lr": 0.1, "model": {"depth": 2, "width": 8}})
    b = tracking.config_hash({"model": {"width": 8, "depth": 2}, "lr": 0.1})
    c = tracking.config_hash({"model": {"width": 8, "depth": 3}, "lr": 0.1})
    assert a == b != c


def test_unfinished_run_with_same_digest_is_reopened(client, exp):
    first, status = run_open.start_stage_run(client, exp, "pretrain", "abc")
    assert status == ""
    client.set_terminated(first, status="KILLED")
    again, status = run_open.start_stage_run(client, exp, "pretrain", "abc")
    assert (again, status) == (first, "KILLED")
    assert client.get_run(first).info.status == "RUNNING"


def test_different_digest_or_stage_starts_a_new_run(client, exp):
    first, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    other_digest, _ = run_open.start_stage_run(client, exp, "pretrain", "xyz")
    other_stage, _ = run_open.start_stage_run(client, exp, "finetune", "abc")
    assert len({first, other_digest, other_stage}) == 3


def test_finished_run_is_reported_and_left_finished(client, exp):
    first, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    tracking.end_run(client, first, ok=True)
    again, status = run_open.start_stage_run(client, exp, "pretrain", "abc")
    assert (again, status) == (first, "FINISHED")
    assert client.get_run(first).info.status == "FINISHED"


def test_stage_run_becomes_child_of_parent_run(client, exp):
    parent, _ = run_open.start_stage_run(client, exp, "pipeline", "p")
    child, _ = run_open.start_stage_run(client, exp, "pretrain", "c", parent_run_id=parent)
    assert client.get_run(child).data.tags[tracking.TAG_PARENT] == parent


def test_params_are_flattened_without_credentials_and_relogging_is_accepted(client, exp):
    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    config = {"lr": 0.001, "model_overrides": {"depth": 2}, "betas": [0.9, 0.999], "secret_key": "S"}
    tracking.log_params(client, run_id, config)
    tracking.log_params(client, run_id, config)  # a resumed execution logs the same config again
    params = client.get_run(run_id).data.params
    assert params == {"lr": "0.001", "model_overrides.depth": "2", "betas": "[0.9, 0.999]"}


def test_a_param_logged_again_with_another_value_keeps_the_first_and_tags_the_latest(client, exp):
    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    tracking.log_params(client, run_id, {"lr": 0.001, "max_failures": 2})
    tracking.log_params(client, run_id, {"lr": 0.001, "max_failures": 5})  # resumed with another retry count
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.001", "max_failures": "2"}
    assert {k: v for k, v in run.data.tags.items() if k.startswith(tracking.TAG_LATEST)} == {
        f"{tracking.TAG_LATEST}max_failures": "5"}


def test_metric_buffer_sends_nothing_until_flushed_then_everything(client, exp):
    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    buffer = tracking.MetricBuffer(client, run_id)
    for step in range(1, 6):
        buffer.add({"train_loss": 1.0 / step, "lr": 0.1}, step)
    assert client.get_metric_history(run_id, "train_loss") == []
    buffer.flush()
    history = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    assert len(client.get_metric_history(run_id, "lr")) == 5


def test_learning_curve_png_is_logged_from_metric_history(client, exp):
    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    buffer = tracking.MetricBuffer(client, run_id)
    for step in range(1, 11):
        buffer.add({"train_loss": 2.0 / step}, step)
    buffer.add({"val_loss": 0.5, "val_top1": 0.7}, 10)
    buffer.flush()
    assert tracking.log_learning_curve(client, run_id)
    names = [a.path for a in client.list_artifacts(run_id)]
    assert "learning_curve.png" in names
    local = client.download_artifacts(run_id, "learning_curve.png")
    with open(local, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_learning_curve_is_skipped_when_nothing_was_logged(client, exp):
    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    assert not tracking.log_learning_curve(client, run_id)
    assert client.list_artifacts(run_id) == []


def test_config_artifact_has_no_credentials(client, exp):
    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    tracking.log_dict_artifact(client, run_id, {"lr": 0.1, "aws_secret_access_key": "S"}, "config.yaml")
    text = open(client.download_artifacts(run_id, "config.yaml")).read()
    assert "lr: 0.1" in text and "aws_secret" not in text


def test_system_info_names_versions_and_workers():
    import ray
    import torch

    tags = tracking.system_info(num_workers=3, use_gpu=False)
    assert tags["vitpipe.num_workers"] == "3"
    assert tags["vitpipe.ray_version"] == ray.__version__
    assert tags["vitpipe.torch_version"] == torch.__version__


def test_logged_checkpoint_dir_loads_back_by_run_uri(client, exp, tmp_path):
    import torch

    import vit

    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    model = vit.create_model("ViT-Ti/16", image_size=16, patch_size=4, num_classes=3, depth=1, embed_dim=16, num_heads=2, mlp_dim=32)
    vit.save_checkpoint(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "train_state.pt").write_bytes(b"optimizer state stays in training storage")
    tracking.log_checkpoint_dir(client, run_id, tmp_path / "ckpt", "checkpoints/final")
    logged = {a.path for a in client.list_artifacts(run_id, "checkpoints/final")}
    assert logged == {"checkpoints/final/model.safetensors", "checkpoints/final/config.json"}
    loaded = registry.load_model_from_run(f"runs:/{run_id}/checkpoints/final", tracking_uri=client.tracking_uri)
    x = torch.randn(2, 16, 48)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_loading_a_run_path_that_is_no_checkpoint_is_a_value_error(client, exp):
    run_id, _ = run_open.start_stage_run(client, exp, "pretrain", "abc")
    tracking.log_dict_artifact(client, run_id, {"a": 1}, "notes/a.json")
    with pytest.raises(ValueError, match="is not a vit checkpoint directory"):
        registry.load_model_from_run(f"runs:/{run_id}/notes", tracking_uri=client.tracking_uri)
