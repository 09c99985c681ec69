"""What a launcher told this process through its environment, readable before any process
group exists and without torch; below every package that must know it (the token cache,
the process group, the replica groups, the launch modes)."""

from __future__ import annotations

import os


def launcher_rank() -> int:
    """This process's rank as its launcher set it (`RANK`; 0 where nothing launched it)."""
    return int(os.environ.get("RANK", 0))


def uses_agent_store() -> bool:
    """Whether torch's elastic agent lends its workers its store (MASTER_ADDR:MASTER_PORT):
    it does unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and outside torchrun there is none."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
