"""Whether a run fits the memory each rank has, before anything is built; an out-of-memory
during the run as one line.

Without this, a model too large for the machine fails inside the trainer, after the run
folder exists, with the allocator's traceback. `check_memory` compares `--plan`'s
per-rank figures (`plan.plan_figures`, for the world this process was launched into)
with what a rank here can use (`memory_limits.Room`):

- the exact part, the weights, gradients and AdamW state (with FSDP's accumulated
  gradients where there are any: plan's `state`), must fit, or the CLI
  refuses the run in one line, naming the layouts that would fit;
- the estimated total (plus activations and FSDP's buffers) only warns: it is an
  estimate, and the layouts it names may need a margin as well.

What a rank can use is `memory_limits.usable_bytes_per_rank`'s; where the CLI checks
(once per node, before the run folder exists) is `cli/preflight.py`'s.

`OutOfMemoryGuard` turns an allocator's failure during a step or an evaluation into
`RankFailed`: one line naming the step, the rank, the plan's figure and the checkpoint
to continue from.
"""

from __future__ import annotations

import math
import os
import re
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from ciuic_train.checkpoint.resume import rerun_from
from ciuic_train.config import Config, Device, Strategy
from ciuic_train.distributed.mesh import expected_world
from ciuic_train.errors import RankFailed, UserError, first_line
from ciuic_train.files import format_bytes
from ciuic_train.memory_limits import Room
from ciuic_train.plan.figures import plan_figures
from ciuic_train.plan.memory import build_meta_model

# The largest world `check_memory`'s suggestions look at.
MAX_RANKS = 65536
# How allocators say they ran out, when it is not torch.OutOfMemoryError or MemoryError.
OOM_PHRASES = ("can't allocate memory", "DefaultCPUAllocator", "not enough memory", "out of memory")


# --- The check -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    fits: bool  # the exact part fits
    fits_total: bool  # so does the estimated total
    line: str  # what to tell the user, one line


def as_launched(config: Config, environ: Mapping[str, str] = os.environ) -> Config:
    """The config with the world this process was launched into (torchrun's or srun's
    WORLD_SIZE), which `plan_figures` takes from `dist.nnodes x dist.nproc_per_node`."""
    world, local = expected_world(config.dist, environ)
    nodes, per_node = (world // local, local) if local > 0 and world % local == 0 else (world, 1)
    return replace(config, dist=replace(config.dist, nnodes=nodes, nproc_per_node=per_node))


def run_device(config: Config) -> str | None:
    """`cpu` or `cuda`, as the trainer will resolve `device`; None for device=cuda without
    CUDA here (the trainer says so itself)."""
    if config.device is Device.cpu:
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return None if config.device is Device.cuda else "cpu"


def check_memory(config: Config, room: Room, model=None) -> Verdict:
    """Whether `config`, as the plan describes it (`as_launched` gives the world this
    process is in), fits in `room` per rank, and the line that says so; a refusal or a
    warning names the changes that would make it fit, as the plan computes them.
    `model`: the config's meta model, where the caller has built it already."""
    model = build_meta_model(config) if model is None else model
    figures = plan_figures(config, model)
    exact, total = _exact(figures), _total(config, figures)
    has = f"a rank here has {format_bytes(room.bytes)} ({room.bound})"
    ranks = figures["world_size"]
    what = f"model={config.model.name} on {ranks} rank{'s' * (ranks > 1)}"
    if exact > room.bytes:
        fixes = _fixes_for_exact(config, model, room)
        return Verdict(False, False, (
            f"{what} does not fit in memory: each rank needs {format_bytes(exact)} for its {_state(figures)} "
            f"({format_bytes(total)} in all, estimated), {has}; "
            + (f"it would fit with {fixes}" if fixes else f"no layout of up to {MAX_RANKS} ranks of this size fits")
            + "; to start anyway: train.check_memory=false"
        ))
    if total > room.bytes:
        fixes = _fixes_for_total(config, model, figures, room)
        return Verdict(True, False, (
            f"{what} may not fit in memory: its estimated total is {format_bytes(total)} per rank "
            f"({_state(figures)} {format_bytes(exact)}), {has}"
            + (f"; it would fit with {' or '.join(fixes)}" if fixes else "") + "; going on (the total is an estimate)"
        ))
    return Verdict(True, True, f"{what} fits in memory: {format_bytes(total)} per rank, estimated, and {has}")


def _exact(figures: dict[str, Any]) -> int:
    return figures["memory"]["state"]


def _state(figures: dict[str, Any]) -> str:
    """What the exact part holds, in words."""
    memory = figures["memory"]
    parts = ["weights", "gradients", "AdamW state"]
    parts += ["accumulated gradients"] * bool(memory["accumulated_grads"])
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _total(config: Config, figures: dict[str, Any]) -> int:
    return figures["memory"]["total"]["ac" if config.activation_checkpointing else "no_ac"]


def _plan(config: Config, model) -> dict[str, Any] | None:
    """The plan of a candidate, or None where its mesh does not resolve."""
    try:
        return plan_figures(config, model)
    except UserError:
        return None


def _total_within(config: Config, model, room: Room) -> int | None:
    """The candidate's estimated total where it fits in `room`, else None."""
    figures = _plan(config, model)
    total = None if figures is None else _total(config, figures)
    return total if total is not None and total <= room.bytes else None


def _with(config: Config, checkpointing: bool | None = None, **sections: dict[str, Any]) -> Config:
    """`config` with fields changed by section, e.g. _with(c, train={"batch_size": 2})."""
    changed: dict[str, Any] = {name: replace(getattr(config, name), **fields) for name, fields in sections.items()}
    if checkpointing is not None:
        changed["activation_checkpointing"] = checkpointing
    return replace(config, **changed)


def _sharded(config: Config, nodes: int, per_node: int) -> tuple[list[str], Config]:
    """The overrides that make every rank of `nodes` x `per_node` one FSDP shard (experts
    kept over dist.ep where it still divides), and the config they give."""
    d = config.dist
    shard = nodes * per_node
    fields: dict[str, Any] = {"nnodes": nodes, "nproc_per_node": per_node, "dp_shard": shard, "dp_replicate": -1}
    words = [f"dist.nnodes={nodes}"] * (nodes != d.nnodes)
    words += [f"dist.nproc_per_node={per_node}"] * (per_node != d.nproc_per_node)
    words.append(f"dist.dp_shard={shard}")
    if d.strategy not in (Strategy.auto, Strategy.fsdp):
        fields["strategy"] = Strategy.fsdp
        words.append("dist.strategy=fsdp")
    if d.dp_replicate not in (-1, 1):
        words.append("dist.dp_replicate=-1")
    if d.ep != 1 and shard % max(d.ep, 1):
        fields["ep"] = 1
        words.append("dist.ep=1")
    return words, _with(config, dist=fields)


def _fixes_for_exact(config: Config, model, room: Room) -> str:
    """The smallest sharded layout whose exact part fits `room` (over the ranks the run
    has, else over more nodes like this one; on CUDA this node's other GPUs first), or a
    little larger where that lets the estimated total fit too, with what else that needs.
    "" where none does."""
    d = config.dist
    per_node = max(d.nproc_per_node, _gpus(config))

    def exact_fits(nodes: int) -> bool:
        figures = _plan(_sharded(config, nodes, per_node)[1], model)
        return figures is not None and _exact(figures) <= room.bytes

    def total_can_fit(nodes: int) -> bool:  # with the smallest activations there are
        smallest = _with(_sharded(config, nodes, per_node)[1], checkpointing=True, train={"batch_size": 1})
        return _total_within(smallest, model, room) is not None

    most = max(d.nnodes, MAX_RANKS // per_node)
    fewest = _fewest(d.nnodes, most, exact_fits)
    if fewest is None:
        return ""
    # More shards cut the state further but not the gathers (which padding even grows):
    # the total may need a few more nodes than the state (tried: powers of two), not many.
    larger = [2**k for k in range(fewest.bit_length(), (4 * fewest).bit_length()) if 2**k <= most]
    nodes = next((n for n in [fewest, *larger] if total_can_fit(n)), fewest)
    words, layout = _sharded(config, nodes, per_node)
    notes = [f"{nodes} nodes like this one"] * (nodes > d.nnodes)
    extra = _mildest_total_fix(layout, model, room)
    if extra is None:
        notes.append("though its estimated total would not fit")
    else:
        words += extra[0]
        notes.append(f"about {format_bytes(extra[1])} per rank in all")
    return " ".join(words) + f" ({'; '.join(notes)})"


def _fewest(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The least n in [low, high] for which `fits`, which stays true once it is (more
    shards never store more): a binary search. None where even `high` does not."""
    if fits(low):
        return low
    if high <= low or not fits(high):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def _mildest_total_fix(config: Config, model, room: Room) -> tuple[list[str], int] | None:
    """The mildest overrides that bring the estimated total within `room`, and that
    total: none, activation checkpointing, then with it a halved train.batch_size, halved
    again...; None if not even a batch of one fits."""
    more = [] if config.activation_checkpointing else ["activation_checkpointing=true"]
    tries = [([], config)] + [(more, _with(config, checkpointing=True))] * bool(more)
    batch = config.train.batch_size
    while batch > 1:
        batch //= 2
        smaller = _with(config, checkpointing=True, train={"batch_size": batch})
        tries.append(([*more, f"train.batch_size={batch}"], smaller))
    for words, candidate in tries:
        total = _total_within(candidate, model, room)
        if total is not None:
            return words, total
    return None


def _fixes_for_total(config: Config, model, figures: dict[str, Any], room: Room) -> list[str]:
    """Single changes that bring the estimated total within `room` (the exact part fits):
    activation checkpointing, the largest halved batch size that does, sharding over
    every rank, more expert parallelism; else the mildest combination."""
    d, mesh = config.dist, figures["mesh"]
    candidates = []
    if not config.activation_checkpointing:
        candidates.append((["activation_checkpointing=true"], _with(config, checkpointing=True)))
    batch = config.train.batch_size // 2
    while batch >= 1 and _total_within(_with(config, train={"batch_size": batch}), model, room) is None:
        batch //= 2
    if batch >= 1:
        candidates.append(([f"train.batch_size={batch}"], _with(config, train={"batch_size": batch})))
    if mesh["dp_shard"] < figures["world_size"]:
        candidates.append(_sharded(config, d.nnodes, d.nproc_per_node))
    experts, shard = config.model.n_routed_experts, mesh["dp_shard"]
    ep = next((e for e in range(shard, mesh["ep"], -1) if experts % e == 0 and shard % e == 0), None)
    if ep is not None:
        candidates.append(([f"dist.ep={ep}"], _with(config, dist={"ep": ep})))
    fixes = []
    for words, candidate in candidates:
        total = _total_within(candidate, model, room)
        if total is not None:
            fixes.append(" ".join(words) + f" (about {format_bytes(total)})")
    combined = None if fixes else _mildest_total_fix(config, model, room)
    if combined is not None:
        fixes.append(" ".join(combined[0]) + f" (about {format_bytes(combined[1])})")
    return fixes


def _gpus(config: Config) -> int:
    if run_device(config) != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


# --- Out of memory during the run ----------------------------------------------------------


def is_out_of_memory(err: BaseException) -> bool:
    import torch

    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(phrase in str(err) for phrase in OOM_PHRASES)


class OutOfMemoryGuard:
    """Turns an allocator's failure inside `during(what)` into `RankFailed`: one line
    with the rank, the step, the plan's per-rank figure, and the checkpoint to resume.

    The plan is computed when the guard is made: once memory has run out, building even
    a meta model may fail. The failed step's tensors are freed (its frames cleared)
    before the line is composed, for the same reason.
    """

    def __init__(self, config: Config, rank: int, run_dir: Path):
        self.config = config
        self.rank = rank
        self.run_dir = run_dir
        planned = as_launched(config)
        figures = plan_figures(planned)
        self.exact, self.total, self.state = _exact(figures), _total(planned, figures), _state(figures)

    @contextmanager
    def during(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, MemoryError) as err:
            if not is_out_of_memory(err):
                raise
            traceback.clear_frames(err.__traceback__)
            raise RankFailed(self._message(what, err)) from None

    def _message(self, what: str, err: BaseException) -> str:
        cause = re.sub(r"^\[enforce fail at [^\]]*\] [^.]*\. ", "", first_line(err))
        saved, resume = rerun_from(self.run_dir, self.config.resume)
        kept = f"the last complete checkpoint {saved} is intact" if saved else "no checkpoint was saved yet"
        return (
            f"out of memory on rank {self.rank} in {what} ({cause}); the plan puts a rank at "
            f"{format_bytes(self.total)} (estimated; {self.state} {format_bytes(self.exact)}); "
            f"{kept}; to need less: {self._knobs()} (see --plan), then rerun with hydra.run.dir={self.run_dir}{resume}"
            + (" to continue from it" if saved else "")
        )

    def _knobs(self) -> str:
        c = self.config
        knobs = ["activation_checkpointing=true"] * (not c.activation_checkpointing)
        if c.train.batch_size > 1:
            knobs.append(f"train.batch_size={math.ceil(c.train.batch_size / 2)}")
        knobs.append("more ranks with dist.dp_shard")
        return ", ".join(knobs)
