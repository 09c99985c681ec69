"""The schema of `ft.*` (fault tolerance across replica groups) and its checks; no torch.

With `ft.enabled=true` the outer data-parallel dimension is split into `ft.groups`
replica groups, each its own torch.distributed world (DDP, FSDP, `ep` or a pipeline
inside it as without `ft`), tied together by torchft: a lighthouse that forms a quorum
of the live groups before each step, and a Manager in each group that averages across
them. A group that dies leaves the others training; one that (re)starts takes the live
state from a peer (ciuic_train/ft/replicas.py). With `ft.sync=every_step` the gradients
are averaged across the live groups every step: the same update as one DDP world of the
same global batch. With `ft.sync=diloco` each group takes `ft.sync_every` steps of its
own and the groups then average how far they moved (ciuic_train/ft/diloco.py): nothing
crosses the slow link between groups in between.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from ciuic_train.errors import UserError


class Sync(str, Enum):
    """How the replica groups agree: every step (averaged gradients), or DiLoCo's rounds."""

    every_step = "every_step"
    diloco = "diloco"


@dataclass
class FtConfig:
    enabled: bool = False
    # Replica groups the CLI's launcher starts: dist.nproc_per_node ranks split evenly
    # between them (2 groups of 4 for dist.nproc_per_node=8 ft.groups=2).
    groups: int = 2
    # A running lighthouse (http://host:port, `torchft_lighthouse`); empty: the CLI's
    # launcher starts one for its groups. Groups started by hand (torchrun, srun) name one.
    lighthouse: str = ""
    # This process's replica group, 0 to groups-1: set by the CLI's launcher for each
    # group it starts; give it by hand to a group started by torchrun.
    group: int = 0
    # The checkpoints/ folder's run folder, shared by every group (the lowest live group
    # writes it, each resumes from it); empty: this group's run folder. The CLI's launcher
    # points every group at the run's folder.
    checkpoints: str = ""
    # A step commits when at least this many groups take part; fewer: it is retried.
    min_groups: int = 1
    # Seconds a collective across groups waits before a silent group counts as gone: the
    # longest stall a dead group costs the others.
    timeout_s: float = 10.0
    # Seconds a group waits for the quorum (a restarting group's peers, the lighthouse).
    quorum_timeout_s: float = 120.0
    # The lighthouse waits this long for groups that heartbeat but have not asked to join
    # before it forms a quorum without them.
    join_timeout_ms: int = 1000
    # every_step: gradients averaged across the groups each step. diloco: each group trains
    # on its own (the inner optimizer: optim.*) and every `sync_every` steps the groups
    # average their parameters' change since the last sync, which an outer SGD with
    # Nesterov momentum applies to the weights they last agreed on.
    sync: Sync = Sync.every_step
    sync_every: int = 32
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # Streaming DiLoCo: the model in this many fragments of consecutive layers, each synced
    # every `sync_every` steps, one fragment every sync_every/fragments steps.
    fragments: int = 1
    # Steps a fragment's exchange overlaps with training before its result is applied (0:
    # applied at once); must be less than sync_every/fragments.
    sync_delay: int = 0
    # What a synced fragment keeps of the steps it took meanwhile: 0 the groups' common
    # weights, 1 its own (Streaming DiLoCo's mixing factor).
    merge_alpha: float = 0.0


# Where the CLI's launcher tells the groups it started to meet once before their first step.
START_STORE = "CIUIC_TRAIN_FT_START_STORE"

LIGHTHOUSE_ADDRESS = re.compile(r"^https?://[^\s/:]+(:\d+)?/?$")


def check_ft(ft: FtConfig, log_grad_consistency: bool, n_layers: int) -> None:
    """`ft.*` against the schema's limits and what a group may run inside; one line each."""
    if not ft.enabled:
        if ft.sync is Sync.diloco:
            raise UserError("ft.sync=diloco trains across replica groups: add ft.enabled=true "
                            "(dist.nproc_per_node=N ft.groups=G for the CLI to start them)")
        return
    if ft.groups < 1:
        raise UserError(f"ft.groups={ft.groups} must be at least 1")
    if not 0 <= ft.group < ft.groups:
        raise UserError(f"ft.group={ft.group} must be between 0 and ft.groups-1={ft.groups - 1}")
    if not 1 <= ft.min_groups <= ft.groups:
        raise UserError(f"ft.min_groups={ft.min_groups} must be between 1 and ft.groups={ft.groups}")
    for key in ("timeout_s", "quorum_timeout_s"):
        if getattr(ft, key) <= 0:
            raise UserError(f"ft.{key}={getattr(ft, key)} must be positive")
    if ft.join_timeout_ms < 0:
        raise UserError(f"ft.join_timeout_ms={ft.join_timeout_ms} must be 0 or more")
    if ft.lighthouse and not LIGHTHOUSE_ADDRESS.match(ft.lighthouse):
        raise UserError(f"ft.lighthouse={ft.lighthouse!r} must be an address http://host:port")
    check_diloco(ft, n_layers)
    if log_grad_consistency:
        raise UserError("train.log_grad_consistency=true measures DDP's all-reduce within one world; "
                        "with ft.enabled=true turn it off")


def check_diloco(ft: FtConfig, n_layers: int) -> None:
    """DiLoCo's keys; one line each. They are read only with ft.sync=diloco."""
    if ft.sync is not Sync.diloco:
        return
    if ft.sync_every < 1:
        raise UserError(f"ft.sync_every={ft.sync_every} must be at least 1")
    if ft.fragments < 1 or ft.sync_every % ft.fragments:
        raise UserError(f"ft.fragments={ft.fragments} must divide ft.sync_every={ft.sync_every}: each fragment "
                        "syncs every sync_every steps, one every sync_every/fragments steps")
    if ft.fragments > n_layers:
        raise UserError(f"ft.fragments={ft.fragments} is more than the model's model.n_layers={n_layers}: a "
                        "fragment is one or more consecutive layers")
    between = ft.sync_every // ft.fragments
    if not 0 <= ft.sync_delay < between:
        raise UserError(f"ft.sync_delay={ft.sync_delay} must be between 0 and {between - 1} "
                        f"(ft.sync_every/ft.fragments - 1): a fragment's exchange ends before the next begins")
    if ft.outer_lr <= 0:
        raise UserError(f"ft.outer_lr={ft.outer_lr} must be positive")
    if not 0 <= ft.outer_momentum < 1:
        raise UserError(f"ft.outer_momentum={ft.outer_momentum} must be at least 0 and below 1")
    if not 0 <= ft.merge_alpha <= 1:
        raise UserError(f"ft.merge_alpha={ft.merge_alpha} must be between 0 and 1")
