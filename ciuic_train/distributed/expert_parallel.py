"""Expert parallelism: each rank of an `ep` group holds a slice of the routed experts, and
tokens travel to the rank of their expert and back.

The model's MoE calls its routed-experts kernel with every (token, expert) assignment of
this rank sorted by expert, the count per expert, and the stacked expert weights
(`Kernels.routed_experts`). `ExpertDispatch` is a kernel with that same signature, so
the model does not change: `split_experts` replaces the weights by this rank's slice
(a DTensor split on the expert dimension, so checkpoints still hold the whole
tensors) and the kernel by a dispatch around it:

    counts per expert [E]                 -> all-to-all -> what each rank sends me, per local expert
    rows sorted by expert (rank-major)    -> all-to-all -> rows for my experts, from every rank
    regroup by local expert, run the local kernel (grouped matmul), undo the regrouping
    results                               -> all-to-all -> back to the ranks the rows came from

Both row all-to-alls are differentiable (backward is the reverse exchange). An expert's
gradient then sums the contributions of the tokens of all `ep` ranks it served, where a
data-parallel gradient holds one rank's: it is scaled by 1/ep, so that FSDP's average over
the ranks holding copies of the expert makes it the mean over every rank, as for any
other parameter.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ciuic_train.distributed.grads import local_value
from ciuic_train.model.moe import MoE


class _AllToAll(torch.autograd.Function):
    """Rows of x, `send[i]` of them to rank i, become `receive[j]` rows from rank j."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(grad_x, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return grad_x, None, None, None


def all_to_all(x: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, receive, send, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class ExpertDispatch:
    """A routed-experts kernel that runs this rank's experts on every rank's tokens for them."""

    def __init__(self, local_kernel: Callable, group, ep_size: int):
        self.local_kernel = local_kernel
        self.group = group
        self.ep_size = ep_size

    @torch.compiler.disable  # a host sync (the split sizes) and collectives: a graph break anyway
    def __call__(self, x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        w13, w2 = (_ScaleGrad.apply(local_value(w), 1 / self.ep_size) for w in (w13, w2))
        n_local = w13.shape[0]
        # counts[e] for the global expert e = rank * n_local + local index.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [ep * n_local]: per source rank
        received = received.view(self.ep_size, n_local)  # [source rank, local expert]
        send, receive = self.split_sizes(len(x), counts, received)

        rows = all_to_all(x, receive, send, self.group)  # rank-major, expert-sorted within a rank
        local_expert = torch.arange(n_local, device=x.device).repeat(self.ep_size)
        local_expert = local_expert.repeat_interleave(received.flatten(), output_size=len(rows))
        by_expert = local_expert.argsort(stable=True)
        out = self.local_kernel(rows[by_expert], received.sum(0), w13, w2)
        # Back to rank-major order, gathered through the inverse permutation: autograd keeps
        # only the index of a gather, where index_copy would keep its whole source (the
        # experts' output, a row of dim per routed token) until backward.
        rank_major = torch.empty_like(by_expert)
        rank_major[by_expert] = torch.arange(len(by_expert), device=x.device)
        return all_to_all(out.index_select(0, rank_major), send, receive, self.group)

    def split_sizes(self, rows: int, counts: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
        """Rows this rank sends to each ep rank, and receives from each, as the row
        all-to-alls want them: host integers, so this waits for the device. Counted from
        this rank's counts per expert [E] (they sum to `rows`) and the counts it received
        [source rank, local expert]; a simulation, whose counts hold no values, overrides
        this (ciuic_train/tools/simulate.py)."""
        return counts.view(self.ep_size, -1).sum(1).tolist(), received.sum(1).tolist()


def split_experts(model: nn.Module, ep_mesh) -> None:
    """Keep only this rank's slice of every MoE layer's routed experts, and dispatch to them.

    Rank i of the ep group holds experts [i * E / ep, (i + 1) * E / ep) as a DTensor split
    on dim 0 (`Shard(0)`). On a model built on meta (the trainer's) that slice is created
    at its local shape and nothing is allocated; on a built model it is cut from the
    weights every rank drew alike.
    """
    from torch.distributed.tensor import DTensor, Shard

    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        for name in ("w13", "w2"):
            full = getattr(module, name)
            local = full.detach().chunk(ep_size, dim=0)[ep_rank].clone()
            split = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, nn.Parameter(split, requires_grad=full.requires_grad))
        module.routed_experts = ExpertDispatch(module.routed_experts, ep_mesh.get_group(), ep_size)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {p for m in model.modules() if isinstance(m, MoE) for p in (m.w13, m.w2)}
