"""What the trainer does at the seams of the shared training step (`step/training_step.py`):
the gradient consistency it measures, the replica groups' average, and the ranks'
agreement that decides whether the update is applied."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ciuic_train.distributed.grads import average_gradients_with_consistency
from ciuic_train.faults import slow_down
from ciuic_train.step.training_step import StepSeams
from ciuic_train.train.loss_watch import StepCheck

# Not applied because a replica group was lost during the step: it runs again.
RETRY = "retry"


@dataclass
class TrainerSeams(StepSeams):
    """One step's seams; `trainer` is the `Trainer` (its parallel, replicas, loss watch and
    step times), `stop_votes` this rank's stop-signal votes, `measure_consistency` whether
    this step averages the gradients by hand to log how far the ranks' agree."""

    trainer: Any
    stop_votes: list[float]
    measure_consistency: bool
    figures: dict[str, float] = field(default_factory=dict)
    check: StepCheck | None = None

    def after_backward(self, loss: torch.Tensor, side_losses: dict[str, torch.Tensor]):
        t = self.trainer
        if self.measure_consistency:
            self.figures["grad_consistency"] = average_gradients_with_consistency(list(t.model.parameters()), t.parallel)
        fault = t.config.fault
        groups = t.replicas.groups
        alone = fault.slow_alone and t.replicas.step_figures().get("participants", groups) < groups
        slow_down(fault, t.replicas.global_rank(t.parallel.info.rank), alone)  # before any exchange
        # Across replica groups (ft): the gradients and figures averaged, the experts' token counts summed.
        across = t.replicas.average_([p.grad for p in t.model.parameters() if p.grad is not None],
                                     torch.stack([loss, *side_losses.values()]), sums=t.model.expert_counts())
        return across[0], dict(zip(side_losses, across[1:]))

    def decide(self, loss: torch.Tensor, grad_norm: torch.Tensor, side_losses: dict[str, torch.Tensor]) -> str:
        t = self.trainer
        t.step_times.reached_agreement(exact=t.cadence.logs(t.step + 1, False, False))
        self.check = t.watch.agree(t.parallel, loss, grad_norm, self.stop_votes, side_losses)
        if not t.replicas.commit():
            return RETRY
        return t.watch.judge(t.step + 1, self.check)
