"""Multi-head Latent Attention, DeepSeek-V2's attention, and the causal attention it runs.

`causal_attention` is the reference formula of `Kernels.attention`; `model/kernels/`
has the faster routes (`model.kernels=auto`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ciuic_train.model.common import Kernels, Linear
from ciuic_train.model.config import ModelConfig
from ciuic_train.model.documents import document_causal_mask
from ciuic_train.model.norm import RMSNorm
from ciuic_train.model.rope import apply_rope
from ciuic_train.model.yarn import yarn_softmax_correction


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, docs: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale, causally masked) v for q, k [B, H, T, d_qk] and v [B, H, T, d_v].

    With `docs` [B, T] (each position's document, `model/documents.py`) a query sees only
    the keys of its own document.
    """
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(docs), scale=scale)


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
            self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, kernels.linear)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, kernels.rms_norm)
            self.wq_b = Linear(cfg.q_lora_rank, q_width, kernels.linear)
        else:
            self.wq = Linear(cfg.dim, q_width, kernels.linear)
        self.wkv_a = Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, kernels.linear)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, kernels.rms_norm)
        self.wkv_b = Linear(
            cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kernels.linear
        )
        self.wo = Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, kernels.linear)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: torch.Tensor | None = None
    ) -> torch.Tensor:
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

        y = self.attention(q, k, v, self.softmax_scale, docs)  # [B, H, T, d_v]
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.v_head_dim))
