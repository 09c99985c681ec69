"""A signal (Slurm's cancel or time-limit warning, Ctrl-C) that ends the run after the
current step, agreed by every rank (`StopRequest`)."""

from __future__ import annotations

import signal
import threading
from typing import Any


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
