"""time_folded_accum (时间折叠): sine-weighted gradient accumulation, one sync per step.

    ciuic-train +trick=time_folded_accum train.grad_accum=4 trick.time_folded_accum.amplitude=0.3

The micro-batches of one optimizer step get weights from the sine of their global
micro-batch index, `max(floor, 0.5 + amplitude * sin(index / period))` (defaults: period
10, amplitude 0.5, floor 0.1), normalised to sum to 1. The floor keeps every weight
positive, so no micro-batch is dropped. Gradients are reduced once per optimizer step, as
without the trick (no_sync on the other micro-batches), so replicas stay bit-identical.
With amplitude 0 the weights are equal and it is plain accumulation; with
`train.grad_accum=1` the one micro-batch has weight 1 (a warning says so).
Logged into `metrics.jsonl`: `time_folded_accum/min_weight` and
`time_folded_accum/max_weight` of the last step.

The article's version and its defects
-------------------------------------
The article registered per-parameter gradient hooks, all-reduced the gradient every
`sync_freq` calls and scaled it by `0.5 + 0.5*sin(step/10)` except on accumulation
boundaries. Its counter advanced once per parameter hook, not per step; the hook
assigned `param.grad`, which autograd then accumulated again; it all-reduced every
parameter separately, unbucketed, racing DDP's own reducer; skipping syncs let replicas
drift apart silently; and a weight could reach 0 and drop a micro-batch.
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
