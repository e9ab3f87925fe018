"""The video chain through the runner, whole: corpus on S3 → video ingest → features → VTN → registered model.

A generated corpus (12 MP4s of 8 frames, 32×32, two classes that differ only in
frame order) is uploaded to the session's moto S3 server. One spec, run with
`run_pipeline`, ingests it, computes per-frame features with a tiny pretrained ViT
(logged as an image pretrain run leaves it), trains a VTN on those features for a
few steps, evaluates it and registers it; every output lives on S3, tracking in a
SQLite store. The spec then runs again and must reuse every stage.
"""

from __future__ import annotations


import pytest
from mlflow.tracking import MlflowClient

from pipelines.core import tracking
from pipelines.corpora.videos import synth_video_corpus
from pipelines.runner import PIPELINE_STAGE, TAG_PIPELINE, TAG_STAGE_NAME, TAG_UPSTREAM, run_pipeline
from pipelines.spec_file import parse_spec
from pipelines.video.train import TAG_BACKBONE_RUN, TAG_VIDEO_RUN
from tests.video_fixtures import FRAMES, TEMPORAL, logged_backbone_run, upload_tree

pytestmark = pytest.mark.slow

EXPERIMENT = "video-chain"
MODEL = "video-chain-vtn"
KINDS = {"videos": "video_ingest", "features": "video_features", "vtn": "video_train"}


def chain_spec(bucket: str, endpoint_url: str, source: str, backbone: dict[str, str]) -> dict:
    """Three stages, every output under `s3://bucket/work`; the backbone is a `runs:/` input of two of them."""
    return {
        "name": "video-chain",
        "storage": {"root": f"s3://{bucket}/work", "endpoint_url": endpoint_url},
        "tracking_uri": backbone["tracking_uri"],
        "experiment": EXPERIMENT,
        "stages": {
            "videos": {"kind": "video_ingest", "source": source, "frame_size": 32, "sampling": "full",
                       "max_frames": FRAMES, "val_fraction": 0.25, "test_fraction": 0.25, "shard_size": 4},
            "features": {"kind": "video_features", "inputs": ["videos", backbone["init"]], "precision": "fp32"},
            "vtn": {"kind": "video_train", "inputs": ["features", backbone["init"]], "vtn": TEMPORAL,
                    "temporal_pos_embed": "fixed", "train_frames": FRAMES, "optimizer": "adamw", "lr": 5e-3,
                    "warmup_steps": 1, "steps": 4, "batch_size_per_worker": 4, "num_workers": 1,
                    "torch_threads": 1, "precision": "fp32", "log_interval": 1, "checkpoint_interval": 0,
                    "eval_split": "val", "eval_modes": ["full_video", "multiview"], "full_video_frames": FRAMES,
                    "multiview_clips": 2, "multiview_crops": 1, "attention_videos": 0,
                    "registry_model": MODEL},
        },
    }


@pytest.fixture(scope="module")
def chain(ray_cluster, s3_server, tmp_path_factory):
    """The spec run twice; returns both results, the spec and an MLflow client of its store."""
    tmp = tmp_path_factory.mktemp("video-chain")
    s3 = s3_server.client()
    bucket = "video-chain"
    s3.create_bucket(Bucket=bucket)
    synth_video_corpus(str(tmp / "corpus"), videos=12, classes=2, size=32, frames=FRAMES, seed=1)
    source = upload_tree(s3, tmp / "corpus", bucket, "corpus")
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    backbone = logged_backbone_run(tmp, EXPERIMENT, steps=20)
    spec = parse_spec(chain_spec(bucket, s3_server.endpoint_url, source, backbone), "video-chain.yaml")
    with pytest.MonkeyPatch.context() as mp:  # the driver reads and writes S3 through the standard AWS chain
        for name, value in s3_server.env.items():
            mp.setenv(name, value)
        mp.setenv("AWS_CONFIG_FILE", "/dev/null")
        mp.delenv("AWS_PROFILE", raising=False)
        first, second = run_pipeline(spec), run_pipeline(spec)
    return first, second, spec, client, backbone


def by_stage(result) -> dict[str, tuple[str, str, str]]:
    return {row.stage: (row.kind, row.status, row.run_id) for row in result.rows}


def test_video_chain_runs_every_stage_as_a_child_of_one_pipeline_run(chain):
    first, _, spec, client, _ = chain
    assert first.ok, first.table()
    rows = by_stage(first)
    assert {stage: (kind, status) for stage, (kind, status, _) in rows.items()} == \
        {stage: (kind, "done") for stage, kind in KINDS.items()}, first.table()
    parent = client.get_run(first.run_id)
    assert parent.data.tags[tracking.TAG_STAGE] == PIPELINE_STAGE and parent.data.tags[TAG_PIPELINE] == spec.name
    assert parent.info.status == "FINISHED"
    experiment = parent.info.experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.`{tracking.TAG_PARENT}` = '{first.run_id}'")
    tree = {run.data.tags[TAG_STAGE_NAME]: (run.data.tags[tracking.TAG_STAGE], run.info.run_id) for run in children}
    assert tree == {stage: (kind, rows[stage][2]) for stage, kind in KINDS.items()}
    upstream = {stage: client.get_run(rows[stage][2]).data.tags.get(TAG_UPSTREAM) for stage in KINDS}
    assert upstream == {"videos": None, "features": f"videos={rows['videos'][2]}",
                        "vtn": f"features={rows['features'][2]}"}
    vtn = client.get_run(rows["vtn"][2])
    assert 0.0 <= vtn.data.metrics["full_video_top1"] <= 1.0 and 0.0 <= vtn.data.metrics["multiview_top1"] <= 1.0


def test_video_chain_registers_one_version_whose_tags_lead_back_to_the_run_and_the_data(chain):
    first, _, _, client, backbone = chain
    vtn_run = by_stage(first)["vtn"][2]
    features = first.outputs["features"]
    versions = client.search_model_versions(f"name = '{MODEL}'")
    assert [str(v.version) for v in versions] == [first.outputs["vtn"].registered_version] == ["1"]
    tags = versions[0].tags
    assert tags[TAG_VIDEO_RUN] == vtn_run
    assert tags["vitpipe.data_uri"] == features.output and features.output.startswith("s3://video-chain/work/")
    assert tags["vitpipe.manifest_hash"] == client.get_run(vtn_run).data.tags["vitpipe.manifest_hash"]
    assert tags[TAG_BACKBONE_RUN] == backbone["run_id"]


def test_video_chain_rerun_of_the_same_spec_reuses_every_stage(chain):
    first, second, _, client, _ = chain
    assert second.ok, second.table()
    assert second.run_id == first.run_id
    before, after = by_stage(first), by_stage(second)
    assert {stage: status for stage, (_, status, _) in after.items()} == {stage: "reused" for stage in KINDS}
    assert {stage: run for stage, (_, _, run) in after.items()} == {stage: run for stage, (_, _, run) in before.items()}
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == 1  # nothing registered twice
