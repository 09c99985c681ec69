"""An fp32 softmax that reuses its input's memory."""

from __future__ import annotations

import torch


def softmax_fp32(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax of x in fp32 or wider; computed over x itself when x already is.

    Taking no second buffer the size of x keeps what the CPU cache holds smaller: the
    attention scores and the loss's logits are the largest activations of a step.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    if x.dtype != dtype:
        return torch.softmax(x, dim, dtype=dtype)
    return torch.ops.aten._softmax.out(x, dim, False, out=x)
