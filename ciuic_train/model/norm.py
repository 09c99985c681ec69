"""RMSNorm: the reference formula and the module every norm of the model is."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32 or wider, returned in x's dtype."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class RMSNorm(nn.Module):
    """Normalised in fp32 so bf16 activations don't lose the mean square."""

    def __init__(self, dim: int, eps: float, kernel: Callable = rms_norm):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)
