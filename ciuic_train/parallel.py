"""Processes, the process group, and the collectives the trainer needs.

The trainer sees one `Parallel` object whatever the world size: with one process it has
no process group and every collective is the identity, so single-process training needs
nothing from torch.distributed. Rank, local rank and world size come from the launcher's
environment (torchrun, the CLI's own elastic launcher, or Slurm). How the model is
spread over the ranks is `ciuic_train/parallelize.py`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ciuic_train.config import Backend, DistConfig, Strategy
from ciuic_train.errors import UserError

log = logging.getLogger("ciuic_train")


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> "RankInfo":
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_strategy(cfg: DistConfig, world_size: int) -> Strategy:
    if cfg.strategy is Strategy.auto:
        return Strategy.ddp if world_size > 1 else Strategy.none
    if cfg.strategy is Strategy.none and world_size > 1:
        raise UserError(
            f"dist.strategy=none with world size {world_size} would train unsynchronised replicas; use ddp or fsdp"
        )
    return cfg.strategy


class Parallel:
    """The process group (if any) and the collectives the trainer needs."""

    def __init__(self, cfg: DistConfig, device: torch.device):
        self.info = RankInfo.from_env()
        self.strategy = resolve_strategy(cfg, self.info.world_size)
        self.device = device
        self.group_started = False
        if self.strategy is Strategy.none:
            return
        backend = cfg.backend.value if cfg.backend is not Backend.auto else (
            "nccl" if device.type == "cuda" else "gloo"
        )
        if backend == "nccl" and device.type != "cuda":
            raise UserError("dist.backend=nccl needs device=cuda; use dist.backend=gloo on CPU")
        if not dist.is_initialized():
            timeout = timedelta(seconds=cfg.timeout_s)
            dist.init_process_group(backend, timeout=timeout, **_attempt_store(self.info, timeout))
            self.group_started = True

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    def grad_sync(self, model: nn.Module, enabled: bool):
        """Context for one micro-batch's backward: gradients are reduced only when enabled."""
        if self.strategy is Strategy.ddp and not enabled:
            return model.no_sync()
        if self.strategy is Strategy.fsdp:
            return _fsdp_sync(model, enabled)
        return nullcontext()

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group_started or dist.is_initialized():
            dist.all_reduce(tensor)
        return tensor

    def mean(self, value: float) -> float:
        """The mean of a per-rank number over all ranks."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return self.all_reduce_sum_(t).item() / self.world_size

    def max(self, value: int) -> int:
        """The largest of a per-rank integer over all ranks."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

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


def _attempt_store(info: RankInfo, timeout: timedelta) -> dict[str, Any]:
    """Under torchrun, a store namespace of our own for each restart attempt.

    torch's env:// rendezvous reuses the elastic agent's store across worker-group
    restarts without a per-attempt prefix, so a restarted rank can read a dead peer's
    address left by the previous attempt and fail to connect (seen with torch 2.13 and
    gloo). Returns the arguments for init_process_group; none outside torchrun.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
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


def param_checksum(model: nn.Module) -> str:
    """A hash of every parameter's name and full bytes: equal only for bit-identical weights.

    Sharded (FSDP2) parameters are gathered first, which is a collective: every rank
    must call this at the same point.
    """
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        digest.update(name.encode())
        digest.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
