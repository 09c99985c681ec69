"""The routed experts' grouped matmul, with two fixes the reference does not need to know about."""

from __future__ import annotations

import torch

from ciuic_train.model.common import compute_dtype, grouped_mm_supported, grouped_swiglu, swiglu_grouped_mm
from ciuic_train.model.eager import kept_eager

# Row multiple each expert's group is padded to in bf16 on CPU (see `pad_groups`).
GROUP_ALIGN = 64


def routed_experts(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """`model.common.grouped_swiglu`, padded for oneDNN in bf16 on CPU, kept eager under compile."""
    dtype = compute_dtype(x)
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return grouped_swiglu_between_graphs(x, counts, w13, w2)
    if x.device.type == "cpu" and dtype != torch.float32 and grouped_mm_supported(x, dtype):
        padded, rows, ends = pad_groups(x.to(dtype), counts)
        return swiglu_grouped_mm(padded, ends, w13.to(dtype), w2.to(dtype)).index_select(0, rows)
    return grouped_swiglu(x, counts, w13, w2)


@kept_eager
def grouped_swiglu_between_graphs(
    x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`grouped_swiglu` run eagerly inside a compiled block, where its dtype cannot be traced.

    `_grouped_mm`'s meta function takes only bf16, so a compiled fp32 block would
    otherwise fall back to the loop over experts; run here, between the block's graphs,
    the grouped kernel serves fp32 as in eager mode.
    """
    return grouped_swiglu(x, counts, w13, w2)


def pad_groups(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Space expert-sorted rows x so each expert's group starts at a multiple of `GROUP_ALIGN` rows.

    Returns (padded x, the row of the padded x each row of x went to, int32 group ends for
    `_grouped_mm`). bf16 matmuls on CPU go through oneDNN, which builds and caches a
    kernel per shape; with a new row count per expert per step it rebuilt kernels all the
    time and its caches kept growing. Multiples of 64 leave a handful of shapes for a few
    percent of zero rows. The buffer has a fixed size, so no host sync; rows past the
    last end are never read. fp32 matmuls keep no such cache, and there the zero rows
    would only cost time.
    """
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)
    rows = torch.arange(len(x), device=x.device) + shift.repeat_interleave(counts, output_size=len(x))
    buffer = x.new_zeros(len(x) + len(counts) * (GROUP_ALIGN - 1), x.shape[-1])
    return buffer.index_copy(0, rows, x), rows, ends.to(torch.int32)
