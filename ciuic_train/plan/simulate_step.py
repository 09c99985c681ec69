"""One training step of one rank, its memory counted by what each tensor is.

`measure_step` is the step `--plan --simulate` runs on fake tensors (`simulate.py`), and
the one tests/simulate_rank.py runs on a real gloo group to check the simulation: the
same code, so the two can be compared byte for byte. It is the trainer's own step
(`step/training_step.py`) without what only logs or agrees across ranks at its seams:
forward and backward over `train.grad_accum` micro-batches under the run's autocast
(gradients synchronised on the last), the clipping across meshes, the AdamW step, the
balancing step. AdamW's moments are
allocated before it (`allocate_state`), as in every step after the first, so the peak
is the steady state's, which is what `--plan` estimates.

torch's trackers (`torch.distributed._tools`) count the bytes of every storage an
operation creates, by category, and keep the snapshot of the largest total. Under FSDP2
`FSDPMemTracker` tells sharded from gathered parameters and gradients; elsewhere
`MemTracker`. Their categories, in `--plan`'s terms (`CATEGORIES`): parameters,
gradients, optimizer (AdamW's moments and step counts), fsdp (gathered parameters and
gradients, all-gather and reduce-scatter buffers), activations (what forward and the
recomputation of checkpointed blocks keep), temporaries (what backward creates: the
activations' gradients), other (buffers, the batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator
from unittest import mock

import torch
from torch import nn

from ciuic_train.config import Config, Precision
from ciuic_train.step.passes import ModelPasses
from ciuic_train.step.training_step import MicroBatch, StepSeams, training_step

CATEGORIES = {
    "Sharded Param": "parameters", "Parameter": "parameters",
    "Sharded Grad": "gradients", "Gradient": "gradients",
    "OptState": "optimizer", "Optstate": "optimizer",
    "Unsharded Param": "fsdp", "All Gather": "fsdp", "Unsharded Grad": "fsdp", "Reduce Scatter": "fsdp",
    "Activation": "activations",
    "Temp": "temporaries",
    "Buffer": "other", "Inputs": "other", "Other": "other",
}


@dataclass
class Measured:
    """One step's memory on one rank, in bytes by category (the values of `CATEGORIES`).

    `at_peak`: what each category held when the total peaked (`peak`); `largest`: the
    most each held at any module boundary of the step, or at its end, where the
    gradients and the optimizer state are whole (at the peak they may not be yet).
    """

    at_peak: dict[str, int]
    largest: dict[str, int]
    peak: int
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    uniform_routing: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)


def measure_step(config: Config, model: nn.Module, wrapped: nn.Module, strategy: str) -> Measured:
    """One training step of `wrapped` (what `parallelize` returned for `model`), its memory
    tracked by category; `strategy` is the mesh's (`MeshShape.strategy`). The step is the
    trainer's (`training_step` through `ModelPasses`), its batches random tokens."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from ciuic_train.step.optim import build_optimizer

    t, device = config.train, next(model.parameters()).device
    optimizer = build_optimizer(model, config.optim, t.lr)
    allocate_state(optimizer)
    sharded = strategy in ("fsdp", "hsdp")
    tracker = tracker_class()(model, optimizer) if sharded else MemTracker()
    if not sharded:
        tracker.track_external(model, optimizer)
    bf16 = config.precision is Precision.bf16
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else None
    passes = ModelPasses(model, wrapped, config, strategy=strategy, all_reduce=sum_over_ranks, autocast=autocast)
    seams = ModuleSnapshots(tracker)
    wrapped.train()
    with tracker:
        training_step(passes, optimizer, random_batches(config, device, t.batch_size), t.grad_accum, 0,
                      t.grad_clip if t.grad_clip > 0 else float("inf"), seams)
    return measured_from(tracker, seams.taken)


def random_batches(config: Config, device: torch.device, rows: int) -> Iterator[MicroBatch]:
    """A step's `train.grad_accum` micro-batches of random tokens, made as the step reaches each."""
    for _ in range(config.train.grad_accum):
        tokens = torch.randint(0, config.model.vocab_size, (rows, config.train.seq_len + 1), device=device)
        yield MicroBatch(tokens[:, :-1], tokens[:, 1:])


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The experts' token counts summed over the ranks, as `Parallel.all_reduce_sum_` does
    (a fake process group's all-reduce in a simulation)."""
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor)
    return tensor


class ModuleSnapshots(StepSeams):
    """The tracker's snapshots: each module's after every micro-batch, the whole after the
    update (where the gradients and the optimizer state are whole)."""

    def __init__(self, tracker: Any):
        self.tracker, self.taken = tracker, []

    def after_micro_batch(self) -> None:
        # The modules' snapshots of this micro-batch; the tracker takes a second forward
        # of the model only without them (the peak is kept apart).
        self.taken += [snapshot for stats in self.tracker.memory_tracking.values()
                       for group in stats.snapshots.values() for snapshot in group]
        self.tracker.reset_mod_stats()

    def after_update(self) -> None:
        self.taken.append(self.tracker.get_tracker_snapshot())


def measured_from(tracker: Any, snapshots: list[dict]) -> Measured:
    """What `tracker` saw: its peak, and the most of each category over `snapshots` and the peak."""
    peak = tracker.get_tracker_snapshot("peak")
    largest = dict.fromkeys(by_category(peak), 0)
    for snapshot in [*snapshots, peak]:
        for name, value in by_category(snapshot).items():
            largest[name] = max(largest[name], value)
    at_peak = by_category(peak)
    return Measured(at_peak, largest, sum(at_peak.values()))


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as after a first step: one step over zero gradients at lr 0, which
    allocates it and moves no weight."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def by_category(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A tracker snapshot ({device: {reference type: bytes, "Total": bytes}}) by category."""
    out = dict.fromkeys(CATEGORIES.values(), 0)
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", key)
            if name in CATEGORIES:
                out[CATEGORIES[name]] += value
    return out


def tracker_class() -> type:
    """`FSDPMemTracker` for FSDP2 units with several parameter groups.

    Under expert parallelism a block's experts are sharded on a mesh of their own, and
    FSDP2 keeps them in a second parameter group of the unit; torch 2.13's tracker reads
    one group per unit (`FSDPState._fsdp_param_group`, which refuses several). While it
    tracks, that property answers with all of a unit's groups as one (`_Groups`), and the
    groups past the first get the backward instrumentation the first gets.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    class Tracker(FSDPMemTracker):
        def __enter__(self):
            if self._depth == 0:
                self._as_one_group = mock.patch.object(FSDPState, "_fsdp_param_group", property(_Groups.of))
                self._as_one_group.start()
            return super().__enter__()

        def __exit__(self, *args):
            super().__exit__(*args)
            if self._depth == 0:
                self._as_one_group.stop()

        def _register_module_and_optimizer_hooks(self) -> None:
            super()._register_module_and_optimizer_hooks()
            self._more_groups = []
            for module in self._root_mod.modules():
                if isinstance(module, FSDPModule):
                    for group in module._get_fsdp_state()._fsdp_param_groups[1:]:
                        self._more_groups.append((group, group.pre_backward, group.post_backward))
                        group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
                        group.post_backward = self._fsdp_param_group_post_backward(module, group.post_backward)

        def _deregister_module_and_optimizer_hooks(self) -> None:
            for group, pre_backward, post_backward in self._more_groups:
                group.pre_backward, group.post_backward = pre_backward, post_backward
            super()._deregister_module_and_optimizer_hooks()

    return Tracker


class _Groups:
    """A unit's FSDP2 parameter groups as the one group FSDPMemTracker reads: the
    parameters of all of them, and otherwise the first group (its backward methods,
    which the tracker wraps)."""

    def __init__(self, groups: list):
        object.__setattr__(self, "groups", groups)

    @staticmethod
    def of(state) -> Any:
        groups = state._fsdp_param_groups
        return _Groups(groups) if len(groups) > 1 else (groups[0] if groups else None)

    @property
    def fsdp_params(self) -> list:
        return [param for group in self.groups for param in group.fsdp_params]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.groups[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.groups[0], name, value)
