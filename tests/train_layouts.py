"""Several training runs in one launch: each layout trained by a Trainer in a run folder of
its own, which holds what `ciuic-train` writes there (metrics.jsonl, summary.json,
checkpoints/).

`train_layouts.py OUT LAYOUTS_JSON OVERRIDE...`, under torchrun (`launch_layouts`):
LAYOUTS_JSON maps a layout's name to its own overrides, added to the common ones; layout
NAME trains in OUT/NAME. The layouts share one launch and one process group (each
Trainer finds it started), so a test module pays one start-up for all its runs of one
world size instead of one per run: a two-rank launch here is about 9 CPU-seconds of
imports and rendezvous before the first step, a tiny model's 20 steps about 2. One-process
references train in the test's own process (`train_here`), which has paid its imports.

What the CLI adds around a Trainer (the checks before a run, the run folder's lock,
Hydra's logging, the sample) is not here: tests that claim those launch `ciuic-train`.
"""

import gc
import json
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from conftest import compose_config, torchrun
from ciuic_train.train.trainer import Trainer


def train_layouts(out: Path, layouts: dict[str, list[str]], *overrides: str,
                  fit: Callable[[Trainer], object] = Trainer.fit) -> dict[str, Path]:
    """Train each layout (name -> its overrides) in `out`/name, one after the other, each
    Trainer handed to `fit` (a script that records more than the run folder holds wraps
    `Trainer.fit`: tests/bf16_rank.py); returns the run folders."""
    runs, first = {}, None
    for name, own in layouts.items():
        runs[name] = out / name
        runs[name].mkdir(parents=True, exist_ok=True)  # as the CLI makes it
        trainer = Trainer(compose_config(*overrides, *own), runs[name])
        fit(trainer)
        first = first or trainer.parallel  # the one that started the group ends it
        del trainer
        gc.collect()  # DDP's reducer, FSDP's state and the stages hold the group: gone before the next layout's
        if dist.is_initialized():
            dist.barrier()
    if first is not None:
        first.close()
    return runs


def launch_layouts(folder: Path, ranks: int, layouts: dict[str, list[str]], *overrides: str) -> dict[str, Path]:
    """`train_layouts` on `ranks` ranks, in one torchrun launch; returns the run folders."""
    folder.mkdir(parents=True, exist_ok=True)
    result = torchrun(f"--nproc_per_node={ranks}", __file__, str(folder), json.dumps(layouts), *overrides,
                      cwd=folder, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: folder / name for name in layouts}


def train_here(folder: Path, layouts: dict[str, list[str]], *overrides: str) -> dict[str, Path]:
    """`train_layouts` in this process, on one thread as each rank of a launch is."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_layouts(folder, layouts, *overrides)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    out, layouts, *common = sys.argv[1:]
    train_layouts(Path(out), json.loads(layouts), *common)
