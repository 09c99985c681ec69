"""`ciuic-train ... --plan --simulate`: rank 0 of the planned cluster, one step on this machine.

`--plan`'s memory figures are formulas; this measures them, without the cluster. In one
process, rank 0 joins a fake process group of the planned world size
(`torch.testing._internal.distributed.fake_pg`: every collective returns at once and
moves nothing), builds the model as the trainer does (on meta, then `parallelize`) under
`FakeTensorMode`, whose tensors have shapes and dtypes but no storage, and runs one
training step, its memory counted by category (`simulate_step.py`). DeepSeek-V3's rank
of 2048 takes minutes on two CPU cores and well under a GiB of real memory. For a
pipeline, the rank is pipeline rank 0, its stages run in the schedule's order
(`simulate_pipeline.py`).

Fake tensors hold no values, so what depends on values is assumed (`prepare_rank`):

- routing: the counts per expert decide which rows go where, but not how many the
  step holds, except under expert parallelism: the rows a rank receives are what the
  other ranks routed to its experts. There every rank sends every other as many rows
  (`ExpertDispatch.split_sizes` gets `_uniform_split_sizes`), as `--plan` assumes; the
  output says so. The loop over experts (fp32 on CUDA) splits its rows evenly too.
- the device: the tensors are CPU tensors. A rank on CUDA (`device=cuda`, or `auto` as
  `--plan` reads it) runs what CUDA would where the package asks: fused SDPA for attention, the unpadded grouped matmul in bf16
  and the loop over experts otherwise (`_cuda_routed_experts`). Autocast is the CPU's,
  whose casts the model's matmuls share; the CUDA allocator's 512-byte rounding is left out.
- `compile=true` is not simulated: the blocks run eagerly (--plan does not model it either).

Three things torch does not do under fake tensors are arranged for while a simulation
runs, each where it is defined: `torch._grouped_mm`'s meta function takes bf16 only
(`_GroupedMMShapes`), a DeviceMesh finds its rank by reading values
(`_meshes_find_their_ranks`), and DTensor would infer shapes under the simulation's
FakeTensorMode, where the tracker counts them (`_dtensor_shapes_apart`).

The model is built by `build_rank`, which tests/simulate_rank.py also calls on a real
gloo group, so tests/test_simulate.py compares the simulation with real ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ciuic_train.config import Config, Device
from ciuic_train.distributed.mesh import Mesh, MeshShape
from ciuic_train.errors import UserError
from ciuic_train.plan.figures import resolve_plan_mesh
from ciuic_train.plan.simulate_step import Measured, measure_step


def simulate(config: Config) -> Measured:
    """Rank 0 of the cluster `config` plans, one training step on fake tensors.

    Raises UserError where `simulable_mesh` does, before anything is built.
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shape = simulable_mesh(config)
    cuda = config.device is not Device.cpu
    notes = ["compile=true is not simulated: the blocks run eagerly"] if config.compile else []
    config = dataclasses.replace(config, compile=False)
    start, cpu_start = time.perf_counter(), time.process_time()
    if shape.world_size > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=shape.world_size)
    try:
        mesh = Mesh(shape, torch.device("cpu"))
        # A ShapeEnv turns `.item()` (the gradient norm, the load imbalance) into a symbol
        # instead of an error; nothing of the step branches on those values.
        fake = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        with _meshes_find_their_ranks(), _dtensor_shapes_apart():
            if shape.pp > 1:  # pipeline rank 0's stages (simulate_pipeline.py)
                from ciuic_train.plan.pipeline import schedule_order
                from ciuic_train.plan.simulate_pipeline import build_pipeline_rank, measure_pipeline_step

                model, stages = build_pipeline_rank(config, mesh, 0, fake=_fake_tensors(fake))
                actions = schedule_order(config.dist)[0]
                step = functools.partial(measure_pipeline_step, config, model, stages, actions, shape)
            else:
                model, wrapped = build_rank(config, mesh, fake=_fake_tensors(fake))
                step = functools.partial(measure_step, config, model, wrapped, mesh.strategy)
            with _fake_tensors(fake):
                uniform = prepare_rank(model, cuda)
                measured = step()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    measured.seconds, measured.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    measured.uniform_routing = uniform
    measured.notes += notes
    return measured


# The simulation's table, row by row: a label, the categories it sums (`simulate_step.CATEGORIES`),
# and --plan's figure for it, from its memory figures and "ac" or "no_ac".
SIMULATED_ROWS = (
    ("parameters", ("parameters",), lambda mem, ac: sum(mem["params"].values())),
    ("gradients", ("gradients",), lambda mem, ac: sum(mem["grads"].values())),
    ("AdamW state", ("optimizer",), lambda mem, ac: sum(mem["optimizer"].values())),
    ("FSDP gathers, unsharded grads", ("fsdp",), lambda mem, ac: mem["fsdp_buffers"] + mem["accumulated_grads"]),
    ("activations", ("activations",), lambda mem, ac: mem["activations"][ac]),
    ("temporaries (backward)", ("temporaries",), None),
    ("buffers, the batch", ("other",), None),
)


def simulated_rank_figures(figures: dict) -> dict:
    """`plan_figures`' figures for the rank a simulation steps: rank 0, whose memory a
    pipeline's figures give per pipeline rank."""
    if "pipeline" not in figures:
        return figures
    return {**figures, "memory": figures["pipeline"]["ranks"][0]["memory"]}


def simulated_rows(config: Config, figures: dict, measured: Measured) -> list[tuple[str, int, int, int | None]]:
    """(label, bytes at the simulated peak, the most in the step, --plan's figure or None)
    for each of `SIMULATED_ROWS`, then the peak beside --plan's total."""
    mem, ac = figures["memory"], "ac" if config.activation_checkpointing else "no_ac"
    rows = []
    for label, categories, planned in SIMULATED_ROWS:
        at_peak = sum(measured.at_peak[c] for c in categories)
        largest = sum(measured.largest[c] for c in categories)
        rows.append((label, at_peak, largest, planned(mem, ac) if planned else None))
    rows.append(("peak (--plan: total)", measured.peak, measured.peak, mem["total"][ac]))
    return rows


def simulation_table(config: Config, figures: dict, measured: Measured):
    """The simulated step's memory beside `figures` (`plan_figures(config)`), as a rich table.

    A category's "most in the step" is what --plan's figure for it estimates; "at the
    peak" is what it held when the total peaked, which the peak row sums.
    """
    from rich.table import Table

    from ciuic_train.files import format_bytes

    notes = [f"{measured.seconds:.0f} s ({measured.cpu_seconds:.0f} s of CPU)"]
    if measured.uniform_routing:
        notes.append("expert dispatch used uniform counts (every rank sends every rank as many rows), as --plan assumes")
    table = Table(
        title=f"simulated: rank 0 of {figures['world_size']}, one training step on fake tensors",
        caption="; ".join(notes + measured.notes),
    )
    table.add_column("memory", style="bold")
    for column in ("at the peak", "most in the step", "--plan", "--plan / most"):
        table.add_column(column, justify="right")
    for label, at_peak, largest, planned in simulated_rows(config, figures, measured):
        ratio = f"{planned / largest:.2f}" if planned is not None and largest else ""
        shown = format_bytes(planned) if planned is not None else "-"
        table.add_row(label, format_bytes(at_peak), format_bytes(largest), shown, ratio)
    return table


def simulable_mesh(config: Config) -> MeshShape:
    """The mesh `config` plans, if a simulation can step it: raises UserError for a mesh
    `resolve_mesh` refuses, for DDP, whose reducer (C++) reads its tensors' data, and for a
    pipeline whose rank would hold several FSDP2 roots (`simulate_pipeline.check_simulable`)."""
    shape = resolve_plan_mesh(config)
    if shape.pp > 1:
        from ciuic_train.plan.simulate_pipeline import check_simulable

        check_simulable(config, shape)
        return shape  # a stage's replicas are FSDP2's, not DDP's
    if shape.strategy == "ddp":
        raise UserError(
            f"--simulate steps FSDP2 and one-process layouts, not DDP ({shape.describe()}), whose reducer "
            f"needs real tensors; simulate dist.dp_shard={shape.world_size} instead"
        )
    return shape


@contextlib.contextmanager
def _fake_tensors(mode) -> Iterator[None]:
    """`mode` (a FakeTensorMode), and `_GroupedMMShapes` above it."""
    with mode, _GroupedMMShapes():
        yield


@contextlib.contextmanager
def _meshes_find_their_ranks() -> Iterator[None]:
    """Let every DeviceMesh cut while the simulation runs (by `Mesh`'s parts, and by FSDP2
    for the experts' DTensors) find this rank in its tensor of ranks, outside FakeTensorMode,
    which would make that search depend on values it does not have."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    find, ranks = DeviceMesh._compute_coordinate_on_dim, DeviceMesh.mesh.fget

    def outside_fake_mode(mesh: DeviceMesh):
        with unset_fake_temporarily():
            return find(mesh)

    def ranks_outside_fake_mode(mesh: DeviceMesh):  # a pipeline's (pp, ...) mesh cut by FSDP2
        with unset_fake_temporarily():
            return ranks(mesh)

    with mock.patch.object(DeviceMesh, "_compute_coordinate_on_dim", outside_fake_mode), \
            mock.patch.object(DeviceMesh, "mesh", property(ranks_outside_fake_mode)):
        yield


def _dtensor_shapes_apart():
    """Let DTensor work out its outputs' shapes under a FakeTensorMode of its own, as it
    does outside a simulation, rather than reuse the simulation's.

    The tracker counts what is allocated under the FakeTensorMode it started in, and
    skips DTensor's shape inference only when that runs under another one; sharing the
    simulation's, the inference's stand-in tensors (the size of every gradient, for the
    clipping's foreach ops) would count as memory.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    own = FakeTensorMode()
    return mock.patch("torch.distributed.tensor._sharding_prop.detect_fake_mode", lambda *inputs: own)


def build_rank(
    config: Config,
    mesh: Mesh,
    init: Callable[[nn.Module], None] | None = None,
    fake: contextlib.AbstractContextManager | None = None,
) -> tuple[nn.Module, nn.Module]:
    """The model as the trainer builds it on this rank: on meta, then `parallelize`, which
    materializes this rank's shards on `mesh.device` and lets `init` fill them. Returns
    (model, what the step calls).

    `fake`: the FakeTensorMode (and what goes with it) to materialize and wrap the model
    in, for a simulation.
    """
    from ciuic_train.distributed.parallelize import parallelize
    from ciuic_train.model import Transformer

    with torch.device("meta"):  # outside FakeTensorMode, which would keep meta tensors it wraps
        model = Transformer(config.model)
    with fake or nullcontext():
        if fake is not None:
            # Fake tensors in place of the meta ones before `parallelize`, whose own
            # `to_empty` would go through FakeTensorMode's wrapping of the meta tensors,
            # which then cannot be swapped out (DDP's and one process's parameters).
            model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=mesh.device))
        wrapped = parallelize(model, mesh, config, init=init)
    return model, wrapped


def prepare_rank(model: nn.Module, cuda: bool) -> bool:
    """Give the model what fake tensors cannot: uniform counts where the step needs split
    sizes on the host, and CUDA's kernels for a CUDA rank. Returns whether the routing
    took uniform counts (under expert parallelism, where they decide what a rank holds)."""
    from ciuic_train.distributed.expert_parallel import ExpertDispatch
    from ciuic_train.model.attention import MultiHeadLatentAttention
    from ciuic_train.model.kernels import attention as fast_attention
    from ciuic_train.model.moe import MoE

    uniform = False
    for module in model.modules():
        if cuda and isinstance(module, MultiHeadLatentAttention) and module.attention is fast_attention.causal_attention:
            module.attention = fast_attention.padded_sdpa
        if not isinstance(module, MoE):
            continue
        if isinstance(module.dispatch, ExpertDispatch):
            module.dispatch.split_sizes = functools.partial(_uniform_split_sizes, module.dispatch.ep_size)
            uniform = True
        if cuda:
            module.routed_experts = _cuda_routed_experts
    return uniform


def _uniform_split_sizes(ep: int, rows: int, counts, received) -> tuple[list[int], list[int]]:
    """`ExpertDispatch.split_sizes` under uniform routing: `rows` spread evenly over the ep
    ranks (the first take the remainder), and from each rank as many as rank 0 keeps."""
    share = _even(rows, ep)
    return share, [share[0]] * ep


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _cuda_routed_experts(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """What `grouped_swiglu` runs on a CUDA GPU of sm80 or newer: one grouped matmul per
    projection in bf16, else the loop over experts, here over uniform counts."""
    from ciuic_train.model.common import compute_dtype, swiglu_grouped_mm, swiglu_of_groups

    dtype = compute_dtype(x)
    if dtype == torch.bfloat16:
        ends = counts.cumsum(0, dtype=torch.int32)
        return swiglu_grouped_mm(x.to(dtype), ends, w13.to(dtype), w2.to(dtype))
    return swiglu_of_groups(x, _even(len(x), len(w13)), w13, w2)


class _GroupedMMShapes(TorchDispatchMode):
    """`torch._grouped_mm` for the dtypes its CPU kernel takes beyond bf16, under fake tensors.

    Its meta function (torch 2.13) accepts bf16 only, the CUDA kernel's rule, so the fp32
    products of the CPU path would have no shape; this gives them the kernel's: rows x
    per-group matrices [M, n], per-group rows^T x rows [groups, m, n] (the weights'
    gradients), and the two batched forms.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        shape = {
            (2, 2): (len(offs) if offs is not None else 0, a.shape[0], b.shape[1]),
            (2, 3): (a.shape[0], b.shape[-1]),
            (3, 2): (a.shape[1], b.shape[1]),
            (3, 3): (a.shape[0], a.shape[1], b.shape[-1]),
        }[a.dim(), b.dim()]
        return torch.empty(shape, dtype=kwargs.get("out_dtype") or a.dtype, device=a.device)
