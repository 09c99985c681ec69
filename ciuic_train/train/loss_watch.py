"""Every step's one agreement between ranks (its loss, whether it is finite, a stop
signal), the non-finite guard and the loss-spike warning (`LossWatch`)."""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ciuic_train.config import OnNonFinite, TrainConfig
from ciuic_train.train.stop_request import StopRequest

log = logging.getLogger("ciuic_train")


@dataclass(frozen=True)
class StepCheck:
    """What every rank agreed on after a step's backward, before its update."""

    loss: float  # the step's loss, mean over ranks
    grad_norm: float
    finite: bool  # the loss and gradient norm are finite on every rank
    stop_signal: str | None  # a signal any rank received (`StopRequest.decide`)
    side_losses: dict[str, float] = field(default_factory=dict)  # e.g. mtp_loss, mean over ranks


class LossWatch:
    """The guard between a step's gradients and its update, and the loss-spike warning.

    `agree` is the step's one collective (it replaces the stop-signal agreement the loop
    needed anyway): each rank's loss, non-finite flag and signal votes, summed. `judge`
    then tells every rank alike whether to apply the step, skip it or stop the run
    (`train.on_nonfinite`). A finite loss above `train.spike_factor` times the median of
    the last `train.spike_window` steps is reported and counted, not acted on: spikes
    often recover, and skipping the batches behind them is a choice for the user.
    """

    def __init__(self, train: TrainConfig, is_main: bool):
        self.on_nonfinite = train.on_nonfinite
        self.max_skipped_steps = train.max_skipped_steps
        self.spike_factor = train.spike_factor
        self.is_main = is_main
        self.recent: deque[float] = deque(maxlen=train.spike_window)
        self.min_history = min(10, train.spike_window)  # a median of fewer steps is noise
        self.skipped_in_a_row = 0
        self.skipped_steps = 0
        self.loss_spikes = 0

    def agree(
        self, parallel, loss: torch.Tensor, grad_norm: torch.Tensor, stop_votes: list[float],
        side_losses: dict[str, torch.Tensor] | None = None,
    ) -> StepCheck:
        """`loss` and `grad_norm` are this rank's, 0-d tensors on its device; `side_losses`
        (the model's `loss_figures`, the same names on every rank) ride along, averaged over
        ranks like the loss. They leave the device here, together: the step's one host sync."""
        side_losses = side_losses or {}
        figures = torch.stack([loss, grad_norm, *side_losses.values()]).double()
        bad = (~torch.isfinite(figures[:2]).all()).double().unsqueeze(0)
        votes = torch.tensor(stop_votes, dtype=torch.float64).to(figures.device)
        totals = parallel.all_reduce_sum_(torch.cat([figures[:2], bad, figures[2:], votes])).tolist()
        # Every rank holds the global gradient norm; the losses are summed over the ranks
        # that see different data (a pipeline's stages without the loss add 0).
        world, shares = parallel.world_size, parallel.data_world
        side = dict(zip(side_losses, (total / shares for total in totals[3 : 3 + len(side_losses)])))
        votes = totals[3 + len(side_losses) :]
        return StepCheck(totals[0] / shares, totals[1] / world, totals[2] == 0, StopRequest.decide(votes), side)

    def judge(self, step: int, check: StepCheck) -> str:
        """`apply`, `skip` or `stop` for optimizer step `step` (1-based), the same on every rank."""
        if check.finite:
            self.skipped_in_a_row = 0
            self._watch_spike(step, check.loss)
            return "apply"
        if self.on_nonfinite is OnNonFinite.stop:
            return "stop"
        self.skipped_in_a_row += 1
        self.skipped_steps += 1
        if self.skipped_in_a_row >= self.max_skipped_steps:
            return "stop"
        if self.is_main:
            log.warning(f"step {step}: loss {check.loss:.4g}, grad norm {check.grad_norm:.4g}; step skipped "
                        f"({self.skipped_in_a_row} in a row, train.max_skipped_steps={self.max_skipped_steps})")
        return "skip"

    def _watch_spike(self, step: int, loss: float) -> None:
        if self.spike_factor and len(self.recent) >= self.min_history:
            median = statistics.median(self.recent)
            if loss > self.spike_factor * median:
                self.loss_spikes += 1
                if self.is_main:
                    log.warning(f"step {step}: loss spike, {loss:.4f} is {loss / median:.1f}x the median "
                                f"{median:.4f} of the last {len(self.recent)} steps (train.spike_factor="
                                f"{self.spike_factor:g})")
        self.recent.append(loss)

    def metrics(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "loss_spikes": self.loss_spikes}

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "skipped_in_a_row": self.skipped_in_a_row, **self.metrics()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.extend(state["recent"])
        self.skipped_in_a_row = state["skipped_in_a_row"]
        self.skipped_steps = state["skipped_steps"]
        self.loss_spikes = state["loss_spikes"]
