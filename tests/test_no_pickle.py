"""No code runs from the registry: models are logged as safetensors + config.json, and vitpipe reads only those.

A planted pickle, whose unpickling creates a marker file, is put where a model is
expected (a registered version's folder, a `runs:/` checkpoint folder, a checkpoint
directory, a weights file). Loading starting weights never creates the marker: the
pickle is ignored, or loading fails in one line. Against the session's real
`mlflow server` (artifacts on the S3 server); the demo's test uses its SQLite store.
"""

from __future__ import annotations

import logging
import pickle
import uuid
import warnings
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

import vit
from pipelines.core import registry, run_open, tracking
from pipelines.demo import demo_spec
from pipelines.training.starting_weights import fetch_starting_weights, starting_origin

PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".bin")


class _Plant:
    """Unpickling this calls `open(marker, "w")`: the marker file appearing means code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "code-ran"


@pytest.fixture
def planted(marker: Path) -> bytes:
    return pickle.dumps(_Plant(marker))


@pytest.fixture
def client(mlflow_server: str) -> MlflowClient:
    return MlflowClient(mlflow_server)


def _model() -> torch.nn.Module:
    return vit.create_model("ViT-Ti/16", image_size=16, patch_size=4, num_classes=3, depth=1, embed_dim=16,
                            num_heads=2, mlp_dim=32).eval()


def _new_run(client: MlflowClient) -> str:
    run_id, _ = run_open.start_stage_run(client, f"no-pickle-{uuid.uuid4().hex[:8]}", "finetune", uuid.uuid4().hex)
    return run_id


def _fetch(init: str, client: MlflowClient):
    return fetch_starting_weights(init, model_name=None, model_overrides={}, tracking_uri=client.tracking_uri)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    theirs = b.state_dict()
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)


def _register_folder(client: MlflowClient, run_id: str, folder: Path, name: str) -> str:
    """Register a run's artifact folder as-is (what an older vitpipe, or anyone, could have registered)."""
    client.log_artifacts(run_id, str(folder), "model")
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    client.create_registered_model(name)
    return client.create_model_version(name, source, run_id=run_id).version


def test_the_planted_pickle_runs_code_when_unpickled(planted: bytes, marker: Path) -> None:
    pickle.loads(planted).close()  # the probe works: unpickling it is what the other tests must never do
    assert marker.exists()


def test_a_logged_model_holds_safetensors_and_the_vit_code_but_no_pickle_and_no_vitpipe_requirement(client, tmp_path):
    run_id = _new_run(client)
    vit.save_checkpoint(_model(), tmp_path / "ckpt")
    uri = registry.log_vit_model(client, run_id, tmp_path / "ckpt")
    root = client.get_logged_model(uri.removeprefix("models:/")).artifact_location
    model_dir = Path(mlflow.artifacts.download_artifacts(artifact_uri=root, dst_path=str(tmp_path / "model"),
                                                         tracking_uri=client.tracking_uri))
    files = {p.relative_to(model_dir).as_posix(): p for p in model_dir.rglob("*") if p.is_file()}
    assert {"MLmodel", "artifacts/checkpoint/model.safetensors", "artifacts/checkpoint/config.json",
            "code/vit/__init__.py", "code/vit/weights.py", "pyfunc_model.py"} <= set(files)
    assert not [n for n, p in files.items() if n.endswith(PICKLE_SUFFIXES) or p.read_bytes()[:1] == b"\x80"]
    requirements = files["requirements.txt"].read_text().split()
    assert not [r for r in requirements if r.startswith("vitpipe")]
    assert any(r.startswith("torch==") for r in requirements) and any(r.startswith("safetensors==") for r in requirements)


def test_the_logged_model_serves_the_checkpoints_logits_through_mlflow_pyfunc(client, tmp_path):
    run_id = _new_run(client)
    model = _model()
    vit.save_checkpoint(model, tmp_path / "ckpt")
    uri = registry.log_vit_model(client, run_id, tmp_path / "ckpt")
    mlflow.set_tracking_uri(client.tracking_uri)
    served = mlflow.pyfunc.load_model(uri)
    x = torch.randn(2, 16, 48)
    with torch.no_grad():
        np.testing.assert_array_equal(served.predict(x.numpy()), model(x).numpy())


def test_logging_and_serving_a_model_raise_no_warning_about_predicts_type_hints(client, tmp_path):
    run_id = _new_run(client)
    vit.save_checkpoint(_model(), tmp_path / "ckpt")
    mlflow.set_tracking_uri(client.tracking_uri)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = mlflow.pyfunc.load_model(registry.log_vit_model(client, run_id, tmp_path / "ckpt"))
        served.predict(np.zeros((1, 16, 48), np.float32))
    assert not [w for w in caught if "type hint" in str(w.message).lower()], [str(w.message) for w in caught]
    assert served.metadata.signature is None  # the model takes patches or frames of any shape


def test_logging_a_model_logs_no_warning_that_its_signature_cannot_be_inferred(client, tmp_path):
    """The model has no signature on purpose; MLflow's warning about it told users nothing."""
    run_id = _new_run(client)
    vit.save_checkpoint(_model(), tmp_path / "ckpt")
    records: list[logging.LogRecord] = []
    seen = logging.Handler(logging.WARNING)
    seen.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("mlflow.pyfunc")
    logger.addHandler(seen)
    try:
        registry.log_vit_model(client, run_id, tmp_path / "ckpt")
    finally:
        logger.removeHandler(seen)
    assert not [r for r in records if "signature" in r.getMessage()], [r.getMessage() for r in records]


def test_the_champion_alias_marks_the_best_scoring_version(client, tmp_path):
    name = f"champion-{uuid.uuid4().hex[:8]}"
    runs = []
    for score in (0.5, 0.9, 0.7):
        run_id = _new_run(client)
        vit.save_checkpoint(_model(), tmp_path / run_id)
        uri = registry.log_vit_model(client, run_id, tmp_path / run_id)
        registry.register(client, name, uri, run_id, {"vitpipe.manifest_hash": "abc"}, run_tag="vitpipe.test_run",
                          score=registry.Score("test_top1", score))
        runs.append(run_id)
    champion = client.get_model_version_by_alias(name, registry.CHAMPION)
    assert (champion.version, champion.run_id) == ("2", runs[1])
    assert champion.tags["vitpipe.manifest_hash"] == "abc" and champion.tags["vitpipe.score"] == "0.9"
    assert _fetch(f"models:/{name}@champion", client).source_run_id == runs[1]


def test_an_alias_moved_after_the_origin_was_looked_up_still_fetches_the_version_it_named(client, tmp_path):
    """The stage's identity holds the run the alias named: the weights it trains from are that run's."""
    name = f"moved-{uuid.uuid4().hex[:8]}"
    models, versions = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(_model())
        run_id = _new_run(client)
        vit.save_checkpoint(models[-1], tmp_path / run_id)
        uri = registry.log_vit_model(client, run_id, tmp_path / run_id)
        versions.append(registry.register(client, name, uri, run_id, {}, run_tag="vitpipe.test_run",
                                          score=registry.Score("m", float(seed))))
    client.set_registered_model_alias(name, "pick", versions[0])
    origin = starting_origin(f"models:/{name}@pick", client.tracking_uri)
    client.set_registered_model_alias(name, "pick", versions[1])
    start = fetch_starting_weights(f"models:/{name}@pick", model_name=None, model_overrides={},
                                   tracking_uri=client.tracking_uri, origin=origin)
    assert start.source_run_id == origin.run_id and origin.version == f"{name}/{versions[0]}"
    _same_weights(start.model, models[0])


def test_registering_the_same_run_again_adds_no_version(client, tmp_path):
    name = f"again-{uuid.uuid4().hex[:8]}"
    run_id = _new_run(client)
    vit.save_checkpoint(_model(), tmp_path / "ckpt")
    uri = registry.log_vit_model(client, run_id, tmp_path / "ckpt")
    first = registry.register(client, name, uri, run_id, {}, run_tag="vitpipe.test_run", score=registry.Score("m", 1.0))
    again = registry.register(client, name, uri, run_id, {}, run_tag="vitpipe.test_run", score=registry.Score("m", 1.0))
    assert first == again == "1"
    assert len(client.search_model_versions(f"name = '{name}'")) == 1


def test_a_pickled_model_registered_under_the_name_is_refused_in_one_line_and_never_unpickled(
        client, tmp_path, planted, marker):
    folder = tmp_path / "pytorch-model"  # the layout of a pickled `mlflow.pytorch` model
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "model.pth").write_bytes(planted)
    (folder / "python_model.pkl").write_bytes(planted)
    (folder / "MLmodel").write_text("flavors:\n  pytorch: {model_data: data, pytorch_version: 2.13.0}\n"
                                    "  python_function: {loader_module: mlflow.pytorch, data: data}\n")
    name = f"pickled-{uuid.uuid4().hex[:8]}"
    version = _register_folder(client, _new_run(client), folder, name)
    client.set_registered_model_alias(name, "champion", version)
    for init in (f"models:/{name}/{version}", f"models:/{name}@champion", f"models:/{name}/latest"):
        with pytest.raises(ValueError) as err:
            _fetch(init, client)
        assert len(str(err.value).splitlines()) == 1 and "never a pickled model" in str(err.value)
    assert not marker.exists()


def test_pickles_beside_a_registered_checkpoint_are_never_read(client, tmp_path, planted, marker):
    model = _model()
    folder = tmp_path / "model"
    vit.save_checkpoint(model, folder / "artifacts" / "checkpoint")
    (folder / "artifacts" / "checkpoint" / "extra.pkl").write_bytes(planted)
    (folder / "python_model.pkl").write_bytes(planted)
    name = f"beside-{uuid.uuid4().hex[:8]}"
    version = _register_folder(client, _new_run(client), folder, name)
    _same_weights(_fetch(f"models:/{name}/{version}", client).model, model)
    assert not marker.exists()


def test_pickles_in_a_runs_checkpoint_folder_are_never_read(client, tmp_path, planted, marker):
    model = _model()
    folder = tmp_path / "final"
    vit.save_checkpoint(model, folder)
    (folder / "train_state.pt").write_bytes(planted)
    (folder / "model.pkl").write_bytes(planted)
    run_id = _new_run(client)
    client.log_artifacts(run_id, str(folder), "checkpoints/final")
    _same_weights(_fetch(f"runs:/{run_id}/checkpoints/final", client).model, model)
    _same_weights(_fetch(run_id, client).model, model)
    _same_weights(registry.load_model_from_run(f"runs:/{run_id}/checkpoints/final", client.tracking_uri), model)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["checkpoint directory", "runs:/ folder", "registered version"])
def test_a_pickle_named_model_safetensors_fails_in_one_line_without_running(client, tmp_path, planted, marker, where):
    folder = tmp_path / "ckpt"
    vit.save_checkpoint(_model(), folder)
    (folder / "model.safetensors").write_bytes(planted)
    if where == "checkpoint directory":
        init = str(folder)
    elif where == "runs:/ folder":
        run_id = _new_run(client)
        client.log_artifacts(run_id, str(folder), "checkpoints/final")
        init = f"runs:/{run_id}/checkpoints/final"
    else:
        (tmp_path / "model" / "artifacts").mkdir(parents=True)
        folder.rename(tmp_path / "model" / "artifacts" / "checkpoint")
        name = f"renamed-{uuid.uuid4().hex[:8]}"
        init = f"models:/{name}/{_register_folder(client, _new_run(client), tmp_path / 'model', name)}"
    with pytest.raises(ValueError) as err:
        _fetch(init, client)
    assert len(str(err.value).splitlines()) == 1 and "not a loadable vit checkpoint" in str(err.value)
    assert not marker.exists()


def test_a_pickled_weights_file_given_as_init_is_refused_in_one_line_without_running(tmp_path, planted, marker):
    weights = tmp_path / "vit_base.pth"
    weights.write_bytes(planted)
    with pytest.raises(ValueError) as err:
        fetch_starting_weights(str(weights), model_name="ViT-Ti/4", model_overrides={"depth": 1},
                               tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert len(str(err.value).splitlines()) == 1 and "refused" in str(err.value)
    assert not marker.exists()


def test_the_demo_spec_names_a_registry_model_for_its_fine_tunes_and_its_vtn(tmp_path):
    # Only the spec: registering under `registry_model` is tested per stage (test_finetune, test_video_train);
    # a demo run is too slow here.
    image, video = demo_spec(tmp_path), demo_spec(tmp_path, video=True)
    assert image.resolved_config("finetune_pretrained")["registry_model"] == "vitpipe-demo-digits"
    assert image.resolved_config("finetune_scratch")["registry_model"] == "vitpipe-demo-digits"
    assert video.resolved_config("vtn")["registry_model"] == "vitpipe-demo-vtn"


def test_the_demo_keeps_mlflow_artifacts_under_its_work_folder(tmp_path, monkeypatch):
    started_in, work = tmp_path / "cwd", tmp_path / "work"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = demo_spec(work)
    work.mkdir()
    client = MlflowClient(spec.resolved_tracking_uri())
    run_id, _ = run_open.start_stage_run(client, spec.experiment, "finetune", "demo")
    vit.save_checkpoint(_model(), work / "ckpt")
    tracking.log_checkpoint_dir(client, run_id, work / "ckpt", "checkpoints/best")
    tracking.log_dict_artifact(client, run_id, {"a": 1}, "best_config.json")
    uri = registry.log_vit_model(client, run_id, work / "ckpt")
    registry.register(client, "vitpipe-demo-digits", uri, run_id, {}, run_tag="vitpipe.finetune_run_id",
                      score=registry.Score("test_top1", 0.9))
    assert list(started_in.iterdir()) == []  # no ./mlruns, ./mlflow.db or ./mlartifacts where it started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "work"]
    artifacts = work / "mlartifacts"
    written = {p.name for p in artifacts.rglob("*") if p.is_file()}
    assert {"best_config.json", "model.safetensors", "MLmodel"} <= written
    assert client.get_run(run_id).info.artifact_uri.startswith(artifacts.as_uri())
    assert client.get_model_version("vitpipe-demo-digits", "1").source.startswith(artifacts.as_uri())
