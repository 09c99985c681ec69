"""A DeepSeek-V2/V3 style decoder: Multi-head Latent Attention plus DeepSeekMoE, in plain PyTorch.

Read top to bottom: RMSNorm, RoPE, causal attention and MLA, the dense SwiGLU, the MoE
(routing, then the routed experts as one grouped matmul per projection), the block,
multi-token prediction, the loss and the model, then parameter and FLOP counting and
sampling.

Most of a training step's time goes to four computations: the norms, the attention, the
routed experts and the loss. Each is one plain function here (`rms_norm`,
`causal_attention`, `grouped_swiglu`, `lm_cross_entropy`), gathered in `REFERENCE`.
`model.kernels=auto` (the default) swaps in the fast versions from
`ciuic_train/model/kernels/` where they serve the device; `model.kernels=reference` runs
these formulas everywhere. Tests hold the two to the same results, forward and gradients.

Weight decay rule for the trainer: decay parameters with ndim >= 2 except
`tok_embeddings.weight`. That excludes norms and keeps matrices, including the stacked
expert weights and `lm_head.weight`.

Building on meta works: `with torch.device("meta"): model = Transformer(cfg)` allocates
nothing; after `model.to_empty(device=...)` call `model.init_weights()` to fill in real
parameters and buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from ciuic_train.model.config import ModelConfig

IGNORE_INDEX = -100  # targets with this value add nothing to the loss, as in F.cross_entropy


@dataclass(frozen=True)
class Kernels:
    """The functions a model computes its four costliest parts with (see the module docstring)."""

    rms_norm: Callable  # (x, weight, eps) -> x normalised
    attention: Callable  # (q, k, v, scale) -> causal attention
    routed_experts: Callable  # (expert-sorted x, counts per expert, w13, w2) -> SwiGLU per expert
    loss: Callable  # (h [N, dim], lm head weight, targets [N], reduction) -> fp32 cross-entropy


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in: autocast's when it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


# --- RMSNorm ------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32 or wider, returned in x's dtype."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class RMSNorm(nn.Module):
    """Normalised in fp32 so bf16 activations don't lose the mean square."""

    def __init__(self, dim: int, eps: float, kernel: Callable = rms_norm):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


# --- RoPE ---------------------------------------------------------------------------------


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None, cfg: ModelConfig | None = None):
    """cos/sin of shape [max_seq_len, head_dim // 2], one angle per rotated pair.

    Plain RoPE, unless `cfg` is given with rope_scaling yarn: then YaRN's frequencies
    (`yarn_frequencies`), and both tables scaled by its magnitude (`yarn_rope_magnitude`).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)  # [d/2]
    yarn = cfg is not None and cfg.rope_scaling == "yarn"
    if yarn:
        inv_freq = yarn_frequencies(inv_freq, head_dim, theta, cfg)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    if not yarn:
        return angles.cos(), angles.sin()
    magnitude = yarn_rope_magnitude(cfg)
    return angles.cos() * magnitude, angles.sin() * magnitude


def yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, cfg: ModelConfig) -> torch.Tensor:
    """YaRN's rotation speeds: slow pairs interpolated, fast pairs kept, a ramp between.

    Pair i turns original_max_seq_len * inv_freq[i] / 2pi times over the pre-training
    length. A pair that turns many times (more than beta_fast) has seen every angle in
    pre-training and keeps its speed; one that turns few times (fewer than beta_slow) would
    meet unseen angles at longer positions, so it is slowed by `factor` (interpolated).
    Between them the two speeds mix linearly in the pair index. Solving for the index at
    which a pair turns r times gives head_dim * ln(L / (2pi r)) / (2 ln theta); the ramp's
    ends are those indices rounded outwards and clamped to [0, head_dim - 1] (head_dim, not
    head_dim / 2: the bound of DeepSeek's and transformers' code, kept for the same tables).
    """

    def index_turning(rotations: float) -> float:
        # The index i whose speed theta^(-2i/d) is rotations * 2pi / L radians per position.
        log_inverse_speed = math.log(cfg.rope_original_max_seq_len / (rotations * 2 * math.pi))
        return head_dim * log_inverse_speed / (2 * math.log(theta))

    low = max(math.floor(index_turning(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(index_turning(cfg.rope_beta_slow)), head_dim - 1)
    if high == low:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    pair = torch.arange(head_dim // 2, device=inv_freq.device, dtype=torch.float32)
    interpolate = ((pair - low) / (high - low)).clamp(0, 1)  # [d/2]: 0 keeps a pair's speed, 1 slows it
    return inv_freq / cfg.rope_factor * interpolate + inv_freq * (1 - interpolate)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 ln(factor) + 1, with DeepSeek's weight on the log."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_rope_magnitude(cfg: ModelConfig) -> float:
    """What YaRN multiplies the rotated channels (cos and sin) by.

    The paper scales q and k, here only their rope parts, by yarn_mscale(factor). DeepSeek
    moved that scaling to the softmax scale, where it reaches every channel
    (`yarn_softmax_correction`), and left here only the ratio of the two weights: 1 in
    their configs, where rope_mscale equals rope_mscale_all_dim. (Where one weight is 0,
    transformers takes yarn_mscale(factor) instead of the ratio; DeepSeek's code takes the ratio.)
    """
    factor = cfg.rope_factor
    return yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)


def yarn_softmax_correction(cfg: ModelConfig) -> float:
    """The factor on the attention softmax scale: yarn_mscale(factor, mscale_all_dim)^2 under yarn, else 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    return yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[..., T, d] by position, pairing adjacent channels (2i, 2i+1).

    Interleaved pairs are the convention of DeepSeek's released inference code, so weights
    from their checkpoints load without permuting the rope channels. Each pair (a, b) is
    the complex number a + ib, turned by multiplying with cos + i sin.
    """
    # contiguous: a complex view needs even offsets and strides, which slices at odd widths lack.
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))  # [..., T, d/2]
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).type_as(x)


# --- Multi-head latent attention ----------------------------------------------------------


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, causally masked) v for q, k [B, H, T, d_qk] and v [B, H, T, d_v]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class MultiHeadLatentAttention(nn.Module):
    """MLA: keys and values are rebuilt from a small shared latent of width kv_lora_rank.

    Only the latent (and one shared rope key) would need caching at inference, which is
    the point of MLA. Position enters through a separate, decoupled rope part of each
    query/key head, because RoPE cannot be folded through the latent up-projection.
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.attention = kernels.attention
        self.softmax_scale = self.qk_head_dim**-0.5 * yarn_softmax_correction(cfg)
        q_width = cfg.n_heads * self.qk_head_dim
        self.compress_q = cfg.q_lora_rank > 0
        if self.compress_q:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, kernels.rms_norm)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, kernels.rms_norm)
        self.wkv_b = nn.Linear(
            cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # x: [B, T, dim]
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.compress_q else self.wq(x)
        q = q.view(batch, seq, self.n_heads, self.qk_head_dim).transpose(1, 2)  # [B, H, T, d_qk]
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)

        # The latent [B, T, kv_lora_rank] and one rope key per position [B, T, d_rope].
        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)  # [B, 1, T, d_rope], shared by every head
        kv = self.wkv_b(self.kv_norm(kv_latent))
        kv = kv.view(batch, seq, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)  # [B, H, T, d_qk]

        y = self.attention(q, k, v, self.softmax_scale)  # [B, H, T, d_v]
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.v_head_dim))


# --- Feed-forward: dense SwiGLU and DeepSeekMoE -------------------------------------------


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


def swiglu_grouped_mm(x: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Group g of x's rows (ends[g-1]:ends[g], int32 ends) through expert g's SwiGLU.

    x [M, dim], w13 [E, 2 * hidden, dim], w2 [E, dim, hidden] -> [M, dim]; one grouped
    matmul per projection.
    """
    gate, up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=ends).chunk(2, dim=-1)  # [M, hidden] each
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=ends)


def swiglu_per_expert(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same as `swiglu_grouped_mm`, one expert at a time, for counts[e] rows of expert e."""
    out = []
    for e, rows in enumerate(x.split(counts.tolist())):  # tolist() waits for the device
        gate, up = (rows @ w13[e].T).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ w2[e].T)
    return torch.cat(out)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Each routed expert's SwiGLU over its rows of expert-sorted tokens x [M, dim].

    Expert e takes counts[e] consecutive rows. One grouped matmul per projection where
    `torch._grouped_mm` serves this device and dtype, else a loop over experts (not tokens).
    `_grouped_mm` ignores autocast, so its operands are cast to autocast's dtype here.
    """
    dtype = compute_dtype(x)
    if not grouped_mm_supported(x, dtype):
        return swiglu_per_expert(x, counts, w13, w2)
    ends = counts.cumsum(0, dtype=torch.int32)
    return swiglu_grouped_mm(x.to(dtype), ends, w13.to(dtype), w2.to(dtype))


class MoE(nn.Module):
    """DeepSeekMoE: top-k of many small routed experts, plus shared experts every token uses.

    Balance comes from `expert_bias` (DeepSeek-V3's auxiliary-loss-free scheme): it is
    added to the scores only to choose experts, so it steers load without distorting
    the gate weights that mix the chosen experts' outputs. Training forwards count the
    tokens each expert received in `tokens_per_expert`; `Transformer.balance_experts`
    turns those counts into a bias step. (Activation checkpointing re-runs the forward
    and counts every token twice; neither the sign-based step nor the imbalance ratio
    minds.) DeepSeek-V2's auxiliary balance losses are there too, off by default
    (`balance_losses`).
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.n_routed_experts = cfg.n_routed_experts
        self.n_activated_experts = cfg.n_activated_experts
        self.n_expert_groups = cfg.n_expert_groups
        self.n_limited_groups = cfg.n_limited_groups
        self.score_func = cfg.score_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.route_scale = cfg.route_scale
        self.bias_update_rate = cfg.bias_update_rate
        self.aux_loss_alpha = cfg.aux_loss_alpha
        self.seq_aux_loss_alpha = cfg.seq_aux_loss_alpha
        # The weighted balance losses of the last training forward ({} when both are off).
        self.balance_loss: dict[str, torch.Tensor] = {}
        self.routed_experts = kernels.routed_experts
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

    def affinities(self, x: torch.Tensor) -> torch.Tensor:
        """Token-to-expert scores [N, E] (fp32) of tokens x [N, dim]."""
        logits = self.gate(x).float()
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens x[N, dim], return (gate weights [N, k] fp32, expert indices [N, k])."""
        return self.choose(self.affinities(x))

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each token (biased scores choose) and their gate weights."""
        choice = scores + self.expert_bias
        if self.n_expert_groups > 1:
            # Group-limited routing, as DeepSeek-V3 (and transformers' DeepseekV3TopkRouter):
            # a group scores the sum of its top-2 choice scores, and the top-k experts come
            # only from the n_limited_groups best groups. The others are masked to -inf, not
            # 0, so that a negative biased score in a kept group still beats them.
            grouped = choice.view(-1, self.n_expert_groups, self.n_routed_experts // self.n_expert_groups)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [N, G]
            kept = group_scores.topk(self.n_limited_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        indices = choice.topk(self.n_activated_experts, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices

    def balance_losses(self, scores: torch.Tensor, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weighted balance losses of one forward: scores [B, T, E], indices [B, T, k].

        Each is sum_i f_i * P_i: f_i, expert i's share of the chosen slots times E (1 for
        every expert at perfect balance, no gradient), P_i its mean affinity, normalized per
        token (the gradient: it lowers the affinity of overloaded experts). 1 at perfect
        balance, E / k when k experts take every token.
        """
        n_experts, k = scores.shape[-1], indices.shape[-1]
        chosen = torch.zeros_like(scores).scatter_(-1, indices, 1.0)  # [B, T, E]
        share = scores / scores.sum(dim=-1, keepdim=True)
        losses = {}
        if self.aux_loss_alpha:  # over every token of the micro-batch
            f = chosen.mean(dim=(0, 1)) * n_experts / k  # [E]
            losses["aux_loss"] = self.aux_loss_alpha * (f * share.mean(dim=(0, 1))).sum()
        if self.seq_aux_loss_alpha:  # within each sequence, then averaged
            f = chosen.mean(dim=1) * n_experts / k  # [B, E]
            losses["seq_aux_loss"] = self.seq_aux_loss_alpha * (f * share.mean(dim=1)).sum(dim=-1).mean()
        return losses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, dim]
        scores = self.affinities(x)  # [N, E]
        weights, indices = self.choose(scores)  # [N, k] each
        if self.training and (self.aux_loss_alpha or self.seq_aux_loss_alpha):
            self.balance_loss = self.balance_losses(scores.view(*shape[:-1], -1), indices.view(*shape[:-1], -1))

        # Sort the N * k (token, expert) assignments by expert, so each expert's tokens form
        # one contiguous slice for the grouped matmul.
        expert_of_assignment = indices.flatten()
        order = expert_of_assignment.argsort(stable=True)
        token_of_assignment = order // self.n_activated_experts  # [N * k]
        counts = torch.bincount(expert_of_assignment, minlength=self.n_routed_experts)  # [E]
        if self.training:
            self.tokens_per_expert += counts
        routed = self.routed_experts(x.index_select(0, token_of_assignment), counts, self.w13, self.w2)
        routed = routed * weights.flatten()[order].unsqueeze(-1)  # [N * k, dim]
        # The routed outputs add into the shared experts' output in place.
        y = self.shared_experts(x).to(x.dtype) if self.shared_experts is not None else torch.zeros_like(x)
        return y.index_add_(0, token_of_assignment, routed.type_as(x)).view(shape)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Nudge underloaded experts up and overloaded ones down by a fixed step."""
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, use_moe: bool, kernels: Kernels):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        self.attn = MultiHeadLatentAttention(cfg, kernels)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        self.ffn = MoE(cfg, kernels) if use_moe else SwiGLU(cfg.dim, cfg.dense_ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


# --- Multi-token prediction ---------------------------------------------------------------


class MultiTokenPrediction(nn.Module):
    """One depth of DeepSeek-V3's multi-token prediction (report section 2.2, arXiv:2412.19437).

    Depth k predicts the token k + 1 ahead: at position i it joins the previous depth's
    hidden state h_i (RMSNorm) with the embedding of token i + k (RMSNorm), projects the
    pair 2 dim -> dim, runs one transformer block, and hands the result to the main
    model's output head through its own final norm. The embedding and the head are the
    main model's (shared, not copied). Names follow DeepSeek's released checkpoints
    (enorm, hnorm, eh_proj; `norm` is their shared_head.norm), and so does the order of
    the pair, embedding first, so released MTP weights mean the same here.
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        # MoE like the main model's later layers (V3's MTP block is an MoE layer).
        self.block = Block(cfg, use_moe=cfg.n_dense_layers < cfg.n_layers, kernels=kernels)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)

    def forward(
        self, h: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T', dim] of the previous depth and the embeddings of the tokens k ahead [B, T', dim]
        -> this depth's hidden states for the next depth, and normalised for the head (both [B, T', dim]).

        Both come out of one call so that FSDP, which gathers a depth's weights for its
        forward only, finds `norm`'s gathered too.
        """
        joined = torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)
        h = self.block(self.eh_proj(joined), cos, sin)
        return h, self.norm(h)


# --- The loss and the model ---------------------------------------------------------------


def lm_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Cross-entropy, in fp32, of the logits h @ weight^T [N, vocab] against targets [N]."""
    return F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


REFERENCE = Kernels(rms_norm, causal_attention, grouped_swiglu, lm_cross_entropy)


def kernels_for(choice: str) -> Kernels:
    """`reference`: the formulas of this file; `auto`: the fast paths of model/kernels/."""
    if choice == "reference":
        return REFERENCE
    from ciuic_train.model.kernels import AUTO  # built on this file's functions, hence imported late

    return AUTO


class Transformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab_size], or with targets the loss (see forward).

    Parameter names the trainer relies on: `tok_embeddings` (not weight-decayed) and
    `lm_head` (decayed like any matrix). `mtp` holds the multi-token-prediction depths
    (`model.n_mtp_layers`, none by default); only training forwards run them.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.kernels = kernels_for(cfg.kernels)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            Block(cfg, use_moe=i >= cfg.n_dense_layers, kernels=self.kernels) for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.kernels.rms_norm)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        # Built without drawing from the global RNG and registered last (init_weights goes in
        # registration order), so turning MTP on leaves the main model's first weights as they were.
        with torch.random.fork_rng(devices=[]):
            self.mtp = nn.ModuleList(MultiTokenPrediction(cfg, self.kernels) for _ in range(cfg.n_mtp_layers))
        # The mean MTP loss of the last training forward that ran them (`loss_figures`).
        self.mtp_loss: torch.Tensor | None = None
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
            cfg=self.config,
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        reduction: str = "mean",
        mtp_loss_weight: float = 0.0,
    ) -> torch.Tensor:
        """Logits [B, T, vocab], or with `targets` [B, T] the fp32 cross-entropy ("mean" or "sum").

        The loss goes through forward so that DDP and FSDP see it. Targets equal to
        `IGNORE_INDEX` (-100) are ignored, as in `F.cross_entropy`. In training, the
        balance losses and, with MTP depths and `mtp_loss_weight` > 0, that weight times the
        mean MTP loss join the gradient; the value returned stays the next-token loss, so it
        compares across runs with and without them (`loss_figures` gives the others).
        """
        h = self.norm(self.trunk(idx))  # [B, T, dim]
        if targets is None:
            return self.lm_head(h)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
        loss = self.kernels.loss(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), reduction)
        if not self.training:
            return loss
        extra = [term for moe in self.moe_layers(mtp=False).values() for term in moe.balance_loss.values()]
        if self.mtp and mtp_loss_weight:
            self.mtp_loss = self.multi_token_loss(h, idx, targets, reduction)
            extra.append(mtp_loss_weight * self.mtp_loss)
            extra += [term for moe in self.mtp_moe_layers() for term in moe.balance_loss.values()]
        if extra:
            total = torch.stack(extra).sum()
            loss = loss + (total - total.detach())  # adds their gradient, and exactly 0
        return loss

    def multi_token_loss(
        self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, reduction: str
    ) -> torch.Tensor:
        """The mean over MTP depths of each depth's loss, from the main model's output h [B, T, dim].

        Depth k sees positions 0 .. T-k-1 (a position needs the token k ahead as input and
        the one k+1 ahead as target): h of the previous depth there (the main model's
        normalised output for k = 1, as inference engines feed DeepSeek's MTP weights),
        the tokens idx[:, k:], the targets targets[:, k:].
        """
        seq = idx.shape[1]
        losses = []
        for k, depth in enumerate(self.mtp, start=1):
            cos, sin = self.rope_cos[: seq - k], self.rope_sin[: seq - k]
            h, normed = depth(h[:, : seq - k], self.tok_embeddings(idx[:, k:]), cos, sin)
            losses.append(self.kernels.loss(normed.flatten(0, 1), self.lm_head.weight, targets[:, k:].flatten(), reduction))
        return torch.stack(losses).mean()

    def loss_figures(self) -> dict[str, float]:
        """The last training forward's side losses: the weighted balance losses summed over MoE
        layers (`aux_loss`, `seq_aux_loss`) and the mean MTP loss (`mtp_loss`), where on."""
        terms: dict[str, list[torch.Tensor]] = {}
        for moe in self.moe_layers().values():
            for name, value in moe.balance_loss.items():
                terms.setdefault(name, []).append(value.detach())
        if self.mtp_loss is not None:
            terms["mtp_loss"] = [self.mtp_loss.detach()]
        if not terms:
            return {}
        totals = torch.stack([torch.stack(values).sum() for values in terms.values()]).tolist()  # one sync
        return dict(zip(terms, totals))

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
            x = layer(x, cos, sin)
        return x

    def blocks(self) -> list[Block]:
        """Every transformer block: the main model's, then those of the MTP depths."""
        return [*self.layers, *(depth.block for depth in self.mtp)]

    def moe_layers(self, mtp: bool = True) -> dict[int, MoE]:
        """The MoE layers by layer index; MTP depth j counts as layer n_layers + j, as in
        DeepSeek's checkpoints (`mtp=False`: the main model's only)."""
        blocks = self.blocks() if mtp else self.layers
        return {i: block.ffn for i, block in enumerate(blocks) if isinstance(block.ffn, MoE)}

    def mtp_moe_layers(self) -> list[MoE]:
        return [depth.block.ffn for depth in self.mtp if isinstance(depth.block.ffn, MoE)]

    @torch.no_grad()
    def balance_experts(self, all_reduce: Callable[[torch.Tensor], object] | None = None) -> float:
        """One auxiliary-loss-free balancing step from the tokens counted since the last call.

        Call after each optimizer step. `all_reduce`, if given, must sum a tensor in place
        across ranks (e.g. `torch.distributed.all_reduce`), so every rank sees the global
        load and makes the same bias update; all layers' counts go through it as one
        tensor. Returns the worst layer's load imbalance, max over mean tokens per expert
        (1.0 is perfect balance; n_routed_experts / n_activated_experts is total collapse).
        """
        moes = list(self.moe_layers().values())
        if not moes:
            return 1.0
        loads = torch.stack([moe.tokens_per_expert for moe in moes])  # [MoE layers, E]
        if all_reduce is not None:
            all_reduce(loads)
        imbalance = (loads.amax(dim=1) / loads.mean(dim=1).clamp_min(1)).max().item()
        for moe, load in zip(moes, loads):
            moe.update_bias(load)
            moe.tokens_per_expert.zero_()
        return imbalance

    def forget_expert_counts(self) -> None:
        """Drop the counts of a step that is not applied, instead of `balance_experts`."""
        for moe in self.moe_layers().values():
            moe.tokens_per_expert.zero_()


def count_parameters(model: Transformer) -> tuple[int, int]:
    """(total, active per token) parameter counts of the main model.

    Active counts every parameter except the routed experts a token does not visit:
    n_activated_experts of the n_routed_experts per MoE layer. Both counts include the
    embedding and the lm head; DeepSeek's published totals do too, their active counts
    leave the input embedding out. MTP depths are left out, as DeepSeek's 671B leaves them
    out: `count_mtp_parameters` counts them. Works on meta models.
    """
    mtp = {id(p) for p in model.mtp.parameters()}
    total = sum(p.numel() for p in model.parameters() if id(p) not in mtp)
    return total, total - _inactive_expert_parameters(model.moe_layers(mtp=False).values())


def count_mtp_parameters(model: Transformer) -> tuple[int, int]:
    """(total, active per token) of the MTP depths' own parameters; the embedding and the
    head they share with the main model are counted there (DeepSeek's 14B for V3's MTP
    module counts its copies of both)."""
    total = sum(p.numel() for p in model.mtp.parameters())
    return total, total - _inactive_expert_parameters(model.mtp_moe_layers())


def _inactive_expert_parameters(moes) -> int:
    """The routed-expert parameters a token does not visit, over `moes`."""
    inactive = 0
    for moe in moes:
        per_expert = moe.w13.shape[1:].numel() + moe.w2.shape[1:].numel()
        inactive += per_expert * (moe.n_routed_experts - moe.n_activated_experts)
    return inactive


def training_flops_per_token(model: Transformer, seq_len: int) -> float:
    """Training FLOPs per token, torchtitan's convention: 6 x matmul params + attention scores.

    The embedding is a lookup, not a matmul, so it leaves the count, unless it is tied to
    the lm head, whose matmul is real. Attention counts the full (not causal) score matrix.
    Each MTP depth adds its own matmuls, one more pass through the shared head, and one
    block's attention (counted over the whole sequence; it runs on seq_len - k positions).
    """
    cfg = model.config
    _, active = count_parameters(model)
    _, mtp_active = count_mtp_parameters(model)
    matmul_params = active - (0 if cfg.tie_embeddings else model.tok_embeddings.weight.numel())
    matmul_params += mtp_active + cfg.n_mtp_layers * model.lm_head.weight.numel()
    qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attention = 6 * (cfg.n_layers + cfg.n_mtp_layers) * cfg.n_heads * (qk_dim + cfg.v_head_dim) * seq_len
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
