"""time_folded_accum (时间折叠): sine-weighted gradient accumulation, one sync per step.

The article's per-parameter hooks counted calls per parameter rather than per step,
assigned `param.grad` (which autograd then accumulated again), all-reduced every
parameter separately beside DDP's own reducer, let replicas drift when they skipped a
sync, and could weight a micro-batch by 0. Here the micro-batches of one optimizer step
get weights from the sine of their global micro-batch index,
`max(floor, 0.5 + amplitude * sin(index / period))`, normalised to sum to 1; the
trainer reduces gradients once per optimizer step (no_sync on the other micro-batches),
so replicas stay bit-identical. With amplitude 0 the weights are equal and it is plain
accumulation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ciuic_train.tricks.base import Trick

log = logging.getLogger("ciuic_train")


class TimeFoldedAccum(Trick):
    name = "time_folded_accum"
    summary = "micro-batch weights from the sine of the global micro-batch index, normalised"

    @dataclass
    class Params:
        period: float = 10.0
        amplitude: float = 0.5
        # Lowest raw weight: no micro-batch is ever dropped.
        floor: float = 0.1

        def __post_init__(self) -> None:
            if self.floor <= 0:
                raise ValueError(f"floor={self.floor} must be positive so no micro-batch is dropped")
            if self.period <= 0:
                raise ValueError(f"period={self.period} must be positive")

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.last_weights: list[float] = []
        if ctx.grad_accum == 1:
            log.warning(
                "trick time_folded_accum: train.grad_accum=1, one micro-batch per step has weight 1"
            )

    def micro_batch_weights(self, step: int, n_micro: int) -> list[float]:
        p = self.params
        raw = [
            max(p.floor, 0.5 + p.amplitude * math.sin((step * n_micro + i) / p.period)) for i in range(n_micro)
        ]
        total = sum(raw)
        self.last_weights = [w / total for w in raw]
        return self.last_weights

    def metrics(self) -> dict[str, float]:
        return {"min_weight": min(self.last_weights, default=1.0), "max_weight": max(self.last_weights, default=1.0)}
