"""Data-parallel training on Ray Train: two workers, one accumulated `TrainStep` each, under DDP."""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.slow

TINY = dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64)


def _one_step_per_rank(config: dict) -> None:
    """Worker loop: one accumulated TrainStep on rank-specific data; rank 0 reports how the ranks compare."""
    import tempfile

    import ray.train
    import ray.train.torch

    from pipelines.training import step as train_step
    from pipelines.training.recipe import LoopSettings

    s = LoopSettings.model_validate(config)
    rank = ray.train.get_context().get_world_rank()
    train_step.seed_everything(s.seed + rank)  # a different init per rank: DDP must broadcast rank 0's
    model = train_step.build_model(s)
    ddp = ray.train.torch.prepare_model(model)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt = train_step.build_optimizer(model, s.lr, s.weight_decay, s.betas)
    step = train_step.TrainStep(ddp, opt, train_step.build_scheduler(opt, s), device=torch.device("cpu"),
                                amp_dtype=train_step.resolve_precision(s.precision, torch.device("cpu")))
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 16, 48, generator=g), torch.randint(0, 4, (8,), generator=g)
    step([(x[:4], y[:4]), (x[4:], y[4:])])  # accumulation: no_sync on the first micro-batch, sync on the last
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = {name: [torch.zeros_like(t) for _ in range(2)] for name, t in (("w", after), ("x", x))}
    torch.distributed.all_gather(gathered["w"], after)
    torch.distributed.all_gather(gathered["x"], x)
    metrics = {
        "rank_weight_diff": float((gathered["w"][0] - gathered["w"][1]).abs().max()),
        "moved": float((after - initial).abs().max()),
        "rank_data_diff": float((gathered["x"][0] - gathered["x"][1]).abs().max()),
    }
    # Result only carries the metrics of checkpointed reports, so rank 0 attaches a (trivial) checkpoint.
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    else:
        ray.train.report(metrics)


def test_both_ranks_hold_identical_weights_after_a_step(ray_cluster, tmp_path):
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipelines.core.stopping import signal_handlers_restored
    from pipelines.training.recipe import LoopSettings

    overrides = {**TINY, "image_size": 16, "patch_size": 4, "num_classes": 4}
    settings = LoopSettings(model_name="ViT-Ti/16", model_overrides=overrides, steps=1, batch_size_per_worker=4, lr=1e-2)
    # Workers cannot import this test module (pytest put tests/ on the path of this process only).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = TorchTrainer(
        _one_step_per_rank, train_loop_config=settings.model_dump(mode="json"),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="ddp-sync", storage_path=str(tmp_path)),
    )
    with signal_handlers_restored():  # Ray Train's Ctrl-C handler would outlive the run in this process
        metrics = trainer.fit().metrics
    assert metrics["rank_data_diff"] > 0  # the ranks saw different data...
    assert metrics["moved"] > 0  # ...the step changed the weights...
    assert metrics["rank_weight_diff"] == 0.0  # ...and both ranks hold exactly the same weights
