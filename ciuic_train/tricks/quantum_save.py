"""quantum_save (量子纠缠): save at a random subset of checkpoint candidates, with a bound.

    ciuic-train +trick=quantum_save trick.quantum_save.p=0.2 trick.quantum_save.max_skips=5 ckpt.every=50

Each checkpoint candidate (every `ckpt.every` steps) saves with probability `p` (default
0.3; 1 is the default every-N policy): one decision drawn from the run seed and the
candidate's index, so every rank makes the same one (checked) and a resumed run makes the
same ones. A save is forced after `max_skips` (3) skipped candidates, which bounds the
gap between checkpoints; the end of the run and SIGTERM always save. Saving goes through
the normal atomic, resumable checkpoint.
Logged into `metrics.jsonl`: `quantum_save/candidates`, `quantum_save/saves` and
`quantum_save/longest_gap` (the most candidates skipped in a row).

The article's version and its defects
-------------------------------------
The article had every rank draw `random() < 0.3`, all-reduce with MAX and, if any rank
drew true, had every rank torch.save its own state_dict while rank 0 "consolidated".
With MAX the save rate is `1 - 0.7^N` (94% on 8 ranks), so its "80% fewer saves" cannot
hold; with probability `0.7^N` nobody saves, and nothing bounds the gap; N replicas of a
DDP model are N copies of one state; there was no optimizer state, so the run could not
resume; a crash mid-write left a corrupt file; and the draw was unseeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ciuic_train.tricks.base import Trick, derived_seed


class QuantumSave(Trick):
    name = "quantum_save"
    summary = "each checkpoint candidate saves with probability p (seeded, agreed), forced after max_skips skips"

    @dataclass
    class Params:
        p: float = 0.3
        max_skips: int = 3

        def __post_init__(self) -> None:
            if not 0 <= self.p <= 1:
                raise ValueError(f"p={self.p} must be between 0 and 1")
            if self.max_skips < 0:
                raise ValueError(f"max_skips={self.max_skips} must be 0 or more")

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.candidates = 0
        self.saves = 0
        self.skipped = 0
        self.longest_gap = 0

    def should_save(self, step: int, every: int) -> bool:
        if every <= 0 or step % every:
            return False
        candidate = step // every
        draw = random.Random(derived_seed(self.ctx.seed, "quantum_save", candidate)).random()
        save = draw < self.params.p or self.skipped >= self.params.max_skips
        if self.ctx.parallel is not None:
            self.ctx.parallel.require_same(str(save), f"quantum_save decision at step {step}")
        self.candidates += 1
        if save:
            self.saves += 1
            self.skipped = 0
        else:
            self.skipped += 1
            self.longest_gap = max(self.longest_gap, self.skipped)
        return save

    def metrics(self) -> dict[str, float]:
        return {"candidates": self.candidates, "saves": self.saves, "longest_gap": self.longest_gap}

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("candidates", "saves", "skipped", "longest_gap")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
