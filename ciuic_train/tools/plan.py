"""`ciuic-train ... --plan`: what a config would build, per rank, without allocating or training.

The model is built on the meta device (shapes, no memory), the mesh is resolved as the
trainer would resolve it (`expected_mesh`: `dist.nnodes * dist.nproc_per_node` ranks),
and every figure below follows from the parameter shapes, the mesh, `train.batch_size`,
`train.seq_len`, `train.grad_accum`, `precision`, `device` and `activation_checkpointing`.
`plan_figures(config)` returns them as a dict (bytes, per rank); `print_plan(config)`
prints them. Nothing here imports CUDA or allocates a tensor's data.

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

Per-rank state (see `_stored_elements`)
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
  param.grad is fp32), and under DDP the reducer's fp32 buckets hold another copy
  (gradient_as_bucket_view is off): `ddp_buckets`;
- optimizer: AdamW's exp_avg and exp_avg_sq, fp32: 8 bytes per stored element;
- with train.grad_accum > 1 under FSDP2, the micro-batches before the last skip the
  gradient sync and FSDP2 keeps each unit's *unsharded* gradient until the last one,
  in fp32 (the reduce dtype): 4 bytes per gathered element of every unit
  (`accumulated_grads`).

FSDP's all-gathers (see `_units`)
---------------------------------
FSDP2 wraps each block (`fully_shard(block)`) and each MTP depth, then the root
(embedding, final norm, lm head). A unit's gather returns, per parameter, n * ceil(d0 / n) * rest elements (dense,
over dp_shard) or efsdp * ceil((E / ep) / efsdp) * rest (experts: only this rank's E / ep
experts, gathered over efsdp), in g bytes: g = 2 (bf16) when precision=bf16 on a CUDA
device (device=cuda or auto; FSDP2's MixedPrecisionPolicy), else 4.

- largest block all-gather: max over blocks of the gathered bytes;
- root all-gather: held from the first forward to the end of backward (FSDP2 does not
  reshard the root after forward);
- FSDP buffers (estimate) = root + 2 x largest block (the running block and the next,
  prefetched) + the largest unit's unsharded gradients in g bytes plus their fp32 copy
  for the reduce-scatter ((g + 4) bytes per gathered element).

Activations (see `activation_bytes`)
------------------------------------
Per micro-batch, the tensors autograd saves for backward, widths r (residual stream),
a (matmul operands and outputs) and 4 (fp32 extras): fp32: r = a = 4; bf16 under FSDP2
on CUDA: r = a = 2 (FSDP casts each block's input to bf16 and gathers bf16 weights);
bf16 otherwise (autocast alone): r = 4, a = 2, and each linear layer that reads a norm's
fp32 output saves its own bf16 copy ("copies" below: 2 for attention, 2 for the dense
FFN, 1 + 2 * [shared experts] for the MoE), where otherwise one copy serves them all,
and keeps a bf16 copy of every weight matrix the block multiplies by (2 bytes per
element; experts: this rank's E / ep) until backward. Per token and block:

    attention  D r + 4 (norm input, 1/rms) + copies * D a (norm output)
               + [q_lora_rank > 0] (2 q_lora_rank a + 4) (wq_a output, its norm output)
               + (kv_lora_rank + d_rope) a + 4 + kv_lora_rank a (latent, its norm output)
               + core + H d_v a (attention output, input of wo)
    core       CUDA (fused SDPA, heads padded to d = max(d_qk, d_v)): 4 H d a (q, k, v,
               output) + 4 H (log-sum-exp); CPU (blocked attention): (2 H d_qk + H d_v) a
               + the fp32 probabilities, 4 H P(T) / T, P(T) = sum over 64-query blocks
               of rows x keys seen
    dense FFN  D r + 4 + copies * D a + 4 F a (w1 and w3 outputs, silu, their product)
    MoE FFN    D r + 4 + copies * D a + 4 E + 28 k (router: fp32 scores and top-k
               weights, int64 indices; + 4 k + 4 with norm_topk_prob; group-limited
               routing keeps nothing more: its top-k values go unused, so autograd
               frees what it saved)
               + k (D a + 4 h a + D a + D r) (dispatched rows,
               expert w13 output, silu, product, expert output, weighted output)
               + 4 S a (shared experts)

plus per block and micro-batch 8 T d_rope (the RoPE rotations, complex64) and 4 E per
MoE block (group ends); and per micro-batch 8 N (token ids) + N (D r + 4) (final norm)
+ N D r (the loss's gradient for h) + V D g (its lm head gradient, accumulated in fp32
and kept in the dtype of the weight it was given: g) + 8.

Each multi-token-prediction depth k (`model.n_mtp_layers`) adds one block over T - k
positions (MoE when the model has MoE layers), and per one of its N_k = B (T - k) tokens
(D r + 4) (enorm input) + 4 (hnorm) + 2 D a (the pair eh_proj reads) + (D r + 4) (its
final norm) + D r (the loss's gradient for h), another V D g + 8 for the shared head, and
for k = 1 N D r: hnorm reads a view of the main model's normalised output, which keeps it.

Without activation checkpointing: the top-level terms + every block's saved tensors
+ one more block's worth (backward's working set: the gradients of the block being
differentiated). With it: the top-level terms + each block's input (N D r per block, N_k D r per MTP block)
+ 2 x the largest block (its recomputed tensors and backward's working set).
The saved-tensor count is checked against `torch.autograd.graph.saved_tensors_hooks`
in fp32 on CPU (tests/test_plan.py); the CUDA kernels' figures are derived, not
measured, and the CPU bf16 path pads expert groups, which is not modelled.

Communication per optimizer step (see `_communication`), bytes a rank sends
--------------------------------------------------------------------------
- all-gather (FSDP, exact): per micro-batch, every block twice (forward, and again in
  backward) and the root once: sum over gathers of (m - 1) x shard bytes (g bytes per
  element) where m is the group size (n for dense parameters, efsdp for experts);
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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ciuic_train.config import Config, Device, Precision
from ciuic_train.files import format_bytes
from ciuic_train.distributed.mesh import MeshShape, expected_mesh

if TYPE_CHECKING:
    from torch import nn

GIB = 2**30
# What torch reports as total memory on these GPUs, rounded down (GiB).
GPUS = {"80 GB": 79.0, "141 GB": 139.0}
# Queries per block of the CPU attention kernel (ciuic_train/model/kernels/attention.py).
CPU_ATTENTION_BLOCK = 64


@dataclass(frozen=True)
class Widths:
    """Bytes per element: r residual stream, a matmul activations, g gathered parameters."""

    r: int
    a: int
    g: int
    copies_per_consumer: bool  # autocast alone: each linear saves its own bf16 copy of a norm's output
    cuda: bool

    @staticmethod
    def of(config: Config, mesh: MeshShape) -> Widths:
        cuda = config.device is not Device.cpu
        bf16 = config.precision is Precision.bf16
        fsdp_bf16 = bf16 and cuda and mesh.strategy in ("fsdp", "hsdp")
        if not bf16:
            return Widths(4, 4, 4, False, cuda)
        if fsdp_bf16:
            return Widths(2, 2, 2, False, cuda)
        return Widths(4, 2, 4, True, cuda)


def build_meta_model(config: Config) -> nn.Module:
    import torch

    from ciuic_train.model import Transformer

    with torch.device("meta"):
        return Transformer(config.model)


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
    units = _units(model, mesh)
    sharded = mesh.strategy in ("fsdp", "hsdp")

    stored = {"experts": 0, "other": 0}
    for unit in units:
        for kind in stored:
            stored[kind] += unit.stored[kind]
    params = {kind: 4 * n for kind, n in stored.items()}
    grads = dict(params)
    optimizer = {kind: 8 * n for kind, n in stored.items()}
    ddp_buckets = 4 * sum(stored.values()) if mesh.strategy == "ddp" else 0
    accumulated = (
        4 * sum(u.gathered for u in units) if sharded and config.train.grad_accum > 1 else 0
    )
    blocks = units[:-1]
    largest_block = max((u.gathered for u in blocks), default=0) * widths.g if sharded else 0
    root = units[-1].gathered * widths.g if sharded else 0
    largest_unit = max((u.gathered for u in units), default=0)
    fsdp_buffers = root + 2 * largest_block + largest_unit * (widths.g + 4) if sharded else 0

    acts = activation_bytes(config, widths, [u.matmul_weights for u in blocks])
    state = sum(params.values()) + sum(grads.values()) + sum(optimizer.values()) + ddp_buckets + accumulated
    totals = {
        "no_ac": state + fsdp_buffers + acts["no_ac"],
        "ac": state + fsdp_buffers + acts["ac"],
    }
    fits = {gpu: {key: totals[key] <= cap * GIB for key in totals} for gpu, cap in GPUS.items()}
    return {
        "model": config.model.name,
        "world_size": mesh.world_size,
        "nodes": config.dist.nnodes,
        "mesh": {**mesh.as_dict(), "efsdp": mesh.efsdp, "strategy": mesh.strategy},
        "parameters": {"total": total, "active": active, "mtp": mtp_total, "mtp_active": mtp_active},
        "widths": {"residual": widths.r, "activation": widths.a, "gather": widths.g},
        "tokens_per_rank": config.train.batch_size * config.train.seq_len,
        "memory": {
            "params": params,
            "grads": grads,
            "optimizer": optimizer,
            "ddp_buckets": ddp_buckets,
            "accumulated_grads": accumulated,
            "largest_block_all_gather": largest_block,
            "root_all_gather": root,
            "fsdp_buffers": fsdp_buffers,
            "activations": acts,
            "state": state,
            "total": totals,
        },
        "activation_checkpointing": config.activation_checkpointing,
        "fits": fits,
        "comm": _communication(config, model, mesh, widths, units),
    }


# --- Parameters per FSDP unit -------------------------------------------------------------


@dataclass
class Unit:
    """One FSDP unit (a block, or the root): its parameters as this rank stores and gathers them."""

    stored: dict[str, int]  # elements stored on rank 0, experts and the rest
    gathered: int  # elements of the unit's all-gather output (padded), 0 when not sharded
    sent: dict[str, int]  # elements this rank sends in one all-gather (= in one reduce-scatter)
    replica_shard: int  # elements HSDP all-reduces across replicas (the stored shard)
    matmul_weights: int  # elements of its matrices as the forward multiplies by them (experts: E / ep)


def _units(model: nn.Module, mesh: MeshShape) -> list[Unit]:
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
        if p.ndim >= 2:
            matmul_weights += d0 * rest
        if sharded:
            gathered += group * shard
            sent[kind] += (group - 1) * shard
    return Unit(stored, gathered, sent, sum(stored.values()), matmul_weights)


def _stored_elements(d0: int, rest: int, group: int) -> int:
    """Rank 0's chunk of a [d0, ...] tensor cut on dim 0 into `group` chunks (FSDP2 pads
    every rank to this size): ceil(d0 / group) rows of `rest` elements."""
    return -(-d0 // group) * rest


# --- Activations --------------------------------------------------------------------------


def activation_bytes(config: Config, widths: Widths, block_weights: list[int] | None = None) -> dict[str, int]:
    """Bytes of saved activations per rank for one micro-batch (formulas: module docstring).

    `block_weights`: per block, the elements of the matrices its forward multiplies by
    (experts: this rank's E / ep); under autocast alone each is saved as a bf16 copy.

    Returns `saved` (what autograd holds at the end of forward without checkpointing),
    `no_ac` and `ac` (the estimates that enter the totals), and the per-block figures.
    """
    m, t = config.model, config.train
    B, T = t.batch_size, t.seq_len
    N = B * T
    r, a = widths.r, widths.a
    D, H = m.dim, m.n_heads
    d_qk, d_v, d_rope = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.qk_rope_head_dim
    k, h, E = m.n_activated_experts, m.moe_ffn_dim, m.n_routed_experts
    S = m.n_shared_experts * h

    def norm_output(consumers: int) -> int:
        return (consumers if widths.copies_per_consumer else 1) * D * a

    # Per token.
    attention = D * r + 4 + norm_output(2)
    if m.q_lora_rank > 0:
        attention += 2 * m.q_lora_rank * a + 4
    attention += (m.kv_lora_rank + d_rope) * a + 4 + m.kv_lora_rank * a
    if widths.cuda:
        d = max(d_qk, d_v)
        attention += 4 * H * d * a + 4 * H
    else:
        attention += (2 * H * d_qk + H * d_v) * a
    attention += H * d_v * a
    dense = D * r + 4 + norm_output(2) + 4 * m.dense_ffn_dim * a
    moe = (
        D * r + 4 + norm_output(1 + (2 if S else 0))
        + 4 * E + 28 * k + (4 * k + 4 if m.norm_topk_prob else 0)
        + k * (D * a + 4 * h * a + D * a + D * r)
        + 4 * S * a
    )
    # Per micro-batch, for a block over sequences of length `seq`.
    def block_bytes(seq: int, is_moe: bool) -> int:
        per_block = 8 * seq * d_rope + (0 if widths.cuda else 4 * B * H * _blocked_probs(seq))
        return B * seq * (attention + (moe if is_moe else dense)) + per_block + (4 * E if is_moe else 0)

    n_moe = m.n_layers - m.n_dense_layers
    per_layer = [block_bytes(T, i >= m.n_dense_layers) for i in range(m.n_layers)]
    # MTP depth k: its block over T - k positions, and around it (per position) the two
    # norms' inputs, the pair eh_proj reads, its own final norm, the loss's gradient for h;
    # depth 1 also keeps the main model's output alive (hnorm reads a view of it); and a
    # second lm head gradient.
    per_depth = []
    for k in range(1, m.n_mtp_layers + 1):
        n_k = B * (T - k)
        around = n_k * ((D * r + 4) + 4 + 2 * D * a + (D * r + 4) + D * r) + m.vocab_size * D * widths.g + 8
        per_depth.append((block_bytes(T - k, n_moe > 0), around + (N * D * r if k == 1 else 0)))
    blocks = per_layer + [block for block, _ in per_depth]
    if widths.copies_per_consumer and block_weights is not None:
        blocks = [b + 2 * w for b, w in zip(blocks, block_weights)]
    top = 8 * N + N * (D * r + 4) + N * D * r + m.vocab_size * D * widths.g + 8 + sum(around for _, around in per_depth)
    largest = max(blocks)
    saved = top + sum(blocks)
    block_inputs = N * D * r * m.n_layers + sum(B * (T - k) * D * r for k in range(1, m.n_mtp_layers + 1))
    return {
        "saved": saved,
        "no_ac": saved + largest,
        "ac": top + block_inputs + 2 * largest,
        "dense_block": blocks[0] if m.n_dense_layers else 0,
        "moe_block": blocks[m.n_layers - 1] if n_moe else 0,
        "top": top,
    }


def _blocked_probs(T: int, block: int = CPU_ATTENTION_BLOCK) -> int:
    """P(T): the blocked CPU attention's fp32 probabilities per sequence and head."""
    return sum((min(start + block, T) - start) * min(start + block, T) for start in range(0, T, block))


# --- Communication ------------------------------------------------------------------------


def _communication(config: Config, model: nn.Module, mesh: MeshShape, widths: Widths, units: list[Unit]) -> dict[str, Any]:
    """Bytes this rank sends per optimizer step, by collective (formulas: module docstring)."""
    m, t = config.model, config.train
    micro = t.grad_accum
    N = t.batch_size * t.seq_len
    W, R = mesh.world_size, mesh.dp_replicate
    n_moe = m.n_layers - m.n_dense_layers
    # Tokens each MoE layer routes per micro-batch: N in the main model, B (T - k) in MTP depth k.
    moe_tokens = [N] * n_moe + ([t.batch_size * (t.seq_len - k) for k in range(1, m.n_mtp_layers + 1)] if n_moe else [])
    sharded = mesh.strategy in ("fsdp", "hsdp")
    blocks, root = units[:-1], units[-1]

    def sent(unit: Unit) -> int:
        return sum(unit.sent.values())

    all_gather = micro * (2 * sum(sent(u) for u in blocks) + sent(root)) * widths.g if sharded else 0
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


# --- Printing -----------------------------------------------------------------------------


def print_plan(config: Config) -> None:
    """Build the model on the meta device (no memory) and print its size, the run's shape,
    and the per-rank memory and communication for the mesh."""
    from rich.console import Console
    from rich.table import Table

    from ciuic_train.model import count_mtp_parameters, count_parameters

    mesh = resolve_plan_mesh(config)  # a bad mesh is a one-line error before torch loads
    model = build_meta_model(config)
    total, active = count_parameters(model)
    mtp_total, mtp_active = count_mtp_parameters(model)
    m, t = config.model, config.train
    table = Table(title=f"plan: model={m.name}", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    rows = {
        "parameters (total)": f"{total:,} ({total / 1e9:.2f} B)",
        "parameters (active per token)": f"{active:,} ({active / 1e9:.2f} B)",
        **({
            f"MTP ({m.n_mtp_layers} depth{'s' * (m.n_mtp_layers > 1)})": (
                f"+ {mtp_total:,} ({mtp_total / 1e9:.2f} B, {mtp_active / 1e9:.2f} B active); shares the "
                f"embedding and head, which DeepSeek's released MTP weights copy "
                f"({(mtp_total + 2 * m.vocab_size * m.dim) / 1e9:.2f} B with them)"
            )
        } if mtp_total else {}),
        "layers (dense + MoE)": f"{m.n_layers} ({m.n_dense_layers} + {m.n_layers - m.n_dense_layers})",
        "experts per MoE layer": f"{m.n_routed_experts} routed (top-{m.n_activated_experts}) + {m.n_shared_experts} shared",
        "attention": f"MLA, {m.n_heads} heads, kv_lora_rank {m.kv_lora_rank}, q_lora_rank {m.q_lora_rank or 'none'}",
        "fp32 weights + AdamW state": f"{(total + mtp_total) * 16 / 2**30:,.1f} GiB",
        "tokens per optimizer step": f"{t.batch_size * t.seq_len * t.grad_accum * mesh.world_size:,}",
        "data": config.data.name + (f" ({config.data.path})" if config.data.path else ""),
        "tricks": ", ".join(sorted(config.trick)) or "none",
    }
    for key, value in rows.items():
        table.add_row(key, value)
    console = Console()
    console.print(table)
    figures = plan_figures(config, model)
    console.print(_memory_table(config, figures))
    console.print(_comm_table(figures))


def _memory_table(config: Config, f: dict[str, Any]) -> Any:
    from rich.table import Table

    mem, mesh, w = f["memory"], f["mesh"], f["widths"]
    gathered = {2: "bf16", 4: "fp32"}[w["gather"]]
    table = Table(
        title=f"per rank: {f['world_size']} ranks ({config.dist.nnodes} x {config.dist.nproc_per_node}), "
        f"{mesh['strategy']} dp_replicate={mesh['dp_replicate']} x dp_shard={mesh['dp_shard']}, "
        f"ep={mesh['ep']}, efsdp={mesh['efsdp']}",
    )
    table.add_column("memory", style="bold")
    table.add_column("per rank", justify="right")
    table.add_column("how")

    def split(d: dict[str, int]) -> str:
        return f"experts {format_bytes(d['experts'])} + other {format_bytes(d['other'])}"

    table.add_row("parameters", format_bytes(sum(mem["params"].values())), f"fp32; {split(mem['params'])} (exact)")
    table.add_row("gradients", format_bytes(sum(mem["grads"].values())), "fp32, as the parameters (exact)")
    table.add_row("AdamW state", format_bytes(sum(mem["optimizer"].values())), "2 x fp32 per parameter (exact)")
    if mem["ddp_buckets"]:
        table.add_row("DDP buckets", format_bytes(mem["ddp_buckets"]), "the reducer's fp32 copy of the gradients")
    if mem["accumulated_grads"]:
        table.add_row("accumulated grads", format_bytes(mem["accumulated_grads"]),
                      "grad_accum > 1: FSDP2 keeps unsharded fp32 gradients between micro-batches")
    if mesh["strategy"] in ("fsdp", "hsdp"):
        table.add_row("largest block all-gather", format_bytes(mem["largest_block_all_gather"]), f"{gathered} (exact)")
        table.add_row("root all-gather", format_bytes(mem["root_all_gather"]), f"{gathered}, held all step (exact)")
        table.add_row("FSDP buffers", format_bytes(mem["fsdp_buffers"]),
                      "root + 2 x largest block + one unit's gradients (estimate)")
    acts = mem["activations"]
    tokens = f"{config.train.batch_size} x {config.train.seq_len} tokens"
    for key, label in (("no_ac", "without AC"), ("ac", "with AC")):
        configured = ", as configured" if (key == "ac") == f["activation_checkpointing"] else ""
        table.add_row(f"activations {label}", format_bytes(acts[key]), f"{tokens}, estimate{configured}")
    for key, label in (("no_ac", "without AC"), ("ac", "with AC")):
        verdicts = ", ".join(
            f"{gpu} ({cap:g} GiB): {'fits' if f['fits'][gpu][key] else 'does not fit'}" for gpu, cap in GPUS.items()
        )
        table.add_row(f"total {label}", format_bytes(mem["total"][key]), verdicts)
    return table


def _comm_table(f: dict[str, Any]) -> Any:
    from rich.table import Table

    comm = f["comm"]
    table = Table(title="communication per optimizer step: bytes each rank sends")
    table.add_column("collective", style="bold")
    table.add_column("per rank", justify="right")
    table.add_column("what")
    ar = comm["all_reduce"]
    parts = [
        f"{name} {format_bytes(ar[key])}"
        for key, name in (("ddp_grads", "DDP grads"), ("hsdp_replicas", "HSDP replicas"), ("moe_load", "MoE load"))
        if ar[key]
    ]
    table.add_row("all-gather", format_bytes(comm["all_gather"]), "FSDP: blocks forward + backward, root once (exact)")
    table.add_row("reduce-scatter", format_bytes(comm["reduce_scatter"]), "FSDP: fp32 gradients, once a step (exact)")
    table.add_row("all-reduce", format_bytes(ar["total"]), (", ".join(parts) or "none") + " (exact)")
    table.add_row("all-to-all", format_bytes(comm["all_to_all"]), "EP: token rows, uniform routing (estimate)")
    return table
