"""The pipeline spec: loading, order, resolved configs, and one-line errors for bad specs (pure Python)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipelines.core.errors import VitpipeError
from pipelines.spec import PipelineSpec, SpecError
from pipelines.spec_file import load_spec
from pipelines.stages import STAGES

SPECS = Path(__file__).resolve().parent.parent / "pipelines" / "specs"

GOOD = """\
name: t
storage: {root: store}
tracking_uri: sqlite:///t.db
defaults:
  finetune: {model: ViT-Ti/4, search_space: {lr: 0.01, steps: 50}, batch_size: 16}
stages:
  raw: {kind: ingest, source: corpus, image_size: 16, patch_size: 4}
  target: {kind: ingest, source: digits, image_size: 16, patch_size: 4}
  pre: {kind: pretrain, inputs: [raw], model: ViT-Ti/4, steps: 20, warmup_steps: 2}
  tune: {kind: finetune, inputs: [target, pre], batch_size: 32}
  scratch: {kind: finetune, inputs: [target]}
  probe: {kind: evaluate, inputs: [target, pre]}
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides or [])
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"spec {path}: ")
    return message


def bad(tmp_path: Path, old: str, new: str) -> str:
    assert old in GOOD
    return error_of(write(tmp_path, GOOD.replace(old, new)))


def test_demo_spec_loads() -> None:
    spec = load_spec(SPECS / "demo.yaml")
    assert {s.kind for s in spec.stages.values()} == {"ingest", "pretrain", "finetune", "evaluate"}
    assert spec.stages["finetune_scratch"].inputs == ["digits"]


def test_video_demo_spec_loads_with_the_image_demos_pretraining() -> None:
    video, image = load_spec(SPECS / "video_demo.yaml"), load_spec(SPECS / "demo.yaml")
    assert video.order() == ["fractals", "videos", "pretrain", "vtn"]
    assert [ref.fill.field for ref in video.inputs_of("vtn")] == ["data", "init"]
    # Field for field the same stage, so that after `vitpipe demo` its finished run is reused.
    assert video.resolved_config("pretrain") == image.resolved_config("pretrain")
    assert video.resolved_config("fractals") == image.resolved_config("fractals")


def test_gpu_cluster_example_spec_loads() -> None:
    spec = load_spec(SPECS / "imagenet21k_to_cifar.yaml")
    assert spec.storage.root.startswith("s3://")
    assert spec.resolved_config("pretrain")["use_gpu"] is True


def test_order_is_topological(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    order = spec.order()
    assert sorted(order) == sorted(spec.stages)
    for name in order:
        for upstream in spec.upstream(name):
            assert order.index(upstream) < order.index(name)


def test_order_follows_dependencies_not_file_order(tmp_path: Path) -> None:
    text = GOOD.replace("  raw: {kind: ingest, source: corpus, image_size: 16, patch_size: 4}\n", "")
    text += "  raw: {kind: ingest, source: corpus, image_size: 16, patch_size: 4}\n"
    order = load_spec(write(tmp_path, text)).order()
    assert order.index("raw") < order.index("pre")


def test_spec_errors_are_vitpipe_errors(tmp_path: Path) -> None:
    with pytest.raises(VitpipeError):
        load_spec(tmp_path / "missing.yaml")


def test_missing_file(tmp_path: Path) -> None:
    assert error_of(tmp_path / "missing.yaml").endswith(": no such file")


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "name: t\nstages: {a: [1, 2\n"))
    assert "YAML syntax error at line" in message


def test_unknown_top_level_key(tmp_path: Path) -> None:
    message = bad(tmp_path, "name: t\n", "name: t\nstagse: {}\n")
    assert message.endswith("field 'stagse': unknown key")


def test_unknown_stage_key(tmp_path: Path) -> None:
    message = bad(tmp_path, "steps: 20,", "stepz: 20, steps: 20,")
    assert message.endswith("stage 'pre' field 'stepz': unknown key for a pretrain stage (did you mean 'steps'?)")


def test_unknown_key_in_defaults(tmp_path: Path) -> None:
    message = bad(tmp_path, "batch_size: 16}", "batch_size: 16, lrr: 1}")
    assert message.endswith("defaults 'finetune' field 'lrr': unknown key for a finetune stage")


def test_wrong_type(tmp_path: Path) -> None:
    message = bad(tmp_path, "steps: 20,", "steps: 20, lr: fast,")
    assert "stage 'pre' field 'lr': Input should be a valid number" in message


def test_wrong_type_from_defaults_names_the_stage(tmp_path: Path) -> None:
    message = bad(tmp_path, "batch_size: 16}", "batch_size: many}")
    assert "stage 'scratch' field 'batch_size': Input should be a valid integer" in message


def test_stage_model_check_names_the_stage(tmp_path: Path) -> None:
    message = bad(tmp_path, "warmup_steps: 2", "warmup_steps: 40")
    assert message.endswith("stage 'pre': warmup_steps (40) must be smaller than steps (20)")


def test_unknown_kind(tmp_path: Path) -> None:
    message = bad(tmp_path, "probe: {kind: evaluate", "probe: {kind: evaluation")
    assert ("stage 'probe' field 'kind': Input should be 'ingest', 'pretrain', 'finetune', 'evaluate', "
            "'embed', 'video_ingest', 'video_features' or 'video_train'; got 'evaluation' (did you mean 'evaluate'?)") in message


def test_missing_kind(tmp_path: Path) -> None:
    assert bad(tmp_path, "probe: {kind: evaluate, ", "probe: {").endswith("stage 'probe' field 'kind': Field required")


def test_reference_to_missing_stage(tmp_path: Path) -> None:
    message = bad(tmp_path, "inputs: [target, pre]}", "inputs: [target, pree]}")
    assert "stage 'probe' field 'inputs': no stage 'pree' (did you mean 'pre'?)" in message


def test_input_of_wrong_kind(tmp_path: Path) -> None:
    message = bad(tmp_path, "inputs: [raw]", "inputs: [target, scratch]")
    assert message.endswith("stage 'pre' field 'inputs': 'scratch' is a finetune stage; a pretrain stage takes ingest stages")


def test_run_reference_is_not_a_pretrain_input(tmp_path: Path) -> None:
    message = bad(tmp_path, "inputs: [raw]", "inputs: [raw, runs:/0123456789abcdef0123456789abcdef]")
    assert "'runs:/0123456789abcdef0123456789abcdef' is an MLflow run; a pretrain stage takes ingest stages" in message


def test_two_inputs_for_one_field(tmp_path: Path) -> None:
    message = bad(tmp_path, "inputs: [target]}", "inputs: [target, raw]}")
    assert message.endswith("stage 'scratch' field 'inputs': 'target' and 'raw' both give field 'data'")


def test_field_set_and_given_by_input(tmp_path: Path) -> None:
    message = bad(tmp_path, "inputs: [target, pre], batch_size: 32}", "inputs: [target, pre], init: x}")
    assert message.endswith("stage 'tune' field 'init': set here and by input 'pre'; keep one")


def test_required_input_missing(tmp_path: Path) -> None:
    message = bad(tmp_path, "inputs: [raw], ", "")
    assert message.endswith("stage 'pre' field 'data': required: set it or name an ingest stage in inputs")


def test_cycle(tmp_path: Path) -> None:
    text = GOOD + "  a: {kind: finetune, inputs: [b, target]}\n  b: {kind: finetune, inputs: [a]}\n"
    message = error_of(write(tmp_path, text))
    assert "field 'inputs': dependency cycle: " in message
    assert ("a -> b -> a" in message) or ("b -> a -> b" in message)


def test_pipeline_owned_field_rejected_in_stage(tmp_path: Path) -> None:
    message = bad(tmp_path, "steps: 20,", "steps: 20, tracking_uri: sqlite:///x.db,")
    assert "stage 'pre' field 'tracking_uri': set by the pipeline" in message


def test_set_override_applied(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD), ["pre.lr=0.01", "pre.model_overrides.depth=3", "storage.root=s3://bucket/p"])
    config = spec.resolved_config("pre")
    assert config["lr"] == 0.01 and config["model_overrides"] == {"depth": 3}
    assert config["storage"] == "s3://bucket/p/runs"


def test_a_nested_set_on_a_defaulted_mapping_keeps_the_defaults_other_keys(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD), ["scratch.search_space.steps=80"])
    assert spec.resolved_config("scratch")["search_space"] == {"lr": 0.01, "steps": 80}
    assert spec.resolved_config("tune")["search_space"] == {"lr": 0.01, "steps": 50}  # the other stage keeps it


def test_a_nested_set_on_a_stages_own_mapping_changes_that_mapping_alone(tmp_path: Path) -> None:
    text = GOOD.replace("inputs: [target]}", "inputs: [target], search_space: {steps: 20}}")
    spec = load_spec(write(tmp_path, text), ["scratch.search_space.lr=0.5"])
    assert spec.resolved_config("scratch")["search_space"] == {"steps": 20, "lr": 0.5}


def test_set_override_unknown_field_rejected(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, GOOD), ["pre.nosuch=1"])
    assert message.endswith("stage 'pre' field 'nosuch': unknown key for a pretrain stage")


def test_set_override_unknown_stage_rejected(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, GOOD), ["prr.lr=1"])
    assert message.endswith("--set prr.lr: no stage 'prr' (did you mean 'pre'?)")


def test_set_override_without_value_rejected(tmp_path: Path) -> None:
    assert "--set expects KEY=VALUE" in error_of(write(tmp_path, GOOD), ["pre.lr"])


def test_set_override_value_is_validated(tmp_path: Path) -> None:
    assert "stage 'pre' field 'steps'" in error_of(write(tmp_path, GOOD), ["pre.steps=-1"])


def test_defaults_merged_under_stage_fields(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    tune, scratch = spec.resolved_config("tune"), spec.resolved_config("scratch")
    assert tune["batch_size"] == 32 and scratch["batch_size"] == 16  # the stage's own field wins
    assert tune["model"] == scratch["model"] == "ViT-Ti/4"
    assert "data" not in tune and "init" not in tune  # filled by the runner from the inputs


def test_pipeline_fills_storage_and_tracking(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    ingest, pre = spec.resolved_config("raw"), spec.resolved_config("pre")
    assert ingest["output"].endswith("/store/data/raw") and Path(ingest["output"]).is_absolute()
    assert pre["storage"].endswith("/store/runs")
    assert pre["tracking_uri"].startswith("sqlite:////") and pre["tracking_uri"].endswith("/t.db")


def test_run_reference_fills_init(tmp_path: Path) -> None:
    run = "0123456789abcdef0123456789abcdef"
    spec = load_spec(write(tmp_path, GOOD.replace("inputs: [target, pre]}", f"inputs: [target, {run}]}}")))
    assert spec.resolved_config("probe")["init"] == run
    assert spec.upstream("probe") == ["target"]


def test_config_for_fills_inputs_from_upstream_results(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    outputs = {"target": {"output": "/data/digits"}, "pre": {"final_checkpoint": "runs:/abc/checkpoints/final"}}
    config = spec.config_for("tune", outputs)
    assert (config.data, config.init, config.batch_size) == ("/data/digits", "runs:/abc/checkpoints/final", 32)


def test_input_table_covers_every_kind() -> None:
    inputs = {kind: stage.inputs for kind, stage in STAGES.items()}
    assert set(inputs) == {"ingest", "pretrain", "finetune", "evaluate", "embed", "video_ingest", "video_features",
                           "video_train"}
    assert inputs["pretrain"]["ingest"].field == "data" and inputs["finetune"]["pretrain"].field == "init"
    assert inputs["video_train"]["video_ingest"].field == "data" and inputs["video_train"]["pretrain"].field == "init"


def test_spec_is_a_validated_model(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    assert isinstance(spec, PipelineSpec)
    assert PipelineSpec.model_validate(spec.model_dump()).order() == spec.order()


def test_ingest_takes_no_inputs(tmp_path: Path) -> None:
    message = bad(tmp_path, "target: {kind: ingest, ", "target: {kind: ingest, inputs: [raw], ")
    assert message.endswith("stage 'target' field 'inputs': 'raw' is an ingest stage; an ingest stage takes no inputs")


def test_two_stages_writing_one_output_are_refused_naming_both(tmp_path: Path) -> None:
    # The second ingest would overwrite the first's shards: its dependents would read the other data.
    text = GOOD.replace("source: corpus,", "source: corpus, output: shared,").replace(
        "source: digits,", "source: digits, output: ./shared/,")
    message = error_of(write(tmp_path, text))
    assert message.endswith(f"stage 'target' field 'output': {Path('shared').absolute()} is also the output of "
                            "stage 'raw'; each stage needs its own")


def test_an_output_set_to_another_stages_own_output_folder_is_refused(tmp_path: Path) -> None:
    text = GOOD.replace("source: digits,", "source: digits, output: store/data/raw,")
    assert "stage 'target' field 'output': " in error_of(write(tmp_path, text))
    assert "is also the output of stage 'raw'" in error_of(write(tmp_path, text))


def test_a_data_path_naming_another_stages_output_is_refused_with_the_input_to_name(tmp_path: Path) -> None:
    # Not ordered after that stage, it read whatever the folder held then (nothing, or an older run's shards).
    message = bad(tmp_path, "scratch: {kind: finetune, inputs: [target]}",
                  "scratch: {kind: finetune, data: ./store/data/target/}")
    assert message.endswith(f"stage 'scratch' field 'data': {Path('store/data/target').absolute()} is the output of "
                            "stage 'target'; name 'target' in inputs instead, so that it runs first")


def test_a_data_path_naming_the_output_of_a_stage_it_cannot_read_says_so(tmp_path: Path) -> None:
    text = GOOD + "  feats: {kind: embed, inputs: [target, pre]}\n  late: {kind: pretrain, data: store/data/feats, model: ViT-Ti/4, steps: 20, warmup_steps: 2}\n"
    assert error_of(write(tmp_path, text)).endswith(
        f"stage 'late' field 'data': {Path('store/data/feats').absolute()} is the output of stage 'feats', "
        "an embed stage, which a pretrain stage cannot read")


def test_a_data_path_outside_every_stages_output_is_taken_as_written(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD.replace("scratch: {kind: finetune, inputs: [target]}",
                                                  "scratch: {kind: finetune, data: store/data/elsewhere}")))
    assert spec.resolved_config("scratch")["data"] == "store/data/elsewhere"
    assert spec.upstream("scratch") == []


def test_an_output_in_an_ingest_default_would_be_shared_by_every_ingest_and_is_refused(tmp_path: Path) -> None:
    text = GOOD.replace("defaults:\n", "defaults:\n  ingest: {output: s3://bucket/shards}\n")
    assert error_of(write(tmp_path, text)).endswith(
        "stage 'target' field 'output': s3://bucket/shards is also the output of stage 'raw'; each stage needs its own")


def test_one_output_path_on_two_s3_endpoints_is_two_outputs(tmp_path: Path) -> None:
    text = GOOD.replace("source: corpus,", "source: corpus, output: s3://bucket/x, endpoint_url: 'http://127.0.0.1:1',"
                        ).replace("source: digits,", "source: digits, output: s3://bucket/x, endpoint_url: 'http://127.0.0.1:2',")
    assert load_spec(write(tmp_path, text)).resolved_config("target")["output"] == "s3://bucket/x"


def test_the_demo_specs_sharing_one_work_directory_write_each_output_with_one_config() -> None:
    # demo.yaml, mae_demo.yaml and video_demo.yaml all keep their outputs under vitpipe-work: two stages
    # writing one place with different configs would rewrite each other's data on every switch of spec.
    writers: dict[str, tuple[str, dict]] = {}
    for name in ("demo.yaml", "mae_demo.yaml", "video_demo.yaml"):
        spec = load_spec(SPECS / name)
        for stage in spec.stages:
            config = spec.resolved_config(stage)
            if "output" not in config:
                continue
            first = writers.setdefault(config["output"], (f"{name}:{stage}", config))
            assert first[1] == config, f"{name}:{stage} and {first[0]} both write {config['output']}"


def test_a_fine_tune_of_an_unlabeled_ingest_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # At run time the sweep failed in its workers with "IndexError: Target -9223372036854775808 is out of bounds".
    message = bad(tmp_path, "source: digits,", "source: digits, labeled: false,")
    assert message.endswith("stage 'tune' field 'inputs': ingest stage 'target' is unlabeled (labeled: false), "
                            "and a finetune stage needs labels")


def test_a_few_shot_evaluation_of_an_unlabeled_ingest_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # At run time it failed with "need at least one array to concatenate".
    text = GOOD.replace("source: digits,", "source: digits, labeled: false,").replace(
        "  tune: {kind: finetune, inputs: [target, pre], batch_size: 32}\n  scratch: {kind: finetune, inputs: [target]}\n", "")
    assert error_of(write(tmp_path, text)).endswith(
        "stage 'probe' field 'inputs': ingest stage 'target' is unlabeled (labeled: false), and an evaluate stage needs labels")


def test_supervised_pretraining_of_an_unlabeled_ingest_is_refused_and_mae_pretraining_taken(tmp_path: Path) -> None:
    message = bad(tmp_path, "source: corpus,", "source: corpus, labeled: false,")
    assert message.endswith("stage 'pre' field 'inputs': ingest stage 'raw' is unlabeled (labeled: false), and a "
                            "pretrain stage needs labels (objective: mae needs none)")
    text = GOOD.replace("source: corpus,", "source: corpus, labeled: false,").replace("steps: 20,", "steps: 20, objective: mae,")
    assert load_spec(write(tmp_path, text)).resolved_config("pre")["objective"] == "mae"


def test_a_stage_written_twice_is_refused_naming_its_line(tmp_path: Path) -> None:
    # YAML's loader keeps the last of two equal keys: the first stage would vanish without a word.
    text = GOOD + "  raw: {kind: ingest, source: other, image_size: 16, patch_size: 4}\n"
    assert error_of(write(tmp_path, text)).endswith("at line 13, column 3: key 'raw' appears twice in one mapping")


def test_a_field_written_twice_in_one_stage_is_refused(tmp_path: Path) -> None:
    message = bad(tmp_path, "steps: 20,", "steps: 20, steps: 2000,")
    assert message.endswith("at line 9, column 68: key 'steps' appears twice in one mapping")


def test_a_key_merged_from_a_yaml_anchor_may_still_be_overridden(tmp_path: Path) -> None:
    text = GOOD.replace("  pre: {kind: pretrain, inputs: [raw], model: ViT-Ti/4, steps: 20, warmup_steps: 2}",
                        "  pre: &pre {kind: pretrain, inputs: [raw], model: ViT-Ti/4, steps: 20, warmup_steps: 2}\n"
                        "  pre2: {<<: *pre, steps: 30}")
    assert load_spec(write(tmp_path, text)).resolved_config("pre2")["steps"] == 30


def test_an_empty_experiment_name_is_refused_at_the_edge(tmp_path: Path) -> None:
    # MLflow refuses it only once Ray is up: "Invalid experiment name: ''".
    text = GOOD.replace("tracking_uri: sqlite:///t.db\n", "tracking_uri: sqlite:///t.db\nexperiment: ''\n")
    assert error_of(write(tmp_path, text)).endswith("field 'experiment': String should have at least 1 character")
