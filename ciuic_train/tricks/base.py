"""The protocol through which a training trick plugs into the trainer.

A trick is one object that replaces the default behaviour at one or more named seams.
The base class *is* the baseline: each seam method's body is what the trainer does when
no trick claims that seam. A trick claims a seam by overriding its method; two tricks
claiming the same seam are refused when the config is checked, before any process
starts, so the trainer never has to decide between them and holds no trick-specific
branches.

A trick's parameters are a dataclass `Params` nested in its class; `conf/trick/<name>.yaml`
gives their defaults and `trick.<name>.<param>=...` overrides them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ciuic_train.errors import UserError

SEAMS = (
    "init_weights",
    "order_indices",
    "lr_at",
    "transform_loss",
    "micro_batch_weights",
    "comm_hook",
    "should_save",
)


@dataclass(frozen=True)
class TrickContext:
    """What a trick may know about the run it joins."""

    seed: int
    rank: int
    world_size: int
    max_steps: int
    grad_accum: int
    # The run's `Parallel` (collectives, rank agreement); None in unit tests of one trick.
    parallel: Any = None


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from the run seed and names: a trick's own stream, apart from the global RNG."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Trick:
    """Baseline behaviour at every seam; subclasses override the seams they change."""

    name: ClassVar[str] = "baseline"
    summary: ClassVar[str] = "no trick: the trainer's default behaviour"

    @dataclass
    class Params:
        pass

    def __init__(self, ctx: TrickContext, params: Any = None):
        self.ctx = ctx
        self.params = params if params is not None else self.Params()

    # --- seams -------------------------------------------------------------------------

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

    def comm_hook(self) -> tuple[Any, Callable] | None:
        """A DDP communication hook `(state, hook)` that replaces the gradient all-reduce."""
        return None

    def should_save(self, step: int, every: int) -> bool:
        """Checkpoint policy after optimizer step `step` (1-based); the end of the run and a
        stop signal always save, whatever the policy says."""
        return every > 0 and step % every == 0

    # --- shared by every trick ---------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The trick's own figures, merged into each logged metrics line."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly (counters, generators, averages)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        """End of training: finish anything still in flight (e.g. an async collective)."""

    @classmethod
    def claimed_seams(cls) -> list[str]:
        return [seam for seam in SEAMS if getattr(cls, seam) is not getattr(Trick, seam)]


def check_compatible(tricks: list[type[Trick]]) -> None:
    """Refuse two tricks that replace the same seam: there is no single right order for them."""
    owners: dict[str, type[Trick]] = {}
    for trick in tricks:
        for seam in trick.claimed_seams():
            if seam in owners:
                raise UserError(
                    f"tricks {owners[seam].name} and {trick.name} both replace the {seam} seam; "
                    "select only one of them"
                )
            owners[seam] = trick


class TrickSet:
    """The selected tricks, seen by the trainer as one object with one owner per seam."""

    def __init__(self, tricks: list[Trick], ctx: TrickContext):
        check_compatible([type(t) for t in tricks])
        self.tricks = tricks
        baseline = Trick(ctx)
        self._owner = {
            seam: next((t for t in tricks if seam in t.claimed_seams()), baseline) for seam in SEAMS
        }

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tricks]

    def resolved_params(self) -> dict[str, dict[str, Any]]:
        return {t.name: dataclasses.asdict(t.params) for t in self.tricks}

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

    def comm_hook(self) -> tuple[str, Any, Callable] | None:
        """(owning trick's name, state, hook), or None to keep DDP's own all-reduce."""
        owner = self._owner["comm_hook"]
        hook = owner.comm_hook()
        return (owner.name, *hook) if hook is not None else None

    def should_save(self, step: int, every: int) -> bool:
        return self._owner["should_save"].should_save(step, every)

    def metrics(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for trick in self.tricks:
            merged.update({f"{trick.name}/{k}": v for k, v in trick.metrics().items()})
        return merged

    def state_dict(self) -> dict[str, Any]:
        return {t.name: t.state_dict() for t in self.tricks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Tricks absent from `state` (a resume with ckpt.allow_trick_change) start fresh."""
        for trick in self.tricks:
            if trick.name in state:
                trick.load_state_dict(state[trick.name])

    def close(self) -> None:
        for trick in self.tricks:
            trick.close()
