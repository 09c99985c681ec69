"""Activations for `--plan`: the bytes autograd saves for backward, per rank and micro-batch.

An estimate (`plan.py` says which figures are exact), in the notation of `plan.py`'s
docstring; `Widths` gives the bytes per element the run's precision, device and mesh
imply, which the FSDP gathers of `plan.py` use too.

Per micro-batch, the tensors autograd saves for backward, widths r (residual stream),
a (matmul operands and outputs) and 4 (fp32 extras): fp32: r = a = 4; bf16 under FSDP2:
r = a = 2 (FSDP gathers bf16 weights, so the embedding's output, and with it the
residual stream, is bf16);
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
"""

from __future__ import annotations

from dataclasses import dataclass

from ciuic_train.config import Config, Device, Precision
from ciuic_train.distributed.mesh import MeshShape

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
        fsdp_bf16 = bf16 and mesh.strategy in ("fsdp", "hsdp")
        if not bf16:
            return Widths(4, 4, 4, False, cuda)
        if fsdp_bf16:
            return Widths(2, 2, 2, False, cuda)
        return Widths(4, 2, 4, True, cuda)


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
        "blocks": blocks,  # each main layer's, then each MTP depth's block
    }


def _blocked_probs(T: int, block: int = CPU_ATTENTION_BLOCK) -> int:
    """P(T): the blocked CPU attention's fp32 probabilities per sequence and head."""
    return sum((min(start + block, T) - start) * min(start + block, T) for start in range(0, T, block))
