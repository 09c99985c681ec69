"""Hydra's submitit launchers, adapted to multi-process training runs.

Each job of a `-m` sweep becomes one element of a Slurm job array (or a local process
group with `local`). Every srun task of a job runs the Hydra job in the folder they
all share (Hydra resolves it once, before submission); rank 0 alone writes `.hydra/`
and the log. After the sweep, every job that failed is named with its log.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

from ciuic_train.launch.slurm import WORKER_OVERRIDES, Task

log = logging.getLogger("ciuic_train")

# Slurm's states for a job stopped from outside (scancel, the time limit, a lost node, the
# OOM killer): its function never returned, so no result file will come. submitit would
# still wait 15 s for one (room for a slow shared filesystem), per job, before saying so.
STOPPED_FROM_OUTSIDE = {"CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def _result(job: Any) -> JobReturn:
    """The job's return once it has ended; UncompletedJobError at once for a job Slurm
    stopped before it wrote one."""
    import submitit

    job.wait()
    if job.state.split()[0] in STOPPED_FROM_OUTSIDE and not job.paths.result_pickle.exists():
        raise submitit.core.utils.UncompletedJobError(job.state)
    return job.results()[0]


class _TrainingTasks:
    """What each task of a submitted job does before Hydra runs it, and how a sweep ends."""

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[Any, Any],
    ) -> JobReturn:
        task = Task.from_submitit()
        task.limit_threads()
        overrides = list(sweep_overrides)
        if task.world_size > 1:
            task.export()
            if task.rank != 0:
                overrides += WORKER_OVERRIDES
        return super().__call__(overrides, job_dir_key, job_num, job_id, singleton_state)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit the sweep as one job array, wait for every job, then name each one that
        failed and where its log is (the plugin stops at the first failure it meets)."""
        import submitit
        from hydra.core.singleton import Singleton

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        executor = self._executor()
        numbers = range(initial_job_idx, initial_job_idx + len(job_overrides))
        state = Singleton.get_state()
        jobs = executor.map_array(
            self,
            [list(o) for o in job_overrides],
            ["hydra.sweep.dir"] * len(job_overrides),
            list(numbers),
            [f"job_id_for_{n}" for n in numbers],
            [state] * len(job_overrides),
        )
        log.info(f"{self._EXECUTOR}: submitted {len(jobs)} jobs ({', '.join(j.job_id for j in jobs)}) into {sweep_dir}")
        returns, failures = [], []
        for number, overrides, job in zip(numbers, job_overrides, jobs):
            try:
                returns.append(_result(job))
                continue
            except submitit.core.utils.UncompletedJobError:
                reason = f"ended {job.state} without a result"
            except submitit.core.utils.FailedJobError as err:
                reason = "raised " + [line for line in str(err).splitlines() if line.strip()][-1].strip()
            what = " ".join(filter_overrides(overrides)) or "no overrides"
            failures.append(f"job #{number} ({what}), {self._EXECUTOR} job {job.job_id}, {reason}; log: {job.paths.stderr}")
        if failures:
            print(f"ciuic-train: error: {len(failures)} of {len(jobs)} jobs failed", file=sys.stderr)
            for line in failures:
                print(f"  {line}", file=sys.stderr)
            sys.exit(1)
        return returns

    def _executor(self) -> Any:
        """submitit's executor with this launcher's resources; keys the plugin does not
        share between executors take the executor's prefix (slurm_partition, ...)."""
        import submitit

        params = dict(self.params)
        folder = params.pop("submitit_folder")
        max_num_timeout = params.pop("max_num_timeout", None)
        extra = {f"{self._EXECUTOR}_max_num_timeout": max_num_timeout} if max_num_timeout is not None else {}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=folder, **extra)
        shared = {f.name for f in dataclasses.fields(BaseQueueConf)}
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        return executor


class SlurmLauncher(_TrainingTasks, submitit_launcher.SlurmLauncher):
    """`hydra/launcher=slurm`: one Slurm array element per job, srun tasks as ranks."""


class LocalLauncher(_TrainingTasks, submitit_launcher.LocalLauncher):
    """`hydra/launcher=local`: the same path in local processes, for trying it without Slurm."""
