"""Training tokens per second, with evaluation and saving left out (`Throughput`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


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
