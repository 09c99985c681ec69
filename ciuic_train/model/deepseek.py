"""A DeepSeek-V2/V3 style decoder: Multi-head Latent Attention plus DeepSeekMoE.

Read top to bottom: RMSNorm, RoPE, the attention kernel and MLA, the dense FFN, the
grouped-matmul helpers and the MoE, the block, the loss, the model, then parameter and
FLOP counting and sampling. The model returns logits, or given targets the cross-entropy,
computed in chunks of tokens so the whole logits tensor is never built. Where autograd's
graph of a formula costs passes over memory that a written-out backward saves (RMSNorm,
blocked attention, the loss), the module has a `torch.autograd.Function`; each is tested
against the plain formula, forward and gradients.

Weight decay rule for the trainer: decay parameters with ndim >= 2 except
`tok_embeddings.weight`. That excludes norms and keeps matrices, including the stacked
expert weights and `lm_head.weight`.

Building on meta works: `with torch.device("meta"): model = Transformer(cfg)` allocates
nothing; after `model.to_empty(device=...)` call `model.init_weights()` to fill in real
parameters and buffers.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion
from torch.utils.checkpoint import checkpoint

from ciuic_train.model.config import ModelConfig

# Most bytes of fp32 logits per loss chunk: the lm head and the cross-entropy run over this
# many tokens at a time (256 at vocab 4096), so only one chunk's logits exist at once and none
# are kept for backward. The loss alone at model=bench fp32, side by side: 256-token chunks ran
# 8% faster than 128 and 2% faster than 512.
LOSS_CHUNK_BYTES = 4 * 2**20
IGNORE_INDEX = -100


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per loss chunk: as many as keep its fp32 logits within `LOSS_CHUNK_BYTES`."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 so bf16 activations don't lose the mean-square."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return RMSNormFunction.apply(x, self.weight, self.eps)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with its backward written out: 10 passes over x where autograd's graph of the
    same formula makes about 14 (model=bench fp32: forward and backward 3.05 -> 1.85 ms)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        inv_rms = torch.linalg.vecdot(x32, x32).div_(x.shape[-1]).add_(eps).rsqrt_().unsqueeze(-1)
        ctx.save_for_backward(x, weight, inv_rms)
        return (x32 * inv_rms).mul_(weight).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, inv_rms = ctx.saved_tensors
        normed, grad = x.to(inv_rms.dtype) * inv_rms, grad.to(inv_rms.dtype)
        grad_weight = (grad * normed).flatten(0, -2).sum(0)
        grad_normed = grad * weight
        # d normed / dx = (I - normed normed^T / n) * inv_rms, applied row by row.
        projection = torch.linalg.vecdot(grad_normed, normed).div_(-x.shape[-1]).unsqueeze(-1)
        grad_x = torch.addcmul(grad_normed, normed, projection).mul_(inv_rms)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None):
    """cos/sin of shape [max_seq_len, head_dim // 2], one angle per rotated pair."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[..., T, d] by position, pairing adjacent channels (2i, 2i+1).

    Interleaved pairs are the convention of DeepSeek's released inference code, so weights
    from their checkpoints would load without permuting the rope channels. Each pair is
    rotated as one complex product: a quarter of the time of the four real products,
    forward and backward.
    """
    # contiguous: a complex view needs even offsets and strides, which slices at odd widths lack.
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).type_as(x)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in: autocast's when it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention by the fastest route measured on each device.

    On CPU, `blocked_attention` beats the fused kernel in fp32 and bf16 alike (model=bench:
    500 vs 531 ms per fp32 step, measured side by side); elsewhere the fused kernel.
    """
    if q.device.type == "cpu":
        return blocked_attention(q, k, v, scale)
    return padded_sdpa(q, k, v, scale)


def padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Fused SDPA, which wants one head dim for q, k and v.

    MLA's 48 vs 32 would send it to its unfused math path. Zero padding is exact: zero
    q/k columns add nothing to a score, zero v columns give zero output columns, cut off
    after.
    """
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:
        q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :v_dim]


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_rows: int = 64
) -> torch.Tensor:
    """Causal attention spelled out, `block_rows` queries at a time (see `BlockedCausalAttention`).

    64 rows measured fastest at model=bench (forward and backward alone: 13% faster than
    128-row blocks, 32 rows the same). Under autocast the matmuls run in autocast's dtype
    around an fp32 softmax, autocast's usual numerics for attention.
    """
    batch, heads = q.shape[:2]
    dtype = compute_dtype(q)
    q, k, v = (t.to(dtype).flatten(0, 1).contiguous() for t in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):
        out = BlockedCausalAttention.apply(q, k, v, scale, block_rows)
    return out.unflatten(0, (batch, heads))


def softmax_fp32(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax of x in fp32 or wider; computed over x itself when x already is.

    Taking no second buffer the size of x keeps what the CPU cache holds smaller: the
    attention scores and the loss's logits are the largest activations of a step.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    if x.dtype != dtype:
        return torch.softmax(x, dim, dtype=dtype)
    return torch.ops.aten._softmax.out(x, dim, False, out=x)


class BlockedCausalAttention(torch.autograd.Function):
    """softmax(q k^T * scale, causal) v for q, k [N, S, d_qk] and v [N, S, d_v], by query blocks.

    Block i scores only the keys up to its own last query, so the fully masked part of the
    score matrix (3/8 of it for four blocks) is never computed; the fused CPU kernel
    computes all of it at these lengths. The backward is written out so that each block's
    gradients add straight into whole q, k, v gradients, instead of autograd's zero-filled
    copy per slice and a sum over blocks (fwd+bwd ~3% faster at model=bench). It keeps what
    autograd would: the inputs and each block's fp32 probabilities.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, size: int) -> torch.Tensor:
        seq = q.shape[1]
        out, probs = [], []
        empty = q.new_empty(())
        # Row r of a block is query start + r, which may see keys 0 .. start + r: only the
        # block's diagonal square of keys start .. end needs a mask, the same for every block
        # (a short last block takes its top-left corner).
        mask = torch.full((size, size), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        for start in range(0, seq, size):
            end = min(start + size, seq)
            scores = torch.baddbmm(empty, q[:, start:end], k[:, :end].transpose(1, 2), beta=0, alpha=scale)
            scores[:, :, start:].add_(mask[: end - start, : end - start])
            p = softmax_fp32(scores, dim=-1)
            out.append(torch.bmm(p.to(v.dtype), v[:, :end]))
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale, ctx.size = scale, size
        return torch.cat(out, dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, *probs = ctx.saved_tensors
        scale, size = ctx.scale, ctx.size
        grad_q, grad_k, grad_v = [], None, None
        # Last block first: it spans every key, so its products are whole grad_k and grad_v,
        # and the earlier, shorter blocks add into their prefixes.
        for i in reversed(range(len(probs))):
            start, p = i * size, probs[i]
            end = start + p.shape[1]
            d_out, p_low = grad_out[:, start:end], p.to(v.dtype)
            # The score gradients overwrite the probability gradients' buffer.
            d_probs = torch.bmm(d_out, v[:, :end].transpose(1, 2)).to(p.dtype)
            d_scores = torch.ops.aten._softmax_backward_data.out(d_probs, p, -1, p.dtype, grad_input=d_probs)
            d_scores = d_scores.to(q.dtype)
            grad_q.append(torch.bmm(d_scores, k[:, :end]).mul_(scale))
            if grad_k is None:
                grad_v = torch.bmm(p_low.transpose(1, 2), d_out)
                grad_k = torch.bmm(d_scores.transpose(1, 2), q[:, start:end]).mul_(scale)
            else:
                grad_v[:, :end] += torch.bmm(p_low.transpose(1, 2), d_out)
                grad_k[:, :end] += torch.bmm(d_scores.transpose(1, 2), q[:, start:end]).mul_(scale)
        return torch.cat(grad_q[::-1], dim=1), grad_k, grad_v, None, None


class MultiHeadLatentAttention(nn.Module):
    """MLA: keys and values are rebuilt from a small shared latent of width kv_lora_rank.

    Only the latent (and one shared rope key) would need caching at inference, which is
    the point of MLA. Position enters through a separate, decoupled rope part of each
    query/key head, because RoPE cannot be folded through the latent up-projection.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        q_width = cfg.n_heads * self.qk_head_dim
        self.compress_q = cfg.q_lora_rank > 0
        if self.compress_q:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(
            cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.compress_q else self.wq(x)
        q = q.view(batch, seq, self.n_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)

        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        # One rope key per position, shared by every head.
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)
        kv = self.wkv_b(self.kv_norm(kv_latent))
        kv = kv.view(batch, seq, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)

        y = causal_attention(q, k, v, scale=self.qk_head_dim**-0.5)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.v_head_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def grouped_mm_supported(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` can multiply `x`'s tokens in `dtype`, here and now.

    CPU has a kernel (fp32 and bf16) from torch 2.9; CUDA takes bf16 on sm80 and newer.
    """
    if not hasattr(torch, "_grouped_mm") or TorchVersion(torch.__version__) < "2.9":
        return False
    if x.device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return False


def pad_groups(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Space expert-sorted rows x so each expert's group starts at a multiple of 64 rows.

    Returns (padded x, where each row of x went or None if unpadded, int32 group ends for
    `_grouped_mm`).
    Only for bf16 (or fp16) on CPU: those matmuls go through oneDNN, which builds and
    caches a kernel per shape; with a new row count per expert per step it rebuilt
    kernels all the time (a seventh of the bf16 step) and its caches grew by hundreds of
    MB in a few steps. Multiples of 64 leave a handful of shapes for ~6% of zero rows. The
    buffer has a fixed size, so no host sync; rows past the last end are never read. fp32
    matmuls keep no such cache, and there the zero rows would only cost time.
    """
    if x.device.type != "cpu" or x.dtype == torch.float32:
        return x, None, counts.cumsum(0, dtype=torch.int32)
    align = 64
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)
    rows = torch.arange(len(x), device=x.device) + shift.repeat_interleave(counts, output_size=len(x))
    buffer = x.new_zeros(len(x) + len(counts) * (align - 1), x.shape[-1])
    return buffer.index_copy(0, rows, x), rows, ends.to(torch.int32)


class MoE(nn.Module):
    """DeepSeekMoE: top-k of many small routed experts, plus shared experts every token uses.

    Balance comes from `expert_bias` (DeepSeek-V3's auxiliary-loss-free scheme): it is
    added to the scores only to choose experts, so it steers load without distorting
    the gate weights that mix the chosen experts' outputs. Training forwards count the
    tokens each expert received in `tokens_per_expert`; `Transformer.update_expert_bias`
    turns those counts into a bias step. (Activation checkpointing re-runs the forward
    and would count every token twice; the sign-based step does not mind.)
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_routed_experts = cfg.n_routed_experts
        self.n_activated_experts = cfg.n_activated_experts
        self.score_func = cfg.score_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.route_scale = cfg.route_scale
        self.bias_update_rate = cfg.bias_update_rate
        self.gate = nn.Linear(cfg.dim, cfg.n_routed_experts, bias=False)
        # Stacked over experts for one grouped matmul; w13 holds each expert's gate (w1)
        # and up (w3) projections as one [2 * hidden, dim] matrix, so both take one product.
        n_experts, hidden, dim = cfg.n_routed_experts, cfg.moe_ffn_dim, cfg.dim
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.shared_experts = (
            SwiGLU(cfg.dim, cfg.n_shared_experts * cfg.moe_ffn_dim)
            if cfg.n_shared_experts > 0
            else None
        )
        # fp32 so steps of ~1e-3 are not rounded away; persistent because it is model state.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer(
            "tokens_per_expert", torch.zeros(n_experts, dtype=torch.float32), persistent=False
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens x[N, dim], return (gate weights [N, k] fp32, expert indices [N, k])."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        indices = (scores + self.expert_bias).topk(self.n_activated_experts, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices

    def experts(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """Run tokens x[M, dim], sorted by expert with counts[e] rows for expert e.

        One grouped matmul per projection where `torch._grouped_mm` serves this device and
        dtype (`grouped=None` decides; tests force either path), else a loop over experts.
        `_grouped_mm` ignores autocast, so its inputs are cast to the autocast dtype here.
        """
        dtype = compute_dtype(x)
        if grouped is None:
            grouped = grouped_mm_supported(x, dtype)
        if grouped:
            x, rows, offsets = pad_groups(x.to(dtype), counts)
            w13, w2 = self.w13.to(dtype).transpose(-2, -1), self.w2.to(dtype).transpose(-2, -1)
            gate, up = torch._grouped_mm(x, w13, offs=offsets).chunk(2, dim=-1)
            out = torch._grouped_mm(F.silu(gate) * up, w2, offs=offsets)
            return out if rows is None else out.index_select(0, rows)
        # tolist() waits for the device; the grouped matmul above does not.
        out = []
        for e, tokens in enumerate(x.split(counts.tolist())):
            gate, up = (tokens @ self.w13[e].T).chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ self.w2[e].T)
        return torch.cat(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.route(x)

        # Sort the (token, slot) assignments by expert so each expert's tokens form one
        # contiguous slice: a grouped matmul (or a loop over experts, not tokens) serves them.
        expert_of_assignment = indices.flatten()
        order = expert_of_assignment.argsort(stable=True)
        token_of_assignment = order // self.n_activated_experts
        counts = torch.bincount(expert_of_assignment, minlength=self.n_routed_experts)
        if self.training:
            self.tokens_per_expert += counts
        run = self.experts
        if torch.compiler.is_compiling() and compute_dtype(x) != torch.bfloat16:
            run = partial(experts_between_graphs, self)
        expert_out = run(x.index_select(0, token_of_assignment), counts)
        expert_out = expert_out * weights.flatten()[order].unsqueeze(-1)
        # The routed outputs add into the shared experts' output in place (its matmul keeps
        # no output for backward): no zero-filled buffer and no separate sum.
        y = self.shared_experts(x).to(x.dtype) if self.shared_experts is not None else torch.zeros_like(x)
        return y.index_add_(0, token_of_assignment, expert_out.type_as(x)).view(shape)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Nudge underloaded experts up and overloaded ones down by a fixed step."""
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)


@torch.compiler.disable
def experts_between_graphs(moe: MoE, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`moe.experts` run eagerly inside a compiled block, where its dtype cannot be traced.

    `_grouped_mm`'s meta function takes only bf16, so a compiled fp32 block would otherwise
    fall back to the loop over experts; run here, between the block's graphs, the grouped
    kernel serves fp32 as in eager mode (model=bench fp32: compiled blocks had been about as
    fast as eager ones, now 3-5% faster in one process).
    """
    return moe.experts(x, counts)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, use_moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MultiHeadLatentAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(cfg) if use_moe else SwiGLU(cfg.dim, cfg.dense_ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `h @ weight.T` against targets, its gradients taken in forward.

    The loss is a scalar, so its gradients with respect to h and the weight are known as
    soon as the forward has seen a chunk: softmax minus one-hot, times the other operand.
    Taking them there, chunk by chunk, means no logits or log-probabilities are kept for
    backward (32 MiB fp32 for model=bench, far more for large vocabularies) and the
    probabilities are walked once, by one softmax. Backward only scales the gradients by the
    incoming one, which is exact for any function of the loss. Matmuls run in autocast's
    dtype, the softmax in fp32, and the weight's gradient accumulates in fp32.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        dtype = compute_dtype(h)
        weight_c = weight.to(dtype)
        with_grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if with_grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
        ignored = targets == IGNORE_INDEX
        any_ignored = bool(ignored.any())
        targets = targets.masked_fill(ignored, 0) if any_ignored else targets
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        # One logits buffer serves every chunk: a fresh one per chunk was handed back to the
        # OS and faulted in again each time (~3,000 page faults per model=bench step).
        vocab = len(weight)
        logits_buffer = torch.empty(vocab * min(chunk, len(h)), dtype=torch.float32, device=h.device)
        for start in range(0, len(h), chunk):
            h_c, t_c = h[start : start + chunk].to(dtype), targets[start : start + chunk]
            cols = torch.arange(len(t_c), device=h.device)
            # Logits transposed, [vocab, chunk]: weight @ h^T runs faster than h @ weight^T on
            # CPU (the loss alone: 1-9% faster), and the gradient matmuls take them as they lie.
            logits = logits_buffer[: vocab * len(t_c)].view(vocab, len(t_c))
            if dtype == torch.float32:
                torch.mm(weight_c, h_c.T, out=logits)
            else:
                logits.copy_(weight_c @ h_c.T)
            # -log softmax at the target is logsumexp - target logit, and
            # logsumexp = max logit - log(max probability): that probability is at least
            # 1/vocab, so unlike the target's it cannot underflow.
            losses = logits.amax(dim=0) - logits[t_c, cols]
            probs = softmax_fp32(logits, dim=0)
            losses -= probs.amax(dim=0).log()
            if any_ignored:
                losses.masked_fill_(ignored[start : start + chunk], 0)
            total += losses.sum()
            if not with_grads:
                continue
            probs[t_c, cols] -= 1
            if any_ignored:
                probs.masked_fill_(ignored[start : start + chunk], 0)
            grad_logits = probs.to(dtype)
            grad_h[start : start + chunk] = grad_logits.T @ weight_c
            if dtype == torch.float32:
                grad_weight.addmm_(grad_logits, h_c)
            else:
                grad_weight += grad_logits @ h_c
        if with_grads:
            ctx.save_for_backward(grad_h, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_weight = ctx.saved_tensors
        return grad_h * grad_loss, grad_weight * grad_loss, None, None


class Transformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab_size], or with targets the loss (see forward).

    Parameter names the trainer relies on: `tok_embeddings` (not weight-decayed) and
    `lm_head` (decayed like any matrix).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            Block(cfg, use_moe=i >= cfg.n_dense_layers) for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        # Recompute each block's activations in backward instead of keeping them (memory for time).
        self.activation_checkpointing = False
        # Recomputable from the config, so kept out of checkpoints.
        half_rope = cfg.qk_rope_head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half_rope), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half_rope), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer from the global torch RNG.

        Called by __init__; call it again after `to_empty()` on a model built on meta.
        """
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, MoE):
                nn.init.normal_(module.w13, mean=0.0, std=std)
                nn.init.normal_(module.w2, mean=0.0, std=std)
                module.expert_bias.zero_()
                module.tokens_per_expert.zero_()
        cos, sin = rope_tables(
            self.config.qk_rope_head_dim,
            self.config.max_seq_len,
            self.config.rope_theta,
            device=self.rope_cos.device,
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Logits [B, T, vocab], or with `targets` [B, T] the fp32 cross-entropy ("mean" or "sum").

        The loss goes through forward so that DDP and FSDP see it. It never builds the whole
        logits tensor: `LinearCrossEntropy` runs the lm head and the loss over chunks of
        `LOSS_CHUNK_BYTES` of logits. Targets equal to -100 are ignored, as in `F.cross_entropy`.
        """
        h = self.norm(self.trunk(idx))
        if targets is None:
            return self.lm_head(h)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
        targets = targets.flatten()
        chunk = loss_chunk_tokens(self.config.vocab_size)
        loss = LinearCrossEntropy.apply(h.flatten(0, 1), self.lm_head.weight, targets, chunk)
        if reduction == "mean":
            loss = loss / (targets != IGNORE_INDEX).sum()
        return loss

    def trunk(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> the last block's hidden states [B, T, dim] (before the final norm)."""
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={self.config.max_seq_len}"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return x

    def moe_layers(self) -> dict[int, MoE]:
        return {i: layer.ffn for i, layer in enumerate(self.layers) if isinstance(layer.ffn, MoE)}

    @torch.no_grad()
    def update_expert_bias(
        self, all_reduce: Callable[[torch.Tensor], object] | None = None
    ) -> None:
        """Apply one auxiliary-loss-free balancing step; call after each optimizer step.

        `all_reduce`, if given, must sum a tensor in place across ranks (e.g.
        `torch.distributed.all_reduce`), so every rank sees the global load and makes the
        same bias update. All layers' counts go through it as one tensor: one collective.
        """
        moes = list(self.moe_layers().values())
        if not moes:
            return
        loads = torch.stack([moe.tokens_per_expert for moe in moes])
        if all_reduce is not None:
            all_reduce(loads)
        for moe, load in zip(moes, loads):
            moe.update_bias(load)
            moe.tokens_per_expert.zero_()

    def expert_load_imbalance(self) -> dict[int, float]:
        """Max over mean tokens per expert, by layer index, since the last bias update.

        1.0 is perfect balance; n_routed_experts / n_activated_experts is total collapse.
        Read it before `update_expert_bias`, which clears the counts.
        """
        return {
            i: (moe.tokens_per_expert.max() / moe.tokens_per_expert.mean().clamp_min(1)).item()
            for i, moe in self.moe_layers().items()
        }


def count_parameters(model: Transformer) -> tuple[int, int]:
    """(total, active per token) parameter counts.

    Active counts every parameter except the routed experts a token does not visit:
    n_activated_experts of the n_routed_experts per MoE layer. Both counts include the
    embedding and the lm head; DeepSeek's published totals do too, their active counts
    leave the input embedding out. Works on meta models.
    """
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for moe in model.moe_layers().values():
        per_expert = moe.w13[0].numel() + moe.w2[0].numel()
        inactive += per_expert * (moe.n_routed_experts - moe.n_activated_experts)
    return total, total - inactive


def training_flops_per_token(model: Transformer, seq_len: int) -> float:
    """Training FLOPs per token, torchtitan's convention: 6 x matmul params + attention scores.

    The embedding is a lookup, not a matmul, so it leaves the count, unless it is tied to
    the lm head, whose matmul is real. Attention counts the full (not causal) score matrix.
    """
    cfg = model.config
    _, active = count_parameters(model)
    matmul_params = active - (0 if cfg.tie_embeddings else model.tok_embeddings.weight.numel())
    qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attention = 6 * cfg.n_layers * cfg.n_heads * (qk_dim + cfg.v_head_dim) * seq_len
    return 6 * matmul_params + attention


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample max_new_tokens after prompt_ids [1, T]; returns prompt and sample, [1, T + new].

    No KV cache: each step re-runs the model on the last max_seq_len tokens, which is
    plenty for a look at what a small model learnt. top_k None or 0 keeps every token.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    was_training = model.training
    model.eval()
    try:
        ids = prompt_ids
        for _ in range(max_new_tokens):
            logits = model(ids[:, -model.config.max_seq_len :])[:, -1, :].float() / temperature
            if top_k:
                kth_largest = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            next_id = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
    finally:
        model.train(was_training)
    return ids
