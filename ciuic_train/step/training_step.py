"""One training step, the same code for the trainer and for `--simulate` (a whole model's
rank and a pipeline's): forward and backward over the step's micro-batches, the global
gradient norm clipped, the optimizer's update and the experts' balancing step.

What only the trainer does around it (averaging across replica groups, the ranks'
agreement on the loss, a stop or a skipped step) and what only the simulator does (a
memory snapshot after each micro-batch) plug into the seams of `StepSeams`, which fire in
this order:

    for each micro-batch:
        loss, side losses = passes.train(micro-batch)   gradients cross ranks on the last one
        seams.after_micro_batch()
    loss, side losses: their mean over the micro-batches, by weight
    loss, side losses = seams.after_backward(...)       the trainer: gradient consistency,
                                                        the replica groups' average
    grad_norm = passes.clip_grad_norm_(max_norm)
    verdict = seams.decide(loss, grad_norm, ...)        apply, or anything else: no update
    apply: optimizer.step(); imbalance = passes.balance_experts()
    else:  the experts' token counts forgotten
    seams.after_update()
    gradients cleared (DDP's bucket views zeroed in place, others set to None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

from ciuic_train.model import Transformer

APPLY = "apply"


@dataclass
class MicroBatch:
    """One micro-batch of a step: its windows' inputs and targets, the weight of its loss
    in the step's mean, and with `data.doc_mask` the model's document keywords."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weight: float = 1.0
    documents: dict[str, torch.Tensor] = field(default_factory=dict)


class StepPasses(Protocol):
    """What the step asks of a layout (`step/passes.py`'s `Passes` is more)."""

    model: Transformer

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float, step: int,
              sync: bool, **documents: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...

    def balance_experts(self) -> torch.Tensor: ...

    def grads_are_bucket_views(self) -> bool: ...


class StepSeams:
    """The step's seams; each default leaves the step as the simulator runs it."""

    def after_micro_batch(self) -> None:
        pass

    def after_backward(self, loss: torch.Tensor, side_losses: dict[str, torch.Tensor]
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss, side_losses

    def decide(self, loss: torch.Tensor, grad_norm: torch.Tensor, side_losses: dict[str, torch.Tensor]) -> str:
        """`APPLY`, or why the update is not applied (the caller's word, returned as is)."""
        return APPLY

    def after_update(self) -> None:
        pass


@dataclass
class StepOutcome:
    """`loss` and `side_losses`: as `after_backward` returned them (0-d tensors);
    `moe_imbalance`: a 0-d tensor after an update, NaN without one."""

    verdict: str
    loss: torch.Tensor
    side_losses: dict[str, torch.Tensor]
    grad_norm: torch.Tensor
    moe_imbalance: torch.Tensor | float


def training_step(passes: StepPasses, optimizer: torch.optim.Optimizer, micro_batches: Iterable[MicroBatch],
                  count: int, step: int, max_norm: float, seams: StepSeams | None = None,
                  sync_gradients: bool = True) -> StepOutcome:
    """Step `step` (0-based) over `count` micro-batches (module docstring). With
    `sync_gradients` false the gradients stay each rank's own after backward (the caller
    averages them itself: `train.log_grad_consistency`)."""
    seams = seams or StepSeams()
    loss_sum, side_sums, total_weight = None, {}, 0.0
    for i, batch in enumerate(micro_batches):
        sync = sync_gradients and i == count - 1
        loss, side = passes.train(batch.inputs, batch.targets, batch.weight, step, sync, **batch.documents)
        # Kept on the device: a GPU runs ahead of the host until the caller reads them.
        loss_sum = loss.double() * batch.weight + (0.0 if loss_sum is None else loss_sum)
        for name, value in side.items():  # MTP and balance losses, where on
            side_sums[name] = side_sums.get(name, 0.0) + value.double() * batch.weight
        total_weight += batch.weight
        seams.after_micro_batch()
    loss, side_losses = seams.after_backward(loss_sum / total_weight,
                                             {name: value / total_weight for name, value in side_sums.items()})
    grad_norm = passes.clip_grad_norm_(max_norm)
    verdict = seams.decide(loss, grad_norm, side_losses)
    if verdict == APPLY:
        optimizer.step()
        moe_imbalance = passes.balance_experts()
    else:
        passes.model.forget_expert_counts()
        moe_imbalance = float("nan")
    seams.after_update()
    optimizer.zero_grad(set_to_none=not passes.grads_are_bucket_views())
    return StepOutcome(verdict, loss, side_losses, grad_norm, moe_imbalance)
