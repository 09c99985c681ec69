"""After which optimizer steps the loop evaluates, saves and logs (`Cadence`)."""

from __future__ import annotations

from typing import Callable

from ciuic_train.config import CheckpointConfig, TrainConfig


class Cadence:
    """When the loop evaluates, saves and logs, after optimizer step `step` (1-based).

    The last step does all three (it saves unless `ckpt.at_end` is false). Saving follows
    the `should_save` policy (a trick's seam), except at the last step and when a stop is
    agreed, which always save, and after a skipped step, which saves only then.
    """

    def __init__(self, train: TrainConfig, ckpt: CheckpointConfig, should_save: Callable[[int, int], bool]):
        self.train = train
        self.ckpt_every = ckpt.every
        self.saves_at_end = ckpt.at_end
        self.should_save = should_save

    def is_last(self, step: int) -> bool:
        return step == self.train.max_steps

    def evaluates(self, step: int) -> bool:
        return step % self.train.eval_every == 0 or self.is_last(step)

    def saves(self, step: int, stopping: bool, applied: bool = True) -> bool:
        # The policy is asked only when neither forces a save: a policy may count its
        # candidates or agree with the other ranks on each one. After a skipped step
        # (`LossWatch`) it is not asked: its weights are no newer, and the save would
        # prune an older checkpoint, perhaps the last one from before the trouble.
        forced = (self.is_last(step) and self.saves_at_end) or stopping
        return forced or (applied and self.should_save(step, self.ckpt_every))

    def logs(self, step: int, evaluated: bool, stopping: bool) -> bool:
        return step % self.train.log_every == 0 or self.is_last(step) or evaluated or stopping
