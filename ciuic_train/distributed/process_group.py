"""Processes, the process group, and the collectives the trainer needs.

The trainer sees one `Parallel` object whatever the world size: with one process it has
no process group and every collective is the identity, so single-process training needs
nothing from torch.distributed. Rank, local rank and world size come from the launcher's
environment (torchrun, the CLI's own elastic launcher, or Slurm). When a collective
fails because a rank or the network went away, `lost_peers_message` says so in one line.

How the model is spread over the ranks is `ciuic_train/distributed/parallelize.py`; what
the training step does with the gradients across ranks, `ciuic_train/distributed/grads.py`.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ciuic_train.config import Backend, DistConfig
from ciuic_train.errors import UserError
from ciuic_train.environment import uses_agent_store
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
                # A GPU rank names its device: NCCL then binds its communicator to it at once,
                # instead of guessing one from the current device at the first collective.
                device_id = device if device.type == "cuda" else None
                dist.init_process_group(backend, timeout=timeout, device_id=device_id, **_attempt_store(self.info, timeout))
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
    def data_world(self) -> int:
        """Ranks that see different data (the world, but for a pipeline's stages, which share theirs)."""
        return self.mesh.shape.data_parallel_size

    @property
    def data_rank(self) -> int:
        """Which of the `data_world` shares of the data this rank sees (pp is outermost)."""
        return self.info.rank % self.data_world

    @property
    def pp_rank(self) -> int:
        return self.info.rank // self.data_world

    @property
    def is_main(self) -> bool:
        return self.info.is_main

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

        A rank runs one job, so its process ends soon after the group is destroyed; should
        it hang on the way out instead (a thread or a destructor stuck), `exit_within` turns that into
        every thread's stack on stderr and exit status 1, not an allocation held forever.
        """
        if self.group_started and dist.is_initialized():
            if clean:
                dist.barrier()  # waits for the slowest rank, within dist.timeout_s
            time.sleep(0.2)  # on every way out, a stopped run's too: the last collective may be draining
            exit_within(EXIT_GRACE_S)
            dist.destroy_process_group()
            self.group_started = False


# How long a rank's process may take to end once it starts destroying its process group.
EXIT_GRACE_S = 120


def exit_within(seconds: float) -> None:
    """If this process is still running `seconds` from now, print every thread's stack
    to stderr and exit with status 1 (faulthandler's timer: a C thread, which needs
    neither the GIL nor a responsive interpreter). A process that cannot start a thread
    any more (out of memory, or of address space) goes without."""
    try:
        faulthandler.dump_traceback_later(seconds, exit=True)
    except RuntimeError:
        log.debug("no exit watchdog: its thread could not start")


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
