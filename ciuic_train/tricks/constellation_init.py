"""constellation_init (星座对齐): xavier init with a 1% sinusoidal column modulation.

The article reseeded the global generator with `42 + rank` before every Linear, used
xavier_uniform, multiplied the columns by `1 + 0.01*sin(linspace(0, 2pi, in) + 2pi*rank/world)`
and broadcast rank 0's weight. Reseeding before every layer gave every same-shape Linear
the same weights and reset the RNG that data and dropout use; the per-rank seed and phase
were dead work once rank 0's weights were broadcast. Here each Linear draws from its own
generator seeded by (run seed, module name), so same-shape layers differ and the global
RNG is untouched; the modulation uses rank 0's phase (0), so every rank computes the same
weights for any world size, and a broadcast from rank 0 stays as a guard.
Only `nn.Linear` modules are touched, as in the article; stacked expert weights and
embeddings keep the model's own init.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ciuic_train.tricks.base import Trick, derived_seed


class ConstellationInit(Trick):
    name = "constellation_init"
    summary = "per-layer seeded xavier init with 1% sinusoidal column modulation, rank 0's phase"

    @dataclass
    class Params:
        modulation: float = 0.01

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.layers_initialised = 0

    @torch.no_grad()
    def init_weights(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            generator = torch.Generator().manual_seed(derived_seed(self.ctx.seed, "constellation_init", name))
            weight = torch.empty(module.weight.shape)
            nn.init.xavier_uniform_(weight, generator=generator)
            columns = torch.linspace(0, 2 * math.pi, weight.shape[1])
            weight *= 1 + self.params.modulation * torch.sin(columns)
            module.weight.copy_(weight)
            if self.ctx.world_size > 1 and dist.is_initialized():
                dist.broadcast(module.weight.data, src=0)
            self.layers_initialised += 1

    def metrics(self) -> dict[str, float]:
        return {"layers_initialised": self.layers_initialised}
