"""The parameters as the mesh holds them: what each rank stores, a checksum of the whole,
and the memory the process has peaked at.

A run's summary reports them: `param_bytes_per_rank` shows what a layout saves (the
planner's figures are checked against it), `param_checksum` shows that the ranks, and two
runs meant to be the same (in any layout), hold bit-identical weights, and
`peak_memory_bytes_per_rank` what each rank needed.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Callable

import torch
from torch import nn

from ciuic_train.distributed.expert_parallel import expert_parameters
from ciuic_train.distributed.materialize import local_rows
from ciuic_train.memory_limits import peak_resident_bytes


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


def param_checksum(model: nn.Module, gather: Callable[[str], list[str]] | None = None) -> str:
    """A hash of every parameter's name and bytes, equal only for bit-identical weights,
    and the same for every layout of the same weights.

    Each rank hashes the dim-0 rows it holds (rows are whole in every layout the package
    builds: `materialize.local_rows`), `gather` (e.g. `Parallel.gather`; a collective,
    every rank must call it at the same point) brings every rank's row hashes together, and
    the checksum hashes them in order. Nothing is gathered but hashes, so it costs a
    rank its shard's bytes, not the model's; and every copy of a row (replicas under DDP
    and HSDP) must hash alike, or this raises naming the first parameter and row that differ.
    """
    mine: dict[str, tuple[int, int, list[str]]] = {}
    for name, param in sorted(model.named_parameters()):
        rows = local_rows(param)
        local = rows.local.detach().cpu().contiguous()
        # The row width spelled out: a padded FSDP2 shard may hold no row, where -1 is ambiguous.
        flat = local.reshape(local.shape[0], math.prod(local.shape[1:])).view(torch.uint8).numpy()
        mine[name] = (rows.global_shape[0], rows.start, [hashlib.sha256(row.tobytes()).hexdigest()[:32] for row in flat])
    everyone = [json.loads(part) for part in gather(json.dumps(mine))] if gather else [mine]
    digest = hashlib.sha256()
    # Every name any rank holds: a pipeline's stages hold different parameters.
    for name in sorted({name for held in everyone for name in held}):
        n_rows = next(held[name][0] for held in everyone if name in held)
        row_hashes: list[str | None] = [None] * n_rows
        for rank, held in enumerate(everyone):
            if name not in held:
                continue
            _, start, hashes = held[name]
            for row, value in enumerate(hashes, start):
                if row_hashes[row] not in (None, value):
                    raise RuntimeError(f"ranks disagree on the weights: {name} row {row} differs on rank {rank}")
                row_hashes[row] = value
        if None in row_hashes:
            raise RuntimeError(f"no rank holds {name} row {row_hashes.index(None)}")
        digest.update(name.encode())
        digest.update("".join(row_hashes).encode())
    return digest.hexdigest()[:16]


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: on CUDA what the allocator handed out, on
    the CPU the resident set's high-water mark (VmHWM; 0 where /proc is not there)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()
