"""Faults on purpose, to rehearse recovery and the warnings: a rank that kills itself, whose
loss is NaN, that runs out of memory, or that is slow (`fault.*`).

The section's schema lives here with the code that reads it, below every package that
injects a fault (the trainer's loop, a pipeline's stage), so none of them reaches up.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import time
from dataclasses import dataclass

from ciuic_train.files import format_bytes
from ciuic_train.memory_limits import mapped_bytes

log = logging.getLogger("ciuic_train")


@dataclass
class FaultConfig:
    """Fault injection for testing recovery: on the first attempt only, rank `kill_rank`
    SIGKILLs itself right after optimizer step `at_step`; rank `nan_rank`'s loss is NaN
    in optimizer step `nan_at_step` (every attempt), as a diverging rank's would be (on a
    pipeline rank without the loss, its stage's output);
    rank `oom_rank` caps its address space at what it maps before step `oom_at_step`
    (every attempt), so that step's first allocation needing more fails in the allocator."""

    kill_rank: int = -1
    at_step: int = 0
    nan_rank: int = -1
    nan_at_step: int = 0
    oom_rank: int = -1
    oom_at_step: int = 0
    # Rank `slow_rank` sleeps `slow_s` seconds in every step before the step's agreement,
    # as a slower machine would take longer (rehearses the straggler warning).
    slow_rank: int = -1
    slow_s: float = 0.0
    # With ft: only in the steps its replica group takes without all the others. A survivor
    # then waits for a lost group however long that group's restart takes, and trains at
    # full speed once it is back (rehearses a rejoin mid-run without a fixed margin).
    slow_alone: bool = False


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


def slow_down(fault: FaultConfig, rank: int, alone: bool) -> None:
    """On rank `fault.slow_rank`, sleep `fault.slow_s` seconds: a step that takes longer
    there (with `fault.slow_alone`, only while its replica group is `alone`)."""
    if rank == fault.slow_rank and (alone or not fault.slow_alone):
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
