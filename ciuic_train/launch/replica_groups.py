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
(`modes.ElasticLauncher`).

On several nodes (`srun -N K --ntasks-per-node=1`, or a Hydra launcher's
`hydra.launcher.nodes=K`), each node's one task starts its share of the groups
(`NodeShare`: ft.groups / K of them, each dist.nproc_per_node / (ft.groups / K) ranks).
The first node's task also runs the lighthouse and the store where the groups meet (on
the job's port there, `MASTER_PORT`); the others find the lighthouse's address in that
store. The first node keeps the lighthouse up until every node's groups ended, or
`NODES_WAIT_S` after its own did (a node lost for good does not hold it forever).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ciuic_train.config import Config
from ciuic_train.errors import UserError, first_line
from ciuic_train.ft.config import START_STORE
from ciuic_train.launch.overrides import quote_override

log = logging.getLogger("ciuic_train")


# How long the first node keeps the lighthouse up for the other nodes' groups once its own ended.
NODES_WAIT_S = 60.0
# Keys of the first node's store: the lighthouse's address, and how many nodes' groups ended.
LIGHTHOUSE_KEY, NODES_ENDED_KEY = "ciuic_train/lighthouse", "ciuic_train/nodes_ended"


@dataclass(frozen=True)
class NodeShare:
    """This task's node among the job's `nodes`, one task per node; `head` and `port`: the
    first node's host name and the job's port there (the launcher's MASTER_ADDR and
    MASTER_PORT)."""

    node: int
    nodes: int
    head: str
    port: int

    @classmethod
    def from_environment(cls) -> "NodeShare":
        env = os.environ
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]))

    def groups(self, total: int) -> range:
        """The replica groups this node starts, of `total`."""
        per_node = total // self.nodes
        return range(self.node * per_node, (self.node + 1) * per_node)


def group_folder(run_dir: Path, group: int) -> Path:
    return run_dir if group == 0 else run_dir / f"group_{group}"


def check_ft_launch(config: Config, starts_workers: bool, srun_tasks_per_node: int = 0, nodes: int = 1) -> None:
    """What `ft` needs from how this process was started, before anything starts:
    `starts_workers` (the CLI's launcher, dist.nproc_per_node > 1) splits its ranks into
    the groups and can start the lighthouse; so does each of srun's tasks on `nodes`
    nodes where `srun_tasks_per_node` is 1 (0: not an srun task); any other process is
    one group's rank and must be told where the lighthouse is, which must answer."""
    ft = config.ft
    if not ft.enabled:
        return
    if srun_tasks_per_node > 1:
        raise UserError(f"ft.enabled=true under srun with {srun_tasks_per_node} tasks per node: each would be one "
                        "rank of one world; run one task per node, which starts that node's replica groups "
                        "(srun -N K --ntasks-per-node=1 ciuic-train dist.nproc_per_node=N ft.enabled=true "
                        "ft.groups=G), or one ciuic-train per replica group (dist.nproc_per_node=N ft.group=G "
                        "ft.lighthouse=URL)")
    if srun_tasks_per_node == 1:
        check_group_split(config, nodes)
    elif starts_workers:
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


def check_group_split(config: Config, nodes: int = 1) -> None:
    """`ft.groups` against the `nodes` and the ranks each node's launcher starts."""
    nproc, groups = config.dist.nproc_per_node, config.ft.groups
    if groups % nodes:
        raise UserError(f"ft.groups={groups} does not divide among the job's {nodes} nodes: every node starts as "
                        f"many replica groups; use a multiple of {nodes}")
    if nproc % (groups // nodes):
        per_node = f" ({groups // nodes} per node)" if nodes > 1 else ""
        raise UserError(f"ft.groups={groups}{per_node} does not divide dist.nproc_per_node={nproc}: every replica "
                        f"group needs as many ranks; use a divisor of {nproc}" + (" per node" if nodes > 1 else ""))


def start_replica_groups(config: Config, run_dir: Path, overrides: list[str],
                         share: NodeShare | None = None) -> tuple[dict[int, int], str | None]:
    """Start the lighthouse and the groups on `overrides` (the job's), wait for every
    group; their exit codes by group, and the signal that stopped them (None: none did).
    `share`: this node's part of a job on several nodes (module docstring); None: one node."""
    share = share or NodeShare(0, 1, "127.0.0.1", 0)
    check_group_split(config, share.nodes)
    ft = config.ft
    groups = share.groups(ft.groups)
    per_group = config.dist.nproc_per_node // len(groups)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log each quorum at info
    store, lighthouse, address = _meeting_point(share, ft)
    env = {**os.environ, START_STORE: f"{share.head}:{store.port}"}  # OMP_NUM_THREADS: set by the launcher
    where = f" on node {share.node} of {share.nodes}" if share.nodes > 1 else ""
    log.info(f"starting {_count(len(groups), 'replica group')} of {_count(per_group, 'worker')}{where} "
             f"(lighthouse {address}) in {run_dir}")
    procs = {}
    for group in groups:
        folder = group_folder(run_dir, group)
        folder.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={per_group}", "--nnodes=1",
            "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", f"--max-restarts={config.dist.max_restarts}",
            "-m", "ciuic_train", *overrides,
            f"hydra.run.dir={quote_override(str(folder.absolute()))}", "hydra.output_subdir=null",
            f"ft.group={group}", f"ft.lighthouse={address}",
            f"ft.checkpoints={quote_override(str(run_dir.absolute()))}",
        ]
        output = None if group == 0 else open(folder / "console.log", "ab")
        procs[group] = subprocess.Popen(command, env=env, stdout=output,
                                        stderr=subprocess.STDOUT if output else None, start_new_session=group > 0)
    stopped_by = None

    def forward(signum, _frame):  # a `kill` of this command: every group saves and stops
        nonlocal stopped_by
        stopped_by = signal.Signals(signum).name
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = {group: proc.wait() for group, proc in procs.items()}
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _leave(store, lighthouse, share)
    return codes, stopped_by


def _meeting_point(share: NodeShare, ft) -> tuple[object, object, str]:
    """The store where the groups meet before their first step, the lighthouse this task
    runs (None where another does) and its address. On one node both are this task's
    (the store on a free port); on several, the first node's, on the job's port there."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    first = share.node == 0
    store = TCPStore(share.head, share.port, is_master=first, wait_for_workers=False,
                     timeout=timedelta(seconds=max(60.0, ft.quorum_timeout_s)))
    if ft.lighthouse:
        return store, None, ft.lighthouse
    if not first:
        return store, None, store.get(LIGHTHOUSE_KEY).decode()  # waits for the first node's
    from torchft._torchft import LighthouseServer

    # On several nodes the others reach it by the first node's name: every interface.
    lighthouse = LighthouseServer(bind="[::]:0" if share.nodes == 1 else "0.0.0.0:0", min_replicas=ft.min_groups,
                                  join_timeout_ms=ft.join_timeout_ms, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=int(ft.timeout_s * 500))
    address = lighthouse.address()
    if share.nodes > 1:
        address = f"http://{share.head}:{address.rsplit(':', 1)[1]}"
        store.set(LIGHTHOUSE_KEY, address)
    return store, lighthouse, address


def _leave(store, lighthouse, share: NodeShare) -> None:
    """This node's groups ended: say so; the lighthouse's node waits for the others'
    (at most `NODES_WAIT_S`) before it stops the lighthouse. Where the first node was lost,
    its store went with it: nothing to report to (a probe first, as a store call to a
    closed port prints torch's C++ stack on the terminal)."""
    if lighthouse is None and share.nodes > 1 and not _answers(share.head, share.port):
        log.warning(f"node {share.node}: the first node's store at {share.head}:{share.port} is gone: that node "
                    "was lost")
        return
    from torch.distributed import DistError

    try:
        ended = store.add(NODES_ENDED_KEY, 1) if share.nodes > 1 else 1
        deadline = time.monotonic() + NODES_WAIT_S
        while lighthouse is not None and ended < share.nodes and time.monotonic() < deadline:
            time.sleep(0.2)
            ended = store.add(NODES_ENDED_KEY, 0)
    except DistError as err:  # gone between the probe and the call
        log.warning(f"node {share.node}: the first node's store at {share.head}:{share.port} is gone "
                    f"({first_line(err)})")
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()


def _answers(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to host:port opens within `timeout_s` (a node powered off
    drops the packets: the timeout; a node whose processes died: refused at once)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
