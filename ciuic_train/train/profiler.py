"""`profile.enabled=true`: torch.profiler traces of a few training steps, one file per rank.

torch's schedule (`torch.profiler.schedule`) decides which steps are traced: per cycle
`profile.wait` steps untraced, `profile.warmup` traced and dropped (the profiler's own
start-up would skew them), `profile.active` recorded; `profile.repeat` cycles, 0 for as
many as the run holds. Each cycle writes RUN/profile/rank<R>.<ns>.pt.trace.json, Chrome's
trace format, which TensorBoard's profiler plugin (`tensorboard --logdir RUN/profile`) and
Perfetto (ui.perfetto.dev) open. With `profile.memory=true` the trace holds allocations,
and a CUDA rank also records its allocator's history, written at the end as
RUN/profile/memory_rank<R>.pickle (pytorch.org/memory_viz draws it). At the end rank 0
logs the operators with the most self time in its last recorded cycle.

Off (the default), `profiled_steps` yields a function that does nothing: no profiler is
created and nothing is recorded.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from ciuic_train.config import ProfileConfig

log = logging.getLogger("ciuic_train")

PROFILE_DIR = "profile"
# Allocator events a CUDA memory history keeps (the newest; each costs ~0.5 KB of host memory).
MEMORY_HISTORY_EVENTS = 100_000


@contextmanager
def profiled_steps(config: ProfileConfig, run_dir: Path, rank: int, device: torch.device) -> Iterator[Callable[[], None]]:
    """Profile the steps run inside; call what it yields once after each training step."""
    if not config.enabled:
        yield lambda: None
        return
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    folder = run_dir / PROFILE_DIR
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda and config.memory:
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_EVENTS)
    profiler = profile(
        activities=activities,
        schedule=schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=config.repeat),
        on_trace_ready=tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}"),
        record_shapes=config.record_shapes,
        profile_memory=config.memory,
    )
    with profiler:
        yield profiler.step
    if cuda and config.memory:
        torch.cuda.memory._dump_snapshot(str(folder / f"memory_rank{rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = sorted(folder.glob(f"rank{rank}.*.pt.trace.json"))
    if rank == 0:
        _log_top_operators(profiler, config, cuda, len(traces), folder)


def _log_top_operators(profiler, config: ProfileConfig, cuda: bool, n_traces: int, folder: Path) -> None:
    if not n_traces:  # the run ended inside its first cycle (a stop signal)
        log.warning(f"profile: the run ended before a cycle of {config.active} recorded steps; no trace in {folder}")
        return
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = profiler.key_averages(group_by_input_shape=config.record_shapes).table(sort_by=sort_by, row_limit=config.top)
    log.info(f"profile: {n_traces} trace(s) per rank in {folder}; the top operators of rank 0's last "
             f"{config.active} recorded steps, by self time:\n{table}")
