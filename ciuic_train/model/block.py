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


class LayerStack(nn.ModuleDict):
    """The main model's blocks by layer index, named `layers.<i>` as an `nn.ModuleList` would
    name them, indexed and iterated like one. A pipeline stage keeps only its own layers
    (`keep`) under the same names, so checkpoints read alike whatever the split."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__({str(i): block for i, block in blocks.items()})

    def __getitem__(self, index: int) -> nn.Module:
        return super().__getitem__(str(index))

    def __iter__(self):
        return iter(self.values())

    def indexed(self) -> list[tuple[int, nn.Module]]:
        """(layer index, block) of each block held, in order."""
        return [(int(key), block) for key, block in self.items()]

    def keep(self, indices: list[int]) -> None:
        """Drop every block whose layer index is not in `indices`."""
        for key in [key for key in self.keys() if int(key) not in indices]:
            del self[key]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, use_moe: bool, kernels: Kernels):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        self.attn = MultiHeadLatentAttention(cfg, kernels)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels.rms_norm)
        self.ffn = MoE(cfg, kernels) if use_moe else SwiGLU(cfg.dim, cfg.dense_ffn_dim, kernels.linear)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, docs=docs)
        return x + self.ffn(self.ffn_norm(x))
