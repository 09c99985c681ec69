"""`ciuic-train ... --plan`: what a config would build, per rank, without allocating or training.

The model is built on the meta device (shapes, no memory), the mesh is resolved as the
trainer would resolve it (`expected_mesh`: `dist.nnodes * dist.nproc_per_node` ranks),
and every figure below follows from the parameter shapes, the mesh, `train.batch_size`,
`train.seq_len`, `train.grad_accum`, `precision`, `device` and `activation_checkpointing`.
`plan_figures(config)` returns them as a dict (bytes, per rank), and
`plan/tables.py`'s `print_plan(config)` prints them. Nothing here imports CUDA or allocates a
tensor's data.

Notation: D model dim, L layers (L_moe of them MoE), H heads, E routed experts, k of
them per token, h expert (and shared-slice) hidden size, S = n_shared_experts * h,
F dense FFN hidden, V vocab; B batch, T sequence, N = B * T tokens per rank per
micro-batch; the mesh R = dp_replicate, n = dp_shard, ep, efsdp = n / ep, W = R * n.

Which figures are exact
-----------------------
*Exact* (they follow from shapes and the layout, and tests/test_plan.py checks the
parameter bytes against what the trainer measures on each rank):
parameters, gradients, optimizer state, the all-gather sizes, and the all-gather,
reduce-scatter and all-reduce volumes (as FSDP2/DDP issue them by default; bytes a rank
sends, ring algorithm).
*Estimates*: activations (a count of the tensors autograd saves, see `activation_bytes`),
the FSDP working buffers, the all-to-all volume (an expectation under uniform routing)
and therefore the totals and the "fits" verdicts. Not counted at all: the CUDA context,
NCCL's buffers, allocator fragmentation, tricks' own state, evaluation steps.

Per-rank state (see `plan/memory.py`'s `_stored_elements`)
---------------------------------------
A parameter of shape [d0, ...] is stored whole under DDP (dp_shard=1) or one process.
Under FSDP2/HSDP it is cut on dim 0 into n chunks as `torch.chunk` does, and every rank
stores (padded to) the first, largest chunk: ceil(d0 / n) * prod(rest) elements; rank 0,
whose figures these are, holds exactly that many. The routed experts' stacked weights
(w13 [E, 2h, D], w2 [E, D, h]) are first cut over `ep` (E / ep experts per rank, even:
the mesh check requires ep | E), then FSDP cuts those E / ep experts over the efsdp
ranks that hold the same experts: ceil((E / ep) / efsdp) experts' rows. Replicas
(dp_replicate) store the same shards.

- parameters: 4 bytes per stored element (fp32 master weights, also under precision=bf16);
- gradients: 4 bytes per stored element (FSDP2 reduces into fp32 sharded gradients; DDP's
  param.grad is fp32, a view of the reducer's fp32 buckets: no second copy, and held all
  step, zeroed in place between steps);
- optimizer: AdamW's exp_avg and exp_avg_sq, fp32: 8 bytes per stored element, and
  its step count, a 4-byte fp32 tensor per parameter tensor (the fused AdamW keeps it on
  the device);
- with train.grad_accum > 1 under FSDP2, the micro-batches before the last skip the
  gradient sync and FSDP2 keeps each unit's *unsharded* gradient until the last one,
  in fp32 (the reduce dtype): 4 bytes per gathered element of every unit
  (`accumulated_grads`).

FSDP's all-gathers (see `plan/memory.py`'s `fsdp_units`)
---------------------------------
FSDP2 wraps each block (`fully_shard(block)`) and each MTP depth, then the root
(embedding, final norm, lm head). A unit's gather returns, per parameter, n * ceil(d0 / n) * rest elements (dense,
over dp_shard) or efsdp * ceil((E / ep) / efsdp) * rest (experts: only this rank's E / ep
experts, gathered over efsdp), in g bytes: g = 2 (bf16) when precision=bf16 (FSDP2's
MixedPrecisionPolicy, on every device), else 4.

- largest block all-gather: max over blocks of the gathered bytes;
- root all-gather: held from the first forward to the end of backward (FSDP2 does not
  reshard the root after forward);
- FSDP buffers (estimate) = root + 2 x largest block (the running block and the next,
  prefetched) + the largest unit's unsharded gradients in g bytes plus their fp32 copy
  for the reduce-scatter ((g + 4) bytes per gathered element).

Activations (`plan/activations.py`)
-----------------------------------
An estimate of the tensors autograd saves for backward per micro-batch, at widths r
(residual stream), a (matmul operands and outputs) and 4 (fp32 extras) that follow from
`precision`, `device` and FSDP; that module's docstring gives every term. Without
activation checkpointing: every block's saved tensors + one more block's worth; with it:
each block's input + 2 x the largest block; plus the terms outside the blocks.

The total (estimate)
--------------------
The parameters, AdamW state, DDP's gradients and accumulated gradients are held all step;
the rest peaks twice, and not at once: when backward starts, the activations are all
there and no gradient is yet (the step before set them to None; DDP's are held), and
when it ends, every gradient is, the activations are gone, and the root, the last unit
to reduce, holds its gradients unsharded and in fp32 for the reduce-scatter. So

    total = held all step + max(root + 2 x largest block + activations,
                                gradients not held + root + largest unit's gradients ((g + 4) B per element))

(the FSDP terms under FSDP2 only). `--plan --simulate` measures a step
(`simulate.py`); docs/plan.md sets the two side by side.

A pipeline (`dist.pp > 1`, `plan/pipeline.py`): the same formulas over the parts each
pipeline rank keeps, with its activations from the schedule's order (the micro-batches
in flight); the figures above are then those of the pipeline rank that needs the most.

Communication per optimizer step (see `_communication`), bytes a rank sends
--------------------------------------------------------------------------
- all-gather (FSDP, exact): per micro-batch, every block twice (forward, and again in
  backward) and the root once, but the last unit once where it stays gathered from
  forward to backward (`dist.fsdp_keep_last_gathered`, not in a pipeline): sum over
  gathers of (m - 1) x shard bytes (g bytes per element) where m is the group size (n
  for dense parameters, efsdp for experts);
- reduce-scatter (FSDP, exact): once per step (the last micro-batch syncs), fp32:
  sum of (m - 1) x shard x 4;
- all-reduce (exact): HSDP's replica all-reduce of the fp32 sharded gradients,
  2 (R - 1) / R x shard bytes; DDP's gradients, 2 (W - 1) / W x 4 x parameters, once a
  step; and the MoE load counts (`balance_experts`), 2 (W - 1) / W x 4 L_moe E (MTP
  depths' MoE layers included);
- all-to-all (EP, estimate): per MoE layer and micro-batch, the token rows go out and
  come back in forward and again in backward, and a rank keeps 1/ep of its rows under
  uniform routing: 2 N k D (r + a) (ep - 1) / ep (= 2 * 2 * N k D a (ep - 1) / ep when
  r = a); activation checkpointing re-runs the forward exchanges: 3 N k D (r + a) ...;
  plus the counts (E int64) once per forward; an MTP depth's MoE layer routes its B (T - k) tokens.
Scalar reductions (loss, grad norm) are left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ciuic_train.config import Config
from ciuic_train.step.batch import tokens_per_step
from ciuic_train.distributed.mesh import MeshShape, expected_mesh
from ciuic_train.plan.activations import Widths, activation_bytes
from ciuic_train.plan.memory import Unit, build_meta_model, fsdp_units, memory_figures

if TYPE_CHECKING:
    from torch import nn


def resolve_plan_mesh(config: Config) -> MeshShape:
    return expected_mesh(config.dist, config.model.n_routed_experts, environ={})


def plan_figures(config: Config, model: nn.Module | None = None) -> dict[str, Any]:
    """Every figure `--plan` prints, per rank (rank 0, the largest shard), in bytes.

    Raises UserError for a mesh `resolve_mesh` refuses, before building anything.
    """
    mesh = resolve_plan_mesh(config)
    if model is None:
        model = build_meta_model(config)
    from ciuic_train.model import count_mtp_parameters, count_parameters

    widths = Widths.of(config, mesh)
    total, active = count_parameters(model)
    mtp_total, mtp_active = count_mtp_parameters(model)
    pipeline = None
    if config.dist.pp > 1:
        from ciuic_train.plan.pipeline import pipeline_plan

        pipeline, parts = pipeline_plan(config, mesh, widths, model)
        # The pipeline rank that needs the most memory speaks for the run (the check a
        # run makes compares it with the device); the table gives every rank.
        busiest = max(range(len(parts)), key=lambda r: pipeline["ranks"][r]["memory"]["total"]["no_ac"])
        pipeline["busiest"] = busiest
        memory, fits = pipeline["ranks"][busiest]["memory"], pipeline["ranks"][busiest]["fits"]
        units, comm_config, comm_model = parts[busiest]
    else:
        units = fsdp_units(model, mesh)
        acts = activation_bytes(config, widths, [u.matmul_weights for u in units[:-1]])
        memory, fits = memory_figures(config, mesh, widths, units, acts)
        comm_config, comm_model = config, model
    return {
        "model": config.model.name,
        "world_size": mesh.world_size,
        "nodes": config.dist.nnodes,
        "mesh": {**mesh.as_dict(), "efsdp": mesh.efsdp, "strategy": mesh.strategy},
        "parameters": {"total": total, "active": active, "mtp": mtp_total, "mtp_active": mtp_active},
        "widths": {"residual": widths.r, "activation": widths.a, "gather": widths.g},
        "tokens_per_rank": config.train.batch_size * config.train.seq_len,
        "tokens_per_step": tokens_per_step(config.train, mesh.data_parallel_size),
        "memory": memory,
        "activation_checkpointing": config.activation_checkpointing,
        "fits": fits,
        "comm": _communication(comm_config, comm_model, mesh, widths, units),
        **({"pipeline": pipeline} if pipeline else {}),
    }


# --- Communication ------------------------------------------------------------------------


def _communication(config: Config, model: nn.Module, mesh: MeshShape, widths: Widths, units: list[Unit]) -> dict[str, Any]:
    """Bytes this rank sends per optimizer step, by collective (formulas: module docstring)."""
    m, t = config.model, config.train
    micro = t.grad_accum
    N = t.batch_size * t.seq_len
    # The ranks that reduce together: a pipeline stage's (its MoE counts, its FSDP groups).
    W, R = mesh.data_parallel_size, mesh.dp_replicate
    n_moe = len(model.moe_layers(mtp=False))  # this rank's: a pipeline stage holds some
    # Tokens each MoE layer routes per micro-batch: N in the main model, B (T - k) in MTP depth k.
    moe_tokens = [N] * n_moe + ([t.batch_size * (t.seq_len - k) for k in range(1, len(model.mtp) + 1)]
                                if m.n_layers > m.n_dense_layers else [])
    sharded = mesh.strategy in ("fsdp", "hsdp")
    blocks, root = units[:-1], units[-1]

    def sent(unit: Unit) -> int:
        return sum(unit.sent.values())

    # The last unit kept gathered from forward to backward (dist.fsdp_keep_last_gathered) is gathered once.
    kept = sent(blocks[-1]) if blocks and config.dist.fsdp_keep_last_gathered and config.dist.pp == 1 else 0
    all_gather = micro * (2 * sum(sent(u) for u in blocks) - kept + sent(root)) * widths.g if sharded else 0
    reduce_scatter = 4 * sum(sent(u) for u in units) if sharded else 0
    replicas = 0
    if mesh.strategy == "hsdp":
        replicas = 2 * (R - 1) * 4 * sum(u.replica_shard for u in units) // R
    ddp = 0
    if mesh.strategy == "ddp":
        ddp = 2 * (W - 1) * 4 * sum(sum(u.stored.values()) for u in units) // W
    load = 2 * (W - 1) * 4 * len(moe_tokens) * m.n_routed_experts // W if W > 1 and moe_tokens else 0
    forwards = 2 if config.activation_checkpointing else 1
    ep = mesh.ep

    def rows(tokens: int) -> int:
        return (forwards + 1) * tokens * m.n_activated_experts * m.dim * (widths.r + widths.a) * (ep - 1) // ep

    counts = forwards * 8 * m.n_routed_experts * (ep - 1) // ep
    all_to_all = micro * sum(rows(tokens) + counts for tokens in moe_tokens) if ep > 1 else 0
    return {
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "all_reduce": {"hsdp_replicas": replicas, "ddp_grads": ddp, "moe_load": load, "total": replicas + ddp + load},
        "all_to_all": all_to_all,
    }
