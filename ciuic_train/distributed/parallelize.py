"""One step that turns a freshly built model into what the training step calls.

`parallelize(model, mesh, config)` applies, in this order:

1. expert parallelism (`dist.ep > 1`): each rank keeps its slice of the routed experts
   and the MoE dispatches tokens to them (ciuic_train/distributed/expert_parallel.py);
2. activation checkpointing, per transformer block (`activation_checkpointing=true`);
3. `torch.compile`, per block (`compile=true`), so a compiled block also compiles its
   recomputation;
4. data parallelism over the mesh (ciuic_train/distributed/mesh.py): DDP replicas when
   `dp_shard=1` (with a trick's communication hook if one claims it), else FSDP2
   (`fully_shard` per block, then the root; HSDP when `dp_replicate > 1`). Under FSDP2
   the routed experts are sharded over the ranks that hold the same experts, everything
   else over all shard ranks. On CUDA with `precision=bf16`, FSDP2 gathers parameters in
   bf16 and reduces gradients in fp32.

The order is the one torchtitan settled on: the wrappers that change what a block
computes come first, and sharding last, so FSDP sees the blocks it must gather as they
will run. It works on the blocks of `ciuic_train.model.Transformer` (`model.blocks()`: the
main layers, then the multi-token-prediction depths').
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ciuic_train.config import Config, Precision
from ciuic_train.distributed.mesh import refuse_comm_hook

if TYPE_CHECKING:
    from ciuic_train.distributed.mesh import Mesh
    from ciuic_train.tricks import CommHook

log = logging.getLogger("ciuic_train")


def parallelize(model: nn.Module, mesh: Mesh, config: Config, comm_hook: CommHook | None = None) -> nn.Module:
    """Wrap `model` as the mesh and config ask; returns the module the training step calls.

    That is DDP's wrapper under `ddp`, else `model` itself (FSDP2 shards it in place).
    Checkpoints, counts and sampling keep using `model`.
    """
    if mesh.shape.ep > 1:
        from ciuic_train.distributed.expert_parallel import shard_experts

        shard_experts(model, mesh.experts())
    if config.activation_checkpointing:
        for block in model.blocks():
            checkpoint_activations(block)
    if config.compile:
        for block in model.blocks():
            block.compile()
    if mesh.strategy == "ddp":
        return replicate(model, mesh, comm_hook, config.dist.ddp_bucket_mb)
    if comm_hook is not None:
        refuse_comm_hook(comm_hook.trick, mesh.shape)
        log.warning(f"trick {comm_hook.trick}: world size 1, no gradient all-reduce to act on")
    if mesh.strategy in ("fsdp", "hsdp"):
        shard(model, mesh, bf16=config.precision is Precision.bf16)
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


def replicate(model: nn.Module, mesh: Mesh, comm_hook: CommHook | None, bucket_mb: float = 25.0) -> nn.Module:
    """DDP: every rank a full replica, gradients all-reduced in buckets of `bucket_mb` MiB
    during backward (a bucket goes as soon as its gradients are ready)."""
    from torch.nn.parallel import DistributedDataParallel

    # Buffers are not re-broadcast before each forward: each rank's MoE token counts are
    # its own until `balance_experts` all-reduces them.
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    no_buffer_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    group = mesh.replicas().get_group() if mesh.device_mesh is not None else None  # None: the default group
    replica = DistributedDataParallel(
        model, device_ids=device_ids, process_group=group, bucket_cap_mb=bucket_mb, **no_buffer_sync
    )
    if comm_hook is not None:
        replica.register_comm_hook(comm_hook.state, comm_hook.hook)
    return replica


def shard(model: nn.Module, mesh: Mesh, bf16: bool) -> None:
    """FSDP2: each block's (and MTP depth's) parameters sharded across ranks and gathered
    when it runs; then the rest (embedding, final norm, lm head) as the root.

    Under expert parallelism the experts are DTensors split over `ep`; FSDP shards them
    further over the ranks that hold the same experts (`Mesh.expert_copies`), through a
    per-parameter placement, and averages their gradients there (scaled for that by
    `ExpertDispatch`). A divide factor of the world size set on the blocks would say the
    same, but torch 2.13 applies it twice where the expert group has one rank (gloo).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16 and mesh.device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    dense = mesh.dense()
    placement = _expert_placement(model, mesh) if mesh.shape.ep > 1 else None
    for unit in [*model.layers, *model.mtp]:  # an MTP depth is gathered as a whole
        fully_shard(unit, mesh=dense, mp_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mesh=dense, mp_policy=policy)


def _expert_placement(model: nn.Module, mesh: Mesh):
    """FSDP's per-parameter placement: experts dim 0 over `expert_copies`, the rest by default.

    FSDP2 (torch 2.13) takes a per-parameter mesh only through these private classes.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    from ciuic_train.distributed.expert_parallel import expert_parameters

    copies = mesh.expert_copies()
    info = (
        HSDPMeshInfo(copies, shard_mesh_dim=1, replicate_mesh_dim=0)
        if copies.ndim == 2
        else FSDPMeshInfo(copies, shard_mesh_dim=0)
    )
    experts = expert_parameters(model)
    return lambda param: ShardPlacementResult(Shard(0), info) if param in experts else None
