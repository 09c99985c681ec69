"""Data parallelism: DDP replicas, or FSDP2 shards (HSDP when both).

`parallelize` calls one of these last, once the blocks compute what they will run:

- `replicate_with_ddp` (`dp_shard=1`): every rank holds the whole model, and DDP
  all-reduces the gradients in buckets during backward, or a trick's communication hook
  does in its place;
- `shard_with_fsdp` (`dp_shard > 1`): FSDP2 shards each block's parameters over the
  shard ranks and gathers them when the block runs, then reduce-scatters the gradients
  (and all-reduces them across replicas under HSDP). The routed experts, already split
  over `ep`, are sharded over the ranks that hold the same experts instead.

"Shard" in this package means this: FSDP2 splitting a parameter over ranks.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
from torch import nn

from ciuic_train.distributed.expert_parallel import expert_parameters

if TYPE_CHECKING:
    from ciuic_train.distributed.mesh import Mesh
    from ciuic_train.tricks import CommHook


# Buckets per model under `dist.ddp_bucket_mb=0`, and the bounds of their size (MiB).
AUTO_BUCKETS, MIN_BUCKET_MB, MAX_BUCKET_MB = 8, 1.0, 25.0


def auto_bucket_mb(model: nn.Module) -> float:
    """The bucket size `dist.ddp_bucket_mb=0` means: an eighth of the model's gradient bytes,
    so the first buckets are all-reduced while backward still runs, within 1 MiB (below,
    each bucket's collective costs more than it hides) and torch's 25 MiB."""
    grad_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    return min(MAX_BUCKET_MB, max(MIN_BUCKET_MB, grad_mb / AUTO_BUCKETS))


def replicate_with_ddp(model: nn.Module, mesh: Mesh, comm_hook: CommHook | None, bucket_mb: float = 0.0) -> nn.Module:
    """DDP: every rank a full replica, gradients all-reduced in buckets of `bucket_mb` MiB
    (0: `auto_bucket_mb`) during backward (a bucket goes as soon as its gradients are ready;
    DDP's first bucket holds 1 MiB, the last layers', whatever the size).

    The gradients are views of the buckets (`gradient_as_bucket_view`): one fp32 copy of
    them instead of two (param.grad and the bucket), and no copy between the two each
    step, once backward has made them views. `grads_are_bucket_views` tells the trainer to
    zero them in place after a step: set to None, the next backward would allocate them
    again and copy them in. A comm hook reads and writes the bucket as it would without them, so the
    tricks' hooks see no difference; the sums are the same, in the same order."""
    from torch.nn.parallel import DistributedDataParallel

    bucket_mb = bucket_mb or auto_bucket_mb(model)

    # Buffers are not re-broadcast before each forward: each rank's MoE token counts are
    # its own until `balance_experts` all-reduces them.
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    no_buffer_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    group = mesh.replicas().get_group() if mesh.device_mesh is not None else None  # None: the default group
    replica = DistributedDataParallel(
        model, device_ids=device_ids, process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
        **no_buffer_sync,
    )
    if comm_hook is not None:
        replica.register_comm_hook(comm_hook.state, comm_hook.hook)
    return replica


def grads_are_bucket_views(model: nn.Module) -> bool:
    """Whether `model` (what `parallelize` returned) keeps its gradients as views of DDP's
    buckets for good, so that a step zeroes them in place.

    Not before DDP has laid its buckets out again in the order the first backward made the
    gradients (it does so once, in the second step's forward): views still held then
    would keep the first layout alive beside the new one, two copies of the gradients."""
    from torch.nn.parallel import DistributedDataParallel

    # `_has_rebuilt_buckets` is DDP's own flag (torch 2.13); without it, in place from the start.
    return (isinstance(model, DistributedDataParallel) and model.gradient_as_bucket_view
            and getattr(model, "_has_rebuilt_buckets", True))


def shard_with_fsdp(model: nn.Module, mesh: Mesh, bf16: bool, roots: list[nn.Module], prefetch: int = 0,
                    keep_last_gathered: bool = False) -> None:
    """FSDP2: each block's (and MTP depth's) parameters sharded across ranks and gathered
    when it runs; then the rest (embedding, final norm, lm head) in each of `roots`: the
    model, or a pipeline's stages (which hold those parts of the model it needs).

    `prefetch` > 0: each block issues the all-gathers of the next `prefetch` blocks as
    soon as its own are in, in forward and (the previous ones) in backward, instead of
    when those blocks start: on gloo the gathers run on its own threads meanwhile, so the
    wire time hides behind the block's computation (0: FSDP's own order, one block ahead
    issued at that block's start). `keep_last_gathered`: the last unit keeps its
    parameters after forward, as backward needs them first (one block's parameters
    more in memory, one all-gather fewer per step).

    Under expert parallelism the experts are DTensors split over `ep`; FSDP shards them
    further over the ranks that hold the same experts (`Mesh.expert_copies`), through a
    per-parameter placement, and averages their gradients there (scaled for that by
    `ExpertDispatch`). A divide factor of the world size set on the blocks would say the
    same, but torch 2.13 applies it twice where the expert group has one rank (gloo).
    """
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_precision(bf16)
    dense = mesh.dense()
    placement = _expert_placement(model, mesh) if mesh.shape.ep > 1 else None
    units = [*model.layers, *model.mtp]  # in the order forward runs them; an MTP depth is gathered as a whole
    for i, unit in enumerate(units):
        reshard = not (keep_last_gathered and i == len(units) - 1)
        fully_shard(unit, mesh=dense, mp_policy=policy, shard_placement_fn=placement, reshard_after_forward=reshard)
    for root in roots:
        fully_shard(root, mesh=dense, mp_policy=policy)
    if prefetch:
        for i, unit in enumerate(units):
            if units[i + 1 : i + 1 + prefetch]:
                unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + prefetch])
            if i:
                unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch) : i][::-1])


def fsdp_precision(bf16: bool):
    """FSDP2's mixed precision: with `precision=bf16`, parameters gathered (and computed)
    in bf16, gradients reduced in fp32; with fp32, FSDP leaves dtypes alone.

    The same on every device, so the CPU suite runs the path a GPU run takes (gloo
    gathers bf16 and reduces fp32 as NCCL does). The blocks' inputs are not cast
    (`cast_forward_inputs=False`): a block takes the RoPE tables beside the activations,
    and those must stay fp32 (`apply_rope` builds complex numbers from them, which bf16
    cannot be, and bf16 angles drift at long positions). The activations need no cast
    either: the trainer runs bf16 under autocast, which casts each matmul's inputs.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy()


def _expert_placement(model: nn.Module, mesh: Mesh):
    """FSDP's per-parameter placement: experts dim 0 over `expert_copies`, the rest by default.

    FSDP2 (torch 2.13) takes a per-parameter mesh only through these private classes.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    copies = mesh.expert_copies()
    info = (
        HSDPMeshInfo(copies, shard_mesh_dim=1, replicate_mesh_dim=0)
        if copies.ndim == 2
        else FSDPMeshInfo(copies, shard_mesh_dim=0)
    )
    experts = expert_parameters(model)
    return lambda param: ShardPlacementResult(Shard(0), info) if param in experts else None
