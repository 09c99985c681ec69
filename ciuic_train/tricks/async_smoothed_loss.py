"""async_smoothed_loss (异步平滑): report an EMA of the cross-rank mean loss, train on the raw loss.

    ciuic-train +trick=async_smoothed_loss trick.async_smoothed_loss.decay=0.95

Every `every` steps (default 5) a detached copy of the loss is summed across ranks by an
all-reduce launched with `async_op=True` and waited for one step later, so it never
stalls a step; the cross-rank mean updates an EMA, `decay * ema + (1 - decay) * mean`
(`decay` 0.9). From step `start_step` (10) on, the loss the trainer reports is the EMA,
while the loss handed to backward is straight-through: its value is the EMA, its
gradient exactly the raw loss's, so gradients are bit-identical to the baseline and no
graph outlives its step. `start_step` >= `train.max_steps` reports the raw loss
throughout. At world size 1 it smooths this process's loss, and says so in a warning.
Logged into `metrics.jsonl`: `async_smoothed_loss/raw_loss` (the last micro-batch's
loss on rank 0), `async_smoothed_loss/smoothed_loss` (the EMA) and
`async_smoothed_loss/reductions` (all-reduces launched).

The article's version and its defects
-------------------------------------
The article all-reduced the raw loss every 5 steps, kept an EMA (0.9/0.1) in a buffer
and from step 10 returned the buffer as the loss. Backward then reached a graph that was
already freed (or, detached, gave zero gradients, so training stopped after step 10);
`all_reduce` is not autograd-aware; under DDP gradients are averaged already, so
averaging the loss value changes no gradient; and the all-reduce blocked, nothing was
async.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ciuic_train.tricks.base import Trick

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ciuic_train")


class AsyncSmoothedLoss(Trick):
    name = "async_smoothed_loss"
    summary = "reported loss = EMA of the cross-rank mean (async all-reduce), gradient = raw loss"

    @dataclass
    class Params:
        every: int = 5
        decay: float = 0.9
        # Steps before this report the raw loss (the article: 10). >= max_steps disables.
        start_step: int = 10

        def __post_init__(self) -> None:
            if self.every < 1:
                raise ValueError(f"every={self.every} must be at least 1")
            if not 0 <= self.decay < 1:
                raise ValueError(f"decay={self.decay} must be in [0, 1)")

    def __init__(self, ctx, params=None):
        import torch.distributed as dist

        super().__init__(ctx, params)
        self.ema: float | None = None
        self.raw = float("nan")
        self.reductions = 0
        self._pending: tuple[object | None, torch.Tensor, int] | None = None
        self._launched_step = -1
        self._distributed = ctx.world_size > 1 and dist.is_available() and dist.is_initialized()
        if not self._distributed:
            log.warning("trick async_smoothed_loss: world size 1, smoothing this process's loss only")

    def _collect(self, step: int) -> None:
        """Fold in the reduction launched at an earlier step (waiting on it only now)."""
        if self._pending is None or self._pending[2] >= step:
            return
        work, buffer, _ = self._pending
        if work is not None:
            work.wait()
        mean = buffer.item() / self.ctx.world_size
        decay = self.params.decay
        self.ema = mean if self.ema is None else decay * self.ema + (1 - decay) * mean
        self._pending = None

    def transform_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        self._collect(step)
        self.raw = loss.detach().item()
        if step % self.params.every == 0 and step != self._launched_step:
            import torch.distributed as dist

            buffer = loss.detach().clone()
            work = dist.all_reduce(buffer, async_op=True) if self._distributed else None
            self._pending = (work, buffer, step)
            self._launched_step = step
            self.reductions += 1
        if step < self.params.start_step or self.ema is None:
            return loss
        # Straight-through: the value is the EMA, the gradient the raw loss's.
        return loss + (self.ema - loss.detach())

    def close(self) -> None:
        if self._pending is not None and self._pending[0] is not None:
            self._pending[0].wait()
        self._pending = None

    def metrics(self) -> dict[str, float]:
        smoothed = self.ema if self.ema is not None else float("nan")
        return {"raw_loss": self.raw, "smoothed_loss": smoothed, "reductions": self.reductions}

    def state_dict(self) -> dict:
        return {"ema": self.ema, "reductions": self.reductions}

    def load_state_dict(self, state: dict) -> None:
        self.ema, self.reductions = state["ema"], state["reductions"]
