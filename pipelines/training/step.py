"""One training step and what it is built from, in plain PyTorch (no Ray).

Precision choice, optimizer, warm-up/decay schedule, `TrainStep`, evaluation
sums and train-state save/restore. The Ray Train worker loop
(`pipelines.training.loop`), the fine-tune trials and the scaling benchmark all run
exactly this step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import vit
from pipelines.training.recipe import LoopSettings, Precision

TRAIN_STATE_FILE = "train_state.pt"


# ---------------------------------------------------------------- precision


def _cpu_has_bf16_units() -> bool:
    """True on CPUs with bf16 matrix instructions (AVX512-BF16 or AMX)."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `precision` on `device`; None means plain fp32.

    "auto" picks bf16 where the hardware computes it natively (CUDA with bf16
    support, CPUs with AVX512-BF16/AMX) and fp32 elsewhere; "bf16" is honoured
    even without native units (slow, but what was asked).
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        return torch.bfloat16 if _cpu_has_bf16_units() else None
    return None


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    """An autocast context for `dtype`, or a no-op for fp32."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# ---------------------------------------------------------------- optimizer and schedule


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only.

    Biases, norm scales and other 1-D parameters are not decayed (the usual ViT
    practice: decaying LayerNorm gains toward zero only hurts).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel exists for CUDA only; foreach is the fast path on CPU.
    fused = bool(decay) and decay[0].is_cuda
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)


def build_sgd_optimizer(model: nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """SGD with momentum (the ViT fine-tuning and VTN recipes); weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    fused = bool(decay) and decay[0].is_cuda  # one kernel for all parameters on GPUs, as AdamW's
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, fused=fused or None)


def build_loop_optimizer(model: nn.Module, s: LoopSettings) -> torch.optim.Optimizer:
    """The optimizer `s.optimizer` names, over the parameters that take gradients."""
    if s.optimizer == "sgd":
        return build_sgd_optimizer(model, s.lr, s.momentum, s.weight_decay)
    return build_optimizer(model, s.lr, s.weight_decay, s.betas)


class WarmupDecay:
    """LR multiplier: linear warm-up from 0 to 1, then cosine or linear decay to `floor`.

    A callable class rather than a closure so `LambdaLR.state_dict()` stores it.
    """

    def __init__(self, warmup_steps: int, total_steps: int, kind: str = "linear", floor: float = 0.0) -> None:
        if total_steps <= 0:
            raise ValueError(f"schedule: total_steps must be positive, got {total_steps}")
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(f"schedule: warmup_steps ({warmup_steps}) must be in [0, total_steps={total_steps})")
        if kind not in ("linear", "cosine"):
            raise ValueError(f"schedule: unknown decay {kind!r} (expected 'linear' or 'cosine')")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.kind = kind
        self.floor = floor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            # Step 0 gets 1/warmup, not 0: a zero-LR first step would be wasted.
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.floor + (1.0 - self.floor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, s: LoopSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up + decay schedule of `s`, stepped once per optimizer step."""
    schedule = WarmupDecay(s.warmup_steps, s.steps, s.schedule, s.min_lr / s.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


# ---------------------------------------------------------------- one step


def call_model(model: nn.Module, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`model(x)`, or `model(*x)` for inputs of several tensors (a video clip and its frame indices)."""
    return model(*x) if isinstance(x, (tuple, list)) else model(x)


@dataclass
class StepStats:
    """What one optimizer step reports (tensors stay on device until read)."""

    loss: torch.Tensor  # mean loss over this worker's micro-batches
    grad_norm: torch.Tensor  # global L2 norm before clipping; identical on every DDP rank
    lr: float


class TrainStep:
    """One optimizer step over `len(micro_batches)` micro-batches.

    Forward under autocast, loss scaled by 1/accum, DDP gradient sync only on the
    last micro-batch (`no_sync` on the others), global-norm clipping, AdamW
    update, schedule tick. A non-finite gradient norm skips the update, so the
    weights stay those of the last good step; the caller decides to stop.

    With `compile`, the step calls `torch.compile(model)`; `model` itself stays
    eager for evaluation and is what checkpoints hold, so a compiled run's keys
    are an eager run's (no `_orig_mod.` prefix) and load into either.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        clip_grad_norm: float | None = 1.0,
        label_smoothing: float = 0.0,
        compile: bool = False,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = torch.compile(model) if compile else model
        # The loss of the model's output and the labels; None: cross-entropy of logits (an objective such as
        # MAE's returns its own loss as the output).
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.amp_dtype = amp_dtype
        self.clip = clip_grad_norm if clip_grad_norm else math.inf
        self.label_smoothing = label_smoothing

    def __call__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepStats:
        self.model.train()
        accum = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == accum - 1
            sync = nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with autocast(self.device, self.amp_dtype):
                    output = call_model(self.model, x)
                if self.loss_fn is None:
                    loss = F.cross_entropy(output.float(), y, label_smoothing=self.label_smoothing)
                else:
                    loss = self.loss_fn(output, y)
                (loss / accum).backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        lr = self.optimizer.param_groups[0]["lr"]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss=total / accum, grad_norm=grad_norm, lr=lr)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Sum of loss, correct top-1 and count over `batches`, as a tensor `[loss_sum, correct, n]`.

    Sums rather than means so shards from several workers add up exactly.
    """
    model.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in batches:
        with autocast(device, amp_dtype):
            logits = call_model(model, x)
        logits = logits.float()
        acc[0] += F.cross_entropy(logits, y, reduction="sum").double()
        acc[1] += (logits.argmax(-1) == y).sum()
        acc[2] += y.numel()
    return acc


# ---------------------------------------------------------------- train state


def save_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    position: dict[str, int | float],
    rng_states: list[torch.Tensor],
    *,
    save_weights: Callable[[nn.Module, Path], Any] = vit.save_checkpoint,
) -> None:
    """Write a resumable checkpoint: the weights (a vit checkpoint unless `save_weights` writes another
    layout), and optimizer/scheduler/position/RNG.

    `position` holds the step and the data position (epoch, batches consumed in
    it); `rng_states` holds one torch RNG state per rank.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_weights(model, directory)
    state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "position": dict(position),
        "rng": rng_states,
    }
    torch.save(state, directory / TRAIN_STATE_FILE)


def load_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    load_weights: Callable[[nn.Module, Path], None] | None = None,
) -> dict[str, Any]:
    """Restore weights (a vit checkpoint's unless `load_weights` reads them), and optimizer/scheduler when given,
    from `save_train_state`; returns the state dict."""
    directory = Path(directory)
    (load_weights or load_vit_weights)(model, directory)
    # weights_only: a checkpoint from shared storage must not be able to run code.
    state = torch.load(directory / TRAIN_STATE_FILE, map_location="cpu", weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return state


def load_vit_weights(model: nn.Module, directory: str | Path) -> None:
    """Load a vit checkpoint directory's weights into `model` (strict)."""
    model.load_state_dict(vit.load_checkpoint(directory).state_dict())


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(s: LoopSettings) -> nn.Module:
    """The model of `s`: a fresh `vit.create_model`, or `init_checkpoint` loaded (head resized when asked)."""
    if s.init_checkpoint:
        model = vit.load_checkpoint(s.init_checkpoint)
        classes = s.model_overrides.get("num_classes")
        if classes is not None:
            model.replace_head(int(classes))
        return model
    return vit.create_model(s.model_name, **s.model_overrides)
