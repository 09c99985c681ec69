"""`--plan` for a pipeline (`dist.pp > 1`): each pipeline rank's memory, its point-to-point
bytes, and the schedule's bubble, from the schedule's own order of work.

The order is torch's: `schedule_order` asks `torch.distributed.pipelining`'s schedule
classes for each rank's list of actions (F forward, B backward, I and W the two halves of a
split backward) through stand-in stages that carry only the shape of the pipeline, and
writes out gpipe's and 1f1b's (which torch runs without a list) as torch runs them:
gpipe every forward then every backward; 1f1b `min(M, pp - r)` forwards on rank r, then
one backward and one forward in turn. From that order:

- **activations in flight**: walking a rank's actions, a micro-batch's activations for a
  stage are held from its F to its B (or, split, to its W: the weight gradient still needs
  the matmuls' inputs after I, so this is an upper bound); the peak over the walk of the
  held bytes, each stage's micro-batch at its blocks' estimates, plus the working set of one
  block (two under activation checkpointing), is the rank's activation estimate;
- **bubble**: the order run with F = I = W = 1 and B = 2 time units for every stage (the
  equal-stage assumption of the zero-bubble papers), each action starting when its rank
  is free and its inputs exist (the previous stage's F; the next stage's B or I): the
  idle share of pp x the makespan. 1f1b and gpipe give (pp - 1) / (M + pp - 1);
- **P2P bytes per step** a rank sends: for each of its stages, M micro-batches' hidden
  states [b, T, D] forward to the next stage and their gradients back to the previous,
  where that stage is on another rank (the V's turn at rank pp - 1 stays on the rank).

Parameters, gradients, optimizer state and FSDP buffers per rank follow `plan.py`'s
formulas over the parts the rank keeps (`keep_stage_parts`, as the trainer prunes the
model), sharded over its stage's ranks.
"""

from __future__ import annotations

import dataclasses
import types
from typing import TYPE_CHECKING, Any

from ciuic_train.config import Config
from ciuic_train.distributed.mesh import MeshShape
from ciuic_train.distributed.pipeline import keep_stage_parts, schedule_class, split_layers
from ciuic_train.distributed.pipeline_split import n_microbatches, n_stages, stage_owners, stages_of_rank
from ciuic_train.plan.activations import Widths, activation_bytes
from ciuic_train.plan.memory import build_meta_model, fsdp_units, memory_figures

if TYPE_CHECKING:
    from torch import nn

# Time units of each action in the bubble's replay.
DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


def schedule_order(dist_cfg: Any) -> dict[int, list[tuple[str, int, int]]]:
    """Each pipeline rank's actions in the order the schedule runs them: (kind, stage, micro-batch)."""
    pp, micro, name = dist_cfg.pp, n_microbatches(dist_cfg), dist_cfg.pp_schedule.value
    if name == "gpipe":
        return {r: [("F", r, m) for m in range(micro)] + [("B", r, m) for m in range(micro)] for r in range(pp)}
    if name == "1f1b":
        order = {}
        for r in range(pp):
            warmup = min(micro, pp - r)
            actions = [("F", r, m) for m in range(warmup)]
            for m in range(micro):
                actions.append(("B", r, m))
                if warmup + m < micro:
                    actions.append(("F", r, warmup + m))
            order[r] = actions
        return order
    return _torch_order(dist_cfg)


def _torch_order(dist_cfg: Any) -> dict[int, list[tuple[str, int, int]]]:
    import torch

    pp, count = dist_cfg.pp, n_stages(dist_cfg)
    # What the schedules read of a stage to plan the order (nothing runs).
    stand_ins = [types.SimpleNamespace(group_size=pp, group_rank=0, num_stages=count, stage_index=i,
                                       is_first=i == 0, is_last=i == count - 1, submod=torch.nn.Identity())
                 for i in stages_of_rank(0, dist_cfg)]
    schedule = schedule_class(dist_cfg.pp_schedule.value)(stand_ins, n_microbatches=n_microbatches(dist_cfg))
    order: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in schedule.pipeline_order.items():
        order[rank] = []
        for action in actions:
            if action is None:
                continue
            for part in getattr(action, "sub_actions", None) or [action]:  # OVERLAP_F_B: its F, then its B
                order[rank].append((part.computation_type.value, part.stage_index, part.microbatch_index))
    return order


def peak_in_flight(actions: list[tuple[str, int, int]], stage_bytes: dict[int, int]) -> int:
    """The most bytes of activations held at once over a rank's actions (module docstring)."""
    held = peak = 0
    for kind, stage, _ in actions:
        if kind == "F":
            held += stage_bytes[stage]
            peak = max(peak, held)
        elif kind in ("B", "W"):  # a whole backward, or a split one's weight half (not I)
            held -= stage_bytes[stage]
    return peak


def bubble_fraction(order: dict[int, list[tuple[str, int, int]]], count: int) -> float:
    """The idle share of the replayed schedule (module docstring)."""
    split = {(stage, mb) for actions in order.values() for kind, stage, mb in actions if kind == "I"}
    done: dict[tuple[str, int, int], float] = {}
    free = {rank: 0.0 for rank in order}
    position = {rank: 0 for rank in order}
    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                kind, stage, mb = actions[position[rank]]
                needs = []
                if kind == "F" and stage > 0:
                    needs.append(("F", stage - 1, mb))
                if kind in ("B", "I"):
                    needs.append(("F", stage, mb))
                    if stage < count - 1:
                        needs.append(("I" if (stage + 1, mb) in split else "B", stage + 1, mb))
                if kind == "W":
                    needs.append(("I", stage, mb))
                if any(need not in done for need in needs):
                    break
                start = max([free[rank], *(done[need] for need in needs)])
                free[rank] = done[(kind, stage, mb)] = start + DURATION[kind]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the pipeline schedule's order waits on itself")
    makespan = max(free.values())
    busy = sum(DURATION[kind] for actions in order.values() for kind, _, _ in actions)
    return 1 - busy / (len(order) * makespan)


def pipeline_plan(config: Config, mesh: MeshShape, widths: Widths,
                  whole: nn.Module) -> tuple[dict[str, Any], list[tuple]]:
    """Each pipeline rank's figures (memory as `plan.memory_figures`, P2P bytes, stages and
    layers), the schedule's bubble and the shape of the micro-batches; and per rank what
    `plan.py` counts its collectives from: (its FSDP units, the config of one micro-batch,
    its part of the model). `whole`: the whole model on meta (left whole)."""
    cfg, m, t = config.dist, config.model, config.train
    micro = n_microbatches(cfg)
    micro_config = dataclasses.replace(config, train=dataclasses.replace(t, batch_size=t.batch_size // micro))
    split = split_layers(whole, config)
    count = len(split)
    order = schedule_order(cfg)
    # Per micro-batch, from the whole model's blocks (main layers, then MTP depths).
    acts = activation_bytes(micro_config, widths, [u.matmul_weights for u in fsdp_units(whole, mesh)[:-1]])
    hidden = micro_config.train.batch_size * t.seq_len * m.dim * widths.r  # one micro-batch's [b, T, D]
    blocks, mtp_blocks = acts["blocks"][: m.n_layers], acts["blocks"][m.n_layers:]

    def stage_bytes(stage: int, checkpointed: bool) -> int:
        layers = split[stage]
        kept = len(layers) * hidden if checkpointed else sum(blocks[i] for i in layers)
        if stage == count - 1:
            kept += acts["top"] + (len(mtp_blocks) * hidden if checkpointed else sum(mtp_blocks))
        return kept + (hidden if stage else 0)  # a stage's input is kept for its backward

    owner = stage_owners(cfg)
    ranks, parts = [], []
    for rank in range(cfg.pp):
        stages = stages_of_rank(rank, cfg)
        model = build_meta_model(config)
        keep_stage_parts(model, stages, split)
        units = fsdp_units(model, mesh)
        own_blocks = [blocks[i] for s in stages for i in split[s]] + (mtp_blocks if count - 1 in stages else [])
        largest = max(own_blocks, default=0)
        rank_acts = {
            "no_ac": peak_in_flight(order[rank], {s: stage_bytes(s, False) for s in stages}) + largest,
            "ac": peak_in_flight(order[rank], {s: stage_bytes(s, True) for s in stages}) + 2 * largest,
        }
        memory, fits = memory_figures(micro_config, mesh, widths, units, rank_acts)
        sends = sum(micro * hidden for s in stages for neighbour in (s - 1, s + 1)
                    if 0 <= neighbour < count and owner[neighbour] != rank)
        ranks.append({
            "rank": rank, "stages": stages, "layers": [len(split[s]) for s in stages],
            "in_flight": peak_in_flight(order[rank], dict.fromkeys(stages, 1)),  # stage micro-batches
            "memory": memory, "fits": fits, "p2p_bytes": sends,
        })
        parts.append((units, micro_config, model))
    figures = {
        "schedule": cfg.pp_schedule.value, "stages": count, "microbatches": micro,
        "micro_batch_size": micro_config.train.batch_size, "layers_per_stage": [len(layers) for layers in split],
        "bubble": bubble_fraction(order, count), "ranks": ranks,
    }
    return figures, parts
