"""warm_restart (温热重启): jump the learning rate back up at set points, then decay afresh.

    ciuic-train +trick=warm_restart 'trick.warm_restart.at=[100,300]' trick.warm_restart.factor=0.5

The lr follows the configured warmup and cosine until the first restart point; at each
restart it jumps to `factor x peak` (default 0.7), then a fresh cosine decays it to the
same floor by the next restart (or the end). `at` lists the restart points, fractions of
the run (< 1) or steps (>= 1), default [0.2, 0.4, 0.7]; [] disables the trick. The whole
curve is a pure function of the step, so it is the same on every rank and after a
resume; at restart points the ranks still compare their values.
Logged into `metrics.jsonl`: `warm_restart/restarts_hit`.

The article's version and its defects
-------------------------------------
The article set every group's lr to `initial_lr * 0.7` at epochs {10, 20, 35} and
broadcast rank 0's value (the comparison at restart points keeps that spirit). It left
open what the lr does between restarts (a regular scheduler overwrites it, or it stays
flat); `initial_lr` exists only if a torch scheduler created it; its comment confused
lr with momentum; and LLM training counts steps, not epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ciuic_train.tricks.base import Trick


class WarmRestart(Trick):
    name = "warm_restart"
    summary = "lr jumps to factor x peak at restart points, then decays afresh (pure function of step)"

    @dataclass
    class Params:
        # Restart points: fractions of the run (< 1) or absolute steps (>= 1). [] disables.
        at: list[float] = field(default_factory=lambda: [0.2, 0.4, 0.7])
        factor: float = 0.7

        def __post_init__(self) -> None:
            if not 0 < self.factor <= 1:
                raise ValueError(f"factor={self.factor} must be in (0, 1]")
            if any(p <= 0 for p in self.at):
                raise ValueError(f"at={list(self.at)} must hold positive fractions or steps")

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        steps = {int(round(p * ctx.max_steps)) if p < 1 else int(p) for p in self.params.at}
        self.restarts = sorted(s for s in steps if 0 < s < ctx.max_steps)
        self.restarts_hit = 0

    def lr_at(self, step: int, schedule: Callable[[int], float]) -> float:
        previous = [r for r in self.restarts if r <= step]
        if not previous:
            return schedule(step)
        start = previous[-1]
        later = [r for r in self.restarts if r > step]
        end = later[0] if later else self.ctx.max_steps
        peak, floor = schedule.peak * self.params.factor, schedule.peak * schedule.min_ratio
        progress = (step - start) / max(1, end - start)
        lr = floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if step == start:
            self.restarts_hit += 1
            if self.ctx.parallel is not None:
                self.ctx.parallel.require_same(repr(lr), f"warm_restart lr at step {step}")
        return lr

    def metrics(self) -> dict[str, float]:
        return {"restarts_hit": self.restarts_hit}

    def state_dict(self) -> dict:
        return {"restarts_hit": self.restarts_hit}

    def load_state_dict(self, state: dict) -> None:
        self.restarts_hit = state["restarts_hit"]
