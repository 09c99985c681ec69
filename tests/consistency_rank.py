"""Under torchrun: `average_gradients_with_consistency` on real ranks, checked against the
same figures computed independently (in float64, from every rank's gradients gathered).

Each rank's gradients are drawn from a generator seeded by its rank, with a part shared
by all ranks so the cosines are neither 0 nor 1. Rank 0 writes what it found (JSON) to
the file named first; tests/test_trainer.py reads it.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ciuic_train.config import DistConfig
from ciuic_train.distributed.grads import average_gradients_with_consistency
from ciuic_train.distributed.process_group import Parallel

SHAPES = [(7, 5), (11,), (3, 4, 2)]


def main(out: str) -> None:
    parallel = Parallel(DistConfig(), torch.device("cpu"), n_routed_experts=0)
    rank, world = parallel.info.rank, parallel.world_size
    shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1 + rank)
    params = [nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=shared) + 0.8 * torch.randn(p.shape, generator=own)
    local = torch.cat([p.grad.reshape(-1) for p in params])
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)  # before the call replaces the gradients by their mean

    measured = average_gradients_with_consistency(params, parallel)

    stacked = torch.stack(everyone).double()
    mean = stacked.mean(0)
    cosines = [float(torch.dot(g, mean) / (g.norm() * mean.norm())) for g in stacked]
    averaged = torch.cat([p.grad.reshape(-1) for p in params]).double()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "measured": measured, "expected": sum(cosines) / world, "cosines": cosines,
            "max_grad_error": float((averaged - mean).abs().max()),
        }))
    parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
