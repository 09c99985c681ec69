"""Multi-token prediction: DeepSeek-V3's extra depths that each predict one token further ahead."""

from __future__ import annotations

import torch
from torch import nn

from ciuic_train.model.block import Block
from ciuic_train.model.common import Kernels, Linear
from ciuic_train.model.config import ModelConfig
from ciuic_train.model.norm import RMSNorm


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
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, kernels.linear)
        # MoE like the main model's later layers (V3's MTP block is an MoE layer).
        self.block = Block(cfg, use_moe=cfg.n_dense_layers < cfg.n_layers, kernels=kernels)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)

    def forward(
        self, h: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        docs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T', dim] of the previous depth and the embeddings of the tokens k ahead [B, T', dim]
        -> this depth's hidden states for the next depth, and normalised for the head (both [B, T', dim]).

        Both come out of one call so that FSDP, which gathers a depth's weights for its
        forward only, finds `norm`'s gathered too.
        """
        joined = torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)
        h = self.block(self.eh_proj(joined), cos, sin, docs=docs)
        return h, self.norm(h)
