"""DDP's gradients compressed on the wire: `dist.grad_compression=bf16|powersgd`.

torch's own communication hooks, in place of DDP's fp32 all-reduce of each bucket:

- `bf16`: each bucket cast to bfloat16 for the all-reduce and back (half the bytes; the
  sum is rounded to bf16's 8 bits of mantissa);
- `powersgd`: each gradient matrix sent as a rank-`dist.powersgd_rank` approximation
  (PowerSGD, Vogels et al. 2019), the error kept and added to the next step's gradient
  (error feedback), after `dist.powersgd_start_step` steps of plain all-reduce (the
  first gradients change too fast to approximate). Its error feedback lives in memory
  only: a resumed run starts it afresh, so a resume is no longer bit-identical.

A hook acts on DDP's all-reduce only: refused under FSDP2 and pipelines (which have
none) and beside a trick's own hook. Under `ft` it compresses the all-reduce inside each
replica group; the average across groups stays fp32 (ciuic_train/ft/replicas.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciuic_train.config import GradCompression
from ciuic_train.errors import UserError

if TYPE_CHECKING:
    from ciuic_train.config import DistConfig
    from ciuic_train.distributed.mesh import MeshShape
    from ciuic_train.tricks import CommHook


def refuse_compression(dist: DistConfig, shape: MeshShape, hook_trick: str | None, log_grad_consistency: bool) -> None:
    """One line, before anything starts, where `dist.grad_compression` has no all-reduce to act on."""
    compression = dist.grad_compression
    if compression is GradCompression.none:
        return
    what = f"dist.grad_compression={compression.value} compresses DDP's gradient all-reduce"
    if shape.pp > 1 or shape.strategy in ("fsdp", "hsdp"):
        raise UserError(f"{what}, which this layout does not have ({shape.describe()}): use dist.dp_shard=1 "
                        "dist.ep=1 dist.pp=1, or dist.grad_compression=none")
    if hook_trick is not None:
        raise UserError(f"{what}, which trick {hook_trick} replaces with its own hook; use one or the other")
    if log_grad_consistency:
        raise UserError(f"{what}; train.log_grad_consistency averages the gradients itself on logging steps, "
                        "uncompressed: use one or the other")


def compression_hook(dist: DistConfig, group) -> CommHook | None:
    """torch's hook for `dist.grad_compression` over `group` (None: the default group), or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from ciuic_train.tricks import CommHook

    name = f"dist.grad_compression={dist.grad_compression.value}"
    if dist.grad_compression is GradCompression.bf16:
        return CommHook(name, bf16_all_reduce, group)
    if dist.grad_compression is GradCompression.powersgd:
        state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=dist.powersgd_rank,
            start_powerSGD_iter=dist.powersgd_start_step, use_error_feedback=True, warm_start=True,
        )
        return CommHook(name, powerSGD_hook.powerSGD_hook, state)
    return None


# Larger than any model's gradients: every parameter in one bucket.
ONE_BUCKET_MB = float(1 << 30)


def compression_bucket_mb(dist: DistConfig, device_type: str) -> float:
    """DDP's bucket size under `dist.grad_compression` (0: DDP's own choice, `dist.ddp_bucket_mb`).

    torch's PowerSGD hook waits for one collective inside the callback of another; gloo
    runs those callbacks on its few worker threads, so with several buckets in flight the
    waits hold every thread and the ranks hang (model=small's 8 buckets, from its third
    compressed step). Off CUDA it gets one bucket (beside DDP's small first one)."""
    if dist.grad_compression is GradCompression.powersgd and device_type != "cuda":
        return ONE_BUCKET_MB
    return dist.ddp_bucket_mb


def bf16_all_reduce(group, bucket):
    """The bucket's mean over `group`, sent as bfloat16. torch's own bf16 hook refuses
    anything but NCCL and XCCL; gloo reduces bf16 as well, so the CPU runs this path too."""
    import torch
    import torch.distributed as dist

    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done):
        mean = bucket.buffer()
        mean.copy_(done.value()[0])
        return mean

    return future.then(decompress)
