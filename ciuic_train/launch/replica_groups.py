"""`ft.enabled=true` under the CLI's launcher: a lighthouse and `ft.groups` replica groups.

`dist.nproc_per_node=N ft.groups=G` starts, from the one command:

- a torchft lighthouse in this process (unless `ft.lighthouse` names a running one), which
  forms the quorum of live groups before each step;
- G torchrun agents, each the elastic launcher of one group of N/G workers with its own
  rendezvous, so a group that dies is restarted by its own agent (`dist.max_restarts`)
  while the others train on. Group 0 trains in the run folder and prints to this
  terminal; group g > 0 in `<run>/group_<g>/` (its train.log, metrics.jsonl and
  summary.json; its terminal output in `console.log` there). Every group shares
  `<run>/checkpoints/` (`ft.checkpoints`);
- a store where the groups meet once before their first step (`replicas.START_STORE`).

The job's summary is group 0's, or, if group 0 did not finish, the lowest group's that did
(`paths.ElasticLauncher`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from ciuic_train.config import Config
from ciuic_train.errors import UserError
from ciuic_train.ft.config import START_STORE
from ciuic_train.launch.overrides import quote_override

log = logging.getLogger("ciuic_train")


def group_folder(run_dir: Path, group: int) -> Path:
    return run_dir if group == 0 else run_dir / f"group_{group}"


def check_ft_launch(config: Config, starts_workers: bool, srun_task: bool) -> None:
    """What `ft` needs from how this process was started, before anything starts:
    `starts_workers` (the CLI's launcher, dist.nproc_per_node > 1) splits its ranks into
    the groups and can start the lighthouse; any other process is one group's rank and
    must be told where the lighthouse is, which must answer."""
    ft = config.ft
    if not ft.enabled:
        return
    if srun_task:
        raise UserError("ft.enabled=true under srun with several tasks: each would be one rank of one world; "
                        "run one task that starts the groups (srun -n 1 ciuic-train dist.nproc_per_node=N "
                        "ft.enabled=true ft.groups=G), or one ciuic-train per replica group (dist.nproc_per_node=N "
                        "ft.group=G ft.lighthouse=URL)")
    if starts_workers:
        check_group_split(config)
    elif not ft.lighthouse:
        raise UserError(f"ft.enabled=true in a process that starts no replica groups needs the lighthouse they "
                        f"share: ft.lighthouse=http://host:port (torchft_lighthouse --min_replicas 1), or "
                        f"dist.nproc_per_node=N ft.groups={ft.groups} for the CLI to start them")
    if ft.lighthouse:
        check_lighthouse(ft.lighthouse)


def check_lighthouse(address: str, timeout_s: float = 5.0) -> None:
    """A lighthouse that does not answer its address is one line, not a hung quorum."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(address, timeout=timeout_s).close()
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise UserError(f"ft.lighthouse={address} does not answer ({reason}); start it first "
                        "(torchft_lighthouse --min_replicas 1 --bind [::]:PORT), or leave ft.lighthouse empty "
                        "for the CLI's launcher to start one") from None


def check_group_split(config: Config) -> None:
    """`ft.groups` against the ranks the CLI's launcher starts."""
    nproc, groups = config.dist.nproc_per_node, config.ft.groups
    if nproc % groups:
        raise UserError(f"ft.groups={groups} does not divide dist.nproc_per_node={nproc}: every replica group "
                        f"needs as many ranks; use a divisor of {nproc}")


def start_replica_groups(config: Config, run_dir: Path, overrides: list[str]) -> tuple[list[int], str | None]:
    """Start the lighthouse and the groups on `overrides` (the job's), wait for every
    group; their exit codes, and the signal that stopped them (None: none did)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    check_group_split(config)
    ft, groups = config.ft, config.ft.groups
    per_group = config.dist.nproc_per_node // groups
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log each quorum at info
    lighthouse = None
    address = ft.lighthouse
    if not address:
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=ft.min_groups, join_timeout_ms=ft.join_timeout_ms,
                                      quorum_tick_ms=100, heartbeat_timeout_ms=int(ft.timeout_s * 500))
        address = lighthouse.address()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, START_STORE: f"127.0.0.1:{store.port}"}  # OMP_NUM_THREADS: set by the launcher
    log.info(f"starting {groups} replica groups of {per_group} workers (lighthouse {address}) in {run_dir}")
    procs = []
    for group in range(groups):
        folder = group_folder(run_dir, group)
        folder.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={per_group}", "--nnodes=1",
            "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", f"--max-restarts={config.dist.max_restarts}",
            "--monitor-interval=0.5", "-m", "ciuic_train", *overrides,
            f"hydra.run.dir={quote_override(str(folder.absolute()))}", "hydra.output_subdir=null",
            f"ft.group={group}", f"ft.lighthouse={address}",
            f"ft.checkpoints={quote_override(str(run_dir.absolute()))}",
        ]
        output = None if group == 0 else open(folder / "console.log", "ab")
        procs.append(subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
                                      start_new_session=group > 0))
    stopped_by = None

    def forward(signum, _frame):  # a `kill` of this command: every group saves and stops
        nonlocal stopped_by
        stopped_by = signal.Signals(signum).name
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lighthouse is not None:
            lighthouse.shutdown()
    return codes, stopped_by
