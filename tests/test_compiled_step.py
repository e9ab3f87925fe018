"""The compiled training step (`compile: true` in a recipe), on CPU torch: same keys, same math, one graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vit
from pipelines.image.configs import PretrainConfig
from pipelines.training import step as train_step
from pipelines.stages import STAGES
from pipelines.training.recipe import LoopSettings, Recipe
from pipelines.training.step import TrainStep

CPU = torch.device("cpu")
TINY = dict(image_size=16, patch_size=4, num_classes=5, depth=2, embed_dim=32, num_heads=2, mlp_dim=64)
SETTINGS = LoopSettings(model_name="ViT-Ti/16", model_overrides=TINY, steps=4, warmup_steps=1, lr=1e-3)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return vit.create_model("ViT-Ti/16", **TINY)


def one_batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, 48, generator=g), torch.randint(0, 5, (4,), generator=g))]


def trained_one_step(directory: Path, compile: bool, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """A tiny ViT after one step of `TrainStep` (compiled or eager), its train state written to `directory`."""
    model = model or tiny_model()
    opt = train_step.build_optimizer(model, SETTINGS.lr, SETTINGS.weight_decay, SETTINGS.betas)
    sched = train_step.build_scheduler(opt, SETTINGS)
    TrainStep(model, opt, sched, device=CPU, amp_dtype=None, compile=compile)(one_batch())
    train_step.save_train_state(directory, model, opt, sched, {"step": 1}, [torch.get_rng_state()])
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """One compiled and one eager step from the same weights, each with its checkpoint."""
    out = {}
    for name, compile in (("compiled", True), ("eager", False)):
        directory = tmp_path_factory.mktemp(name)
        out[name] = directory, trained_one_step(directory, compile)
    return out


def test_a_compiled_run_writes_checkpoint_keys_equal_to_an_eager_runs(runs):
    keys = {name: set(load_file(d / "model.safetensors")) for name, (d, _) in runs.items()}
    assert keys["compiled"] == keys["eager"]
    assert not any("_orig_mod" in k for k in keys["compiled"])


def test_a_compiled_step_updates_the_weights_as_an_eager_step_does(runs):
    compiled, eager = runs["compiled"][1].state_dict(), runs["eager"][1].state_dict()
    for key, value in eager.items():
        torch.testing.assert_close(compiled[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("saved_by", ["compiled", "eager"])
def test_a_checkpoint_resumes_in_a_compiled_run(runs, saved_by, tmp_path):
    directory, trained = runs[saved_by]
    model = tiny_model()
    train_step.load_train_state(directory, model)
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    trained_one_step(tmp_path, compile=True, model=model)
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(directory / "model.safetensors"))


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16])
def test_the_vit_training_forward_is_one_graph_for_the_compiler(amp_dtype):
    model = tiny_model().train()
    x = one_batch()[0][0]
    with train_step.autocast(CPU, amp_dtype):
        explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_every_training_stage_has_the_compile_switch_off_by_default():
    trainers = {kind: s.config_model for kind, s in STAGES.items() if issubclass(s.config_model, Recipe)}
    assert set(trainers) == {"pretrain", "finetune", "video_train"}
    assert all(model.model_fields["compile"].default is False for model in trainers.values())


def test_the_compile_switch_reaches_the_worker_settings():
    config = PretrainConfig(data="d", steps=2, warmup_steps=0, compile=True)
    settings = config.loop_settings(has_val=False, run_id=None, tracking_uri=None, model_name="ViT-Ti/16")
    assert settings.compile is True
