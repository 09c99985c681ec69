"""Processes, the process group, and the collectives the trainer needs.

The trainer sees one `Parallel` object whatever the world size: with one process it has
no process group and every collective is the identity, so single-process training needs
nothing from torch.distributed. Rank, local rank and world size come from the launcher's
environment (torchrun, the CLI's own elastic launcher, or Slurm). How the model is
spread over the ranks is `ciuic_train/distributed/parallelize.py`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ciuic_train.config import Backend, DistConfig
from ciuic_train.errors import UserError
from ciuic_train.launch.paths import uses_agent_store
from ciuic_train.distributed.mesh import Mesh, resolve_mesh

log = logging.getLogger("ciuic_train")


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_env(cls) -> "RankInfo":
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("LOCAL_RANK", 0)),
            world_size,
            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Parallel:
    """The process group (if any), the device mesh, and the collectives the trainer needs."""

    def __init__(self, cfg: DistConfig, device: torch.device, n_routed_experts: int):
        self.info = RankInfo.from_env()
        shape = resolve_mesh(cfg, self.info.world_size, self.info.local_world_size, n_routed_experts)
        self.device = device
        self.group_started = False
        if shape.world_size > 1:
            backend = cfg.backend.value if cfg.backend is not Backend.auto else (
                "nccl" if device.type == "cuda" else "gloo"
            )
            if backend == "nccl" and device.type != "cuda":
                raise UserError("dist.backend=nccl needs device=cuda; use dist.backend=gloo on CPU")
            if not dist.is_initialized():
                timeout = timedelta(seconds=cfg.timeout_s)
                dist.init_process_group(backend, timeout=timeout, **_attempt_store(self.info, timeout))
                self.group_started = True
        self.mesh = Mesh(shape, device)
        # Where every rank runs, so that a lost connection can name the rank behind it.
        self.addresses = self.gather(local_address()) if self.group_started or dist.is_initialized() else []

    @property
    def strategy(self) -> str:
        """none, ddp, fsdp or hsdp (see `MeshShape.strategy`)."""
        return self.mesh.strategy

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    def grad_sync(self, model: nn.Module, enabled: bool):
        """Context for one micro-batch's backward: gradients are reduced only when enabled."""
        if self.strategy == "ddp" and not enabled:
            return model.no_sync()
        if self.strategy in ("fsdp", "hsdp"):
            return _fsdp_sync(model, enabled)
        return nullcontext()

    def average_gradients_with_consistency(self, parameters: list[nn.Parameter]) -> float:
        """Replace each rank's own gradients by their mean over ranks, as DDP's all-reduce
        would (divided first, then summed), in one collective; return the mean over ranks
        of cos(this rank's gradient, the mean gradient)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        local = torch.cat([g.reshape(-1) for g in grads])
        mean = local / self.world_size
        self.all_reduce_sum_(mean)
        cosine = torch.dot(local.double(), mean.double()) / (local.double().norm() * mean.double().norm()).clamp_min(1e-30)
        offset = 0
        for g in grads:
            g.copy_(mean[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return self.mean(cosine.item())

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group_started or dist.is_initialized():
            dist.all_reduce(tensor)
        return tensor

    def mean(self, value: float) -> float:
        """The mean of a per-rank number over all ranks."""
        return self.sum([value])[0] / self.world_size

    def sum(self, values: list[float]) -> list[float]:
        """Each of a few per-rank numbers summed over all ranks, in one collective."""
        if self.world_size == 1:
            return list(values)
        return self.all_reduce_sum_(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def gather(self, value: str) -> list[str]:
        if self.world_size == 1:
            return [value]
        values: list[str] = [""] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def require_same(self, value: str, what: str, error: type[Exception] = RuntimeError) -> None:
        """Fail the run, on every rank, if ranks disagree on `value`."""
        values = self.gather(value)
        differing = [r for r, v in enumerate(values) if v != values[0]]
        if differing:
            message = f"ranks disagree on {what}: rank 0 has {values[0]}, rank {differing[0]} has {values[differing[0]]}"
            log.error(message)
            raise error(message)

    def close(self, clean: bool = True) -> None:
        """Destroy the group; after a clean run, once every rank is done with it.

        The pause matters: gloo's worker thread frees each finished collective's tensors
        under the GIL. If the last reference to the group (held by DDP's reducer) goes
        while that is still pending, the destructor joins the worker thread with the GIL
        held and both wait forever (seen with torch 2.13: a rank hung after finishing).
        Sleeping releases the GIL so the worker can drain first.
        """
        if self.group_started and dist.is_initialized():
            if clean:
                dist.barrier()
                time.sleep(0.2)
            dist.destroy_process_group()
            self.group_started = False


def local_address() -> str:
    """`hostname address` as gloo finds this rank: GLOO_SOCKET_IFNAME's interface if set,
    else the address the hostname resolves to."""
    name = socket.gethostname()
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return f"{name} interface {interface}"
    try:
        return f"{name} {socket.gethostbyname(name)}"
    except OSError:
        return f"{name} (hostname does not resolve)"


# What gloo and the c10d store say when a peer is gone or unreachable.
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out",
                    "Timed out", "timeout", "Connection refused", "No route to host")


def lost_peers_message(err: BaseException, timeout_s: int, addresses: list[str]) -> str | None:
    """One line for a collective that failed because a rank or the network went away, or
    None for any other error. `addresses` (from `Parallel.addresses`) names the ranks at
    the addresses the error mentions."""
    text = str(err).strip()
    if not isinstance(err, dist.DistError) and not any(marker in text for marker in _CONNECTION_LOST):
        return None
    info = RankInfo.from_env()
    mentioned = set(re.findall(r"\d+\.\d+\.\d+\.\d+", text))
    lost = [f"rank {r} ({a})" for r, a in enumerate(addresses) if r != info.rank and a.split()[-1] in mentioned]
    first = (text.splitlines() or [type(err).__name__])[0]
    first = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first).split(". ")[0][:200]  # gloo's source location off
    settings = ("set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) and torchrun's --local-addr if this rank "
                "used the wrong address")
    if not addresses:  # the process group never formed
        store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (
            f"rank {info.rank} on {local_address()} could not form the process group through {store} within "
            f"dist.timeout_s={timeout_s} s: {first}. A rank did not start or cannot reach the others; {settings}"
        )
    return (
        f"rank {info.rank} on {addresses[info.rank]} lost contact with {', '.join(lost) or 'the other ranks'}: "
        f"{first}. A node died or the network failed (collectives wait dist.timeout_s={timeout_s} s); "
        f"{settings}; continue with resume=auto"
    )


def _attempt_store(info: RankInfo, timeout: timedelta) -> dict[str, Any]:
    """Under torchrun, a store namespace of our own for each restart attempt.

    torch's env:// rendezvous reuses the elastic agent's store across worker-group
    restarts without a per-attempt prefix, so a restarted rank can read a dead peer's
    address left by the previous attempt and fail to connect (seen with torch 2.13 and
    gloo). Returns the arguments for init_process_group; none outside torchrun.
    """
    if not uses_agent_store():
        return {}
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"ciuic_train/attempt_{attempt}", agent_store)
    return {"store": store, "rank": info.rank, "world_size": info.world_size}


@contextmanager
def _fsdp_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(enabled)
    yield


def full_value(tensor: torch.Tensor) -> float:
    """A scalar as a float, gathering it first if it is a sharded (FSDP2) DTensor."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).item()


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so their global L2 norm is at most `max_norm`; returns the norm.

    torch's `clip_grad_norm_` stacks the per-parameter norms, which fails when gradients
    are DTensors on different meshes (the experts under expert parallelism). Here each
    group of gradients that share a mesh and placement sums its local squares, and one
    reduction over that mesh's sharded dimensions makes the group's total. Plain tensors
    (one process, or DDP's already averaged gradients) take torch's own path.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    grads = [p.grad for p in parameters if p.grad is not None]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    groups: dict[Any, list[DTensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, g.placements), []).append(g)
    if not groups:
        return full_value(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    squares = torch.nn.utils.get_total_norm(plain).pow(2) if plain else torch.zeros((), device=grads[0].device)
    for (mesh, placements), members in groups.items():
        local = sum(torch.linalg.vector_norm(g.to_local(), dtype=torch.float32).pow(2) for g in members)
        partial = [Partial() if p.is_shard() else Replicate() for p in placements]
        squares = squares + DTensor.from_local(local, mesh, partial, run_check=False).full_tensor()
    total = squares.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's clip_grads_with_norm_
    for members in [plain, *groups.values()]:
        if members:
            torch._foreach_mul_(members, scale)
    return total.item()


def param_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank stores: routed experts, and the rest (shards only,
    under FSDP or expert parallelism)."""
    from torch.distributed.tensor import DTensor

    from ciuic_train.distributed.expert_parallel import expert_parameters

    experts = expert_parameters(model)
    stored = {"experts": 0, "other": 0}
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        stored["experts" if param in experts else "other"] += local.numel() * local.element_size()
    return stored


def param_checksum(model: nn.Module) -> str:
    """A hash of every parameter's name and full bytes: equal only for bit-identical weights.

    Sharded (FSDP2) parameters are gathered first, which is a collective: every rank
    must call this at the same point.
    """
    from torch.distributed.tensor import DTensor

    # Gathering an expert (sharded over efsdp, then ep) takes two all-gathers, which torch
    # warns about as slow; once at the end of a run it does not matter.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    digest = hashlib.sha256()
    try:
        params = [(name, p.full_tensor() if isinstance(p, DTensor) else p) for name, p in sorted(model.named_parameters())]
    finally:
        redistribute_log.setLevel(level)
    for name, full in params:
        digest.update(name.encode())
        digest.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
