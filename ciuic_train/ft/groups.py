"""The replica groups a run asks for (`ft.*`): torchft's, meeting every step or in
DiLoCo's rounds, or the whole world as one group."""

from __future__ import annotations

from typing import Callable

from ciuic_train.ft.config import FtConfig, Sync
from ciuic_train.ft.replicas import OneGroup, ReplicaGroups


def replica_groups(ft: FtConfig, parallel, max_steps: int, state: Callable[[], dict], load: Callable[[dict], None],
                   resume: Callable[[], None]) -> OneGroup:
    """The replica groups `ft` asks for: torchft's, meeting every step or in DiLoCo's
    rounds (up to `max_steps`), or the world as one group."""
    if not ft.enabled:
        return OneGroup()
    if ft.sync is Sync.diloco:
        from ciuic_train.ft.diloco import DiLoCoGroups

        return DiLoCoGroups(ft, parallel, max_steps, state, load, resume)
    return ReplicaGroups(ft, parallel, state, load, resume)
