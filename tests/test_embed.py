"""The embed stage on the session's real local Ray: pooled features of every image of an ingest output.

The data are the session's tiny ingest output (`tiny_dataset`: 120 fractal images,
16×16, patch 4, in shards); the model is a tiny ViT logged as a pretrain run leaves
it (`checkpoints/final` of an MLflow run in a SQLite store under the module's tmp).
One embedding run is shared by the tests that read it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

import vit
from pipelines.core import shards, tracking
from pipelines.core.errors import VitpipeError
from pipelines.core.storage import open_store
from pipelines.image.data import normalize, patches_array
from pipelines.image.embed import run_embed
from pipelines.image.configs import EmbedConfig
from pipelines.image.embeddings import embedding_matrix, read_embeddings
from pipelines.runner import run_pipeline
from pipelines.spec_file import load_spec

TINY = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}


def tiny_model(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return vit.create_model("ViT-Ti/4", image_size=16, num_classes=4, **TINY)


def logged_run(tmp: Path, tracking_uri: str, seed: int) -> str:
    """A tiny ViT as a pretrain run leaves it: `checkpoints/final` of a finished MLflow run; returns the run id."""
    checkpoint = vit.save_checkpoint(tiny_model(seed), tmp / f"checkpoint-{seed}")
    client = MlflowClient(tracking_uri)
    run_id = client.create_run(tracking.get_or_create_experiment(client, "embed-models"),
                               tags={tracking.TAG_STAGE: "pretrain"}).info.run_id
    tracking.log_checkpoint_dir(client, run_id, checkpoint, "checkpoints/final")
    client.set_terminated(run_id)
    return run_id


def stored_rows(uri: str) -> pa.Table:
    """Every row of an ingest output (`patches`, `label`, `key`, `split`), in key order."""
    store = open_store(uri)
    manifest = shards.read_manifest(store)
    return pa.concat_tables([pq.read_table(path, filesystem=fs) for fs, path in
                             (store.arrow(s["path"]) for s in manifest["shards"])]).sort_by("key")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("embed")
    tracking_uri = f"sqlite:///{tmp}/mlflow.db"
    return {"tmp": str(tmp), "tracking_uri": tracking_uri, "run_id": logged_run(tmp, tracking_uri, seed=0)}


@pytest.fixture(scope="module")
def embedded(ray_cluster, tiny_dataset, setup):
    config = EmbedConfig(data=tiny_dataset, output=f"{setup['tmp']}/embeddings", init=setup["run_id"],
                         precision="fp32", batch_size=16, tracking_uri=setup["tracking_uri"], experiment="embed-tests")
    return config, run_embed(config)


def test_output_rows_are_the_models_pooled_features_of_the_same_images(embedded, tiny_dataset):
    config, _ = embedded
    source = stored_rows(tiny_dataset)
    patches = normalize(patches_array(source.column("patches"), 16, 48))
    with torch.inference_mode():
        expected = tiny_model(seed=0).eval().pooled_features(torch.from_numpy(patches)).numpy()
    manifest, table = read_embeddings(config.output)
    assert table.column("key").to_pylist() == source.column("key").to_pylist()
    assert manifest["embedding_dim"] == 32 and table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    np.testing.assert_allclose(embedding_matrix(table), expected, rtol=0, atol=1e-5)


def test_output_rows_carry_the_ingests_labels_and_splits(embedded, tiny_dataset):
    config, _ = embedded
    source = stored_rows(tiny_dataset)
    _, table = read_embeddings(config.output)
    assert table.column("label").to_pylist() == source.column("label").to_pylist()
    assert table.column("split").to_pylist() == source.column("split").to_pylist()


def test_the_run_records_its_params_row_count_speed_and_the_model_it_came_from(embedded, setup):
    config, result = embedded
    run = MlflowClient(setup["tracking_uri"]).get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags[tracking.TAG_STAGE] == "embed"
    assert run.data.tags["vitpipe.pretrain_run_id"] == setup["run_id"]
    assert run.data.params["precision"] == "fp32" and run.data.params["resolution"] == "16"
    assert run.data.metrics["images"] == 120 and run.data.metrics["images_per_s"] > 0


def test_a_rerun_with_the_same_model_and_data_reuses_the_output_and_the_run(embedded):
    config, first = embedded
    again = run_embed(config)
    assert again.reused and again.run_id == first.run_id and again.shards_written == 0
    assert again.manifest["content_hash"] == first.manifest["content_hash"]


def test_another_model_is_not_reused_from_a_finished_output(embedded, setup):
    config, first = embedded
    copy = shutil.copytree(config.output, Path(setup["tmp"]) / "copy")  # the first model's finished output
    other = logged_run(Path(setup["tmp"]), setup["tracking_uri"], seed=1)
    changed = run_embed(config.model_copy(update={"init": other, "output": str(copy)}))
    assert not changed.reused and changed.run_id != first.run_id
    assert changed.shards_written == len(first.manifest["shards"]) and changed.shards_reused == 0
    assert changed.manifest["content_hash"] != first.manifest["content_hash"]



@pytest.mark.parametrize("stage", ["embed", "evaluate", "pretrain", "finetune"])
def test_an_output_that_holds_no_images_as_the_data_is_refused_in_one_line_naming_it(embedded, setup, tmp_path, stage):
    from pipelines.image.configs import EvaluateConfig, FinetuneConfig, PretrainConfig
    from pipelines.image.evaluate import run_evaluate
    from pipelines.image.finetune import run_finetune
    from pipelines.image.pretrain import run_pretrain

    config, _ = embedded  # its output: embeddings, no patches to read
    fields = {"data": config.output, "tracking_uri": setup["tracking_uri"]}
    runs = {  # pretrain and fine-tune failed on the first image field missing: "KeyError: 'image_size'"
        "embed": lambda: run_embed(EmbedConfig(**fields, init=setup["run_id"], output=str(tmp_path / "again"))),
        "evaluate": lambda: run_evaluate(EvaluateConfig(**fields, init=setup["run_id"], shots=[1], repeats=1)),
        "pretrain": lambda: run_pretrain(PretrainConfig(**fields, steps=4, warmup_steps=1, storage=str(tmp_path))),
        "finetune": lambda: run_finetune(FinetuneConfig(**fields, init=setup["run_id"], storage=str(tmp_path),
                                                        search_space={"lr": 0.01, "steps": 4}, batch_size=8)),
    }
    with pytest.raises(VitpipeError) as err:
        runs[stage]()
    assert str(err.value) == (f"{config.output}: not an image dataset (format 'vitpipe-embeddings/1', "
                              "expected 'vitpipe-patches/1')")


def test_an_output_that_holds_another_finished_dataset_is_refused_and_left_whole(embedded, tiny_dataset, setup, tmp_path):
    config, _ = embedded
    other = shutil.copytree(tiny_dataset, tmp_path / "other-dataset")  # a finished ingest output, e.g. a path mistyped
    before = {p.relative_to(other): p.read_bytes() for p in Path(other).rglob("*") if p.is_file()}
    with pytest.raises(VitpipeError) as err:
        run_embed(config.model_copy(update={"output": str(other)}))
    assert str(err.value) == (f"{other}: holds a finished output of another kind (format 'vitpipe-patches/1', "
                              "not 'vitpipe-embeddings/1'); write to a new folder or to an earlier output of this kind")
    assert {p.relative_to(other): p.read_bytes() for p in Path(other).rglob("*") if p.is_file()} == before


def test_an_output_folder_that_holds_the_data_is_refused_and_the_data_left_whole(embedded, tiny_dataset, tmp_path):
    config, _ = embedded
    data = shutil.copytree(tiny_dataset, tmp_path / "work" / "shards")  # README's `vitpipe ingest ./corpus ./shards`
    before = {p.relative_to(data): p.read_bytes() for p in Path(data).rglob("*") if p.is_file()}
    with pytest.raises(ValueError) as err:
        run_embed(config.model_copy(update={"data": str(data), "output": str(tmp_path / "work")}))
    assert str(err.value) == f"output: {tmp_path / 'work'} holds the data ({data}); embeddings go elsewhere"
    assert {p.relative_to(data): p.read_bytes() for p in Path(data).rglob("*") if p.is_file()} == before

def test_a_spec_with_an_embed_stage_runs_through_the_runner(ray_cluster, setup, tmp_path):
    from pipelines.corpora.images import synth_corpus

    synth_corpus(str(tmp_path / "corpus"), images=24, classes=2, size=16, seed=5)
    checkpoint = vit.save_checkpoint(tiny_model(seed=2), tmp_path / "checkpoint")
    spec = {"name": "embed-spec", "storage": {"root": str(tmp_path / "work")},
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "embed-spec",
            "stages": {"corpus": {"kind": "ingest", "source": str(tmp_path / "corpus"), "image_size": 16,
                                  "patch_size": 4, "shard_size": 8},
                       "vectors": {"kind": "embed", "inputs": ["corpus"], "init": str(checkpoint),
                                   "batch_size": 8}}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    result = run_pipeline(load_spec(str(tmp_path / "spec.yaml")))
    assert [(r.stage, r.status) for r in result.rows] == [("corpus", "done"), ("vectors", "done")]
    manifest, table = read_embeddings(result.outputs["vectors"].output)
    assert manifest["counts"]["images"] == table.num_rows == 24


@pytest.mark.timeout(300)
def test_actors_that_take_every_cpu_still_embed_every_image(ray_cluster, tiny_dataset, setup):
    # The session cluster has 4 CPUs; the shard reads take none, so they never wait for the actors'.
    config = EmbedConfig(data=tiny_dataset, output=f"{setup['tmp']}/crowded", init=setup["run_id"], num_workers=4,
                         tracking_uri=setup["tracking_uri"], experiment="embed-tests")
    _, table = read_embeddings(run_embed(config).output)
    assert sorted(table.column("key").to_pylist()) == sorted(stored_rows(tiny_dataset).column("key").to_pylist())


@pytest.mark.parametrize("output, words", [
    ("DATA", "is the data's own location; embeddings go elsewhere"),
    ("ftp://host/x", "ftp://host/x"),
    ("s3://bkt/emb//x", "s3://bkt/emb//x: an empty folder name ('//') is refused here"),
])
def test_an_output_that_is_the_data_or_no_storage_uri_is_a_one_line_error_naming_it(tmp_path, output, words):
    from pipelines.image.embed import load_config

    data = str(tmp_path / "data")
    with pytest.raises(ValueError) as err:
        load_config({"data": data, "output": data if output == "DATA" else output})
    message = str(err.value)
    assert message.startswith("embed config: ") and "\n" not in message and words in message


def test_a_from_scratch_model_is_drawn_from_the_configs_seed(tmp_path):
    from pipelines.image.frozen_model import load_frozen_model

    manifest = {"image_size": 16, "patch_size": 4, "patch_dim": 48}

    def weights(seed: int) -> str:
        config = EmbedConfig(data=str(tmp_path / "data"), output=str(tmp_path / "out"), init=None, model="ViT-Ti/4",
                             model_overrides=TINY, seed=seed)
        start, _ = load_frozen_model(config, manifest, "unused")
        return vit.weights_hash(start.model)

    assert weights(0) == weights(0)
    assert weights(1) != weights(0)  # so the output's fingerprint, which holds this hash, differs too


def test_the_output_manifest_holds_no_password_of_the_tracking_uri(ray_cluster, tiny_dataset, mlflow_server, tmp_path):
    checkpoint = vit.save_checkpoint(tiny_model(seed=3), tmp_path / "checkpoint")
    with_password = mlflow_server.replace("http://", "http://bob:hunter2@")
    config = EmbedConfig(data=tiny_dataset, output=str(tmp_path / "embeddings"), init=str(checkpoint),
                         tracking_uri=with_password, experiment="embed-secret", batch_size=32)
    run_embed(config)
    written = (tmp_path / "embeddings" / shards.MANIFEST).read_text()
    assert "hunter2" not in written and mlflow_server in written
