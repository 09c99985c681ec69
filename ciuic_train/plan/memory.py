"""A rank's memory for `--plan` (the formulas: `plan.py`'s docstring): its parameters as
FSDP2 units (`fsdp_units`, what each rank stores and gathers), and the totals that follow
from them and its activations (`memory_figures`). `plan.py` takes them for the whole
model, `plan/pipeline.py` for the parts each pipeline rank keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ciuic_train.config import Config
from ciuic_train.distributed.mesh import MeshShape
from ciuic_train.plan.activations import Widths

if TYPE_CHECKING:
    from torch import nn

GIB = 2**30
# What torch reports as total memory on these GPUs, rounded down (GiB).
GPUS = {"80 GB": 79.0, "141 GB": 139.0}


def build_meta_model(config: Config) -> nn.Module:
    import torch

    from ciuic_train.model import Transformer

    with torch.device("meta"):
        return Transformer(config.model)


def memory_figures(config: Config, mesh: MeshShape, widths: Widths, units: list[Unit],
                   acts: dict[str, int]) -> tuple[dict[str, Any], dict[str, dict[str, bool]]]:
    """A rank's memory (module docstring) from its FSDP units and its activations
    (`acts`: the "no_ac" and "ac" estimates), and whether it fits each GPU."""
    sharded = mesh.strategy in ("fsdp", "hsdp")
    stored = {"experts": 0, "other": 0}
    tensors = {"experts": 0, "other": 0}
    for unit in units:
        for kind in stored:
            stored[kind] += unit.stored[kind]
            tensors[kind] += unit.tensors[kind]
    params = {kind: 4 * n for kind, n in stored.items()}
    grads = dict(params)
    optimizer = {kind: 8 * n + 4 * tensors[kind] for kind, n in stored.items()}
    # DDP's gradients are views of its reducer's buckets, zeroed in place between steps:
    # held all step, where one process and FSDP2 free theirs after each (a pipeline's
    # replicas are FSDP2's, HSDP with one shard: no DDP reducer).
    grads_held = sum(grads.values()) if mesh.strategy == "ddp" and mesh.pp == 1 else 0
    accumulated = (
        4 * sum(u.gathered for u in units) if sharded and config.train.grad_accum > 1 else 0
    )
    blocks = units[:-1]
    largest_block = max((u.gathered for u in blocks), default=0) * widths.g if sharded else 0
    root = units[-1].gathered * widths.g if sharded else 0
    largest_unit = max((u.gathered for u in units), default=0)
    fsdp_buffers = root + 2 * largest_block + largest_unit * (widths.g + 4) if sharded else 0

    state = sum(params.values()) + sum(grads.values()) + sum(optimizer.values()) + accumulated
    held = sum(params.values()) + sum(optimizer.values()) + grads_held + accumulated
    backward_end = sum(grads.values()) - grads_held + (root + largest_unit * (widths.g + 4) if sharded else 0)
    totals = {key: held + max(root + 2 * largest_block + acts[key], backward_end) for key in ("no_ac", "ac")}
    fits = {gpu: {key: totals[key] <= cap * GIB for key in totals} for gpu, cap in GPUS.items()}
    memory = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "grads_held": grads_held,
        "accumulated_grads": accumulated,
        "largest_block_all_gather": largest_block,
        "root_all_gather": root,
        "fsdp_buffers": fsdp_buffers,
        "activations": acts,
        "state": state,
        "total": totals,
    }
    return memory, fits


# --- Parameters per FSDP unit -------------------------------------------------------------


@dataclass
class Unit:
    """One FSDP unit (a block, or the root): its parameters as this rank stores and gathers them."""

    stored: dict[str, int]  # elements stored on rank 0, experts and the rest
    tensors: dict[str, int]  # parameter tensors, experts and the rest
    gathered: int  # elements of the unit's all-gather output (padded), 0 when not sharded
    sent: dict[str, int]  # elements this rank sends in one all-gather (= in one reduce-scatter)
    replica_shard: int  # elements HSDP all-reduces across replicas (the stored shard)
    matmul_weights: int  # elements of its matrices as the forward multiplies by them (experts: E / ep)


def fsdp_units(model: nn.Module, mesh: MeshShape) -> list[Unit]:
    """The blocks in order, then the MTP depths, then the root (everything neither holds)."""
    from ciuic_train.distributed.expert_parallel import expert_parameters

    experts = {id(p) for p in expert_parameters(model)}
    in_blocks: set[int] = set()
    groups = []
    for block in [*model.layers, *model.mtp]:
        params = list(_unique(block.parameters()))
        in_blocks.update(id(p) for p in params)
        groups.append(params)
    groups.append([p for p in _unique(model.parameters()) if id(p) not in in_blocks])
    return [_unit(params, experts, mesh) for params in groups]


def _unique(params):
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _unit(params, experts, mesh: MeshShape) -> Unit:
    sharded = mesh.strategy in ("fsdp", "hsdp")
    stored = {"experts": 0, "other": 0}
    tensors = {"experts": 0, "other": 0}
    gathered = 0
    sent = {"experts": 0, "other": 0}
    matmul_weights = 0
    for p in params:
        is_expert = id(p) in experts
        kind = "experts" if is_expert else "other"
        d0, rest = (p.shape[0], math.prod(p.shape[1:])) if p.ndim else (1, 1)
        if is_expert:
            d0 //= mesh.ep  # expert parallelism: E / ep experts per rank
        group = (mesh.efsdp if is_expert else mesh.dp_shard) if sharded else 1
        shard = _stored_elements(d0, rest, group)
        stored[kind] += shard
        tensors[kind] += 1
        if p.ndim >= 2:
            matmul_weights += d0 * rest
        if sharded:
            gathered += group * shard
            sent[kind] += (group - 1) * shard
    return Unit(stored, tensors, gathered, sent, sum(stored.values()), matmul_weights)


def _stored_elements(d0: int, rest: int, group: int) -> int:
    """Rank 0's chunk of a [d0, ...] tensor cut on dim 0 into `group` chunks (FSDP2 pads
    every rank to this size): ceil(d0 / group) rows of `rest` elements."""
    return -(-d0 // group) * rest
