"""RMSNorm with its backward written out."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`model.norm.rms_norm`, computed by `RMSNormFunction` (fp32 inside, autocast off)."""
    with torch.autocast(x.device.type, enabled=False):
        return RMSNormFunction.apply(x, weight, eps)


class RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight with a hand-written backward.

    Autograd's graph of the formula walks over x about 14 times forward and backward;
    this takes 10, and the norms are memory-bound.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        inv_rms = torch.linalg.vecdot(x32, x32).div_(x.shape[-1]).add_(eps).rsqrt_().unsqueeze(-1)
        ctx.save_for_backward(x, weight, inv_rms)
        return (x32 * inv_rms).mul_(weight).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, inv_rms = ctx.saved_tensors
        normed, grad = x.to(inv_rms.dtype) * inv_rms, grad.to(inv_rms.dtype)
        grad_weight = (grad * normed).flatten(0, -2).sum(0)
        grad_normed = grad * weight
        # d normed / dx = (I - normed normed^T / n) * inv_rms, applied row by row.
        projection = torch.linalg.vecdot(grad_normed, normed).div_(-x.shape[-1]).unsqueeze(-1)
        grad_x = torch.addcmul(grad_normed, normed, projection).mul_(inv_rms)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None
