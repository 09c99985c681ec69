"""Expert parallelism: each rank of an `ep` group holds a slice of the routed experts, and
tokens travel to the rank of their expert and back.

The model's MoE hands its experts every (token, expert) assignment of this rank sorted by
expert, the count per expert, and the tokens themselves for the shared experts
(`MoE.experts`). `split_experts` replaces the routed weights by this rank's slice (a
DTensor split on the expert dimension, so checkpoints still hold the whole tensors) and
gives the MoE an `ExpertDispatch`, which runs the MoE's own routed-experts kernel around
two exchanges:

    counts per expert [E]                 -> all-to-all -> what each rank sends me, per local expert
    rows sorted by expert (rank-major)    -> all-to-all -> rows for my experts, from every rank
                                             (meanwhile: the shared experts' w1, w3)
    regroup by local expert, run the local kernel (grouped matmul), undo the regrouping
    results                               -> all-to-all -> back to the ranks the rows came from
                                             (meanwhile: the shared experts' w2)

Both row all-to-alls are differentiable (backward is the reverse exchange, the shared
experts' gradients computed meanwhile). An expert's gradient then sums the contributions
of the tokens of all `ep` ranks it served, where a data-parallel gradient holds one
rank's: it is scaled by 1/ep, so that FSDP's average over the ranks holding copies of the
expert makes it the mean over every rank, as for any other parameter.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ciuic_train.distributed.grads import local_value
from ciuic_train.model.eager import kept_eager
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


class RowExchange:
    """One row all-to-all that other work runs beside, in forward and again in backward.

    Two autograd nodes bracket it, so that each pass has a start and an end:

        forward:  start (_Launch) ... meanwhile ... end (_Land: wait)
        backward: start (_Land: the reverse exchange) ... meanwhile ... end (_Launch: wait)

    What runs between them in backward is autograd's choice: among the nodes ready to run,
    the engine takes the one created last in forward. So work computed in forward between
    the two nodes, whose gradients are ready when the exchange's are, runs in backward
    between them too: after the reverse exchange starts, before it is waited for.
    """

    def __init__(self, receive: list[int], send: list[int], group):
        self.receive, self.send, self.group = receive, send, group
        self.work = None
        self.sent: torch.Tensor | None = None  # kept alive until the exchange is done
        self.arriving: torch.Tensor | None = None

    def start(self, x: torch.Tensor, reverse: bool = False) -> None:
        """Send x's rows away in the background (`reverse`: back where they came from)."""
        receive, send = (self.send, self.receive) if reverse else (self.receive, self.send)
        self.sent = x.contiguous()
        self.arriving = x.new_empty(sum(receive), *x.shape[1:])
        self.work = dist.all_to_all_single(self.arriving, self.sent, receive, send, group=self.group, async_op=True)

    def wait(self) -> torch.Tensor:
        """The rows the exchange brought, once they are all in."""
        self.work.wait()
        arrived = self.arriving
        self.work = self.sent = self.arriving = None
        return arrived


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: RowExchange) -> torch.Tensor:
        ctx.exchange = exchange
        exchange.start(x)
        return exchange.arriving  # being filled: only _Land reads it, after waiting

    @staticmethod
    def backward(ctx, placeholder: torch.Tensor):
        return ctx.exchange.wait(), None  # the reverse exchange _Land.backward started


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx, arriving: torch.Tensor, exchange: RowExchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.wait().view_as(arriving)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.exchange.start(grad, reverse=True)
        # Autograd wants a gradient shaped like the rows that arrived, which `grad` is;
        # _Launch.backward passes on the reverse exchange's result in its place.
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def exchange_rows(x: torch.Tensor, receive: list[int], send: list[int], group, meanwhile: Callable[[], Any]):
    """`all_to_all(x, ...)` with `meanwhile()` run while the rows travel, in forward and (its
    gradients) in backward; returns the exchanged rows and what `meanwhile` returned."""
    exchange = RowExchange(receive, send, group)
    travelling = _Launch.apply(x, exchange)
    beside = meanwhile()
    return _Land.apply(travelling, exchange), beside


class ExpertDispatch:
    """Runs this rank's experts on every rank's tokens for them, and the shared experts
    while the tokens travel.

    With `overlap` (`dist.ep_overlap`, the default) each row exchange runs in the
    background: the shared experts' first half (w1, w3) beside the exchange out, their
    second half (w2) beside the exchange back, and their gradients beside the same
    exchanges in backward. The sums are the ones the blocking exchange computes, in the
    same order: the result is bit-identical (tests/test_expert_overlap.py).
    """

    def __init__(self, group, ep_size: int, overlap: bool = True):
        self.group = group
        self.ep_size = ep_size
        self.overlap = overlap

    @kept_eager  # a host sync (the split sizes) and collectives: a graph break anyway
    def __call__(self, x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 local_kernel: Callable, tokens: torch.Tensor, shared: nn.Module | None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Routed experts' outputs for the expert-sorted rows x (`local_kernel` on this rank's
        slice w13, w2), and the shared experts' outputs for `tokens` (None without them)."""
        w13, w2 = (_ScaleGrad.apply(local_value(w), 1 / self.ep_size) for w in (w13, w2))
        n_local = w13.shape[0]
        # counts[e] for the global expert e = rank * n_local + local index.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [ep * n_local]: per source rank
        received = received.view(self.ep_size, n_local)  # [source rank, local expert]
        send, receive = self.split_sizes(len(x), counts, received)

        first = (lambda: shared.hidden(tokens)) if shared is not None else (lambda: None)
        rows, hidden = self.exchange(x, receive, send, first)  # rank-major, expert-sorted within a rank
        local_expert = torch.arange(n_local, device=x.device).repeat(self.ep_size)
        local_expert = local_expert.repeat_interleave(received.flatten(), output_size=len(rows))
        by_expert = local_expert.argsort(stable=True)
        out = local_kernel(rows[by_expert], received.sum(0), w13, w2)
        # Back to rank-major order, gathered through the inverse permutation: autograd keeps
        # only the index of a gather, where index_copy would keep its whole source (the
        # experts' output, a row of dim per routed token) until backward.
        rank_major = torch.empty_like(by_expert)
        rank_major[by_expert] = torch.arange(len(by_expert), device=x.device)
        second = (lambda: shared.w2(hidden)) if shared is not None else (lambda: None)
        return self.exchange(out.index_select(0, rank_major), send, receive, second)

    def exchange(self, x: torch.Tensor, receive: list[int], send: list[int], meanwhile: Callable[[], Any]):
        if self.overlap:
            return exchange_rows(x, receive, send, self.group, meanwhile)
        return all_to_all(x, receive, send, self.group), meanwhile()

    def split_sizes(self, rows: int, counts: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
        """Rows this rank sends to each ep rank, and receives from each, as the row
        all-to-alls want them: host integers, so this waits for the device. Counted from
        this rank's counts per expert [E] (they sum to `rows`) and the counts it received
        [source rank, local expert]; a simulation, whose counts hold no values, overrides
        this (ciuic_train/plan/simulate.py)."""
        return counts.view(self.ep_size, -1).sum(1).tolist(), received.sum(1).tolist()


def split_experts(model: nn.Module, ep_mesh, overlap: bool = True) -> None:
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
        module.dispatch = ExpertDispatch(ep_mesh.get_group(), ep_size, overlap)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {p for m in model.modules() if isinstance(m, MoE) for p in (m.w13, m.w2)}
