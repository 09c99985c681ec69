"""One step that turns a model built on the meta device into what the training step calls.

`parallelize(model, mesh, config, init=...)` applies, in this order:

1. expert parallelism (`dist.ep > 1`): each rank keeps its slice of the routed experts
   and the MoE dispatches tokens to them (ciuic_train/distributed/expert_parallel.py);
2. activation checkpointing, per transformer block (`activation_checkpointing=true`);
3. `torch.compile`, per block (`compile=true`), so a compiled block also compiles its
   recomputation;
4. data parallelism over the mesh (ciuic_train/distributed/mesh.py), in
   ciuic_train/distributed/data_parallel.py: DDP replicas when `dp_shard=1` (with a
   trick's communication hook if one claims it, or `dist.grad_compression`'s), else
   FSDP2 (`fully_shard` per block, then the root; HSDP when `dp_replicate > 1`). A pipeline's stages run every
   data-parallel layout on FSDP2, each stage a root (`fsdp_roots`): torch's schedules
   drive FSDP2's gradient sync (none until a stage's last micro-batch), and replicas
   are HSDP with one shard. Under FSDP2 the routed experts are
   sharded over the ranks that hold the same experts, everything else over all shard
   ranks. With `precision=bf16`, FSDP2 gathers parameters in bf16 and reduces
   gradients in fp32;
5. materialization (ciuic_train/distributed/materialize.py): each rank allocates the
   parameters it holds on the device and `init` fills them, by rows, the same values for
   every layout. Under DDP this comes before the wrapper, which broadcasts rank 0's
   weights; under FSDP2 after the sharding, so no rank ever holds the whole model.

The order is the one torchtitan settled on: the wrappers that change what a block
computes come first, and sharding last, so FSDP sees the blocks it must gather as they
will run. It works on the blocks of `ciuic_train.model.Transformer` (`model.blocks()`: the
main layers, then the multi-token-prediction depths').

Before any of it, what needs DDP's gradient all-reduce is refused on a mesh without one
(`refuse_comm_hook`, the check the CLI runs before anything starts). Activation
checkpointing is the one wrapper defined here: like `compile`, it changes how a block
runs, not where its parameters live.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ciuic_train.config import Config, GradCompression, Precision
from ciuic_train.distributed.compression import compression_bucket_mb, compression_hook, refuse_compression
from ciuic_train.distributed.data_parallel import replicate_with_ddp, shard_with_fsdp
from ciuic_train.distributed.expert_parallel import split_experts
from ciuic_train.distributed.materialize import materialize
from ciuic_train.distributed.mesh import refuse_comm_hook
from ciuic_train.model.eager import prepare_compile

if TYPE_CHECKING:
    from ciuic_train.distributed.mesh import Mesh
    from ciuic_train.tricks import CommHook

log = logging.getLogger("ciuic_train")


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    config: Config,
    comm_hook: CommHook | None = None,
    init: Callable[[nn.Module], None] | None = None,
    fsdp_roots: list[nn.Module] | None = None,
) -> nn.Module:
    """Wrap `model` as the mesh and config ask, materialize it, and `init(model)` its values;
    returns the module the training step calls.

    That is DDP's wrapper under `ddp`, else `model` itself (FSDP2 shards it in place).
    Checkpoints, counts and sampling keep using `model`. A model built on a device keeps
    its memory, and is filled only if `init` is given. `fsdp_roots`: a pipeline's stage
    modules, over `model`'s parts, which FSDP2 takes as its roots in place of `model`.
    """
    hook_trick = comm_hook.trick if comm_hook is not None else None
    refuse_comm_hook(hook_trick, mesh.shape, config.train.log_grad_consistency)
    refuse_compression(config.dist, mesh.shape, hook_trick, config.train.log_grad_consistency)
    if mesh.shape.ep > 1:
        split_experts(model, mesh.experts(), overlap=config.dist.ep_overlap)
    if config.activation_checkpointing:
        for block in model.blocks():
            checkpoint_activations(block)
    if config.compile:
        prepare_compile()
        for block in model.blocks():
            block.compile()
    if mesh.strategy == "ddp" and fsdp_roots is None:
        materialize(model, mesh.device, init)
        group = mesh.replicas().get_group() if mesh.device_mesh is not None else None
        return replicate_with_ddp(model, mesh, comm_hook or compression_hook(config.dist, group),
                                  compression_bucket_mb(config.dist, mesh.device.type))
    if comm_hook is not None:  # one process: a sharded mesh refused the hook above
        log.warning(f"trick {hook_trick}: world size 1, no gradient all-reduce to act on")
    if config.dist.grad_compression is not GradCompression.none and mesh.strategy == "none":
        log.warning(f"dist.grad_compression={config.dist.grad_compression.value}: world size 1, no gradient "
                    "all-reduce to compress")
    if mesh.strategy != "none":
        # A pipeline's blocks do not run in one order on a rank (its stages interleave micro-batches):
        # FSDP's own order there.
        linear = fsdp_roots is None
        shard_with_fsdp(model, mesh, bf16=config.precision is Precision.bf16, roots=fsdp_roots or [model],
                        prefetch=config.dist.fsdp_prefetch if linear else 0,
                        keep_last_gathered=config.dist.fsdp_keep_last_gathered and linear)
    materialize(model, mesh.device, init)
    return model


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute the block's activations in backward instead of keeping them (memory for time).

    The block's own `forward` is wrapped rather than the block, so parameter names, and
    with them checkpoints, stay the same with and without it.
    """
    forward = block.forward

    def recomputed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed_forward
