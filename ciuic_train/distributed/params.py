"""The parameters as the mesh holds them: what each rank stores, and a checksum of the whole.

A run's summary reports both: `param_bytes_per_rank` shows what a layout saves (the
planner's figures are checked against it), and `param_checksum` shows that the ranks,
and two runs meant to be the same, hold bit-identical weights.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch import nn

from ciuic_train.distributed.expert_parallel import expert_parameters


def param_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank stores: routed experts, and the rest (shards only,
    under FSDP or expert parallelism)."""
    from torch.distributed.tensor import DTensor

    experts = expert_parameters(model)
    stored = {"experts": 0, "other": 0}
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        stored["experts" if param in experts else "other"] += local.numel() * local.element_size()
    return stored


def param_checksum(model: nn.Module) -> str:
    """A hash of every parameter's name and full bytes: equal only for bit-identical weights.

    Sharded (FSDP2) parameters are gathered first, which is a collective: every rank
    must call this at the same point.
    """
    from torch.distributed.tensor import DTensor

    # Gathering an expert (split over ep, sharded over efsdp) takes two all-gathers, which
    # torch warns about as slow; once at the end of a run it does not matter.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    digest = hashlib.sha256()
    try:
        params = [(name, p.full_tensor() if isinstance(p, DTensor) else p) for name, p in sorted(model.named_parameters())]
    finally:
        redistribute_log.setLevel(level)
    for name, full in params:
        digest.update(name.encode())
        digest.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
