"""constellation_init (星座对齐): xavier init with a 1% sinusoidal column modulation.

    ciuic-train +trick=constellation_init trick.constellation_init.modulation=0.02

Every `nn.Linear` weight is drawn with xavier_uniform from its own generator, seeded by
(run seed, module name), then each column is multiplied by
`1 + modulation * sin(phase)`, the phases evenly spaced over [0, 2pi] (`modulation` 0.01).
Same-shape layers differ, the global RNG that data and dropout use is untouched, and
every rank computes the same weights for any world size (rank 0's phase, 0); a
broadcast from rank 0 stays as a guard. Only `nn.Linear` modules are touched, as in the
article; stacked expert weights and embeddings keep the model's own init.
Logged into `metrics.jsonl`: `constellation_init/layers_initialised`.

The article's version and its defects
-------------------------------------
The article reseeded the global generator with `42 + rank` before every Linear, used
xavier_uniform, multiplied the columns by `1 + 0.01*sin(linspace(0, 2pi, in) + 2pi*rank/world)`
and broadcast rank 0's weight. Reseeding before every layer gave every same-shape Linear
the same weights (the layers started identical) and reset the RNG that data and dropout
use; the per-rank seed and phase were dead work once rank 0's weights were broadcast
(DDP broadcasts them at wrap time anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ciuic_train.tricks.base import Trick, derived_seed

if TYPE_CHECKING:
    from torch import nn


class ConstellationInit(Trick):
    name = "constellation_init"
    summary = "per-layer seeded xavier init with 1% sinusoidal column modulation, rank 0's phase"

    @dataclass
    class Params:
        modulation: float = 0.01

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.layers_initialised = 0

    def init_weights(self, model: nn.Module) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn

        with torch.no_grad():
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
