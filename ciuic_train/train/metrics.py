"""Where training figures go: metrics.jsonl, the log, and the terminal.

On a terminal the user gets a rich progress bar that carries the latest figures; in a
log (no terminal, or `progress=plain`) every logged step is one plain line. Either way
the run folder's log file receives the plain lines.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ciuic_train.files import written_atomically
from ciuic_train.train.trackers import Trackers

log = logging.getLogger("ciuic_train")


class MetricsFile:
    """One JSON object per logged step, appended and flushed so a crash loses nothing logged;
    each line also goes to the experiment trackers (`+logger=...`), as the summary does.

    Without a path (ranks other than 0) it writes nothing.
    """

    def __init__(self, path: Path | None, trackers: Trackers | None = None):
        self.path = path
        self._file = open(path, "a", encoding="utf-8") if path is not None else None
        self._trackers = trackers or Trackers([])

    def drop_after(self, step: int) -> None:
        """`drop_metrics_after` on the open file: a run that resumes once it is training
        (a replica group that found no live peer) forgets the steps it will train again."""
        if self._file is not None:
            self._file.close()
            drop_metrics_after(self.path, step)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        self._trackers.log_metrics(record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._trackers.log_summary(summary)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ends by an error, which the trackers record."""
        if self._file is not None:
            self._file.close()
        self._trackers.close(failed)


def drop_metrics_after(path: Path, step: int) -> None:
    """On resume, forget logged steps the checkpoint does not contain, so none is duplicated."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    with written_atomically(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def logged_loss(path: Path, step: int) -> float:
    """The training loss metrics.jsonl logged at `step` (NaN if it logged none there)."""
    if not path.is_file():
        return float("nan")
    records = (json.loads(line) for line in path.read_text().splitlines() if line)
    return next((float(r["loss"]) for r in records if r["step"] == step), float("nan"))


def format_step(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if "mtp_loss" in record:
        parts.append(f"mtp_loss {record['mtp_loss']:.4f}")
    parts += [
        f"lr {record['lr']:.2e}",
        f"grad_norm {record['grad_norm']:.3f}",
        f"{record['tokens_per_s']:,.0f} tok/s",
    ]
    return " | ".join(parts)


class ProgressDisplay:
    """A rich bar on a terminal, plain log lines otherwise; nothing on ranks other than 0."""

    def __init__(self, total_steps: int, mode: str, enabled: bool = True):
        self.enabled = enabled
        self.rich = enabled and (mode == "rich" or (mode == "auto" and sys.stdout.isatty()))
        self.total_steps = total_steps
        self._progress: Progress | None = None
        self._detached: list[tuple[logging.Logger, logging.Handler]] = []

    def __enter__(self) -> "ProgressDisplay":
        if self.rich:
            # Console log handlers would tear the live bar; the log file keeps every line.
            for handler in list(logging.getLogger().handlers):
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    logging.getLogger().removeHandler(handler)
                    self._detached.append((logging.getLogger(), handler))
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[figures]}"),
                console=Console(),
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total_steps, figures="")
        return self

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def report(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = format_step(record)
        log.info(line)
        if self._progress is not None:
            self._progress.update(
                self._task,
                figures=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s",
            )
            if "val_loss" in record:
                self._progress.console.print(line)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        for logger, handler in self._detached:
            logger.addHandler(handler)


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="ciuic-train summary", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in summary.items():
        if isinstance(value, float):
            text = f"{value:,.4f}" if math.isfinite(value) and abs(value) < 1e4 else f"{value:,.1f}"
        elif isinstance(value, int):
            text = f"{value:,}"
        else:
            text = str(value)
        table.add_row(key, text)
    return table
