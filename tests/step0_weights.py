"""Under torchrun (or alone): for each layout given, build a Trainer, gather every
parameter's step-0 value one at a time and, on rank 0, save them to OUT/<layout>.pt.

Usage: step0_weights.py OUT LAYOUTS_JSON OVERRIDE...: LAYOUTS_JSON maps a layout's name
to its own overrides (the mesh), added to the common ones. The layouts of one world size
share one launch and one process group (the trainers find it started), so
tests/test_init.py pays one start-up per world size, not one per layout, and compares
the files bit for bit.
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from conftest import compose_config
from ciuic_train.train.trainer import Trainer


def step0_weights(trainer: Trainer) -> dict:
    weights = {}
    for name, param in sorted(trainer.model.named_parameters()):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        weights[name] = full.detach().cpu().clone()
    buffers = {name: buffer.detach().cpu().clone() for name, buffer in trainer.model.named_buffers()}
    return {"params": weights, "buffers": buffers, "mesh": trainer.parallel.mesh.shape.as_dict()}


def main(out: str, layouts: str, *overrides: str) -> None:
    first = None
    for name, mesh in json.loads(layouts).items():
        trainer = Trainer(compose_config(*overrides, *mesh), Path(out) / f"run_{name}")
        found = step0_weights(trainer)
        if trainer.parallel.is_main:
            torch.save(found, Path(out) / f"{name}.pt")
        first = first or trainer.parallel  # the one that started the group ends it
        del trainer
        gc.collect()  # DDP's reducer and FSDP's state hold the group: gone before the next layout's
        if dist.is_initialized():
            dist.barrier()
    # As a run ends: a process that exits with its gloo group alive can abort in the
    # group's threads ("terminate called without an active exception", seen in CI).
    first.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
