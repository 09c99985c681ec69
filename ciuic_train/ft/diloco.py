"""DiLoCo across replica groups (`ft.sync=diloco`): each group trains alone, and they meet every few steps.

Each replica group trains on its own data with its own optimizer (the inner one,
`optim.*`), exchanging nothing with the other groups; every `ft.sync_every` steps the
groups average how far each moved from the weights they last agreed on (the
pseudo-gradient: anchor - weights), and an outer SGD with Nesterov momentum
(`ft.outer_lr`, `ft.outer_momentum`) applies that average to the anchor: the new common
weights (DiLoCo, Douillard et al. 2023). Over a slow link one exchange of the weights every
sync_every steps replaces an all-reduce of the gradients every step.

Streaming DiLoCo (Douillard et al. 2025): `ft.fragments` cuts the model into fragments of
consecutive layers (the embedding with the first, the head with the last), synced in turn,
one every sync_every/fragments steps, so that each exchange carries a fraction of the
model; `ft.sync_delay` steps of training overlap each exchange before its result is
applied, and `ft.merge_alpha` is how much of those steps a synced fragment keeps.

The schedule is a function of the step (`boundary_plan`), so a group that heals from a peer knows
what comes next. At the boundary after step s (`end_step`), in this order:

    sync   s is a multiple of sync_every/fragments: the fragment whose turn it is. Its
           exchange, started sync_delay steps ago, is waited for and applied; with none in
           flight (sync_delay=0, or a resume or a heal inside the window) it runs now. An
           exchange that fails (a group lost during it) runs again with the groups left
           until it commits: no step is redone, none is lost.
    final  s = train.max_steps: every other fragment syncs too, so that the run ends on
           the groups' common weights.
    start  s + sync_delay is the next sync (sync_delay > 0): the quorum, then the exchange
           starts, and training goes on while it runs.

torchft gives the quorum (which groups take part; a group behind the others heals from a
peer in it), its fault-tolerant all-reduce and the commit. Its own `DiLoCo` class is not
used: it drops a round's steps when an exchange fails, heals a group inside the
optimizer's step hook, counts a healing group's copy of its peer's change as a second
group's, keeps its copies out of checkpoints, and leaves the MoE balancing biases to drift
apart. Here a failed exchange is retried, a group heals at a step boundary, a healing group
adds nothing to the average (the count of contributing groups travels in the exchange),
the anchors and outer momentum are in every checkpoint (`tensors`), and each fragment's
biases are averaged with it.

Each quorum's step for torchft is the position in this schedule (step x slots + item), so
"behind" is behind in the schedule: a group that restarts at step 0 heals from any peer,
and, healed, reads from that step where the peer is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed import ReduceOp

from ciuic_train.errors import RunFailed
from ciuic_train.ft.config import FtConfig
from ciuic_train.ft.live_state import local_state, local_tensor
from ciuic_train.ft.replicas import ReplicaGroups

log = logging.getLogger("ciuic_train")

# Failed exchanges of one fragment in a row before the run gives up on the groups.
MAX_TRIES = 10


def outer_sgd_(weight: torch.Tensor, momentum_buffer: torch.Tensor, grad: torch.Tensor, lr: float,
               momentum: float) -> None:
    """torch.optim.SGD's step, with Nesterov momentum when `momentum` > 0, in place. The
    buffer starts at zero, so its first step equals SGD's (which starts it at the gradient)."""
    if momentum:
        momentum_buffer.mul_(momentum).add_(grad)
        grad = grad.add(momentum_buffer, alpha=momentum)
    weight.sub_(grad, alpha=lr)


def boundary_plan(step: int, between: int, fragments: int, delay: int, max_steps: int) -> list[tuple[str, int]]:
    """What the boundary after `step` does, in order: ("sync" | "start", fragment). A
    fragment syncs every `between` x `fragments` steps, one every `between` steps; its
    exchange starts `delay` steps before; at `max_steps` every fragment syncs."""
    plan = []
    if step > 0 and step % between == 0:
        plan.append(("sync", (step // between - 1) % fragments))
    if step == max_steps:
        plan += [("sync", f) for f in range(fragments) if ("sync", f) not in plan]
    upcoming = step + delay
    if delay and upcoming % between == 0 and upcoming <= max_steps:
        plan.append(("start", (upcoming // between - 1) % fragments))
    return plan


@dataclass
class Fragment:
    """Consecutive layers synced together: their parameters, the anchor (the weights the
    groups last agreed on) and the outer momentum of each, and their MoE biases."""

    names: list[str] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    anchors: list[torch.Tensor] = field(default_factory=list)
    momenta: list[torch.Tensor] = field(default_factory=list)
    biases: list[torch.Tensor] = field(default_factory=list)


def split_fragments(model: torch.nn.Module, count: int) -> list[Fragment]:
    """`count` fragments of consecutive layers: layer i in fragment i*count // n_layers,
    the embedding in the first, the final norm, the head and MTP in the last."""
    n_layers = model.config.n_layers

    def fragment_of(name: str) -> int:
        if name.startswith("layers."):
            return int(name.split(".")[1]) * count // n_layers
        return 0 if name.startswith("tok_embeddings.") else count - 1

    fragments = [Fragment() for _ in range(count)]
    for name, param in model.named_parameters():
        fragment = fragments[fragment_of(name)]
        anchor = param.detach().clone()  # a DTensor's shards stay shards: DCP saves them per rank
        fragment.names.append(name)
        fragment.params.append(param)
        fragment.anchors.append(anchor)
        fragment.momenta.append(torch.zeros_like(anchor))
    for index, moe in model.moe_layers().items():
        fragments[min(index * count // n_layers, count - 1)].biases.append(moe.expert_bias)
    return fragments


@dataclass
class Exchange:
    """A fragment's exchange: the summed changes, biases and contributing groups (`flat`'s
    last element), and torchft's work that fills it."""

    fragment: int
    flat: torch.Tensor
    work: Any


class _Healed(Exception):
    """A quorum brought a peer's state: go on where the peer is in the schedule."""

    def __init__(self, step: int, index: int):
        super().__init__(step, index)
        self.step, self.index = step, index


class DiLoCoGroups(ReplicaGroups):
    """Replica groups that meet only at DiLoCo's syncs (the module's docstring)."""

    def __init__(self, ft: FtConfig, parallel, max_steps: int, state: Callable[[], dict],
                 load: Callable[[dict], None], resume: Callable[[], None]):
        super().__init__(ft, parallel, state, load, resume)
        self.max_steps = max_steps
        self.between = ft.sync_every // ft.fragments  # steps from one fragment's sync to the next's
        self.slots = ft.fragments + 2  # the most items a boundary's plan holds, and one to spare
        self.fragments: list[Fragment] = []
        self._in_flight: Exchange | None = None
        self._met = False  # whether any quorum has formed yet
        self.syncs = self.retried_syncs = 0
        self.sync_s = 0.0  # the time training stood still for exchanges
        self.manager.register_state_dict_fn("diloco", self._load_anchors, self._anchors_state)

    def attach(self, model: torch.nn.Module) -> None:
        self.fragments = split_fragments(model, self.ft.fragments)

    def tensors(self) -> dict[str, Any]:
        return {
            "anchor": {n: a for f in self.fragments for n, a in zip(f.names, f.anchors)},
            "outer_momentum": {n: m for f in self.fragments for n, m in zip(f.names, f.momenta)},
        }

    def _anchors_state(self) -> dict[str, Any]:
        """What a healing peer receives beside the trainer's state: this rank's shards."""
        return local_state(self.tensors())

    def _load_anchors(self, state: dict[str, Any]) -> None:
        for kind, by_name in self.tensors().items():
            for name, tensor in by_name.items():
                local_tensor(tensor).copy_(state[kind][name])
        self._in_flight = None  # an exchange of the schedule this group left

    def start_step(self) -> None:
        """Only a restarted group meets the others here: it waits for their next quorum and
        heals from a peer in it, or, none ahead, resumes."""
        self._first_step_waits_for_all()
        if not self._rejoining:
            return
        try:
            self._meet(0, 0)  # a restarted group starts at step 0, behind any live peer
        except _Healed as healed:
            self._rejoining = False
            self._run(healed.step, healed.index, joined=True)
        else:
            self._after_first_quorum()

    def average_(self, grads: list[torch.Tensor], figures: torch.Tensor,
                 sums: list[torch.Tensor] = ()) -> torch.Tensor:
        return figures  # nothing crosses between groups inside a round

    def commit(self) -> bool:
        return True  # an inner step is this group's alone: nothing to agree on

    def end_step(self, step: int) -> None:
        began = time.perf_counter()
        self._run(step)
        waited = time.perf_counter() - began
        self.sync_s += waited
        self.longest_stall_s = max(self.longest_stall_s, waited)

    def step_figures(self) -> dict[str, Any]:
        participants = self.manager.num_participants() if self._met else self.groups
        return {"participants": participants, "syncs": self.syncs}

    def saves(self) -> bool:
        return self.manager.participating_rank() == 0 if self._met else self.group == 0

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "syncs": self.syncs, "retried_syncs": self.retried_syncs,
                "sync_s": round(self.sync_s, 3)}

    def _where(self) -> str:
        return f"the sync after step {self.manager.current_step() // self.slots}"

    def _run(self, step: int, start: int = 0, joined: bool = False) -> None:
        """The plan of `step` from item `start` (`joined`: its quorum is over, this group
        healed in it); a heal on the way goes on from the peer's place."""
        while True:
            try:
                plan = boundary_plan(step, self.between, self.ft.fragments, self.ft.sync_delay, self.max_steps)
                for index, (kind, fragment) in enumerate(plan):
                    if index < start:
                        continue
                    if kind == "start":
                        if not joined:
                            self._meet(step, index)
                        self._in_flight = self._exchange(fragment, joined)
                    else:
                        self._sync(fragment, step, index, joined)
                    joined = False
                return
            except _Healed as healed:
                step, start, joined = healed.step, healed.index, True

    def _sync(self, fragment: int, step: int, index: int, joined: bool) -> None:
        """Apply `fragment`'s exchange in flight, or run one now; again until one commits."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and in_flight.fragment == fragment and self._finish(in_flight):
            return
        retry = in_flight is not None
        for _ in range(MAX_TRIES):
            if retry:
                self.retried_syncs += 1
                if self.parallel.is_main:
                    log.warning(f"replica group {self.group}: the sync of fragment {fragment} after step {step} "
                                "is retried: a group was lost during it")
            if not joined:
                self._meet(step, index)
            exchange = self._exchange(fragment, joined)
            joined, retry = False, True
            if self._finish(exchange):
                return
        raise RunFailed(f"replica group {self.group}: the sync of fragment {fragment} after step {step} failed "
                        f"{MAX_TRIES} times in a row; the run stops")

    def _meet(self, step: int, index: int) -> None:
        """The quorum of item `index` of `step`'s plan; raises _Healed if it brought a peer's state."""
        self.manager.load_state_dict({"step": step * self.slots + index,
                                      "batches_committed": self.manager.batches_committed()})
        self._quorum()
        self._met = True
        if self._healed:
            raise _Healed(*divmod(self.manager.current_step(), self.slots))

    def _exchange(self, fragment: int, joined: bool) -> Exchange:
        """Start summing `fragment`'s change since its anchor, and its biases, over the
        groups of the quorum; a group that has just healed holds its peer's weights and
        adds nothing (not even to the count)."""
        part = self.fragments[fragment]
        with torch.no_grad():
            changes = [(local_tensor(anchor) - local_tensor(param.detach())).reshape(-1)
                       for anchor, param in zip(part.anchors, part.params)]
            one = torch.ones(1, dtype=torch.float32, device=self.parallel.device)
            flat = torch.cat([*changes, *(b.reshape(-1).float() for b in part.biases), one])
            if joined:
                flat.zero_()
        return Exchange(fragment, flat, self.manager.allreduce(flat, reduce_op=ReduceOp.SUM))

    def _finish(self, exchange: Exchange) -> bool:
        """Wait for `exchange`; if the groups commit it, apply it: the outer step on the
        anchors, the weights set from them, the biases averaged."""
        exchange.work.wait()
        if not self.manager.should_commit():
            return False
        part, flat = self.fragments[exchange.fragment], exchange.flat
        mean = flat[:-1] / flat[-1]
        offset = 0
        with torch.no_grad():
            for param, anchor, momentum in zip(part.params, part.anchors, part.momenta):
                anchor, weight = local_tensor(anchor), local_tensor(param.detach())
                change = mean[offset : offset + anchor.numel()].view_as(anchor)
                offset += anchor.numel()
                outer_sgd_(anchor, local_tensor(momentum), change, self.ft.outer_lr, self.ft.outer_momentum)
                weight.lerp_(anchor, 1.0 - self.ft.merge_alpha)
            for bias in part.biases:
                bias.copy_(mean[offset : offset + bias.numel()].view_as(bias))
                offset += bias.numel()
        self.syncs += 1
        self._last_commit = time.perf_counter()
        return True
