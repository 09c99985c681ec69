"""From a model built on the meta device to real, initialized parameters, each rank its own rows.

The trainer builds the `Transformer` under `torch.device("meta")` (shapes, no memory),
`parallelize` splits the experts and shards the rest while nothing is allocated, and only
then does `materialize` allocate each rank's parameters (`to_empty`) and fill them. A rank
never holds more than its shards, whatever the size of the model.

`local_rows(param)` says which rows of the global parameter this rank holds: all of them
for a plain tensor, the slice a DTensor's placements give it otherwise. Every layout the
package builds cuts parameters on dim 0 only (FSDP2's `Shard(0)`, expert parallelism's
`Shard(0)` of the stacked experts, both at once for experts under FSDP), so a rank's part
is one run of rows; `ciuic_train/model/init.py` draws values by rows, and
`checkpoint/hf_weights.py` reads them by rows.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ciuic_train.model.init import Rows, whole_rows


def local_rows(param: torch.Tensor) -> Rows:
    """The rows of `param` this rank holds, writable in place."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return whole_rows(param)
    local = param.to_local()
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(offset[1:]):
        raise ValueError(f"parameter split on a dim other than 0 ({param.placements}): rows cannot locate it")
    return Rows(local, param.shape, offset[0] if local.dim() else 0)


def materialize(model: nn.Module, device: torch.device, init: Callable[[nn.Module], None] | None) -> None:
    """Allocate a meta-built `model`'s parameters and buffers on `device` (each rank its
    shards only; a model already on a device keeps its memory), then `init(model)` fills them.

    `init` None leaves the values as they are: uninitialized after `to_empty`, which is
    what a simulation wants (its tensors hold no data).
    """
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device=device)
    if init is not None:
        init(model)
