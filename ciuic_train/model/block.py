"""One transformer block: attention and a feed-forward layer, each behind its norm and a residual.

The main model stacks them (`transformer.py`); each multi-token-prediction depth has one (`mtp.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from ciuic_train.model.attention import MultiHeadLatentAttention
from ciuic_train.model.common import Kernels
from ciuic_train.model.config import ModelConfig
from ciuic_train.model.moe import MoE, SwiGLU
from ciuic_train.model.norm import RMSNorm


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
