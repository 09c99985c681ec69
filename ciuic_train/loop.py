"""The training loop's bookkeeping, kept out of `Trainer.fit` so that it reads like the algorithm.

- `Cadence`: after which optimizer steps the loop evaluates, saves and logs;
- `Throughput`: training tokens per second, with evaluation and saving left out;
- `StopRequest`: a signal (Slurm's cancel or time-limit warning, Ctrl-C) that ends the
  run after the current step, agreed by every rank;
- `inject_fault`: a rank that kills itself on purpose, to rehearse recovery.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ciuic_train.config import CheckpointConfig, FaultConfig, TrainConfig

log = logging.getLogger("ciuic_train")


class Cadence:
    """When the loop evaluates, saves and logs, after optimizer step `step` (1-based).

    The last step does all three. Saving follows the `should_save` policy (a trick's
    seam), except at the last step and when a stop is agreed, which always save.
    """

    def __init__(self, train: TrainConfig, ckpt: CheckpointConfig, should_save: Callable[[int, int], bool]):
        self.train = train
        self.ckpt_every = ckpt.every
        self.should_save = should_save

    def is_last(self, step: int) -> bool:
        return step == self.train.max_steps

    def evaluates(self, step: int) -> bool:
        return step % self.train.eval_every == 0 or self.is_last(step)

    def saves(self, step: int, stopping: bool) -> bool:
        # The policy is asked only when neither forces a save: a policy may count its
        # candidates or agree with the other ranks on each one.
        return self.is_last(step) or stopping or self.should_save(step, self.ckpt_every)

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
        """Tokens/s over the steps this process trained (a resumed run's earlier steps excluded)."""
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

    def agreed(self, parallel) -> str | None:
        """The signal's name once any rank has one, the same on every rank (a collective)."""
        highest = parallel.max(self.received)
        return self.SIGNALS[highest - 1].name if highest else None

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def inject_fault(fault: FaultConfig, rank: int, step: int) -> None:
    """Kill this process as a crash would, on the first attempt only, to test recovery."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and rank == fault.kill_rank and step == fault.at_step:
        log.warning(f"fault injection: rank {rank} kills itself after step {step}")
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
