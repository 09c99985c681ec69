"""A process's start-up with Python's cyclic garbage collector paused.

Starting a rank imports torch, DCP with DTensor and dynamo, and composes the config: some
hundreds of thousands of objects, each allocation counted towards the collector's next
pass, so that it walks the growing heap dozens of times, finding next to nothing to free
(modules, functions and classes live as long as the process). Paused, a tiny model's
start-up takes about 0.85 of the CPU time (docs/performance.md,
`python scripts/bench_startup.py`).

The collector runs again as soon as the work that makes and drops objects for hours
begins: the training steps, or the supervision of worker processes. What start-up made
(modules, the model, the optimizer) is then frozen: every later collection skips it
instead of walking it again, such as the full one a checkpoint's save sets off (a
tenth of a second each for a tiny model's rank). `gc.collect()` is never paused: code
that asks for a collection gets one.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def start_up() -> Iterator[None]:
    """Within: the collector paused. After: every object alive then frozen (`gc.freeze`:
    set aside from every later collection, as they will live as long as the run) and the
    collector running as before. `thaw` undoes the freeze."""
    was_running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_running:
            gc.enable()


def thaw() -> None:
    """After a job: what its start-up froze is collected again, and at once: the job's
    cycles (its trainer, model and optimizer) are freed before the next job a sweep runs
    in this process starts up, which would otherwise freeze them for its whole run."""
    gc.unfreeze()
    gc.collect()
