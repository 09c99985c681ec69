"""Replica groups: the outer data-parallel dimension, made fault tolerant by torchft.

Without `ft` the world is one replica group (`OneGroup`, whose methods do nothing). With
`ft.enabled=true` each group is a torch.distributed world of its own (DDP, FSDP, `ep`
or a pipeline inside it, unchanged: a stage's rank meets the same rank of the other
groups), and `ReplicaGroups` ties the groups together through a torchft Manager in every
rank, around each training step:

    start_step   the quorum: which groups take part in this step. A group behind the
                 others (one that restarted) receives their live state here, from the
                 same rank of a peer group, before its forward: weights, optimizer,
                 step, data position (no checkpoint is read).
    average_     after backward, each rank's gradients (its local shards under FSDP)
                 and the step's figures are averaged over the same rank of every group
                 taking part: with every group in, the update of one DDP world of the
                 same global batch.
    commit       whether the step counts: False when a peer was lost during it (its
                 collective timed out after `ft.timeout_s`); the trainer then drops the
                 step (no update, the data position rewound) and retries it with the
                 groups left, so no step is applied twice or half.

Data: group g's ranks read the shares g*K .. g*K+K-1 of a global world of groups*K
shares (K: a group's data-parallel ranks), so no window is read by two groups. While a
group is away its shares are not trained (the others do not take them over); it
resumes them at the data position the step implies.

Checkpoints: the lowest group taking part (`saves`) writes them, into the run's one
`checkpoints/` folder; a restart of every group resumes from there as without `ft`.

A group that restarts beside live ones takes their state at its first quorum; only if no
peer is ahead (every group restarted) does it resume from the checkpoint (`resume`).

With `ft.sync=diloco` the groups meet only every few steps, at the step boundaries
`end_step` marks: ciuic_train/ft/diloco.py.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from ciuic_train.errors import RunFailed, first_line
from ciuic_train.ft.config import START_STORE, FtConfig
from ciuic_train.ft.live_state import local_tensor
from ciuic_train.environment import uses_agent_store

log = logging.getLogger("ciuic_train")

# torchft's own loggers: their lines go to train.log (the root's file handler), not the terminal.
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


class OneGroup:
    """No fault tolerance: the whole world is one replica group."""

    groups = 1
    group = 0

    def data_share(self, data_rank: int, data_world: int) -> tuple[int, int]:
        """This rank's share of the training data and how many shares there are."""
        return data_rank, data_world

    def global_rank(self, rank: int) -> int:
        return rank

    def restarted(self) -> bool:
        """Whether this group restarted while others may be training (its torchrun restarted it)."""
        return False

    def set_step(self, step: int) -> None:
        """The step this rank resumed at (from a checkpoint)."""

    def attach(self, model: torch.nn.Module) -> None:
        """The model whose weights the groups keep in agreement, once it holds its step-0 values."""

    def tensors(self) -> dict[str, Any]:
        """What a checkpoint keeps of the groups beside the model and optimizer (DCP's
        tensors, loaded in place)."""
        return {}

    def start_step(self) -> None:
        pass

    def average_(self, grads: list[torch.Tensor], figures: torch.Tensor,
                 sums: list[torch.Tensor] = ()) -> torch.Tensor:
        return figures

    def step_figures(self) -> dict[str, Any]:
        """What a metrics line says of the groups."""
        return {}

    def commit(self) -> bool:
        return True

    def end_step(self, step: int) -> None:
        """Optimizer step `step` is applied (DiLoCo's groups meet here)."""

    def saves(self) -> bool:
        return True

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class ReplicaGroups(OneGroup):
    """This rank's place among `ft.groups` replica groups, and its torchft Manager.

    `state()` and `load(state)` are the trainer's live state, as a peer sends it and as a
    healing group applies it (tensors local to this rank: FSDP's shards as plain tensors);
    `resume()` resumes a restarted group that found no peer ahead of it.
    """

    def __init__(self, ft: FtConfig, parallel, state: Callable[[], dict], load: Callable[[dict], None],
                 resume: Callable[[], None]):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log each quorum at info, to stderr
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        _torchft_logs_to_file()
        self.ft, self.parallel = ft, parallel
        self.groups, self.group = ft.groups, ft.group
        self._load, self._resume, self._healed = load, resume, False
        self._rejoining = self.restarted()
        self._last_participants, self.retried_steps = ft.groups, 0
        # The longest step of this group, from its first attempt to its commit: whatever a lost
        # group cost it (the quorum waiting for it, a collective timing out, the retry).
        self._attempt_started, self._last_commit, self.longest_stall_s = None, None, 0.0
        self._wait_for_all = True
        timeout = timedelta(seconds=ft.timeout_s)
        pg = ProcessGroupNCCL(timeout) if parallel.device.type == "cuda" else ProcessGroupGloo(timeout)
        info = parallel.info
        store_addr, store_port = _group_store()

        def manager() -> Manager:
            return Manager(
                pg=pg, load_state_dict=self._heal, state_dict=state, min_replica_size=ft.min_groups,
                use_async_quorum=False,  # a group heals before its forward, and joins the step it heals in
                timeout=timeout, quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=timedelta(seconds=ft.quorum_timeout_s),
                rank=info.rank, world_size=info.world_size, store_addr=store_addr, store_port=store_port,
                lighthouse_addr=ft.lighthouse, replica_id=f"ciuic_train_group_{ft.group}",
                init_sync=False,  # every group initializes the same weights from the seed
            )

        # Rank 0 publishes its Manager's address in the group's store before the others read
        # it: after a restart the store still holds the previous attempt's.
        if info.rank == 0:
            self.manager = manager()
        if info.world_size > 1:
            torch.distributed.barrier()
        if info.rank != 0:
            self.manager = manager()

    def data_share(self, data_rank: int, data_world: int) -> tuple[int, int]:
        return self.group * data_world + data_rank, self.groups * data_world

    def global_rank(self, rank: int) -> int:
        return self.group * self.parallel.world_size + rank

    def restarted(self) -> bool:
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"

    def set_step(self, step: int) -> None:
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})

    def step_figures(self) -> dict[str, Any]:
        return {"participants": self.manager.num_participants()}

    def start_step(self) -> None:
        if self._attempt_started is None:  # a retried step keeps the time of its first attempt
            self._attempt_started = time.perf_counter()
        self._first_step_waits_for_all()
        self._quorum()
        self._after_first_quorum()

    def _first_step_waits_for_all(self) -> None:
        if self._wait_for_all:
            self._wait_for_all = False
            if not self.restarted():  # a restarted group's peers are long past their first step
                _all_groups_started(self.groups, self.ft.quorum_timeout_s, self.parallel.info.rank)

    def _after_first_quorum(self) -> None:
        """A restarted group's first quorum is over: it healed from a peer, or none was
        ahead (every group restarted) and it resumes as a first start would."""
        if self._rejoining:
            self._rejoining = False
            if not self._healed:
                self._resume()

    def _quorum(self) -> None:
        """Which groups take part from here; a group behind the others heals from a peer in it."""
        self._healed = False
        try:
            self.manager.start_quorum()
        except Exception as err:  # the lighthouse is gone, or never answered
            raise RunFailed(
                f"replica group {self.group}: no quorum from the lighthouse {self.ft.lighthouse} "
                f"({first_line(err)}) within ft.quorum_timeout_s={self.ft.quorum_timeout_s:g} s; the run stops at "
                f"{self._where()} without a save (with no quorum no group knows whether it is the one that saves): "
                "run the command again once the lighthouse answers (resume=auto continues from the last checkpoint)"
            ) from None
        participants = self.manager.num_participants()
        if participants != self._last_participants and self.parallel.is_main:
            how = "healed from a peer: " if self._healed else ""
            since = (f" ({time.perf_counter() - self._last_commit:.1f} s after the last step)"
                     if self._last_commit is not None else "")
            log.warning(f"replica group {self.group}: {how}{participants} of {self.groups} groups take part "
                        f"from {self._where()}{since}")
        self._last_participants = participants

    def _where(self) -> str:
        """Where in the run a quorum is, for its log line."""
        return f"step {self.manager.current_step() + 1}"

    def _heal(self, state: dict) -> None:
        self._healed = True
        self._load(state)

    def average_(self, grads: list[torch.Tensor], figures: torch.Tensor,
                 sums: list[torch.Tensor] = ()) -> torch.Tensor:
        """Each gradient averaged in place over the groups taking part (one flat
        collective), `figures` (a 1-d tensor) likewise, and each of `sums` summed in place
        (the MoE's token counts, so every group makes the same balancing step); returns
        the averaged figures. Before the commit: what a lost peer corrupts is dropped."""
        from torch.distributed import ReduceOp

        grads = [local_tensor(g) for g in grads]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        figures = figures.detach().double().clone()
        counts = torch.cat([c.reshape(-1) for c in sums]).double() if sums else torch.zeros(0, dtype=torch.float64)
        works = [self.manager.allreduce(flat), self.manager.allreduce(figures),
                 self.manager.allreduce(counts, reduce_op=ReduceOp.SUM)]
        for work in works:
            work.wait()
        for tensors, source in ((grads, flat), (sums, counts)):
            offset = 0
            for tensor in tensors:
                tensor.copy_(source[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        return figures

    def commit(self) -> bool:
        committed = self.manager.should_commit()
        if not committed:
            self.retried_steps += 1
            if self.parallel.is_main:
                log.warning(f"replica group {self.group}: step {self.manager.current_step() + 1} is retried: a "
                            "group was lost during it")
            return False
        now = time.perf_counter()
        if not self._healed:  # a healing step's wait is its own restart's, not a stall
            self.longest_stall_s = max(self.longest_stall_s, now - self._attempt_started)
        self._attempt_started, self._last_commit = None, now
        return True

    def saves(self) -> bool:
        """Whether this group writes the checkpoints: the lowest of the groups taking part."""
        return self.manager.participating_rank() == 0

    def summary(self) -> dict[str, Any]:
        return {"replica_group": self.group, "replica_groups": self.groups,
                "retried_steps": self.retried_steps, "longest_stall_s": round(self.longest_stall_s, 3)}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _all_groups_started(groups: int, timeout_s: float, rank: int) -> None:
    """On a launch's first attempt, wait until every group the CLI's launcher started is
    about to ask for its first quorum (`START_STORE`), so that the first step is every
    group's: alone, the first to arrive would take it by itself."""
    where = os.environ.get(START_STORE)
    if not where or rank != 0:
        return
    host, port = where.rsplit(":", 1)
    store = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    store.add("started", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("started", 0) < groups:
        if time.monotonic() > deadline:
            raise RunFailed(f"the other replica groups did not start within ft.quorum_timeout_s={timeout_s:g} s")
        time.sleep(0.05)


def _group_store() -> tuple[str, int]:
    """The group's TCPStore, where its Manager's ranks meet: the launcher's (torchrun's
    agent, or rank 0's of `init_process_group`); a lone rank without one starts its own."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port and (uses_agent_store() or int(os.environ.get("WORLD_SIZE", 1)) > 1):
        return addr, int(port)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _group_store.keep = store  # alive for the process's life
    return "127.0.0.1", store.port


def _torchft_logs_to_file() -> None:
    """torchft logs every quorum and commit: those lines belong in train.log, not the terminal.

    Its checkpoint server (http.server) writes each request to stderr; it goes to torchft's log too."""
    from http.server import BaseHTTPRequestHandler

    BaseHTTPRequestHandler.log_message = lambda handler, form, *args: logging.getLogger("torchft").info(form % args)
    for name in TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                logger.addHandler(handler)
