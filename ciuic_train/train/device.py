"""The device a rank trains on, and the matmul precision fp32 gets there."""

from __future__ import annotations

import os

import torch

from ciuic_train.config import Device
from ciuic_train.errors import UserError


def resolve_device(choice: Device, local_rank: int = 0) -> torch.device:
    if choice is Device.cuda and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is available; use device=cpu or device=auto")
    if choice is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:  # else CUDA's own "invalid device ordinal", deep inside the first kernel
        raise UserError(
            f"local rank {local_rank} has no GPU of its own: this node shows {count} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"run at most dist.nproc_per_node={count} ranks per node, or device=cpu"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def use_tf32(device: torch.device, enabled: bool) -> None:
    """fp32 matmuls on a CUDA `device` in TensorFloat-32 or IEEE fp32 (the `tf32` key);
    nothing elsewhere. The flag is the process's, the one torch reads for every matmul."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
