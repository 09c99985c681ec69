"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ciuic_train.config import DecayShape, OptimConfig, Schedule

DECAY_SHAPES = {
    DecayShape.cosine: lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    DecayShape.linear: lambda p: 1.0 - p,
    DecayShape.sqrt: lambda p: 1.0 - math.sqrt(p),
}


@dataclass(frozen=True)
class LrSchedule:
    """Linear warmup to `peak`, then `kind` (`Schedule`): a decay to `peak * min_ratio` at
    `total_steps` shaped by `decay_shape`, starting right after warmup (cosine) or for the
    last `decay_fraction` of the steps (wsd); `step_factor` applied at each of
    `step_fractions` of the steps (step); or no decay (constant).

    A pure function of the step, so every rank computes the same value and a resumed run
    continues the same curve. Steps count from 0 (the first optimizer step).
    """

    peak: float
    warmup_steps: int
    total_steps: int
    min_ratio: float
    kind: Schedule = Schedule.cosine
    decay_fraction: float = 1.0
    decay_shape: DecayShape = DecayShape.cosine
    step_fractions: tuple[float, ...] = ()
    step_factor: float = 1.0

    @classmethod
    def from_config(cls, cfg: OptimConfig, peak: float, warmup_steps: int, total_steps: int) -> "LrSchedule":
        shape = DecayShape.cosine if cfg.schedule is Schedule.cosine else cfg.decay_shape
        return cls(peak, warmup_steps, total_steps, cfg.min_lr_ratio, cfg.schedule, cfg.decay_fraction, shape,
                   tuple(cfg.step_fractions), cfg.step_factor)

    @property
    def drops(self) -> list[int]:
        """The steps at which `step` multiplies the lr by `step_factor`."""
        return [round(fraction * self.total_steps) for fraction in self.step_fractions]

    @property
    def decay_start(self) -> int:
        if self.kind is Schedule.wsd:
            return max(self.warmup_steps, self.total_steps - round(self.decay_fraction * self.total_steps))
        return self.warmup_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind is Schedule.step:
            return self.peak * self.step_factor ** sum(step >= drop for drop in self.drops)
        if self.kind is Schedule.constant or step < self.decay_start:
            return self.peak
        progress = min(1.0, (step - self.decay_start) / max(1, self.total_steps - self.decay_start))
        return self.peak * (self.min_ratio + (1.0 - self.min_ratio) * DECAY_SHAPES[self.decay_shape](progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """AdamW (or SGD with momentum, `optim=sgd`) with weight decay on matrices only: norms,
    biases and embeddings are not decayed."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_embedding = name.endswith("tok_embeddings.weight")
        (no_decay if param.ndim < 2 or is_embedding else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum)
    on_cpu_or_cuda = all(p.device.type in ("cpu", "cuda") for p in decay + no_decay)
    return torch.optim.AdamW(
        groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=on_cpu_or_cuda
    )
