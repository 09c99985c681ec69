"""The model's fp32 linear layers through oneDNN, on CPUs where it beats MKL.

`linear(x, weight)` is `F.linear(x, weight)` (no bias: the model has none). On CPU in
fp32, where `gemm_choice` measured oneDNN's GEMM clearly faster than MKL's for a
product, that product runs through oneDNN (`OneDNNLinear`): forward x @ w^T, and in
backward the input gradient g @ w and the weight gradient g^T @ x, each by the backend
chosen for it. Both are full fp32 GEMMs; they round differently, nothing more.

Everything else takes `F.linear` unchanged: other devices and dtypes, bf16 autocast (the
bf16 path stays as it is), tensor subclasses (DTensor, fake tensors of a `--simulate`
run) and meta tensors, an active dispatch mode, code being compiled, and oneDNN allowed
to round fp32 matmuls lower. On a CPU where MKL wins every product (an AVX2-only AMD
EPYC, for one), it is `F.linear` throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ciuic_train.model.kernels.gemm_choice import GemmPlan, fp32_gemm_plan, onednn_mm_nt, onednn_weight_grad

PLAIN = (torch.Tensor, nn.Parameter)


class OneDNNLinear(torch.autograd.Function):
    """x [N, in] @ weight [out, in]^T, each product by the backend `plan` names."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.plan = plan
        return onednn_mm_nt(x, weight) if plan.forward else x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        plan = ctx.plan
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_mm_nt(grad, weight.t()) if plan.grad_input else grad @ weight
        if ctx.needs_input_grad[1]:
            grad_w = onednn_weight_grad(grad, x, weight) if plan.grad_weight else grad.t() @ x
        return grad_x, grad_w, None


def onednn_in_full_fp32() -> bool:
    """Whether oneDNN's fp32 matmuls stay fp32 (`torch.backends.mkldnn.matmul.fp32_precision`
    can let them round their operands to bf16 or tf32, as MKL never does)."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return getattr(matmul, "fp32_precision", "none") in ("none", "ieee")


def takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T is a plain fp32 product on CPU, computed eagerly, outside autocast."""
    return (
        type(x) in PLAIN
        and type(weight) in PLAIN
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
        and _get_current_dispatch_mode() is None
        and onednn_in_full_fp32()
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), with its products through oneDNN where that is faster here."""
    if torch.compiler.is_compiling() or not takes_onednn(x, weight):
        return F.linear(x, weight)
    plan = fp32_gemm_plan()
    if not plan.any:
        return F.linear(x, weight)
    # Flattened and unflattened out here: a view made inside a Function may not be written in place.
    out = OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), weight, plan)
    return out.view(*x.shape[:-1], weight.shape[0])
