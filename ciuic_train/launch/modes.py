"""Launch paths: how the processes of one training run come to exist, and what each must do.

A process finds out from its environment how it was started; each way is one subclass
of `LaunchPath`, and `current()` picks the first class in `PATHS` whose `applies()` is
true (or, if none is, `LaunchPath` itself: a process whose rank, if it has one, is
already in its environment):

- `SrunTask`: `srun -n N ciuic-train ...` inside a Slurm allocation. srun started this
  process as one of N tasks, each one rank of one run; the rank comes from Slurm's
  variables, and the run folder is named after the job and step. With `ft.enabled=true`
  (one task per node) each task starts its node's replica groups instead.
- `LauncherTask`: a task of our Hydra launchers' job on several nodes, its rank exported
  by the launcher; likewise a rank, or with `ft.enabled=true` its node's groups.
- `ElasticWorker`: torchrun started this process, or `ElasticLauncher` below did. Torch's
  elastic agent set its rank; the ranks agree on one run folder through the agent's store.
- `ElasticLauncher`: nothing gave this process a rank (a user typed `ciuic-train ...`).
  It trains by itself, or with `dist.nproc_per_node=N` it starts N `ElasticWorker`s
  inside the Hydra job, as torchrun would, and waits for them.
- Hydra's launchers, `-m hydra/launcher=slurm|local`, submit each job of a sweep; they
  live in `hydra_plugins/ciuic_train_launcher/`, where Hydra's plugin scan finds them, and
  prepare each task's rank there before the job starts.

A new launch path is one subclass here, added to `PATHS` ahead of any path whose
`applies()` would also be true for it; nothing outside this file changes. It provides
what `LaunchPath` declares (each default does nothing), used in this order:

1. `applies()`: whether this process was started this way, from the environment only.
2. `runs_sweeps`: False where every rank would run the whole `-m` sweep; the command
   then refuses `-m`, calling the path by its `name`.
3. `overrides_before_check(argv)`: Hydra overrides to add before the command is checked
   and composed (the run folder, say); also the place to set environment that must be
   there before torch is imported.
4. `run_folder(checked)`: the run folder, from the one the check resolved for the first
   job (the CLI pins it and locks it before Hydra writes there).
5. `overrides_after_check(run_dir)`: overrides that need that run folder.
6. `start_workers(config, run_dir)`: inside the Hydra job, start the processes that
   train it, wait for them and return the summary they wrote (the job reads its
   `stopped_by` and `final_val_loss`); None: this process trains.

The CLI's pre-flight check (`cli/preflight.py`) asks `current()` for 1-5 before Hydra
runs jobs (commands that only print skip them), and the Hydra job (`cli/job.py`) for 6.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ciuic_train.launch import runlock
from ciuic_train.config import Config
from ciuic_train.environment import launcher_rank, uses_agent_store
from ciuic_train.errors import ERROR_LINE_PREFIX, RUN_FAILED_STATUS, RunFailed, UserError
from ciuic_train.launch.overrides import quote_override
from ciuic_train.launch.slurm import WORKER_OVERRIDES, Task, in_slurm_task

log = logging.getLogger("ciuic_train")


class LaunchPath:
    """A process that trains as it is: the base every path builds on (see above)."""

    name = "ciuic-train"
    runs_sweeps = True

    @classmethod
    def applies(cls) -> bool:
        """Whether the environment says this process was started this way."""
        return True

    def overrides_before_check(self, argv: list[str]) -> list[str]:
        """Overrides to add to the command line `argv` before it is checked."""
        return []

    def run_folder(self, checked: str) -> str:
        """The run folder (absolute), from the one the check resolved."""
        return str(Path(checked).absolute())

    def overrides_after_check(self, run_dir: str) -> list[str]:
        """Overrides to add once the run folder is known."""
        return []

    def start_workers(self, config: Config, run_dir: Path) -> dict[str, Any] | None:
        """Inside the job: the summary of the workers that trained it, or None to train here."""
        return None


class SrunTask(LaunchPath):
    """One of N tasks that srun started directly, each one rank of one run (no torchrun inside)."""

    name = "srun"
    runs_sweeps = False

    @classmethod
    def applies(cls) -> bool:
        # Tasks of our Hydra launchers are srun tasks too, but the launcher has prepared them.
        return in_slurm_task() and "SUBMITIT_FOLDER" not in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1

    def overrides_before_check(self, argv: list[str]) -> list[str]:
        """Tasks cannot agree on a `${now:}` folder before they can talk, so unless the
        command names one, the run folder is named after the job and step: the same on
        every task, and again when the job is requeued."""
        task = Task.from_slurm()
        task.export()
        task.limit_threads()
        overrides = []
        if not any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv):
            step = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
            overrides.append(f"hydra.run.dir={quote_override(str(Path('outputs') / f'slurm-{step}'))}")
        return overrides + (list(WORKER_OVERRIDES) if task.rank != 0 else [])

    def start_workers(self, config: Config, run_dir: Path) -> dict[str, Any] | None:
        """With `ft.enabled=true` this task is its node's one (`srun -N K --ntasks-per-node=1`):
        it starts the node's share of the replica groups."""
        return _start_node_groups(config, run_dir)


class LauncherTask(LaunchPath):
    """A task of our Hydra launchers' job on several nodes (`hydra.launcher.nodes=K`): the
    launcher exported its rank; it trains as that rank, or with `ft.enabled=true` (one task
    per node) starts the node's share of the replica groups."""

    name = "hydra/launcher"

    @classmethod
    def applies(cls) -> bool:
        env = os.environ
        return "SUBMITIT_FOLDER" in env and "WORLD_SIZE" in env and "TORCHELASTIC_RUN_ID" not in env

    def start_workers(self, config: Config, run_dir: Path) -> dict[str, Any] | None:
        return _start_node_groups(config, run_dir)


def _start_node_groups(config: Config, run_dir: Path) -> dict[str, Any] | None:
    """A node's one task of an `ft` job: its groups' summary; None without `ft` (train here)."""
    if not config.ft.enabled:
        return None
    from ciuic_train.launch.replica_groups import NodeShare

    # The launcher gave this task the node's share of the CPUs: one share of it per rank.
    task_threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, task_threads // config.dist.nproc_per_node))
    return _start_replica_groups(config, run_dir, NodeShare.from_environment())


class ElasticWorker(LaunchPath):
    """A worker that torch's elastic agent started: torchrun, or `ElasticLauncher`."""

    name = "torchrun"
    runs_sweeps = False

    @classmethod
    def applies(cls) -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ

    def overrides_before_check(self, argv: list[str]) -> list[str]:
        """Without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which torch 2.13
        needs for a replaced node to rejoin under --max-restarts) the ranks cannot agree on a
        `${now:}` folder (`run_folder`), so several ranks need it named."""
        named = any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv)
        if not uses_agent_store() and int(os.environ.get("WORLD_SIZE", 1)) > 1 and not named:
            raise UserError(
                "under torchrun without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the ranks "
                "cannot agree on a dated run folder; name it: hydra.run.dir=DIR (on storage every host sees)"
            )
        return []

    def run_folder(self, checked: str) -> str:
        """One run folder for all ranks.

        Each rank composes its own config, and `${now:}` can differ between them, so the
        folder is agreed through the elastic agent's store: the first rank to propose one
        wins, and a restarted worker group finds the same folder again.
        """
        return _agree_run_dir(checked)

    def overrides_after_check(self, run_dir: str) -> list[str]:
        """Rank 0 alone writes in the run folder."""
        return list(WORKER_OVERRIDES) if launcher_rank() != 0 else []


class ElasticLauncher(LaunchPath):
    """A process no launcher gave a rank: with `dist.nproc_per_node=N` > 1 it starts N
    workers on this job's config and folder through torch's elastic launcher, as torchrun
    would, instead of training itself."""

    @classmethod
    def applies(cls) -> bool:
        return "WORLD_SIZE" not in os.environ

    def start_workers(self, config: Config, run_dir: Path) -> dict[str, Any] | None:
        nproc = config.dist.nproc_per_node
        if nproc == 1:
            return None
        # Like torchrun, keep N processes from each starting one thread per core.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        if config.ft.enabled:  # replica groups, each its own torchrun: ciuic_train/launch/replica_groups.py
            return _start_replica_groups(config, run_dir, None)
        import uuid

        from hydra.core.hydra_config import HydraConfig
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        overrides = [
            *HydraConfig.get().overrides.task,
            f"hydra.run.dir={quote_override(str(run_dir.absolute()))}",
            "hydra.output_subdir=null",  # this process already wrote .hydra/
        ]
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=str(uuid.uuid4()),
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=config.dist.max_restarts,
        )  # its agent looks at the workers every 0.1 s, as torchrun's does
        log.info(f"starting {nproc} workers (torch elastic launcher) in {run_dir}")
        runlock.lend_to_children(run_dir)
        try:
            with _elastic_logs_quiet():
                elastic_launch(launch, sys.executable)("-m", "ciuic_train", *overrides)
        except SignalException as err:
            # This process was signalled (a `kill` of the command): torch's agent passed the
            # signal on to the workers and waited for them, which saved and stopped.
            return {"stopped_by": err.sigval.name, "final_val_loss": float("nan")}
        except ChildFailedError as err:
            exit_codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
            reported = reported_exit_status(exit_codes)  # rank 0 has already said what went wrong
            if reported == RUN_FAILED_STATUS:
                raise RunFailed("") from None
            if reported is not None:
                raise SystemExit(reported) from None
            failed = ", ".join(f"rank {rank} exit code {code}" for rank, code in sorted(exit_codes.items()))
            raise WorkersFailed(f"workers failed ({failed}); see {run_dir / 'train.log'}") from None
        return workers_result(run_dir, config.train.max_steps)


def _start_replica_groups(config: Config, run_dir: Path, share: Any) -> dict[str, Any]:
    """Start this node's replica groups (`share`: a `NodeShare`, or None on one node), wait
    for them and return the job's summary (`_replica_groups_result`)."""
    from hydra.core.hydra_config import HydraConfig

    from ciuic_train.launch.replica_groups import start_replica_groups

    runlock.lend_to_children(run_dir)
    codes, stopped_by = start_replica_groups(config, run_dir, list(HydraConfig.get().overrides.task), share)
    try:
        return _replica_groups_result(codes, stopped_by, config, run_dir)
    except WorkersFailed as err:
        if share is None or share.nodes == 1:
            raise
        raise NodeFailed(f"node {share.node} of {share.nodes}: {err}") from None


def _replica_groups_result(codes: dict[int, int], stopped_by: str | None, config: Config,
                           run_dir: Path) -> dict[str, Any]:
    """The job's summary once this node's replica groups exited with `codes` (by group):
    the first group's, or the lowest finished group's where it failed; none finished is a
    failure."""
    from ciuic_train.launch.replica_groups import group_folder

    if stopped_by:
        return {"stopped_by": stopped_by, "final_val_loss": float("nan")}
    finished = [group for group, code in codes.items() if code == 0]
    if not finished:
        failed = "; ".join(f"group {group} exit code {code}{_said(group_folder(run_dir, group))}"
                           for group, code in codes.items())
        raise WorkersFailed(f"every replica group failed ({failed}); see {run_dir / 'train.log'} and "
                            f"{run_dir}/group_*/train.log")
    first = min(codes)
    if finished[0] != first:
        log.warning(f"replica group {first} failed (exit code {codes[first]}); the run's summary is group "
                    f"{finished[0]}'s")
    return workers_result(group_folder(run_dir, finished[0]), config.train.max_steps)


def _said(group_dir: Path) -> str:
    """`: LINE`, the last error line a replica group printed into its console.log (groups
    after the first print there, not on this terminal), or nothing."""
    console = group_dir / "console.log"
    lines = console.read_text(errors="replace").splitlines() if console.is_file() else []
    said = [line.removeprefix(ERROR_LINE_PREFIX) for line in lines if line.startswith(ERROR_LINE_PREFIX)]
    return f": {said[-1]}" if said else ""


def workers_result(run_dir: Path, max_steps: int) -> dict[str, Any]:
    """The summary the workers' rank 0 wrote, once they all exited cleanly. Rank 0 writes
    none when a signal stopped the run after a save: then a summary.json there is an
    earlier, shorter run's of the same folder (a finished run's has `max_steps` steps),
    and the run counts as stopped."""
    summary = run_dir / "summary.json"
    written = json.loads(summary.read_text()) if summary.is_file() else None
    if written is None or written.get("steps") != max_steps:
        return {"stopped_by": "a signal", "final_val_loss": float("nan")}
    return written


ELASTIC_LOGS = "torch.distributed.elastic"


@contextmanager
def _elastic_logs_quiet() -> Iterator[None]:
    """Torch's elastic agent logs each worker it stops and each exit code; the workers
    and `WorkersFailed` already say what went wrong, in one line."""
    loggers = [logging.getLogger(name) for name in logging.root.manager.loggerDict if name.startswith(ELASTIC_LOGS)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# Checked in this order: a torchrun worker inside a Slurm job is an ElasticWorker, not an SrunTask.
PATHS: tuple[type[LaunchPath], ...] = (SrunTask, ElasticWorker, LauncherTask, ElasticLauncher)


def current() -> LaunchPath:
    """How this process was started."""
    return next((path() for path in PATHS if path.applies()), LaunchPath())


class WorkersFailed(Exception):
    """Workers this process started crashed; the message names each failed rank."""


class NodeFailed(WorkersFailed):
    """Every replica group one node's task started failed. Said by that task whatever its
    rank: the nodes of an `ft` job fail apart, and the first node may be the one lost."""


def reported_exit_status(exit_codes: dict[int, int]) -> int | None:
    """The status to exit with when failed workers' exit codes by rank mean that rank 0
    said what went wrong, not a crash; None otherwise.

    Rank 0 exits 2 after a user mistake, 3 after a run stopped itself (`RunFailed`). The
    other ranks meet the same end, but one still on its way there when rank 0 exits is
    stopped by the launcher (SIGTERM, then SIGKILL), which is no crash of its own. A run
    stops itself on every rank at once, after they agreed, and rank 0 says why before
    anything else; so when another rank exits 3 first, rank 0 stopped by the launcher
    on its way out (on a busy machine its exit can take longer than the launcher's 0.5 s
    look) has said it too.
    """
    status = exit_codes.get(0)
    if status not in (2, RUN_FAILED_STATUS) and RUN_FAILED_STATUS in exit_codes.values():
        status = RUN_FAILED_STATUS
    if status not in (2, RUN_FAILED_STATUS):
        return None
    stopped = {status, -signal.SIGTERM, -signal.SIGKILL}
    return status if all(code in stopped for code in exit_codes.values()) else None


def _agree_run_dir(proposal: str) -> str:
    """The first proposal any rank of this worker group made (our own, without an agent store)."""
    if not uses_agent_store():
        return str(Path(proposal).absolute())
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    key = f"ciuic_train/run_dir/{os.environ['TORCHELASTIC_RUN_ID']}"
    return store.compare_set(key, "", str(Path(proposal).absolute())).decode()
