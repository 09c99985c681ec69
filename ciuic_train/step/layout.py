"""The one step that lays a run's model out on its ranks: the whole model on every rank
or a pipeline's stages, chosen here and nowhere else from `dist.pp`.

`build_layout` takes the `Transformer` built on the meta device and returns the layout's
`Passes` (`step/passes.py`), with what the trainer keeps beside them. Either way
`parallelize` then wraps, materializes and initializes what this rank holds (a pipeline's
stage modules as FSDP2's roots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ciuic_train.config import Config
from ciuic_train.distributed.parallelize import parallelize
from ciuic_train.distributed.pipeline import Pipeline
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.model import Transformer
from ciuic_train.step.passes import ModelPasses, Passes


@dataclass
class Layout:
    """`passes`: how a micro-batch goes forward and backward on this rank; `wrapped_model`:
    the module whose train/eval mode the loop switches; `whole_shape`: the whole model's
    shape on meta, for counts, whatever part of it this rank holds."""

    passes: Passes
    wrapped_model: nn.Module
    whole_shape: Transformer


def build_layout(model: Transformer, parallel: Parallel, config: Config, tricks: Any, autocast: Any,
                 init: Callable[[nn.Module], None]) -> Layout:
    """Lay `model` (built on meta) out as `dist.*` asks, materialized and `init`ialized."""
    if config.dist.pp > 1:
        with torch.device("meta"):
            whole_shape = Transformer(config.model)
        pipeline = Pipeline(model, parallel, config, autocast)  # keeps only this rank's stages' parts
        wrapped = parallelize(model, parallel.mesh, config, tricks.comm_hook(), init=init, fsdp_roots=pipeline.stages)
        return Layout(pipeline, wrapped, whole_shape)
    wrapped = parallelize(model, parallel.mesh, config, tricks.comm_hook(), init=init)
    passes = ModelPasses(model, wrapped, config, strategy=parallel.strategy, rank=parallel.info.rank,
                         all_reduce=parallel.all_reduce_sum_, transform_loss=tricks.transform_loss, autocast=autocast)
    return Layout(passes, wrapped, model)
