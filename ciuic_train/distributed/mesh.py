"""The device mesh: how the ranks split into data-parallel replicas, shards and expert groups.

Three sizes describe a layout (`dist.dp_replicate`, `dist.dp_shard`, `dist.ep`):

- `dp_replicate` groups of ranks each hold a whole copy of the model; gradients are
  averaged across them (DDP when `dp_shard=1`, the outer dimension of HSDP otherwise).
- within a group, `dp_shard` ranks split every parameter between them (FSDP2).
- `ep` of those shard ranks also split the routed experts: each holds
  `n_routed_experts / ep` experts, whose parameters live only there, and tokens travel
  to their expert's rank and back (all-to-all). Expert-parallel ranks are shard ranks
  (as in torchtitan), so `ep` divides `dp_shard`; the `dp_shard / ep` ranks that hold the
  same experts ("efsdp") shard them further, as FSDP does any parameter.

A pipeline (`dist.pp`, ciuic_train/distributed/pipeline.py) is the outermost dimension:
`pp` groups of ranks each hold some of the layers, and the sizes above describe the data
parallelism within each stage, over its `world / pp` ranks. Global rank = pp rank x
(ranks per stage) + data rank: the ranks of a stage are neighbours (one node, where
they fit), so what crosses nodes is the pipeline's activations.

The torch mesh has the dimensions (dp_replicate, dp_shard), or (pp, dp_replicate,
dp_shard) for a pipeline; the experts see dp_shard split into (efsdp, ep).

`resolve_mesh` and `refuse_comm_hook` need no torch, so the CLI checks a layout, and what
needs DDP's gradient all-reduce on it, before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ciuic_train.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ciuic_train.config import DistConfig

REST = -1  # "what the world size leaves"


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: the ranks of one pipeline stage see the same."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Shard ranks that hold the same experts (and shard them between them)."""
        return self.dp_shard // self.ep

    @property
    def strategy(self) -> str:
        """none (one process per stage), ddp (replicas only), fsdp (shards only) or hsdp (both)."""
        if self.data_parallel_size == 1:
            return "none"
        if self.dp_shard == 1:
            return "ddp"
        return "fsdp" if self.dp_replicate == 1 else "hsdp"

    def describe(self) -> str:
        pipeline = f"pp={self.pp} x " if self.pp > 1 else ""
        return f"{pipeline}dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}, ep={self.ep}"

    def as_dict(self) -> dict[str, int]:
        pipeline = {"pp": self.pp} if self.pp > 1 else {}  # a pp key only where there is a pipeline
        return {**pipeline, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "ep": self.ep}


def expected_world(cfg: DistConfig, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(world size, ranks per node) of the job `cfg` describes, before any process group.

    A launcher that started this process says so (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`);
    otherwise the job will have `dist.nnodes x dist.nproc_per_node` ranks. `--plan` passes
    an empty `environ`: it describes the config, whatever launched the command.
    """
    world_size = int(environ.get("WORLD_SIZE", cfg.nnodes * cfg.nproc_per_node))
    return world_size, int(environ.get("LOCAL_WORLD_SIZE", cfg.nproc_per_node))


def expected_mesh(cfg: DistConfig, n_routed_experts: int, environ: Mapping[str, str] = os.environ) -> MeshShape:
    """The mesh the job `cfg` describes will resolve to (`expected_world`, `resolve_mesh`)."""
    return resolve_mesh(cfg, *expected_world(cfg, environ), n_routed_experts)


def resolve_mesh(cfg: DistConfig, world_size: int, local_world_size: int, n_routed_experts: int) -> MeshShape:
    """The mesh `cfg` asks for on `world_size` ranks (`local_world_size` per node), checked.

    `dist.strategy` is a shorthand: `ddp` replicates only, `fsdp` shards only, `hsdp`
    shards within a node and replicates across nodes; `auto` takes the sizes as given.
    A size of -1 takes what the others leave (`dp_shard` first). Any combination that
    does not multiply out, or that contradicts the strategy, is a one-line error; a value
    no world size could make right is `check_dist`'s (distributed/checks.py), run first.
    """
    if world_size % cfg.pp:
        raise UserError(
            f"dist.pp={cfg.pp} must divide the world size {world_size} (each pipeline stage gets world / pp "
            f"ranks); run a multiple of {cfg.pp} ranks"
        )
    world_size //= cfg.pp  # from here on, the ranks of one stage
    # How the messages below name those ranks.
    size = "world size" if cfg.pp == 1 else f"stage size (world size / dist.pp={cfg.pp})"
    strategy = cfg.strategy.value
    if strategy == "none" and world_size > 1:
        raise UserError(
            f"dist.strategy=none with {size} {world_size} would train unsynchronised replicas; "
            "use ddp, fsdp or hsdp"
        )
    replicate, shard = cfg.dp_replicate, cfg.dp_shard
    if strategy == "ddp":
        _require(shard in (1, REST) and cfg.ep in (1, REST), cfg, "dist.strategy=ddp replicates only: "
                 "it needs dist.dp_shard=1 and dist.ep=1 (use dist.strategy=fsdp or hsdp to shard)")
        shard = 1
    elif strategy == "fsdp":
        _require(replicate in (1, REST), cfg, "dist.strategy=fsdp shards only: it needs dist.dp_replicate=1 "
                 "(use dist.strategy=hsdp to replicate across nodes)")
        replicate, shard = 1, REST if shard in (1, REST) else shard
    elif strategy == "hsdp":
        if shard in (1, REST):
            shard = min(local_world_size, world_size)
    if shard == REST:
        shard = world_size // (1 if replicate == REST else replicate)
    if replicate == REST:
        if world_size % shard:
            raise UserError(f"dist.dp_shard={shard} must divide the {size} {world_size} (dist.dp_replicate=-1 takes the rest)")
        replicate = world_size // shard
    if replicate * shard != world_size:
        raise UserError(
            f"dist.dp_replicate={replicate} x dist.dp_shard={shard} = {replicate * shard} ranks, "
            f"but the {size} is {world_size}"
        )
    if strategy == "hsdp" and world_size > 1 and (replicate == 1 or shard == 1):
        raise UserError(
            f"dist.strategy=hsdp needs more than one replica and more than one shard, but on {world_size} "
            f"ranks it gets dp_replicate={replicate} x dp_shard={shard}; set dist.dp_shard or use fsdp"
        )
    ep = shard if cfg.ep == REST else cfg.ep
    if shard % ep:
        raise UserError(
            f"dist.ep={ep} must divide dist.dp_shard={shard} (expert-parallel ranks are shard ranks); "
            f"e.g. dist.dp_shard={ep * max(1, shard // ep)} dist.ep={ep}"
        )
    if n_routed_experts % ep:
        raise UserError(f"dist.ep={ep} must divide model.n_routed_experts={n_routed_experts}")
    return MeshShape(replicate, shard, ep, cfg.pp)


def refuse_comm_hook(trick: str | None, shape: MeshShape, log_grad_consistency: bool = False) -> None:
    """Refuse what needs DDP's gradient all-reduce where the mesh has none to offer: the
    one check, run by the CLI before anything starts and by `parallelize` before it wraps.

    - A trick's communication hook (`trick`: the trick that claims `comm_hook`) replaces
      DDP's all-reduce, which FSDP2 does not have.
    - `train.log_grad_consistency` needs each rank's own gradient next to the mean: DDP's
      gradients, averaged by hand on logging steps, which a trick's hook would not be.
    """
    sharded = shape.strategy in ("fsdp", "hsdp")
    if trick is not None and sharded:
        raise UserError(
            f"trick {trick} needs DDP's communication hook, which dist.strategy={shape.strategy} does not have "
            f"({shape.describe()}); use dist.dp_shard=1 dist.ep=1"
        )
    if log_grad_consistency and sharded:
        raise UserError(
            f"train.log_grad_consistency needs replicas' whole gradients (DDP); dist.strategy={shape.strategy} "
            f"shards them ({shape.describe()})"
        )
    if log_grad_consistency and trick is not None:
        raise UserError(
            f"train.log_grad_consistency averages gradients itself on logging steps, which would bypass "
            f"trick {trick}'s communication hook; use one or the other"
        )


def _require(condition: bool, cfg: DistConfig, message: str) -> None:
    if not condition:
        raise UserError(
            f"{message}; got dist.dp_replicate={cfg.dp_replicate} dist.dp_shard={cfg.dp_shard} dist.ep={cfg.ep}"
        )


class Mesh:
    """A `MeshShape` made real: torch's DeviceMesh over the process group, and its parts.

    With one process there is no process group and no DeviceMesh (`device_mesh` is None).
    The mesh is (dp_replicate, dp_shard); its expert view splits dp_shard into
    (efsdp, ep), so both views index the same ranks and FSDP can combine them.
    """

    def __init__(self, shape: MeshShape, device: torch.device):
        self.shape = shape
        self.device = device
        self.device_mesh: DeviceMesh | None = None
        self._expert_view: DeviceMesh | None = None
        if shape.world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            sizes, names = (shape.dp_replicate, shape.dp_shard), ("dp_replicate", "dp_shard")
            if shape.pp > 1:
                sizes, names = (shape.pp, *sizes), ("pp", *names)
            self.device_mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
            self._expert_view = self.device_mesh._unflatten(len(names) - 1, (shape.efsdp, shape.ep), ("efsdp", "ep"))

    @property
    def strategy(self) -> str:
        return self.shape.strategy

    def dense(self) -> DeviceMesh:
        """Where every parameter but the routed experts is sharded: 1-D for FSDP, 2-D for HSDP
        (and for a pipeline stage's replicas, which FSDP2 runs as HSDP with one shard)."""
        if self.shape.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    def experts(self) -> DeviceMesh:
        """The ranks that split the routed experts between them."""
        return self._expert_view["ep"]

    def expert_copies(self) -> DeviceMesh:
        """The ranks that hold the same experts: FSDP shards (and HSDP replicates) them here."""
        if self.shape.dp_replicate > 1:
            return self._expert_view["dp_replicate", "efsdp"]
        return self._expert_view["efsdp"]

    def pipeline(self) -> DeviceMesh:
        """The ranks of one pipeline, a rank per stage: this rank's data share in each stage."""
        return self.device_mesh["pp"]

    def replicas(self) -> DeviceMesh:
        """DDP's ranks (dp_shard=1: every rank)."""
        return self.device_mesh["dp_replicate"]
