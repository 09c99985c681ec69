"""The `ciuic-train` command: check the whole request, then hand it to Hydra.

Hydra reports configuration mistakes as multi-line messages (or tracebacks) and only
after it has created a run folder. So before Hydra runs, every job the command line
describes (one, or each point of a `-m` sweep) is composed and checked here; the first
mistake is printed as one line and the process exits with status 2, writing nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import typing
from difflib import get_close_matches
from pathlib import Path
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ciuic_train.config import Config, register_configs, to_config
from ciuic_train.errors import UserError
from ciuic_train.slurm import WORKER_OVERRIDES, Task, end_stopped_task, in_slurm_task

PROG = "ciuic-train"
CONFIG_MODULE = "ciuic_train.conf"
CONFIG_NAME = "config"
# Flags that only print information: Hydra answers them without running a job.
_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--info", "-i", "--shell-completion", "-sc"}
PLAN_FLAG = "--plan"
LIST_TRICKS_FLAG = "--list-tricks"

log = logging.getLogger("ciuic_train")

register_configs()


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def _hydra_job(cfg: DictConfig) -> float:
    """One training job inside Hydra's run (or sweep) folder; returns the final val loss for sweepers."""
    config = to_config(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if config.dist.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:  # no launcher has set the ranks
        return _launch_workers(config, run_dir)

    from ciuic_train.parallel import Parallel, RankInfo  # torch is imported only when a job runs
    from ciuic_train.trainer import Trainer, resolve_device

    info = RankInfo.from_env()
    if not info.is_main and config.dist.rank_logs:
        logging.getLogger().addHandler(_rank_log_handler(run_dir / f"rank{info.rank}.log"))
    parallel, finished = None, False
    try:
        parallel = Parallel(config.dist, resolve_device(config.device, info.local_rank))
        _require_same_config(parallel, cfg)
        trainer = Trainer(config, run_dir, parallel)
        summary = trainer.fit()
        sample = trainer.sample() if not summary["stopped_by"] else None
        finished = True
    except UserError as err:
        if info.is_main:
            _remove_unused_run_dir(run_dir)
        fail(str(err))
    finally:
        if parallel is not None:
            parallel.close(clean=finished)
    if info.is_main and not summary["stopped_by"]:
        show_results(summary, sample, config.sample.prompt)
    if summary["stopped_by"]:
        _after_stop(summary["stopped_by"], info.is_main)
    return summary["final_val_loss"]


def _after_stop(signal_name: str, is_main: bool) -> None:
    """A signal stopped the run and its checkpoint is saved: a Slurm task ends without a
    result (requeued on the time-limit warning), and a sweep starts no further job."""
    if in_slurm_task():
        end_stopped_task(signal_name, is_main)
    if HydraConfig.get().mode is RunMode.MULTIRUN:
        fail(f"sweep stopped by {signal_name} during job #{HydraConfig.get().job.num}; later jobs were not started", 1)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if LIST_TRICKS_FLAG in argv:
        list_tricks()
        return
    plan = PLAN_FLAG in argv
    argv = [a for a in argv if a != PLAN_FLAG]
    if not _INFO_FLAGS.intersection(argv):
        if _srun_tasks() > 1:
            argv += _srun_task_overrides(argv)
        try:
            jobs = check_request(argv)
        except UserError as err:
            fail(str(err))
        if plan:
            from ciuic_train.plan import print_plan

            for job in jobs:
                print_plan(job.config)
            return
        if _under_elastic_agent() and jobs:
            argv += _worker_overrides(jobs[0].run_dir)
    sys.argv = [PROG, *argv]
    try:
        _hydra_job()
    except BrokenPipeError:  # `ciuic-train --help | head`: the reader left, nothing is wrong
        sys.stderr.close()


def list_tricks() -> None:
    """One line per trick, with its parameters and how to select it."""
    import dataclasses as dc

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ciuic_train.tricks import registry

    table = Table(title=escape("tricks: +trick=NAME, several: '+trick=[a,b]', parameters: trick.NAME.PARAM=VALUE"))
    for column in ("name", "what it does", "parameters (defaults)"):
        table.add_column(column)
    for name, cls in sorted(registry().items()):
        defaults = ", ".join(f"{f.name}={getattr(cls.Params(), f.name)}" for f in dc.fields(cls.Params))
        table.add_row(name, cls.summary, defaults)
    Console().print(table)


def _under_elastic_agent() -> bool:
    """A worker started by torchrun or by our own launcher (torch's elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _worker_overrides(proposed_run_dir: str) -> list[str]:
    """Make the ranks of one torchrun job share one run folder, written by rank 0 only.

    Each rank composes its own config, and `${now:}` can differ between them, so the
    folder is agreed through the elastic agent's store: the first rank to propose one
    wins, and a restarted worker group finds the same folder again.
    """
    overrides = [f"hydra.run.dir={quote_override(_agree_run_dir(proposed_run_dir))}"]
    if int(os.environ.get("RANK", 0)) != 0:
        overrides += WORKER_OVERRIDES
    return overrides


def _srun_tasks() -> int:
    """Tasks of this srun step when srun itself started the training processes."""
    return int(os.environ.get("SLURM_NTASKS", 1)) if in_slurm_task() and "SUBMITIT_FOLDER" not in os.environ else 0


def _srun_task_overrides(argv: list[str]) -> list[str]:
    """`srun -n N ciuic-train ...`: each task is one rank of one run.

    Ranks come from Slurm's variables. Tasks cannot agree on a `${now:}` folder before
    they can talk, so unless the command names one, the run folder is named after the
    job and step, the same on every task and again when the job is requeued.
    """
    task = Task.from_slurm()
    task.export()
    task.limit_threads()
    overrides = []
    if not any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv):
        step = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
        overrides.append(f"hydra.run.dir={quote_override(str(Path('outputs') / f'slurm-{step}'))}")
    return overrides + (list(WORKER_OVERRIDES) if task.rank != 0 else [])


def _agree_run_dir(proposal: str) -> str:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return proposal
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    key = f"ciuic_train/run_dir/{os.environ['TORCHELASTIC_RUN_ID']}"
    return store.compare_set(key, "", str(Path(proposal).absolute())).decode()


def quote_override(value: str) -> str:
    """A value that Hydra's override parser reads back verbatim (paths may hold spaces or '=')."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def is_user_error_exit(exit_codes: dict[int, int]) -> bool:
    """Whether failed workers' exit codes by rank mean a user mistake, not a crash.

    Rank 0 exits 2 after saying what was wrong. The other ranks hit the same mistake, but
    one still on its way there when rank 0 exits is stopped by the launcher (SIGTERM, then
    SIGKILL), which is no crash of its own.
    """
    stopped = {2, -signal.SIGTERM, -signal.SIGKILL}
    return exit_codes.get(0) == 2 and all(code in stopped for code in exit_codes.values())


def _launch_workers(config: Config, run_dir: Path) -> float:
    """Start `dist.nproc_per_node` workers on this job's config and folder, as torchrun would."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = config.dist.nproc_per_node
    # Like torchrun, keep N processes from each starting one thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
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
        monitor_interval=0.5,
    )
    log.info(f"starting {nproc} workers (torch elastic launcher) in {run_dir}")
    try:
        elastic_launch(launch, sys.executable)("-m", "ciuic_train", *overrides)
    except ChildFailedError as err:
        if is_user_error_exit({rank: failure.exitcode for rank, failure in err.failures.items()}):
            sys.exit(2)  # rank 0 has already said what the mistake was
        failed = ", ".join(f"rank {rank} exit code {f.exitcode}" for rank, f in sorted(err.failures.items()))
        fail(f"workers failed ({failed}); see {run_dir / 'train.log'}", status=1)
    if not (run_dir / "summary.json").is_file():  # the workers saved and stopped on a signal
        _after_stop("a signal", is_main=True)
        return float("nan")
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["final_val_loss"]


def _require_same_config(parallel, cfg: DictConfig) -> None:
    """Every rank must train under the same resolved config; name the first key that differs."""
    mine = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    configs = parallel.gather(json.dumps(mine, sort_keys=True))
    for rank, other in enumerate(configs):
        if other != configs[0]:
            key = _first_difference(json.loads(configs[0]), json.loads(other))
            raise UserError(
                f"ranks composed different configs: {key} differs between rank 0 and rank {rank} "
                "(give every rank the same overrides and environment)"
            )


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
    return path or "the config"


def _rank_log_handler(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] - %(message)s"))
    return handler


def _remove_unused_run_dir(run_dir: Path) -> None:
    """Undo the folder Hydra made for a job that failed before writing any result of its own."""
    hydra_files = {".hydra", "train.log"}
    if not run_dir.is_dir() or any(p.name not in hydra_files for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    (run_dir / "train.log").unlink(missing_ok=True)
    run_dir.rmdir()


def show_results(summary: dict[str, Any], sample: str | None, prompt: str) -> None:
    from rich.console import Console
    from rich.panel import Panel

    from ciuic_train.metrics import summary_table

    console = Console()
    console.print(summary_table(summary))
    if sample is not None:
        log.info(f"sample: {sample!r}")
        console.print(Panel(sample, title=f"sample from prompt {prompt!r}"))


def fail(message: str, status: int = 2) -> None:
    """Report a mistake in one line and exit; under torchrun only rank 0 speaks."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(status)


@dataclasses.dataclass(frozen=True)
class CheckedJob:
    config: Config
    run_dir: str  # hydra.run.dir as this process resolves it


def check_request(argv: list[str]) -> list[CheckedJob]:
    """Compose and check every job the command line asks for, before anything runs."""
    from hydra._internal.utils import get_args_parser
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    args, unknown = get_args_parser().parse_known_args(argv)
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r}; see {PROG} --help")
    if args.config_name not in (None, CONFIG_NAME) or args.config_path or args.config_dir:
        return []  # a user-supplied primary config: Hydra checks it against our schema itself
    GlobalHydra.instance().clear()
    with hydra.initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        try:
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(args.overrides)
            jobs = BasicSweeper.split_arguments(parsed, None)[0] if args.multirun else [args.overrides]
        except (HydraException, OmegaConfBaseException) as err:
            raise UserError(_first_line(err)) from None
        launcher = _check_launcher(parsed, args.multirun)
        if not args.multirun and any(o.is_sweep_override() for o in parsed):
            sweep = next(o.input_line for o in parsed if o.is_sweep_override())
            raise UserError(f"{sweep!r} is a sweep; add -m (--multirun) to run one job per value")
        if args.multirun and (_under_elastic_agent() or _srun_tasks() > 1):
            raise UserError(
                "-m under torchrun or srun would run the whole sweep on every rank; "
                f"sweep distributed jobs with {PROG} -m ... dist.nproc_per_node=N instead"
            )
        checked = [_check_job(job) for job in jobs]
        if launcher and any(job.config.dist.nproc_per_node > 1 for job in checked):
            raise UserError(
                f"with hydra/launcher={launcher} each rank is a task: set hydra.launcher.tasks_per_node=N "
                "instead of dist.nproc_per_node=N"
            )
        return checked


# Our launchers (conf/hydra/launcher/) and what each needs beyond Hydra itself.
SUBMITIT_LAUNCHERS = {"slurm": "sbatch", "local": None}


def _check_launcher(parsed: list[Any], multirun: bool) -> str | None:
    """Say what a submitit launcher lacks here, before Hydra fails on it with a traceback;
    the one chosen, if any."""
    import importlib.util

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


def _check_job(overrides: list[str]) -> CheckedJob:
    try:
        cfg = hydra.compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True)
        run_dir = str(cfg.hydra.run.dir)
        with open_dict(cfg):
            del cfg["hydra"]  # its sweep keys only resolve inside a running sweep
        config = to_config(cfg)
    except MissingConfigException as err:
        raise UserError(_unknown_option(err)) from None
    except OmegaConfBaseException as err:
        raise UserError(_describe_omegaconf(err)) from None
    except HydraException as err:
        cause = err.__cause__
        if isinstance(cause, OmegaConfBaseException):
            raise UserError(_describe_omegaconf(cause)) from None
        raise UserError(_first_line(err)) from None
    from ciuic_train.data import find_sources  # fails fast on a missing corpus, before any folder exists

    find_sources(config.data)
    _check_resume(config, Path(run_dir))
    return CheckedJob(config, run_dir)


def _check_resume(config: Config, run_dir: Path) -> None:
    """Refuse a checkpoint this run cannot continue before Hydra touches its folder."""
    from ciuic_train.checkpoint import check_compatible, read_meta, resolve_resume, run_fingerprint

    path = resolve_resume(config.resume, run_dir)
    if path is None:
        return
    world_size = int(os.environ.get("WORLD_SIZE", config.dist.nproc_per_node))
    expected = run_fingerprint(config.model, list(config.trick), world_size)
    check_compatible(read_meta(path), expected, config.ckpt.allow_trick_change)


def _unknown_option(err: MissingConfigException) -> str:
    """`model=tyny` -> name the group, the bad option and the valid ones."""
    missing = getattr(err, "missing_cfg_file", None) or ""
    options = list(err.options or [])
    group, _, option = missing.rpartition("/")
    if not group:
        return _first_line(err)
    if not options:
        options = GlobalHydra.instance().config_loader().get_group_options(group)
    hint = get_close_matches(option, options, n=1)
    valid = ", ".join(options) if options else "none yet"
    return (
        f"unknown {group} {option!r}"
        + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; available: {valid}"
    )


def _describe_omegaconf(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    msg = _first_line(getattr(err, "msg", None) or str(err))
    name = type(err).__name__
    if name in ("ConfigKeyError", "ConfigAttributeError") and key:
        parent, _, leaf = str(key).rpartition(".")
        allowed = _schema_keys(parent)
        if allowed is not None:
            hint = get_close_matches(leaf, allowed, n=1)
            return (
                f"unknown config key {key!r}"
                + (f" (did you mean {(parent + '.' if parent else '') + hint[0]!r}?)" if hint else "")
                + f"; valid keys{' in ' + repr(parent) if parent else ''}: {', '.join(allowed)}"
            )
    if name == "MissingMandatoryValue" and key:
        return f"{key} must be set (add {key}=...)"
    return f"{key}: {msg}" if key and key not in msg else msg


def _schema_keys(path: str) -> list[str] | None:
    """The keys the schema allows under a dotted path, or None if that is not a typed section."""
    parts = [p for p in path.split(".") if p]
    if len(parts) == 2 and parts[0] == "trick":
        from ciuic_train.tricks import registry

        cls = registry().get(parts[1])
        return [f.name for f in dataclasses.fields(cls.Params)] if cls else None
    node: Any = Config
    for part in parts:
        node = typing.get_type_hints(node).get(part)
        if not dataclasses.is_dataclass(node):
            return None
    return [f.name for f in dataclasses.fields(node)]


def _first_line(err: Any) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
