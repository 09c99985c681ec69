"""Slurm tasks: ranks from the job environment, and what a stopped task does.

The launchers that submit jobs (`hydra/launcher=slurm|local`) live in
`hydra_plugins/ciuic_train_launcher`, where Hydra looks for plugins; plain `srun` is
`ciuic_train.launch.modes.SrunTask`. srun starts one task per training process; each task
takes its rank from the job environment and exports the variables torch's env://
rendezvous reads. A run stopped by Slurm's time-limit warning (SIGUSR1) saves a
checkpoint and requeues itself; the requeued job resumes it (`resume=auto`, the default).
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass


log = logging.getLogger("ciuic_train")

# Rendezvous ports are derived from the job id, so jobs sharing a node do not collide.
PORT_BASE, PORT_SPAN = 20000, 20000
# What rank 0 leaves out: every task shares the job folder.
WORKER_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=worker")


@dataclass(frozen=True)
class Task:
    """One process of a job, as the scheduler (or submitit's local executor) sees it."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    nodes: int
    head_node: str

    @classmethod
    def from_submitit(cls) -> "Task":
        import submitit

        env = submitit.JobEnvironment()
        return cls(str(env.job_id), env.global_rank, env.local_rank, env.num_tasks, env.num_nodes, env.hostnames[0])

    @classmethod
    def from_slurm(cls) -> "Task":
        """A task srun started directly: Slurm's own variables."""
        env = os.environ
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return cls(
            env["SLURM_JOB_ID"],
            int(env["SLURM_PROCID"]),
            int(env["SLURM_LOCALID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES", 1)),
            nodes[0],
        )

    @property
    def master_port(self) -> int:
        # Array elements each have a job id of their own: SLURM_JOB_ID, not "<array>_<index>";
        # steps of one job running side by side differ by step id.
        job = int(os.environ.get("SLURM_JOB_ID") or "".join(c for c in self.job_id if c.isdigit()) or 0)
        step = int(os.environ.get("SLURM_STEP_ID", 0)) % 16
        return PORT_BASE + (job * 16 + step) % PORT_SPAN

    def export(self) -> None:
        """The environment torch.distributed's env:// init and our RankInfo read."""
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK=str(self.local_rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.head_node,
            MASTER_PORT=str(self.master_port),
        )

    @property
    def local_world_size(self) -> int:
        return max(1, self.world_size // self.nodes)

    def limit_threads(self) -> None:
        """Like torchrun: one share of the job's CPUs per task, not one thread per core of
        the node each. Must run before torch is imported."""
        cpus = os.environ.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1
        share = os.environ.get("SLURM_CPUS_PER_TASK") or max(1, int(cpus) // self.local_world_size)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def in_slurm_task() -> bool:
    """A process srun started (directly or through submitit), not a torchrun worker."""
    return "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ


def end_stopped_task(signal_name: str, is_main: bool) -> None:
    """After a signal stopped the run and its checkpoint is saved: end this Slurm task
    without a result, so the sweep does not count the job as done.

    SIGUSR1 is Slurm's notice before the time limit (or a preemption sent that way):
    rank 0 requeues the job, which then resumes from the checkpoint. SIGTERM is a cancel,
    or a preemption that Slurm requeues by itself: the scheduler decides.
    """
    if signal_name == "SIGUSR1" and is_main:
        env = os.environ
        # An array element's SLURM_JOB_ID can be the array's own id, which names every element.
        array = "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}" if array else env["SLURM_JOB_ID"]
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
        log.warning(f"stopped by {signal_name}: checkpoint saved, Slurm job {job} requeued to resume it")
    raise SystemExit(0)
