"""The pipeline runner on the session's real local Ray: a whole spec, ingest → pretrain → fine-tune → evaluate.

One tiny pipeline runs once (module fixture) into a SQLite store, then again;
the tests read both outcomes. A second spec fails in its pretrain stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines.runner import PipelineResult, run_pipeline
from pipelines.spec import load_spec

pytestmark = pytest.mark.slow

TINY = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}


def write_spec(tmp: Path, corpus: Path, **pretrain_fields) -> Path:
    spec = {
        "name": "tiny",
        "storage": {"root": str(tmp / "work")},
        "tracking_uri": f"sqlite:///{tmp}/mlflow.db",
        "experiment": "runner-tests",
        "stages": {
            "corpus": {"kind": "ingest", "source": str(corpus), "image_size": 16, "patch_size": 4,
                       "val_fraction": 0.2, "test_fraction": 0.2, "shard_size": 100},
            "pretrain": {"kind": "pretrain", "inputs": ["corpus"], "model": "ViT-Ti/16", "model_overrides": TINY,
                         "num_workers": 1, "batch_size_per_worker": 16, "steps": 6, "warmup_steps": 1,
                         "log_interval": 2, "augment": False, **pretrain_fields},
            "finetune": {"kind": "finetune", "inputs": ["corpus", "pretrain"], "batch_size": 16, "eval_interval": 3,
                         "search_space": {"lr": 0.01, "steps": 6}, "max_concurrent_trials": 1},
            "fewshot": {"kind": "evaluate", "inputs": ["corpus", "pretrain"], "shots": [1, 2], "repeats": 1},
        },
    }
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from pipelines.corpus import synth_corpus

    root = tmp_path_factory.mktemp("runner-corpus")
    synth_corpus(str(root), images=150, classes=3, size=16, seed=3)
    return root


@pytest.fixture(scope="module")
def runs(ray_cluster, corpus, tmp_path_factory) -> tuple[PipelineResult, PipelineResult, MlflowClient]:
    tmp = tmp_path_factory.mktemp("runner")
    spec = load_spec(write_spec(tmp, corpus))
    first = run_pipeline(spec)
    second = run_pipeline(spec)
    return first, second, MlflowClient(spec.resolved_tracking_uri())


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
