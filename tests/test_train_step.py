"""The training loop's building blocks, in one process without Ray."""

from __future__ import annotations

import functools
import math
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import vit
from pipelines.training import step as train_step
from pipelines.training.recipe import LoopSettings
from pipelines.training.step import TrainStep, WarmupDecay

CPU = torch.device("cpu")
TINY = dict(image_size=16, patch_size=4, num_classes=5, depth=2, embed_dim=32, num_heads=2, mlp_dim=64)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return vit.create_model("ViT-Ti/16", **TINY)


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, 48, generator=g), torch.randint(0, 5, (n,), generator=g)


def settings(**kw) -> LoopSettings:
    base = dict(model_name="ViT-Ti/16", model_overrides=TINY, steps=10, warmup_steps=2, batch_size_per_worker=4, lr=1e-3)
    return LoopSettings(**{**base, **kw})


def make_step(model, s: LoopSettings, amp_dtype=None, optimizer=None) -> TrainStep:
    optimizer = optimizer or train_step.build_optimizer(model, s.lr, s.weight_decay, s.betas)
    scheduler = train_step.build_scheduler(optimizer, s)
    return TrainStep(model, optimizer, scheduler, device=CPU, amp_dtype=amp_dtype,
                     clip_grad_norm=s.clip_grad_norm, label_smoothing=s.label_smoothing)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---------------------------------------------------------------- precision


def test_fp32_request_means_no_autocast():
    assert train_step.resolve_precision("fp32", CPU) is None


def test_bf16_request_is_honoured():
    assert train_step.resolve_precision("bf16", CPU) is torch.bfloat16


@pytest.mark.parametrize("has_units, expected", [(True, torch.bfloat16), (False, None)])
def test_auto_precision_follows_cpu_bf16_units(monkeypatch, has_units, expected):
    monkeypatch.setattr(train_step, "_cpu_has_bf16_units", lambda: has_units)
    assert train_step.resolve_precision("auto", CPU) is expected


def test_cpu_bf16_probe_agrees_with_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    assert train_step._cpu_has_bf16_units() == ("avx512_bf16" in flags or "amx_bf16" in flags)


# ---------------------------------------------------------------- schedule and optimizer


def test_warmup_rises_linearly_to_the_peak():
    sched = WarmupDecay(warmup_steps=4, total_steps=20)
    assert [sched(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_linear_decay_halves_midway_and_ends_at_floor():
    sched = WarmupDecay(warmup_steps=0, total_steps=10, kind="linear", floor=0.1)
    assert sched(5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert sched(10) == pytest.approx(0.1)


def test_cosine_decay_follows_half_cosine_to_zero():
    sched = WarmupDecay(warmup_steps=2, total_steps=12, kind="cosine")
    assert sched(2) == pytest.approx(1.0)
    assert sched(7) == pytest.approx(0.5)
    assert sched(12) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("warmup, total, kind", [(10, 10, "linear"), (-1, 10, "linear"), (0, 10, "step")])
def test_bad_schedule_is_a_value_error(warmup, total, kind):
    with pytest.raises(ValueError, match="schedule"):
        WarmupDecay(warmup, total, kind)


def test_weight_decay_applies_to_matrices_only():
    model = tiny_model()
    opt = train_step.build_optimizer(model, 1e-3, 0.1, (0.9, 0.999))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim < 2 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_adamw_uses_the_papers_betas_by_default():
    opt = train_step.build_optimizer(tiny_model(), 1e-3, 0.1, settings().betas)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


# ---------------------------------------------------------------- the step


def test_accumulated_micro_batches_equal_one_full_batch():
    s = settings()
    a, b = tiny_model(), tiny_model()
    x, y = batch(8, seed=1)
    make_step(a, s)([(x, y)])
    make_step(b, s)([(x[:4], y[:4]), (x[4:], y[4:])])
    torch.testing.assert_close(flat(a), flat(b), rtol=1e-5, atol=1e-6)


def test_step_loss_is_cross_entropy_with_label_smoothing():
    s = settings(label_smoothing=0.2)
    model = tiny_model()
    x, y = batch(8, seed=2)
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y, label_smoothing=0.2)
    stats = make_step(model, s)([(x, y)])
    assert float(stats.loss) == pytest.approx(float(expected), rel=1e-5)


def test_gradients_are_clipped_to_the_global_norm():
    s = settings(clip_grad_norm=1e-3, warmup_steps=0)
    model = tiny_model()
    before = flat(model)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # plain SGD: the update is the clipped gradient itself
    stats = make_step(model, s, optimizer=sgd)([batch(8, seed=3)])
    assert float(stats.grad_norm) > 1e-3
    assert float((flat(model) - before).norm()) == pytest.approx(1e-3, rel=1e-3)


def test_non_finite_gradients_leave_weights_and_schedule_untouched():
    s = settings()
    model = tiny_model()
    before = flat(model)
    step = make_step(model, s)
    x, y = batch(8, seed=4)
    x[0, 0, 0] = float("nan")
    stats = step([(x, y)])
    assert not math.isfinite(float(stats.grad_norm))
    assert torch.equal(flat(model), before)
    assert step.scheduler.last_epoch == 0


def test_bf16_autocast_step_computes_in_bf16_and_updates_fp32_weights():
    model = tiny_model()
    before = flat(model)
    seen = []  # a block's MLP output: bf16 only if autocast was in effect
    model.blocks[0].mlp.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    stats = make_step(model, settings(), amp_dtype=torch.bfloat16)([batch(8, seed=5)])
    assert seen == [torch.bfloat16]
    assert math.isfinite(float(stats.loss))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(flat(model), before)  # the optimizer stepped


def test_steps_lower_the_loss_on_a_fixed_batch():
    model = tiny_model()
    step = make_step(model, settings(steps=30, warmup_steps=1, lr=3e-3))
    data = [batch(16, seed=6)]
    losses = [float(step(data).loss) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_evaluate_returns_loss_sum_correct_and_count():
    model = tiny_model()
    batches = [batch(8, seed=7), batch(5, seed=8)]
    loss_sum, correct, n = train_step.evaluate(model, batches, CPU, None).tolist()
    with torch.no_grad():
        logits = [model(x) for x, _ in batches]
    labels = [y for _, y in batches]
    assert n == 13
    assert correct == sum(int((l.argmax(-1) == y).sum()) for l, y in zip(logits, labels))
    assert loss_sum == pytest.approx(sum(float(F.cross_entropy(l, y, reduction="sum")) for l, y in zip(logits, labels)), rel=1e-5)


# ---------------------------------------------------------------- train state


def test_restored_train_state_continues_exactly_like_the_original(tmp_path):
    s = settings()
    data = [batch(8, seed=10 + i) for i in range(4)]
    original = tiny_model()
    step = make_step(original, s)
    for d in data[:2]:
        step([d])
    position = {"step": 2, "epoch": 0, "batch_in_epoch": 2, "best_val_top1": 0.25}
    train_step.save_train_state(tmp_path, original, step.optimizer, step.scheduler, position, [{"cpu": torch.get_rng_state(), "cuda": None}])

    restored = tiny_model(seed=99)  # different init: everything must come from the checkpoint
    resumed = make_step(restored, s)
    state = train_step.load_train_state(tmp_path, restored, resumed.optimizer, resumed.scheduler)
    assert state["position"] == position
    for d in data[2:]:
        step([d])
        resumed([d])
    assert torch.equal(flat(original), flat(restored))
    assert resumed.scheduler.last_epoch == step.scheduler.last_epoch == 4


def test_train_state_checkpoint_is_a_loadable_vit_checkpoint(tmp_path):
    model = tiny_model()
    step = make_step(model, settings())
    train_step.save_train_state(tmp_path, model, step.optimizer, step.scheduler, {"step": 0}, [])
    x, _ = batch(4, seed=11)
    torch.testing.assert_close(vit.load_checkpoint(tmp_path)(x), model(x))


def test_init_checkpoint_model_keeps_the_checkpoints_backbone_and_gets_a_new_zero_head(tmp_path):
    saved = tiny_model()
    vit.save_checkpoint(saved, tmp_path)
    model = train_step.build_model(settings(init_checkpoint=str(tmp_path), model_overrides={"num_classes": 3}))
    assert model(batch(2, seed=12)[0]).shape == (2, 3)
    backbone = {k: v for k, v in saved.state_dict().items() if not k.startswith("head.")}
    loaded = model.state_dict()
    for name, tensor in backbone.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    head = {k: v for k, v in loaded.items() if k.startswith("head.")}
    assert sorted(head) == ["head.bias", "head.weight"]
    assert all(not v.any() for v in head.values())  # zero-initialised (paper §3.2)


# ---------------------------------------------------------------- one loop, one recipe


def test_the_worker_loop_imports_no_stage():
    """The loop knows no stage: stages hand it their differences as hooks."""
    code = ("import sys, pipelines.training.loop, pipelines.training.trainer; "
            "print(sorted(m for m in sys.modules if m.startswith(('pipelines.image', 'pipelines.video'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_loop_hooks_travel_to_ray_workers_by_pickle():
    from pipelines.training.hooks import LoopHooks
    from pipelines.training.loop import train_loop_per_worker

    loop = pickle.loads(pickle.dumps(functools.partial(train_loop_per_worker, hooks=LoopHooks())))
    assert isinstance(loop.keywords["hooks"], LoopHooks)
    patches, labels = loop.keywords["hooks"].inputs({"patches": torch.zeros(2, 16, 48), "label": torch.tensor([1, 0])})
    assert patches.shape == (2, 16, 48) and labels.dtype == torch.long


def test_recipes_derive_from_one_base_and_share_fields_by_name():
    from pipelines.training.recipe import Recipe, TrainRecipe, shared_fields

    assert issubclass(LoopSettings, Recipe) and issubclass(TrainRecipe, Recipe)
    recipe = TrainRecipe(steps=10, lr=0.5)
    shared = shared_fields(recipe, LoopSettings, exclude=("tracking_uri",))
    assert shared["lr"] == 0.5 and shared["checkpoint_interval"] == 500 and "tracking_uri" not in shared
    assert "keep_last" not in shared and "num_workers" not in shared  # the driver's fields stay there
