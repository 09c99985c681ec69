"""Where a training trick hooks into the trainer: the seams, and how to claim one.

A trick replaces the trainer's default behaviour at one or more *seams*. Each seam is a
method of `Trick` marked `@seam`, and its body *is* the default, so the trainer holds no
trick-specific branches: it calls the seams of one `TrickSet`, itself a `Trick` whose
seams are bound to the selected tricks that claim them. The seams, in the order the
trainer reaches them:

| seam | when the trainer calls it |
|---|---|
| `init_weights(model, init)` | once, on each rank's materialized parameters (shards under FSDP), after the model's own init |
| `comm_hook()` | once, when `parallelize` wraps the model in DDP: a communication hook to install, or None |
| `order_indices(share, epoch)` | by the window sampler, on this rank's share of each epoch (and on resume) |
| `lr_at(step, schedule)` | at the start of every optimizer step |
| `micro_batch_weights(step, n)` | at the start of every optimizer step, for its `n` micro-batches |
| `transform_loss(loss, step)` | on every micro-batch, between the forward and the backward |
| `should_save(step, every)` | after every optimizer step (the last step and a stop signal save anyway) |

Besides the seams every trick may report `metrics()` (logged into `metrics.jsonl` as
`<trick>/<figure>`), carry resumable state (`state_dict`/`load_state_dict`) and finish
work in flight in `close()`.

**Claiming a seam**: override its method, same signature. A trick claims the seams it
overrides (`Trick.claimed_seams`). Two selected tricks that claim the same seam are
refused when the config is checked (`refuse_seam_conflicts`), before any process
starts: there is no single right order in which to apply them.

**Adding a trick**: one file `ciuic_train/tricks/<name>.py` with one `Trick` subclass
(`name`, a one-line `summary`, a `Params` dataclass with the parameters and their
defaults, and the seams it overrides), plus `conf/trick/<name>.yaml` headed
`# @package trick.<name>` with the same defaults (a test checks they agree). The registry
finds the class by importing the package; nothing else changes.

**Adding a seam**: two edits. A `@seam` method on `Trick` whose body is the default
behaviour, and the call `self.tricks.<seam>(...)` where it applies in
`ciuic_train/train/trainer.py`. `SEAMS`, conflict checking and `TrickSet`'s forwarding follow
from the decorator.

The CLI imports this package to list and check tricks before any process starts, so no
module here imports torch at import time: torch is imported inside the methods that run
during training, and type annotations that name it are only read by type checkers.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

from ciuic_train.errors import UserError

if TYPE_CHECKING:
    import torch

    from ciuic_train.model.init import ParameterInit

Method = TypeVar("Method", bound=Callable[..., Any])


def seam(method: Method) -> Method:
    """Mark a `Trick` method as a seam: its body is the default, a trick overriding it claims it."""
    method.is_seam = True  # type: ignore[attr-defined]
    return method


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


@dataclass(frozen=True)
class CommHook:
    """A trick's DDP communication hook, for `DistributedDataParallel.register_comm_hook`."""

    trick: str  # the owning trick's name, for messages
    hook: Callable  # hook(state, bucket) -> Future[Tensor], replacing the bucket's all-reduce
    state: Any = None


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from the run seed and names: a trick's own stream, apart from the global RNG."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Trick:
    """The default behaviour at every seam; a trick subclasses it and overrides the seams it changes."""

    name: ClassVar[str] = "baseline"
    summary: ClassVar[str] = "no trick: the trainer's default behaviour"

    @dataclass
    class Params:
        pass

    def __init__(self, ctx: TrickContext, params: Any = None):
        self.ctx = ctx
        self.params = params if params is not None else self.Params()

    # --- seams (see the module docstring for when each is called) -----------------------

    @seam
    def init_weights(self, model: torch.nn.Module, init: ParameterInit) -> None:
        """Change the step-0 weights; the default keeps the model's own init.

        A rank holds only its rows of a sharded parameter: draw values with `init.fill_`
        (by rows, the same for every layout; ciuic_train/model/init.py), not by writing
        whole tensors.
        """

    @seam
    def comm_hook(self) -> CommHook | None:
        """A DDP communication hook replacing the gradient all-reduce; None keeps DDP's own."""
        return None

    @seam
    def order_indices(self, share: torch.Tensor, epoch: int) -> torch.Tensor:
        """Reorder this rank's windows for an epoch (must keep the same set of windows)."""
        return share

    @seam
    def lr_at(self, step: int, schedule: Callable[[int], float]) -> float:
        """Learning rate at an optimizer step; `schedule` is the configured `LrSchedule`."""
        return schedule(step)

    @seam
    def micro_batch_weights(self, step: int, n_micro: int) -> list[float]:
        """Weights of the micro-batches of one optimizer step; they should sum to 1."""
        return [1.0 / n_micro] * n_micro

    @seam
    def transform_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """The loss to back-propagate and report for one micro-batch."""
        return loss

    @seam
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
        """The seams this trick overrides."""
        return [name for name in SEAMS if getattr(cls, name) is not getattr(Trick, name)]


SEAMS: tuple[str, ...] = tuple(
    name for name, member in vars(Trick).items() if getattr(member, "is_seam", False)
)


def refuse_seam_conflicts(tricks: list[type[Trick]]) -> None:
    """Refuse two tricks that replace the same seam: there is no single right order for them."""
    owners: dict[str, type[Trick]] = {}
    for trick in tricks:
        for name in trick.claimed_seams():
            if name in owners:
                raise UserError(
                    f"tricks {owners[name].name} and {trick.name} both replace the {name} seam; "
                    "select only one of them"
                )
            owners[name] = trick


class TrickSet(Trick):
    """The selected tricks, seen by the trainer as one `Trick` with one owner per seam.

    Each seam is bound in `__init__` to the trick that claims it; an unclaimed seam keeps
    the inherited default. So a new seam needs no forwarding method here.
    """

    def __init__(self, tricks: list[Trick], ctx: TrickContext):
        refuse_seam_conflicts([type(t) for t in tricks])
        super().__init__(ctx)
        self.tricks = tricks
        for trick in tricks:
            for name in trick.claimed_seams():
                setattr(self, name, getattr(trick, name))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tricks]

    def resolved_params(self) -> dict[str, dict[str, Any]]:
        return {t.name: dataclasses.asdict(t.params) for t in self.tricks}

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
