"""The check before Hydra runs: every job the command line asks for, composed and checked.

Hydra reports configuration mistakes as multi-line messages (or tracebacks) and only
after it has created a run folder. So before Hydra runs, `check_request` composes each
job (one, or each point of a `-m` sweep) and checks what can be checked without
starting it: the schema, the launcher, the mesh the world size resolves to, the corpus,
the checkpoint a resume continues and the weights `init_from` loads, and whether the
run fits the memory a rank has here (`plan/memory_check.py`). The first mistake is a
`UserError`, which `cli.main` prints as one line before anything is written.

The memory check runs in the process that is first to run a job here: the one a user
started (for all its `dist.nproc_per_node` workers: the node's memory is divided
between them), each torchrun or srun worker (for its own share), but not the workers
our elastic launcher starts, which it checked already (`MEMORY_CHECKED_BY`). Where a
Slurm launcher submits the jobs, this host is not where they run: nothing is checked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from pathlib import Path

from hydra.core.override_parser.types import Override

from ciuic_train.cli.compose import compose, config_module, job_config, without_hydra
from ciuic_train.cli.flags import PROG, composes_our_config, parse_hydra_command_line
from ciuic_train.cli.messages import as_user_errors, is_rank_0, print_warning
from ciuic_train.cli.sweeps import job_overrides, parse_overrides
from ciuic_train.config import Config
from ciuic_train.distributed.compression import refuse_compression
from ciuic_train.distributed.mesh import expected_mesh, expected_world, refuse_comm_hook
from ciuic_train.distributed.checks import check_pipeline_mesh
from ciuic_train.errors import UserError
from ciuic_train.launch import modes as launch
from ciuic_train.launch.replica_groups import check_ft_launch, check_group_split
from ciuic_train.launch.slurm import Task
from ciuic_train.tricks import seam_owner

# Our launchers (conf/hydra/launcher/) and what each needs beyond Hydra itself.
SUBMITIT_LAUNCHERS = {"slurm": "sbatch", "local": None}
# Set by a process that checked the memory of the workers it starts: its pid.
MEMORY_CHECKED_BY = "CIUIC_TRAIN_MEMORY_CHECKED_BY"


@dataclasses.dataclass(frozen=True)
class CheckedJob:
    config: Config
    run_dir: str  # hydra.run.dir as this process resolves it
    sweep_dir: str  # hydra.sweep.dir, likewise
    tasks_per_node: int  # hydra.launcher.tasks_per_node, likewise (1 where the launcher has none)
    nodes: int  # hydra.launcher.nodes, likewise


def check_request(
    argv: list[str], path: launch.LaunchPath | None = None, config_only: bool = False,
    check_memory: bool = True,
) -> list[CheckedJob]:
    """Compose and check every job the command line asks for, before anything runs.

    `path` is how this process was started (default: as the environment says);
    `config_only` is for commands that print the config: they skip the corpus and
    checkpoint checks, which need torch. `check_memory`: whether a job that would not
    fit here is refused (--plan reports the figures instead).
    """
    args, unknown = parse_hydra_command_line(argv)
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r}; see {PROG} --help")
    if args.resolve and not (args.cfg or args.help):
        raise UserError("--resolve works only with --cfg or --help")
    if args.cfg and args.multirun:
        raise UserError("--cfg prints the config of one job; leave out -m")
    if not composes_our_config(args):
        return []  # a user-supplied primary config: Hydra checks it against our schema itself
    path = path or launch.current()
    with config_module(), as_user_errors():
        parsed = parse_overrides(args.overrides)
        launcher = None if config_only else _check_launcher(parsed, args.multirun)
        jobs = job_overrides(parsed, args.multirun)
        if args.multirun and not path.runs_sweeps:
            raise UserError(
                f"-m under {path.name} would run the whole sweep on every rank; "
                f"sweep distributed jobs with {PROG} -m ... dist.nproc_per_node=N instead"
            )
        checked = [_check_job(job, config_only, check_mesh=launcher is None) for job in jobs]
    if not config_only and launcher is None:
        for job in checked:
            starts_workers = isinstance(path, launch.ElasticLauncher) and job.config.dist.nproc_per_node > 1
            srun = Task.from_slurm() if isinstance(path, launch.SrunTask) else None
            check_ft_launch(job.config, starts_workers, srun.local_world_size if srun else 0, srun.nodes if srun else 1)
            _check_gpus(job.config, path)
            if check_memory:
                _check_memory(job.config, path)
    if launcher:
        _check_launcher_tasks(launcher, checked)
    return checked


def _check_launcher_tasks(launcher: str, checked: list[CheckedJob]) -> None:
    """Under a submitit launcher each task is a rank, except with `ft.enabled=true`: there
    each node's one task starts that node's replica groups, as the CLI's launcher does
    (`dist.nproc_per_node=N ft.groups=G`, the lighthouse in the first node's task)."""
    for job in checked:
        if job.config.ft.enabled:
            if job.tasks_per_node != 1:
                raise UserError(
                    f"ft.enabled=true under hydra/launcher={launcher}: each node's one task starts its replica "
                    f"groups (dist.nproc_per_node=N ft.groups=G); set hydra.launcher.tasks_per_node=1, "
                    f"not {job.tasks_per_node}"
                )
            check_group_split(job.config, job.nodes)
        elif job.config.dist.nproc_per_node > 1:
            raise UserError(
                f"with hydra/launcher={launcher} each rank is a task: set hydra.launcher.tasks_per_node=N "
                "instead of dist.nproc_per_node=N (or ft.enabled=true: one task starts the replica groups)"
            )


def _check_launcher(parsed: list[Override], multirun: bool) -> str | None:
    """Say what a submitit launcher lacks here, before Hydra fails on it with a traceback;
    the one chosen, if any."""
    chosen = [o.value() for o in parsed if o.key_or_group == "hydra/launcher" and o.value() in SUBMITIT_LAUNCHERS]
    for name in chosen:
        if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
            raise UserError(f"hydra/launcher={name} needs the slurm extra: pip install 'ciuic-train[slurm]'")
        command = SUBMITIT_LAUNCHERS[name]
        if command and shutil.which(command) is None:
            raise UserError(
                f"hydra/launcher={name} submits with Slurm's {command}, which is not on PATH here; "
                "run from a Slurm login node, or try the same path locally with hydra/launcher=local"
            )
        if not multirun:
            raise UserError(f"hydra/launcher={name} acts only with -m (Hydra launches jobs in multirun mode); add -m")
    return chosen[0] if chosen else None


def _check_job(overrides: list[str], config_only: bool, check_mesh: bool = True) -> CheckedJob:
    """`check_mesh`: whether this process knows the world size (not so where a Slurm
    launcher will decide it: each task checks its own mesh when it starts)."""
    with as_user_errors():
        cfg = compose(overrides)
        run_dir, sweep_dir = str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)
        tasks_per_node = int(cfg.hydra.launcher.get("tasks_per_node") or 1)
        nodes = int(cfg.hydra.launcher.get("nodes") or 1)
        config = job_config(without_hydra(cfg), overrides)
    if not config_only and check_mesh:
        shape = expected_mesh(config.dist, config.model.n_routed_experts)
        hook_trick = seam_owner(config.trick, "comm_hook")
        refuse_comm_hook(hook_trick, shape, config.train.log_grad_consistency)
        refuse_compression(config.dist, shape, hook_trick, config.train.log_grad_consistency)
        check_pipeline_mesh(config, shape)
    if not config_only:
        from ciuic_train.data.sources import find_sources  # fails fast on a missing corpus, before any folder exists

        from ciuic_train.checkpoint.resume import resolve_resume

        find_sources(config.data)
        resumes_from = resolve_resume(config.resume, Path(run_dir))
        if resumes_from is not None:
            _check_resume(config, resumes_from)
        elif config.init_from:  # a run that will resume its own checkpoint does not read init_from
            _check_init_from(config)
    return CheckedJob(config, run_dir, sweep_dir, tasks_per_node, nodes)


def _check_resume(config: Config, checkpoint: Path) -> None:
    """Refuse a checkpoint this run cannot continue before Hydra touches its folder."""
    from ciuic_train.checkpoint.resume import check_resumable, read_meta, run_fingerprint

    world_size, _ = expected_world(config.dist)
    # A pipeline's stages share their data: the world splits the data pp times less.
    expected = run_fingerprint(config.model, list(config.trick), world_size // config.dist.pp)
    check_resumable(read_meta(checkpoint), expected, config.ckpt.allow_trick_change)


def _check_init_from(config: Config) -> None:
    """Check init_from's tensor names and shapes before Hydra touches the run folder."""
    from ciuic_train.checkpoint.hf_weights import check_init_from

    check_init_from(config.model, Path(config.init_from).expanduser())


def _check_gpus(config: Config, path: launch.LaunchPath) -> None:
    """Refuse to start more local workers on CUDA than the node has GPUs (a worker's own
    check, in `resolve_device`, would leave the others waiting for it at the rendezvous)."""
    from ciuic_train.plan.memory_check import run_device

    workers = config.dist.nproc_per_node
    if not (isinstance(path, launch.ElasticLauncher) and workers > 1) or run_device(config) != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    if workers > count:
        raise UserError(
            f"dist.nproc_per_node={workers} ranks on CUDA, but this node shows {count} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): one rank per GPU; "
            f"run at most dist.nproc_per_node={count}, or device=cpu"
        )


def _check_memory(config: Config, path: launch.LaunchPath) -> None:
    """Refuse a job whose exact memory does not fit a rank here; warn when only its
    estimated total does (rank 0 speaks, as for every mistake)."""
    from ciuic_train.plan.memory_check import as_launched, check_memory, run_device
    from ciuic_train.memory_limits import usable_bytes_per_rank

    checked_by_parent = (
        isinstance(path, launch.ElasticWorker) and os.environ.get(MEMORY_CHECKED_BY) == str(os.getppid())
    )
    device = run_device(config)
    if not config.train.check_memory or checked_by_parent or device is None:
        return
    planned = as_launched(config)
    starts_workers = isinstance(path, launch.ElasticLauncher) and config.dist.nproc_per_node > 1
    local_rank = None if starts_workers else int(os.environ.get("LOCAL_RANK", 0))
    room = usable_bytes_per_rank(device, planned.dist.nproc_per_node, local_rank)
    if room is None:
        return
    verdict = check_memory(planned, room)
    if not verdict.fits:
        raise UserError(verdict.line)
    if not verdict.fits_total and is_rank_0():
        print_warning(verdict.line)
    if starts_workers:
        os.environ[MEMORY_CHECKED_BY] = str(os.getpid())
