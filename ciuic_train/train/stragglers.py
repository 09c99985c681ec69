"""Which rank is slow: each rank's own time in a step, shared on logging steps.

In a synchronous step every rank ends together, so the wall time of a step says nothing
about who held it up. What differs is the time a rank spends before it reaches the
step's agreement (`LossWatch.agree`), where the faster ranks then wait for it: `busy_s`,
from the step's start to there, and of it `data_s`, the time spent fetching its batches.
On a step that logs, a CUDA rank waits for its GPU before reading the clock, so busy_s
holds its device work too (one more sync, on logging steps only).

A rank slowed before a collective inside the step (its data, under DDP; under FSDP, any
block's gather) makes the others wait inside that collective, which then counts as their
busy time too; data_s still names the rank whose data was slow.

On each logging step the ranks exchange both figures in one small collective;
metrics.jsonl gets the fastest and slowest rank's busy_s, the slowest rank and the
largest data_s, and a warning names a rank (and its host) whose busy_s exceeded
`train.straggler_factor` x the median of the other ranks' on `train.straggler_windows`
logging steps in a row.
"""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ciuic_train.config import TrainConfig

log = logging.getLogger("ciuic_train")


class StepTimes:
    def __init__(self, train: TrainConfig, parallel):
        self.parallel = parallel
        self.factor = train.straggler_factor
        self.windows = train.straggler_windows
        self.busy_s = self.data_s = 0.0
        self._started = 0.0
        self._streak_rank, self._streak = -1, 0

    def start(self) -> None:
        self._started, self.data_s = time.perf_counter(), 0.0

    @contextmanager
    def fetching_data(self) -> Iterator[None]:
        began = time.perf_counter()
        yield
        self.data_s += time.perf_counter() - began

    def reached_agreement(self, exact: bool) -> None:
        """`exact`: this step logs; a GPU's queued work is waited for first."""
        if exact and self.parallel.device.type == "cuda":
            torch.cuda.synchronize(self.parallel.device)
        self.busy_s = time.perf_counter() - self._started

    def share(self) -> dict[str, Any]:
        """Every rank, on logging steps: the last step's figures of all ranks (one
        collective), for metrics.jsonl; warns about a straggler."""
        world = self.parallel.world_size
        if world == 1:
            return {}
        rank = self.parallel.info.rank
        figures = torch.zeros(2 * world, dtype=torch.float64, device=self.parallel.device)
        figures[2 * rank], figures[2 * rank + 1] = self.busy_s, self.data_s
        figures = self.parallel.all_reduce_sum_(figures).tolist()
        busy, data = figures[0::2], figures[1::2]
        slowest = max(range(world), key=busy.__getitem__)
        self.watch(slowest, busy, data)
        return {"step_s_min": min(busy), "step_s_max": busy[slowest], "slowest_rank": slowest, "data_s_max": max(data)}

    def watch(self, slowest: int, busy: list[float], data: list[float]) -> None:
        """The straggler rule on one logging step's figures of every rank (rank 0 warns)."""
        others = statistics.median(b for r, b in enumerate(busy) if r != slowest)
        straggling = self.factor > 0 and busy[slowest] > self.factor * others
        self._streak = self._streak + 1 if straggling and slowest == self._streak_rank else int(straggling)
        self._streak_rank = slowest if straggling else -1
        if self._streak == self.windows and self.parallel.is_main:  # once per streak
            where = self.parallel.addresses[slowest] if self.parallel.addresses else "?"
            log.warning(
                f"rank {slowest} ({where}) is a straggler: on {self.windows} logged steps in a row its step "
                f"took over {self.factor:g}x the other ranks' median (last: {busy[slowest]:.3f} s against "
                f"{others:.3f} s, {data[slowest]:.3f} s of it fetching data; train.straggler_factor)"
            )
