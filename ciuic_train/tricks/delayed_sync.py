"""delayed_sync (延迟启动): a bounded, seeded sleep before each gradient all-reduce.

    ciuic-train +trick=delayed_sync dist.nproc_per_node=2 trick.delayed_sync.per=bucket

A DDP communication hook sleeps `uniform(0, max_delay_s)` seconds (default 0.5; 0
disables the sleep) right before a bucket's all-reduce: once per step, before its first
bucket (`per=step`, the default), or before every bucket (`per=bucket`). The draws come
from a generator seeded by (run seed, rank); the ranks in `exempt_ranks` (default [0])
never sleep. The all-reduce itself is DDP's default (divide by world size, sum), so
gradients are bit-identical to a run without the trick. It needs DDP: at world size 1
there is nothing to synchronise (a warning says so), and `dist.strategy=fsdp`, which has
no communication hook, is an error at start.
Logged into `metrics.jsonl`: `delayed_sync/slept_s` and `delayed_sync/sleeps`, the
seconds slept and the sleeps taken on rank 0, which writes the metrics (so 0 while rank
0 is exempt; the step time shows the cost).

The article's version and its defects
-------------------------------------
The article slept `uniform(0, 0.5)` s on every rank with `local_rank != 0` and then called
all_reduce by hand. Under DDP the all-reduce happens inside backward, bucket by bucket,
so that sleep never touched the real sync; an all-reduce waits for the slowest rank, so
the delay is added to the whole step; `local_rank` exempts one rank per node, not one
per job; and the draw was unseeded.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from ciuic_train.tricks.base import CommHook, Trick, derived_seed


class DelayedSync(Trick):
    name = "delayed_sync"
    summary = "seeded, bounded sleep before DDP's gradient all-reduce (a communication hook)"

    @dataclass
    class Params:
        max_delay_s: float = 0.5
        # "step": one sleep before a step's first bucket; "bucket": before every bucket.
        per: str = "step"
        # Global ranks that never sleep (the article spared local rank 0 of every node).
        exempt_ranks: list[int] = field(default_factory=lambda: [0])

        def __post_init__(self) -> None:
            if self.per not in ("step", "bucket"):
                raise ValueError(f"per={self.per!r} is not one of: step, bucket")
            if self.max_delay_s < 0:
                raise ValueError(f"max_delay_s={self.max_delay_s} must be 0 or more")

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.rng = random.Random(derived_seed(ctx.seed, "delayed_sync", ctx.rank))
        self.slept_s = 0.0
        self.sleeps = 0
        self._next_bucket_starts_step = True

    def comm_hook(self) -> CommHook:
        return CommHook(self.name, self._sleep_then_all_reduce)

    def _sleep_then_all_reduce(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        sleeps_here = self.params.per == "bucket" or self._next_bucket_starts_step
        if sleeps_here and self.ctx.rank not in self.params.exempt_ranks and self.params.max_delay_s > 0:
            delay = self.rng.uniform(0.0, self.params.max_delay_s)
            time.sleep(delay)
            self.slept_s += delay
            self.sleeps += 1
        self._next_bucket_starts_step = bucket.is_last()
        return allreduce_hook(state, bucket)

    def metrics(self) -> dict[str, float]:
        return {"slept_s": self.slept_s, "sleeps": self.sleeps}

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "slept_s": self.slept_s, "sleeps": self.sleeps}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]  # JSON turned the tuples into lists
        self.rng.setstate((version, tuple(internal), gauss))
        self.slept_s, self.sleeps = state["slept_s"], state["sleeps"]
