"""constellation_init (星座对齐): xavier init with a 1% sinusoidal column modulation.

    ciuic-train +trick=constellation_init trick.constellation_init.modulation=0.02

Every `nn.Linear` weight is drawn from xavier's uniform distribution, U(-a, a) with
a = sqrt(6 / (fan_in + fan_out)), from generators of its own, seeded by (run seed, module
name), then each column is multiplied by `1 + modulation * sin(phase)`, the phases evenly
spaced over [0, 2pi] (`modulation` 0.01). Same-shape layers differ, the global RNG that
data and dropout use is untouched, and every rank computes the same weights for any world
size and layout (rank 0's phase, 0). It works on shards: the values are drawn by blocks
of rows (`ParameterInit.fill_`, ciuic_train/model/init.py), and a row's modulation
depends on its columns only, which every shard holds whole; so under FSDP each rank
draws only its own rows, and no broadcast is needed. Only `nn.Linear` modules are
touched, as in the article; stacked expert weights and embeddings keep the model's own init.
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

from ciuic_train.tricks.base import Trick

if TYPE_CHECKING:
    from torch import nn

    from ciuic_train.model.init import ParameterInit


class ConstellationInit(Trick):
    name = "constellation_init"
    summary = "per-layer seeded xavier init with 1% sinusoidal column modulation, rank 0's phase"

    @dataclass
    class Params:
        modulation: float = 0.01

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.layers_initialised = 0

    def init_weights(self, model: nn.Module, init: ParameterInit) -> None:
        import torch
        from torch import nn

        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            fan_out, fan_in = module.weight.shape  # global, also for a shard
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            modulation = 1 + self.params.modulation * torch.sin(torch.linspace(0, 2 * math.pi, fan_in))

            def draw(block: torch.Tensor, generator: torch.Generator, modulation=modulation, bound=bound) -> None:
                block.uniform_(-bound, bound, generator=generator).mul_(modulation.to(block.device))

            init.fill_(f"constellation_init:{name}", module.weight, draw)
            self.layers_initialised += 1

    def metrics(self) -> dict[str, float]:
        return {"layers_initialised": self.layers_initialised}
