"""Under torchrun (or alone): build a Trainer from the overrides given, gather every
parameter's step-0 value one at a time and, on rank 0, save them to the file named first.

tests/test_init.py runs it once per layout and compares the files bit for bit.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from conftest import compose_config
from ciuic_train.train.trainer import Trainer


def main(out: str, *overrides: str) -> None:
    config = compose_config(*overrides)
    trainer = Trainer(config, Path(out).parent / f"run_{Path(out).stem}")
    weights = {}
    for name, param in sorted(trainer.model.named_parameters()):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        weights[name] = full.detach().cpu().clone()
    buffers = {name: buffer.detach().cpu().clone() for name, buffer in trainer.model.named_buffers()}
    if trainer.parallel.is_main:
        torch.save({"params": weights, "buffers": buffers, "mesh": trainer.parallel.mesh.shape.as_dict()}, out)
    # As a run ends: a process that exits with its gloo group alive can abort in the
    # group's threads ("terminate called without an active exception", seen in CI).
    trainer.parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
