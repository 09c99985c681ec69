"""Gradients across ranks: when they are exchanged, how far replicas agree, and clipping.

Which collective exchanges the gradients is the data-parallel wrapper's
(ciuic_train/distributed/data_parallel.py); this module is what the training step does
with them around it:

- `grad_sync`: gradients cross ranks on a step's last micro-batch only;
- `average_gradients_with_consistency`: on a step that logs `train.log_grad_consistency`,
  the replicas' own gradients are averaged here instead of by DDP, next to how far each
  agreed with the mean;
- `clip_grad_norm_`: the global norm over gradients that may be DTensors on different
  meshes (the experts under expert parallelism, the rest under FSDP2).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from ciuic_train.distributed.process_group import Parallel


def grad_sync(model: nn.Module, strategy: str, enabled: bool):
    """Context for one micro-batch's backward: gradients are reduced only when enabled.

    `model` is what `parallelize` returned; `strategy` is the mesh's (`MeshShape.strategy`).
    """
    if strategy == "ddp" and not enabled:
        return model.no_sync()
    if strategy in ("fsdp", "hsdp"):
        return _fsdp_sync(model, enabled)
    return nullcontext()


@contextmanager
def _fsdp_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(enabled)
    yield


def average_gradients_with_consistency(parameters: list[nn.Parameter], parallel: Parallel) -> float:
    """Replace each rank's own gradients by their mean over ranks, as DDP's all-reduce
    would (divided first, then summed), in one collective; return the mean over ranks
    of cos(this rank's gradient, the mean gradient)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    local = torch.cat([g.reshape(-1) for g in grads])
    mean = local / parallel.world_size
    parallel.all_reduce_sum_(mean)
    cosine = torch.dot(local.double(), mean.double()) / (local.double().norm() * mean.double().norm()).clamp_min(1e-30)
    offset = 0
    for g in grads:
        g.copy_(mean[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return parallel.mean(cosine.item())


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as a plain one, gathered first if it is a sharded (FSDP2) DTensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself if plain)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most `max_norm`; returns the norm,
    a 0-d tensor on the gradients' device (reading it is the caller's wait for the device).

    torch's `clip_grad_norm_` stacks the per-parameter norms, which fails when gradients
    are DTensors on different meshes (the experts under expert parallelism). Here each
    group of gradients that share a mesh and placement sums its local squares, and one
    reduction over that mesh's sharded dimensions makes the group's total. Plain tensors
    (one process, or DDP's already averaged gradients) take torch's own path.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return full_value(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    squares, groups = grad_norm_squares(grads)
    total = squares.sqrt()
    scale_to_max_norm_(groups, total, max_norm)
    return total


def grad_norm_squares(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The squared global L2 norm of `grads` (plain tensors, or DTensors on any meshes), and
    the gradients in groups that one foreach call can scale (plain; each mesh's DTensors)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    plain = [g for g in grads if not isinstance(g, DTensor)]
    groups: dict[Any, list[DTensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, g.placements), []).append(g)
    device = grads[0].device if grads else None
    squares = torch.nn.utils.get_total_norm(plain).pow(2) if plain else torch.zeros((), device=device)
    for (mesh, placements), members in groups.items():
        local = sum(torch.linalg.vector_norm(g.to_local(), dtype=torch.float32).pow(2) for g in members)
        partial = [Partial() if p.is_shard() else Replicate() for p in placements]
        squares = squares + DTensor.from_local(local, mesh, partial, run_check=False).full_tensor()
    return squares, [plain, *groups.values()]


def scale_to_max_norm_(groups: list[list[torch.Tensor]], total: torch.Tensor, max_norm: float) -> None:
    """Scale gradients whose global L2 norm is `total` so that it is at most `max_norm` (as
    torch's clip_grads_with_norm_); one foreach call per group (DTensors of one mesh, or
    plain tensors)."""
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for members in groups:
        if members:
            torch._foreach_mul_(members, scale)
