"""The protocol through which a training trick plugs into the trainer.

A trick is one object that replaces the default behaviour at one or more named seams.
The base class *is* the baseline: each seam method's body is what the trainer does when
no trick claims that seam. A trick claims a seam by overriding its method; two tricks
claiming the same seam are refused before training starts, so the trainer never has to
decide between them and holds no trick-specific branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ciuic_train.errors import UserError

SEAMS = ("init_weights", "order_indices", "lr_at", "transform_loss", "micro_batch_weights")


@dataclass(frozen=True)
class TrickContext:
    """What a trick may know about the run it joins."""

    seed: int
    rank: int
    world_size: int
    max_steps: int
    grad_accum: int


class Trick:
    """Baseline behaviour at every seam; subclasses override the seams they change."""

    name: ClassVar[str] = "baseline"
    summary: ClassVar[str] = "no trick: the trainer's default behaviour"

    def __init__(self, ctx: TrickContext, **params: Any):
        if params:
            raise UserError(f"trick {self.name} takes no parameter {sorted(params)}")
        self.ctx = ctx

    def init_weights(self, model: torch.nn.Module) -> None:
        """Change the freshly built model's weights; the baseline keeps the model's own init."""

    def order_indices(self, share: torch.Tensor, epoch: int) -> torch.Tensor:
        """Reorder this rank's windows for an epoch (must keep the same set of windows)."""
        return share

    def lr_at(self, step: int, schedule: Callable[[int], float]) -> float:
        """Learning rate at an optimizer step; `schedule` is the configured warmup-cosine."""
        return schedule(step)

    def transform_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """The loss to back-propagate and report for one micro-batch."""
        return loss

    def micro_batch_weights(self, step: int, n_micro: int) -> list[float]:
        """Weights of the micro-batches of one optimizer step; they should sum to 1."""
        return [1.0 / n_micro] * n_micro

    def metrics(self) -> dict[str, float]:
        """The trick's own figures, merged into each logged metrics line."""
        return {}

    def claimed_seams(self) -> list[str]:
        return [seam for seam in SEAMS if getattr(type(self), seam) is not getattr(Trick, seam)]


class TrickSet:
    """The selected tricks, seen by the trainer as one object with one owner per seam."""

    def __init__(self, tricks: list[Trick], ctx: TrickContext):
        self.tricks = tricks
        baseline = Trick(ctx)
        owners: dict[str, Trick] = {}
        for trick in tricks:
            for seam in trick.claimed_seams():
                if seam in owners:
                    raise UserError(
                        f"tricks {owners[seam].name} and {trick.name} both replace the {seam} seam; "
                        "select only one of them"
                    )
                owners[seam] = trick
        self._owner = {seam: owners.get(seam, baseline) for seam in SEAMS}

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tricks]

    def init_weights(self, model: torch.nn.Module) -> None:
        self._owner["init_weights"].init_weights(model)

    def order_indices(self, share: torch.Tensor, epoch: int) -> torch.Tensor:
        return self._owner["order_indices"].order_indices(share, epoch)

    def lr_at(self, step: int, schedule: Callable[[int], float]) -> float:
        return self._owner["lr_at"].lr_at(step, schedule)

    def transform_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return self._owner["transform_loss"].transform_loss(loss, step)

    def micro_batch_weights(self, step: int, n_micro: int) -> list[float]:
        return self._owner["micro_batch_weights"].micro_batch_weights(step, n_micro)

    def metrics(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for trick in self.tricks:
            merged.update({f"{trick.name}/{k}": v for k, v in trick.metrics().items()})
        return merged
