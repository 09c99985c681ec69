"""One step that turns a freshly built model into what the training step calls.

`parallelize` applies, in this order:

1. activation checkpointing, per transformer block (`activation_checkpointing=true`);
2. `torch.compile`, per block (`compile=true`), so a compiled block also compiles its
   recomputation;
3. data parallelism: DDP replicas (`dist.strategy=ddp`, with a trick's communication
   hook if one claims it) or FSDP2 shards (`fully_shard` per block, then the root).

The order is the one torchtitan settled on: the wrappers that change what a block
computes come first, and sharding last, so FSDP sees the blocks it must gather as they
will run. It works on the blocks of `ciuic_train.model.Transformer` (`model.layers`).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ciuic_train.config import Config, Strategy
from ciuic_train.errors import UserError

if TYPE_CHECKING:
    from ciuic_train.parallel import Parallel
    from ciuic_train.tricks import CommHook

log = logging.getLogger("ciuic_train")


def parallelize(model: nn.Module, config: Config, parallel: Parallel, comm_hook: CommHook | None = None) -> nn.Module:
    """Wrap `model` as the config asks; returns the module the training step calls.

    That is DDP's wrapper under `ddp`, else `model` itself (FSDP2 shards it in place).
    Checkpoints, counts and sampling keep using `model`.
    """
    if config.activation_checkpointing:
        for block in model.layers:
            checkpoint_activations(block)
    if config.compile:
        for block in model.layers:
            block.compile()
    if parallel.strategy is Strategy.ddp:
        return replicate(model, parallel.device, comm_hook)
    if comm_hook is not None:
        if parallel.strategy is Strategy.fsdp:
            raise UserError(
                f"trick {comm_hook.trick} needs DDP's communication hook, which dist.strategy=fsdp does not have"
            )
        log.warning(f"trick {comm_hook.trick}: world size 1, no gradient all-reduce to act on")
    if parallel.strategy is Strategy.fsdp:
        shard(model)
    return model


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute the block's activations in backward instead of keeping them (memory for time).

    The block's own `forward` is wrapped rather than the block, so parameter names, and
    with them checkpoints, stay the same with and without it.
    """
    forward = block.forward

    def recomputed_forward(*args):
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False)

    block.forward = recomputed_forward


def replicate(model: nn.Module, device: torch.device, comm_hook: CommHook | None) -> nn.Module:
    """DDP: every rank a full replica, gradients all-reduced in buckets during backward."""
    from torch.nn.parallel import DistributedDataParallel

    # Buffers are not re-broadcast before each forward: each rank's MoE token counts are
    # its own until `balance_experts` all-reduces them.
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    no_buffer_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    device_ids = [device.index] if device.type == "cuda" else None
    replica = DistributedDataParallel(model, device_ids=device_ids, **no_buffer_sync)
    if comm_hook is not None:
        replica.register_comm_hook(comm_hook.state, comm_hook.hook)
    return replica


def shard(model: nn.Module) -> None:
    """FSDP2: each block's parameters sharded across ranks and gathered when it runs; then
    the rest (embedding, final norm, lm head) as the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
