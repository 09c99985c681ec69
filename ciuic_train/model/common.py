"""What the reference model and its fast kernels (`model/kernels/`) share.

The `Kernels` table the model computes its costliest parts with, the `Linear` layer that
takes its product from it, the loss's ignore index, the dtype matmuls run in, and the
routed experts' grouped matmul: the reference
runs `grouped_swiglu`, and `kernels/moe.py` pads its groups and calls the same products.
Both sides import from here, never from each other's files, so neither needs the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

IGNORE_INDEX = -100  # targets with this value add nothing to the loss, as in F.cross_entropy


@dataclass(frozen=True)
class Kernels:
    """The functions a model computes its costliest parts with (see model/transformer.py)."""

    rms_norm: Callable  # (x, weight, eps) -> x normalised
    attention: Callable  # (q, k, v, scale, docs or None) -> causal attention (within documents)
    routed_experts: Callable  # (expert-sorted x, counts per expert, w13, w2) -> SwiGLU per expert
    loss: Callable  # (h [N, dim], lm head weight, targets [N], reduction) -> fp32 cross-entropy
    linear: Callable  # (x [..., in], weight [out, in]) -> x @ weight^T, every `Linear` layer's product


class Linear(nn.Linear):
    """`nn.Linear` without bias whose product is `kernel` (a `Kernels.linear`, F.linear by default).

    Parameters, state_dict keys and `isinstance(module, nn.Linear)` are nn.Linear's.
    """

    def __init__(self, in_features: int, out_features: int, kernel: Callable = F.linear):
        super().__init__(in_features, out_features, bias=False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in: autocast's when it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


# --- The routed experts as grouped matmuls -------------------------------------------------


def grouped_mm_supported(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` can multiply `x`'s tokens in `dtype`, here and now.

    CPU has a kernel (fp32 and bf16) from torch 2.9; CUDA takes bf16 on sm80 and newer.
    """
    if not hasattr(torch, "_grouped_mm") or TorchVersion(torch.__version__) < "2.9":
        return False
    if x.device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return False


def swiglu_grouped_mm(x: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Group g of x's rows (ends[g-1]:ends[g], int32 ends) through expert g's SwiGLU.

    x [M, dim], w13 [E, 2 * hidden, dim], w2 [E, dim, hidden] -> [M, dim]; one grouped
    matmul per projection.
    """
    gate, up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=ends).chunk(2, dim=-1)  # [M, hidden] each
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=ends)


def swiglu_per_expert(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same as `swiglu_grouped_mm`, one expert at a time, for counts[e] rows of expert e."""
    return swiglu_of_groups(x, counts.tolist(), w13, w2)  # tolist() waits for the device


def swiglu_of_groups(x: torch.Tensor, sizes: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """`swiglu_per_expert` for split sizes known on the host (a simulation supplies its own)."""
    out = []
    for e, rows in enumerate(x.split(sizes)):
        gate, up = (rows @ w13[e].T).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ w2[e].T)
    return torch.cat(out)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Each routed expert's SwiGLU over its rows of expert-sorted tokens x [M, dim].

    Expert e takes counts[e] consecutive rows. One grouped matmul per projection where
    `torch._grouped_mm` serves this device and dtype, else a loop over experts (not tokens).
    `_grouped_mm` ignores autocast, so its operands are cast to autocast's dtype here.
    """
    dtype = compute_dtype(x)
    if not grouped_mm_supported(x, dtype):
        return swiglu_per_expert(x, counts, w13, w2)
    ends = counts.cumsum(0, dtype=torch.int32)
    return swiglu_grouped_mm(x.to(dtype), ends, w13.to(dtype), w2.to(dtype))
