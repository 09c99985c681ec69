"""Fast paths for the model's costliest computations, chosen by `model.kernels=auto`.

Each replaces one function of `ciuic_train/model/transformer.py`'s `REFERENCE` and computes
the same thing, forward and gradients (tests/test_kernels.py holds them to it, in fp32
and bf16). What `auto` runs, per device:

| reference (model/)             | auto                                                       | module       |
|--------------------------------|------------------------------------------------------------|--------------|
| `norm.rms_norm`                | `RMSNormFunction`, its backward written out (every device) | norm.py      |
| `attention.causal_attention`   | CPU: `blocked_attention`; elsewhere `padded_sdpa`          | attention.py |
| `common.grouped_swiglu`        | bf16 on CPU: groups padded to 64 rows; compiling fp32: run | moe.py       |
|                                | between graphs; else the reference                         |              |
| `transformer.lm_cross_entropy` | `LinearCrossEntropy`, chunked, gradients taken in forward  | loss.py      |
| `F.linear` (every `Linear`)    | fp32 on CPU: each product by oneDNN where it measured      | linear.py    |
|                                | clearly faster than MKL here (`gemm_choice.py`), else MKL  |              |

Why each exists, and what it was measured to save: docs/bench/README.md ("The kernels").
"""

from ciuic_train.model.common import Kernels
from ciuic_train.model.kernels.attention import causal_attention
from ciuic_train.model.kernels.linear import linear as fp32_linear  # the name `linear` stays the module's
from ciuic_train.model.kernels.loss import linear_cross_entropy
from ciuic_train.model.kernels.moe import routed_experts
from ciuic_train.model.kernels.norm import rms_norm

AUTO = Kernels(
    rms_norm=rms_norm, attention=causal_attention, routed_experts=routed_experts, loss=linear_cross_entropy, linear=fp32_linear
)

__all__ = ["AUTO"]
