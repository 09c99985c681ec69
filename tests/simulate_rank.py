"""Under torchrun: one real training step of the overrides' config on every rank, its
memory tracked as `--plan --simulate` tracks it; rank 0 writes the figures (JSON) to the
file named first.

tests/test_simulate.py compares them with the simulation of the same config on fake ranks.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from conftest import compose_config
from ciuic_train.distributed.materialize import local_rows
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.model.init import ParameterInit
from ciuic_train.plan.simulate import build_rank, measure_step


def main(out: str, *overrides: str) -> None:
    config = compose_config(*overrides)
    torch.manual_seed(config.seed)
    parallel = Parallel(config.dist, torch.device("cpu"), config.model.n_routed_experts)
    model, wrapped = build_rank(config, parallel.mesh, lambda built: built.init_weights(ParameterInit(config.seed, local_rows)))
    measured = measure_step(config, model, wrapped, parallel.strategy)
    if parallel.is_main:
        Path(out).write_text(json.dumps(dataclasses.asdict(measured)))
    parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
