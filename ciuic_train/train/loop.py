"""The training loop's bookkeeping, kept out of `Trainer.fit` so that it reads like the algorithm.

- `Cadence`: after which optimizer steps the loop evaluates, saves and logs;
- `Throughput`: training tokens per second, with evaluation and saving left out;
- `StopRequest`: a signal (Slurm's cancel or time-limit warning, Ctrl-C) that ends the
  run after the current step, agreed by every rank;
- `LossWatch`: every step's one agreement between ranks (its loss, whether it is finite,
  a stop signal), the non-finite guard and the loss-spike warning;
- `inject_fault`, `poison_loss`, `cap_address_space`, `slow_down`: a rank that kills
  itself, whose loss is NaN, that runs out of memory, or that is slow, on purpose, to
  rehearse recovery and the warnings.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ciuic_train.config import CheckpointConfig, FaultConfig, OnNonFinite, TrainConfig
from ciuic_train.files import format_bytes
from ciuic_train.tools.memory_limits import mapped_bytes

log = logging.getLogger("ciuic_train")


class Cadence:
    """When the loop evaluates, saves and logs, after optimizer step `step` (1-based).

    The last step does all three. Saving follows the `should_save` policy (a trick's
    seam), except at the last step and when a stop is agreed, which always save, and
    after a skipped step, which saves only then.
    """

    def __init__(self, train: TrainConfig, ckpt: CheckpointConfig, should_save: Callable[[int, int], bool]):
        self.train = train
        self.ckpt_every = ckpt.every
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
        forced = self.is_last(step) or stopping
        return forced or (applied and self.should_save(step, self.ckpt_every))

    def logs(self, step: int, evaluated: bool, stopping: bool) -> bool:
        return step % self.train.log_every == 0 or self.is_last(step) or evaluated or stopping


class Throughput:
    """Training tokens per second over the whole loop (data, step, logging), without the
    time spent evaluating or saving checkpoints; per log window and for the run."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.started = self._window_started = time.perf_counter()
        self.steps = self._window_steps = 0
        self.paused_s = self._window_paused_s = 0.0

    def count_step(self) -> None:
        self.steps += 1
        self._window_steps += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is left out of both rates."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            pause = time.perf_counter() - tic
            self.paused_s += pause
            self._window_paused_s += pause

    def window_rate(self) -> float:
        """Tokens/s since the previous call (or the start); the next window starts now."""
        now = time.perf_counter()
        rate = self.tokens_per_step * self._window_steps / (now - self._window_started - self._window_paused_s)
        self._window_started, self._window_steps, self._window_paused_s = now, 0, 0.0
        return rate

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def run_rate(self) -> float:
        """Tokens/s over the steps this process trained (a resumed run's earlier steps
        excluded); NaN if it trained none (a run resumed at its end)."""
        if not self.steps:
            return float("nan")
        return self.tokens_per_step * self.steps / (self.elapsed_s() - self.paused_s)


class StopRequest:
    """A signal asks the loop to save a checkpoint and stop after the current step.

    SIGTERM: Slurm's cancel or preemption, or a plain `kill`; SIGUSR1: Slurm's warning
    before the time limit (`--signal=USR1@N`, submitit's default); SIGINT: Ctrl-C, where
    a second one interrupts at once. Ranks stop at the same step, under one signal name.
    """

    # Ranked: when ranks see different signals, the highest wins (a cancel must not
    # turn into a requeue).
    SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.received = 0  # 1 + index in SIGNALS of the highest signal seen; 0: none
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = max(self.received, 1 + self.SIGNALS.index(signum))
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def votes(self) -> list[float]:
        """This rank's vote, one slot per signal, for `decide` once summed over ranks."""
        return [float(self.received == i + 1) for i in range(len(self.SIGNALS))]

    @classmethod
    def decide(cls, totals: list[float]) -> str | None:
        """The highest signal any rank saw, from the votes summed over ranks; None: none."""
        seen = [sig.name for sig, count in zip(cls.SIGNALS, totals) if count]
        return seen[-1] if seen else None

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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


def inject_fault(fault: FaultConfig, rank: int, step: int) -> None:
    """Kill this process as a crash would, on the first attempt only, to test recovery."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and rank == fault.kill_rank and step == fault.at_step:
        log.warning(f"fault injection: rank {rank} kills itself after step {step}")
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def poison_loss(fault: FaultConfig, rank: int, step: int, loss):
    """The loss, or NaN in its place on rank `fault.nan_rank` in step `fault.nan_at_step` (1-based)."""
    return loss * float("nan") if rank == fault.nan_rank and step == fault.nan_at_step else loss


def slow_down(fault: FaultConfig, rank: int) -> None:
    """On rank `fault.slow_rank`, sleep `fault.slow_s` seconds: a step that takes longer there."""
    if rank == fault.slow_rank:
        time.sleep(fault.slow_s)


def cap_address_space(fault: FaultConfig, rank: int, step: int) -> None:
    """Before step `fault.oom_at_step` (1-based) on rank `fault.oom_rank`, lower this
    process's address-space limit (RLIMIT_AS, as `ulimit -v` does) to what it maps now:
    the step's first allocation that needs fresh memory then fails in the allocator, a
    real out-of-memory. (glibc's malloc may serve a small model's step from memory it
    holds already; MALLOC_MMAP_THRESHOLD_=131072 makes every larger tensor a fresh map.)"""
    if rank == fault.oom_rank and step == fault.oom_at_step:
        mapped = mapped_bytes()
        log.warning(f"fault injection: rank {rank} caps its address space at {format_bytes(mapped)} before step {step}")
        resource.setrlimit(resource.RLIMIT_AS, (mapped, resource.getrlimit(resource.RLIMIT_AS)[1]))
