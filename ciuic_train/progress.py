"""Progress of long work outside the training loop: tokenizing a corpus, reading
`init_from`'s weights, writing an export.

On a terminal, a rich bar on stderr (done / total, rate, time left), gone when the work
is; where the output is a log, a plain line every `PLAIN_EVERY_S` seconds, so work done
sooner prints nothing more than it did. Measured in bytes (of text read, of tensors
copied or written). Only where `enabled`: rank 0, as for all output.
"""

from __future__ import annotations

import logging
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ciuic_train.files import format_bytes

log = logging.getLogger("ciuic_train")

PLAIN_EVERY_S = 30.0


class WorkProgress:
    """`with WorkProgress("tokenizing", total_bytes) as progress: ... progress.advance(n)`.

    `console`: where the bar goes (default stderr, when it is a terminal)."""

    def __init__(self, what: str, total: int, enabled: bool = True, console: Console | None = None):
        self.what, self.total, self.enabled = what, max(1, total), enabled
        self.console = console or (Console(stderr=True) if sys.stderr.isatty() else None)
        self.done = 0
        self._bar: Progress | None = None

    def __enter__(self) -> WorkProgress:
        self._started = self._last_line = time.monotonic()
        if self.enabled and self.console is not None:
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                 TimeRemainingColumn(), console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        return self

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.advance(self._task, n)
            return
        now = time.monotonic()
        if now - self._last_line >= PLAIN_EVERY_S:
            self._last_line = now
            rate = self.done / max(now - self._started, 1e-9)
            left = (self.total - self.done) / rate if rate else float("inf")
            log.info(f"{self.what}: {format_bytes(self.done)} of {format_bytes(self.total)} "
                     f"({self.done / self.total:.0%}), {format_bytes(rate)}/s, about {left:,.0f} s left")

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
