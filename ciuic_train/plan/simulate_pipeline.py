"""`--plan --simulate` for a pipeline: pipeline rank 0's stages, one step on fake tensors.

The rank is built as the trainer builds it (`keep_stage_parts`, `stage_modules`, then
`parallelize` with the stage modules as FSDP2's roots) and runs the trainer's step
(`step/training_step.py`) with `SimulatedStages` as its passes: each of the step's
`train.grad_accum` batches cut into the schedule's micro-batches, its actions run in the
schedule's order (`plan/pipeline.py`'s `schedule_order`), its memory counted by category as
`simulate_step.measure_step` counts a whole model's step. What the rank would receive
from its neighbours is made up, with the shapes the schedule sends: the previous stage's
hidden states for each forward, gradients for the stage's output for each backward (the
last stage's starts from its loss); nothing crosses between ranks but the collectives
inside a stage. A split backward (zbv, dualpipev) runs whole at its first half, so those
schedules' activations are freed earlier than `--plan`'s bound assumes (at the weight
half). FSDP2 syncs a stage's gradients on its last micro-batch only, as torch's schedules
make it.

The tracker follows one FSDP2 root (torch 2.13's `FSDPMemTracker`), so with data
parallelism in the stages only one stage per rank is simulated (`check_simulable`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn

from ciuic_train.config import Config, Precision
from ciuic_train.distributed.mesh import Mesh, MeshShape
from ciuic_train.distributed.pipeline_split import n_microbatches, stages_of_rank
from ciuic_train.errors import UserError
from ciuic_train.distributed.grads import clip_grad_norm_
from ciuic_train.distributed.pipeline import residual_dtype
from ciuic_train.plan.simulate_step import Measured, allocate_state, measured_from, random_batches, tracker_class
from ciuic_train.step.training_step import StepSeams, training_step


def _without_module_stats(tracker: type) -> type:
    """`tracker` without its per-module statistics, which torch 2.13 keeps for one forward of
    a top-level module at a time, where a pipeline rank runs several micro-batches' forwards
    before their backwards. What a tensor is still follows from where it was made (forward,
    backward, the optimizer); the step's snapshots are taken after each action instead."""

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class WithoutModuleStats(tracker):
        def __init__(self, *args: Any):
            super().__init__(*args)
            self.seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()

        def _pre_fw_hook(self, module, inputs) -> None:
            # The one thing kept: a module's parameters, and the hooks that tell their
            # gradients, as the tracker's own hook registers them at a module's first forward.
            if not isinstance(self, FSDPMemTracker) and module not in self.seen:
                self.seen.add(module)
                self._track_module_params_and_buffers(module, install_grad_hooks=True)

        def _post_fw_hook(self, *args) -> None:
            pass

        def _pre_bw_hook(self, *args) -> None:
            pass

        def _post_bw_hook(self, *args) -> None:
            pass

    return WithoutModuleStats


class _Forward(nn.Module):
    """Runs a stage's forward inside its own, so that the stage (an FSDP2 root) is not a
    top-level module called again, which torch 2.13's FSDPMemTracker takes for the next
    iteration and refuses: a pipeline rank runs several micro-batches' forwards in a step."""

    def forward(self, stage: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        return stage(*args)


def check_simulable(config: Config, shape: MeshShape) -> None:
    """Refuse, in one line, a pipeline rank the tracker cannot follow (module docstring)."""
    if shape.strategy != "none" and config.dist.pp_stages_per_rank > 1:
        raise UserError(
            f"--simulate follows one FSDP2 root per rank, and dist.pp_stages_per_rank="
            f"{config.dist.pp_stages_per_rank} with data parallelism in the stages ({shape.describe()}) gives a rank "
            "more; simulate gpipe or 1f1b, or --plan alone"
        )


def build_pipeline_rank(config: Config, mesh: Mesh, pp_rank: int,
                        fake: contextlib.AbstractContextManager | None = None) -> tuple[nn.Module, list[nn.Module]]:
    """Pipeline rank `pp_rank`'s model (its parts, named as the whole model's) and its stage
    modules, built, parallelized and materialized as the trainer does."""
    from ciuic_train.distributed.parallelize import parallelize
    from ciuic_train.distributed.pipeline import keep_stage_parts, split_layers, stage_modules
    from ciuic_train.model import Transformer

    with torch.device("meta"):
        model = Transformer(config.model)
    split = split_layers(model, config)
    stage_ids = stages_of_rank(pp_rank, config.dist)
    keep_stage_parts(model, stage_ids, split)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if config.precision is Precision.bf16 else None
    stages = stage_modules(model, stage_ids, split, config, autocast)
    with fake or nullcontext():
        if fake is not None:  # as `simulate.build_rank`: fake tensors in place of the meta ones
            model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=mesh.device))
        parallelize(model, mesh, config, fsdp_roots=stages)
    return model, stages


def measure_pipeline_step(config: Config, model: nn.Module, stages: list[Any], actions: list[tuple[str, int, int]],
                          shape: MeshShape) -> Measured:
    """One optimizer step of a pipeline rank's `stages` in the order of `actions`, its memory
    tracked by category (module docstring): the trainer's step (`training_step`), with
    `SimulatedStages` as the layout's passes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from ciuic_train.step.optim import build_optimizer

    t = config.train
    device = next(model.parameters()).device
    optimizer = build_optimizer(model, config.optim, t.lr)
    allocate_state(optimizer)
    sharded = shape.strategy != "none"  # every data-parallel layout of a stage is FSDP2
    tracker = _without_module_stats(tracker_class() if sharded else MemTracker)(
        *((stages[0], optimizer) if sharded else ()))
    if not sharded:
        tracker.track_external(model, optimizer)
    snapshots = Snapshots(tracker)
    passes = SimulatedStages(config, model, stages, actions, shape, snapshots.take)
    model.train()
    with tracker:
        training_step(passes, optimizer, random_batches(config, device, t.batch_size), t.grad_accum, 0,
                      t.grad_clip if t.grad_clip > 0 else float("inf"), snapshots)
    for stage in stages:
        stage.figures = []
    return measured_from(tracker, snapshots.taken)


class Snapshots(StepSeams):
    """The tracker's snapshot after each action of the schedule (`take`) and after the update."""

    def __init__(self, tracker: Any):
        self.tracker, self.taken = tracker, []

    def take(self) -> None:
        self.taken.append(self.tracker.get_tracker_snapshot())

    def after_update(self) -> None:
        self.take()


class SimulatedStages:
    """A pipeline rank's stages as the step's passes (`StepPasses`): each batch cut into the
    schedule's micro-batches, its actions run in the schedule's order, with what the
    neighbours would send made up in the shapes they send it."""

    def __init__(self, config: Config, model: nn.Module, stages: list[Any], actions: list[tuple[str, int, int]],
                 shape: MeshShape, after_action: Callable[[], None]):
        self.config, self.model, self.actions, self.after_action = config, model, actions, after_action
        self.by_index = {stage.index: stage for stage in stages}
        self.sharded = shape.strategy != "none"
        self.hidden_dtype = residual_dtype(config, shape)
        self.forward = _Forward()

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float, step: int,
              sync: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        micro = n_microbatches(self.config.dist)
        rows = inputs.shape[0] // micro
        tokens, answers = inputs.split(rows), targets.split(rows)
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        backwards: Counter[int] = Counter()
        for kind, index, mb in self.actions:
            stage = self.by_index[index]
            if kind == "F":
                x = tokens[mb] if stage.is_first else torch.randn(
                    rows, inputs.shape[1], self.model.config.dim, dtype=self.hidden_dtype, device=inputs.device,
                    requires_grad=True)
                outputs[(index, mb)] = self.forward(stage, x, tokens[mb], answers[mb])
            elif kind in ("B", "I"):
                out = outputs.pop((index, mb))
                backwards[index] += 1
                if self.sharded:
                    stage.set_requires_gradient_sync(sync and backwards[index] == micro)
                out.backward(None if stage.is_last else torch.randn_like(out))
            self.after_action()
        return torch.zeros((), device=inputs.device), {}

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(list(self.model.parameters()), max_norm)

    def balance_experts(self) -> torch.Tensor:
        return self.model.balance_experts()

    def grads_are_bucket_views(self) -> bool:
        return False
