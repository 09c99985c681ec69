"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ciuic_train.config import OptimConfig


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup to `peak`, then cosine decay to `peak * min_ratio` at `total_steps`.

    A pure function of the step, so every rank computes the same value and a resumed run
    continues the same curve. Steps count from 0 (the first optimizer step).
    """

    peak: float
    warmup_steps: int
    total_steps: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak * (self.min_ratio + (1.0 - self.min_ratio) * cosine)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: norms, biases and embeddings are not decayed."""
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
    on_cpu_or_cuda = all(p.device.type in ("cpu", "cuda") for p in decay + no_decay)
    return torch.optim.AdamW(
        groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=on_cpu_or_cuda
    )
