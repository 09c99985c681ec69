"""The `ciuic-train` command: answer what only prints, check what runs, hand it to Hydra.

Hydra reports configuration mistakes as multi-line messages (or tracebacks) and only
after it has created a run folder. So before Hydra runs, every job the command line
describes (one, or each point of a `-m` sweep) is composed and checked here; the first
mistake is printed as one line and the process exits with status 2, writing nothing.
How this process was started, and what that asks of it, is `ciuic_train.launch.paths`'s.

Importing torch takes longer than everything else a command that only prints does, so
`--help`, `--cfg` and `--list-tricks` never import it (tests/test_cli.py checks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib.resources
import itertools
import json
import logging
import math
import os
import shutil
import string
import sys
import typing
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Iterator

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep
from hydra.errors import CompactHydraException, HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ciuic_train.launch import paths as launch, runlock
from ciuic_train.config import Config, register_configs, to_config
from ciuic_train.errors import RUN_FAILED_STATUS, RunFailed, UserError, first_line
from ciuic_train.distributed.mesh import check_grad_consistency, expected_mesh, expected_world, refuse_comm_hook
from ciuic_train.launch.slurm import end_stopped_task, in_slurm_task
from ciuic_train.tricks import trick_classes

PROG = "ciuic-train"
CONFIG_MODULE = "ciuic_train.conf"
CONFIG_NAME = "config"
PLAN_FLAG = "--plan"
LIST_TRICKS_FLAG = "--list-tricks"

log = logging.getLogger("ciuic_train")

register_configs()


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def _hydra_job(cfg: DictConfig) -> float:
    """One training job inside Hydra's run (or sweep) folder; returns the final val loss for sweepers."""
    overrides = list(HydraConfig.get().overrides.task)
    config = _job_config(cfg, overrides)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if _is_rank_0():  # a sweep's job, or a task of our Hydra launchers; a run's is held since `main`
            runlock.acquire(run_dir)
        summary = launch.current().start_workers(config, run_dir)
        if summary is None:
            summary = _train_in_this_process(cfg, config, run_dir)
    except UserError as err:
        fail(str(err))
    except launch.WorkersFailed as err:
        fail(str(err), status=1)
    except RunFailed as err:
        _run_failed(str(err))
    finally:
        runlock.release(run_dir)
    if summary["stopped_by"]:
        _after_stop(summary["stopped_by"], _is_rank_0())
    return summary["final_val_loss"]


def _train_in_this_process(cfg: DictConfig, config: Config, run_dir: Path) -> dict[str, Any]:
    from ciuic_train.distributed.process_group import Parallel, RankInfo, lost_peers_message  # torch only when a job runs
    from ciuic_train.train.trainer import Trainer, resolve_device

    info = RankInfo.from_env()
    if not info.is_main and config.dist.rank_logs:
        logging.getLogger().addHandler(_rank_log_handler(run_dir / f"rank{info.rank}.log"))
    parallel, finished = None, False
    try:
        parallel = Parallel(config.dist, resolve_device(config.device, info.local_rank), config.model.n_routed_experts)
        _require_same_config(parallel, cfg)
        trainer = Trainer(config, run_dir, parallel)
        summary = trainer.fit()
        sample = trainer.sample() if not summary["stopped_by"] else None
        finished = True
    except UserError as err:
        if info.is_main:
            _remove_unused_run_dir(run_dir)
        fail(str(err))
    except RunFailed:
        raise
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        raise RunFailed(  # a full disk outside a save (which says more: Checkpointer.save)
            f"writing {err.filename} failed: {err.strerror}; the run stops here, its checkpoints are intact "
            "(rerun the same command to resume)"
        ) from None
    except Exception as err:  # a peer or the network gone: every rank says what it saw, in one line
        message = lost_peers_message(err, config.dist.timeout_s, parallel.addresses if parallel else [])
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(1)
    finally:
        if parallel is not None:
            parallel.close(clean=finished)
    if info.is_main and not summary["stopped_by"]:
        show_results(summary, sample, config.sample.prompt)
    return summary


# Write errors of the run folder's filesystem: no space, quota, read-only, I/O, file size limit.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)


class SweepJobFailed(CompactHydraException):
    """A sweep's job that stopped itself; Hydra raises the first once every job has run,
    printing this one line (a compact exception has no traceback)."""


def _run_failed(message: str) -> None:
    """A run that stopped itself (diverged, or cannot save): one line (empty: a worker
    already printed it), also in train.log, and RUN_FAILED_STATUS. In a sweep the other
    jobs still run: one diverging learning rate must not end an lr sweep."""
    if message and _is_rank_0():
        _write_to_log_files(message)
    if HydraConfig.get().mode is RunMode.MULTIRUN:
        if message:
            print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SweepJobFailed(
            f"{PROG}: error: sweep job #{HydraConfig.get().job.num} failed (see above and its train.log); "
            "the other jobs ran"
        )
    if message:
        fail(message, RUN_FAILED_STATUS)
    sys.exit(RUN_FAILED_STATUS)


def _write_to_log_files(message: str) -> None:
    """Log an error to the run's log file only (the console gets it once, from `fail`)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _after_stop(signal_name: str, is_main: bool) -> None:
    """A signal stopped the run and its checkpoint is saved: a Slurm task ends without a
    result (requeued on the time-limit warning), and a sweep starts no further job."""
    if in_slurm_task():
        end_stopped_task(signal_name, is_main)
    if HydraConfig.get().mode is RunMode.MULTIRUN:
        fail(f"sweep stopped by {signal_name} during job #{HydraConfig.get().job.num}; later jobs were not started", 1)


def main(argv: list[str] | None = None) -> None:
    """The console script: answer what only prints, check what runs, then hand over to Hydra."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if LIST_TRICKS_FLAG in argv:
        list_tricks()
        return
    plan = PLAN_FLAG in argv
    argv = [a for a in argv if a != PLAN_FLAG]
    args, _ = parse_hydra_command_line(argv)
    try:
        if args.help and _composes_our_config(args):
            print_help(args)
            return
        if _runs_jobs(args):
            path = launch.current()
            argv += path.overrides_before_check(argv)
            jobs = check_request(argv, path)
            if plan:
                from ciuic_train.tools.plan import print_plan

                for job in jobs:
                    print_plan(job.config)
                return
            if jobs:
                argv += _claim_folder(jobs[0], path, args.multirun)
        elif args.cfg:
            check_request(argv, config_only=True)
        # Hydra's own answers: --hydra-help, --info, --shell-completion, --help on another primary config.
    except UserError as err:
        fail(str(err))
    run_hydra_main(argv)


def _claim_folder(job: "CheckedJob", path: launch.LaunchPath, multirun: bool) -> list[str]:
    """Lock the folder the job (or sweep) will write, before Hydra writes anything there,
    and pin it: Hydra resolves `${now:}` again when the job starts, maybe a second later.
    Where a launcher started every rank, rank 0 holds the lock for all."""
    if multirun:
        sweep_dir = str(Path(job.sweep_dir).absolute())
        runlock.acquire(sweep_dir)
        return [f"hydra.sweep.dir={launch.quote_override(sweep_dir)}"]
    run_dir = path.run_folder(job.run_dir)
    if _is_rank_0():
        runlock.acquire(run_dir)
    return [f"hydra.run.dir={launch.quote_override(run_dir)}", *path.overrides_after_check(run_dir)]


def parse_hydra_command_line(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command line as @hydra.main reads it, and the arguments it would refuse.

    Hydra has no public parser, so this is its private one: both sides then read every
    flag alike. Checked against hydra-core 1.3.8; tests/test_cli.py::
    test_hydra_parses_the_command_line_as_we_read_it fails if a flag we read changes.
    `--version` prints Hydra's version and exits here, as @hydra.main would.
    """
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_known_args(argv)


def run_hydra_main(argv: list[str]) -> None:
    """Run @hydra.main on `argv`. It reads its arguments only from sys.argv (hydra-core 1.3
    takes no others), so sys.argv holds them for the call."""
    saved = sys.argv
    sys.argv = [PROG, *argv]
    try:
        _hydra_job()
    except BrokenPipeError:  # `ciuic-train --cfg job | head`: the reader left, nothing is wrong
        sys.stderr.close()
    finally:
        sys.argv = saved


def print_help(args: argparse.Namespace) -> None:
    """`--help`: Hydra's help template (conf/config.yaml) filled with our config groups and
    the config the command's overrides compose.

    Hydra's own `--help` lists its own groups as well, and reads the whole config
    repository again for each of some seventy groups: over a second. This lists ours.
    """
    with _config_module(), _as_user_errors():
        overrides = _job_overrides(_parse_overrides(args.overrides), args.multirun)[0]
        cfg = hydra.compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True)
        template = cfg.hydra.help.template
        _job_config(_without_hydra(cfg), overrides)  # the run's own checks: a help on a mistake would mislead
    config = OmegaConf.to_yaml(cfg, resolve=args.resolve)
    groups = "\n".join(_config_groups(importlib.resources.files(CONFIG_MODULE)))
    print(string.Template(template).safe_substitute(APP_CONFIG_GROUPS=groups, CONFIG=config))


def _config_groups(folder: Any, parent: str = "") -> list[str]:
    """`group: option, ...` for each of our config groups: the folders of the conf package
    (`folder`, an importlib.resources Traversable). Hydra's loader lists them too, but
    copies its whole config repository for each question."""
    lines = []
    for sub in sorted((f for f in folder.iterdir() if f.is_dir()), key=lambda f: f.name):
        group = f"{parent}{sub.name}"
        if group == "hydra":
            continue
        options = sorted(f.name.removesuffix(".yaml") for f in sub.iterdir() if f.name.endswith(".yaml"))
        if options:
            lines.append(f"{group}: {', '.join(options)}")
        lines += _config_groups(sub, f"{group}/")
    return lines


def list_tricks() -> None:
    """One line per trick, with its parameters and how to select it."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ciuic_train.tricks import registry

    table = Table(title=escape("tricks: +trick=NAME, several: '+trick=[a,b]', parameters: trick.NAME.PARAM=VALUE"))
    for column in ("name", "what it does", "parameters (defaults)"):
        table.add_column(column)
    for name, cls in sorted(registry().items()):
        defaults = ", ".join(f"{f.name}={getattr(cls.Params(), f.name)}" for f in dataclasses.fields(cls.Params))
        table.add_row(name, cls.summary, defaults)
    Console().print(table)


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
    """Undo the folder made for a job that failed before writing any result of its own."""
    made_for_it = {".hydra", "train.log", runlock.LOCK_NAME}
    if not run_dir.is_dir() or any(p.name not in made_for_it for p in run_dir.iterdir()):
        return
    runlock.release(run_dir)
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for name in ("train.log", runlock.LOCK_NAME):
        (run_dir / name).unlink(missing_ok=True)
    run_dir.rmdir()


def show_results(summary: dict[str, Any], sample: str | None, prompt: str) -> None:
    from rich.console import Console
    from rich.panel import Panel

    from ciuic_train.train.metrics import summary_table

    console = Console()
    console.print(summary_table(summary))
    if sample is not None:
        log.info(f"sample: {sample!r}")
        console.print(Panel(sample, title=f"sample from prompt {prompt!r}"))


def fail(message: str, status: int = 2) -> None:
    """Report a mistake in one line and exit; under torchrun only rank 0 speaks."""
    if _is_rank_0():
        print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(status)


def _is_rank_0() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


@dataclasses.dataclass(frozen=True)
class CheckedJob:
    config: Config
    run_dir: str  # hydra.run.dir as this process resolves it
    sweep_dir: str  # hydra.sweep.dir, likewise


def check_request(
    argv: list[str], path: launch.LaunchPath | None = None, config_only: bool = False
) -> list[CheckedJob]:
    """Compose and check every job the command line asks for, before anything runs.

    `path` is how this process was started (default: as the environment says);
    `config_only` is for commands that print the config: they skip the corpus and
    checkpoint checks, which need torch.
    """
    args, unknown = parse_hydra_command_line(argv)
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r}; see {PROG} --help")
    if args.resolve and not (args.cfg or args.help):
        raise UserError("--resolve works only with --cfg or --help")
    if args.cfg and args.multirun:
        raise UserError("--cfg prints the config of one job; leave out -m")
    if not _composes_our_config(args):
        return []  # a user-supplied primary config: Hydra checks it against our schema itself
    path = path or launch.current()
    with _config_module(), _as_user_errors():
        parsed = _parse_overrides(args.overrides)
        launcher = None if config_only else _check_launcher(parsed, args.multirun)
        jobs = _job_overrides(parsed, args.multirun)
        if args.multirun and not path.runs_sweeps:
            raise UserError(
                f"-m under {path.name} would run the whole sweep on every rank; "
                f"sweep distributed jobs with {PROG} -m ... dist.nproc_per_node=N instead"
            )
        checked = [_check_job(job, config_only, check_mesh=launcher is None) for job in jobs]
    if launcher and any(job.config.dist.nproc_per_node > 1 for job in checked):
        raise UserError(
            f"with hydra/launcher={launcher} each rank is a task: set hydra.launcher.tasks_per_node=N "
            "instead of dist.nproc_per_node=N"
        )
    return checked


def _composes_our_config(args: argparse.Namespace) -> bool:
    return args.config_name in (None, CONFIG_NAME) and not args.config_path and not args.config_dir


def _runs_jobs(args: argparse.Namespace) -> bool:
    """Whether Hydra will run jobs, rather than only print something."""
    return not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion)


@contextlib.contextmanager
def _config_module() -> Iterator[None]:
    """Hydra initialised on our configs, as @hydra.main will be."""
    GlobalHydra.instance().clear()
    with hydra.initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        yield


@contextlib.contextmanager
def _as_user_errors() -> Iterator[None]:
    """Hydra's and OmegaConf's composition errors, as one line a user can act on."""
    try:
        yield
    except MissingConfigException as err:
        raise UserError(_unknown_option(err)) from None
    except OmegaConfBaseException as err:
        raise UserError(_describe_omegaconf(err)) from None
    except HydraException as err:
        cause = err.__cause__
        if isinstance(cause, OmegaConfBaseException):
            raise UserError(_describe_omegaconf(cause)) from None
        raise UserError(first_line(err)) from None


def _parse_overrides(overrides: list[str]) -> list[Override]:
    loader = GlobalHydra.instance().config_loader()  # glob() sweeps list a group's options through it
    return OverridesParser.create(config_loader=loader).parse_overrides(overrides)


def _job_overrides(parsed: list[Override], multirun: bool) -> list[list[str]]:
    """The overrides of each job: the command's own, or with -m one job per point of the
    sweeps' product, as Hydra's basic sweeper expands them (a key given twice: the later).
    Another sweeper (hydra/sweeper=NAME) expands its sweeps itself: `_sweep_samples`."""
    if not multirun:
        sweep = next((o.input_line for o in parsed if o.is_sweep_override()), None)
        if sweep is not None:
            raise UserError(f"{sweep!r} is a sweep; add -m (--multirun) to run one job per value")
        return [[o.input_line for o in parsed]]
    if _sweeper(parsed) != "basic":
        return _sweep_samples(parsed)
    values: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise UserError(
                f"{override.input_line!r}: an interval has no points to run; sweep a list, range() or glob(), "
                "or choose a sweeper that samples intervals (e.g. hydra/sweeper=optuna)"
            )
    return [list(job) for job in itertools.product(*values.values())]


def _sweeper(parsed: list[Override]) -> str:
    """The sweeper that -m hands the sweeps to: hydra/sweeper=NAME, Hydra's basic one by default."""
    import importlib.util

    chosen = [str(o.value()) for o in parsed if o.key_or_group == "hydra/sweeper"]
    if "optuna" in chosen and importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None:
        raise UserError("hydra/sweeper=optuna needs the optuna extra: pip install 'ciuic-train[optuna]'")
    return chosen[-1] if chosen else "basic"


def _sweep_samples(parsed: list[Override]) -> list[list[str]]:
    """Jobs that check a search space another sweeper will sample, without expanding it: the
    fixed overrides with each swept key at each of its choices or either end of its range or
    interval, the other swept keys at their first point (one job per point, not their product)."""
    points: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        points[key] = [f"{key}={value}" for value in _sweep_points(override)]
    first = {key: values[0] for key, values in points.items()}
    jobs = [list(first.values())]
    for key, values in points.items():
        jobs += [list({**first, key: value}.values()) for value in values[1:]]
    return jobs


def _sweep_points(override: Override) -> list[str]:
    """The values `_sweep_samples` tries for one override (the value itself if it sweeps nothing)."""
    value = override.value()
    if not override.is_sweep_override():
        return [override.get_value_element_as_str()]
    if isinstance(value, IntervalSweep):
        return [str(value.start), str(value.end)]
    if isinstance(value, RangeSweep) and not value.shuffle:
        count = math.ceil((value.stop - value.start) / value.step)
        if count < 1:
            raise UserError(f"{override.input_line!r}: the range is empty")
        return [str(value.start), str(value.start + (count - 1) * value.step)]
    points = list(override.sweep_string_iterator())
    if not points:
        raise UserError(f"{override.input_line!r}: the sweep has no points")
    return points


def _without_hydra(cfg: DictConfig) -> DictConfig:
    """The job's part of a composed config (the `hydra` node's sweep keys only resolve
    inside a running sweep)."""
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


# Our launchers (conf/hydra/launcher/) and what each needs beyond Hydra itself.
SUBMITIT_LAUNCHERS = {"slurm": "sbatch", "local": None}


def _check_launcher(parsed: list[Override], multirun: bool) -> str | None:
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


def _check_job(overrides: list[str], config_only: bool, check_mesh: bool = True) -> CheckedJob:
    """`check_mesh`: whether this process knows the world size (not so where a Slurm
    launcher will decide it: each task checks its own mesh when it starts)."""
    with _as_user_errors():
        cfg = hydra.compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True)
        run_dir, sweep_dir = str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)
        config = _job_config(_without_hydra(cfg), overrides)
    if not config_only and check_mesh:
        shape = expected_mesh(config.dist, config.model.n_routed_experts)
        hook_tricks = [trick.name for trick in trick_classes(config.trick) if "comm_hook" in trick.claimed_seams()]
        for trick in hook_tricks:
            refuse_comm_hook(trick, shape)
        if config.train.log_grad_consistency:
            check_grad_consistency(shape, hook_tricks[0] if hook_tricks else None)
    if not config_only:
        from ciuic_train.data.corpus import find_sources  # fails fast on a missing corpus, before any folder exists

        find_sources(config.data)
        _check_resume(config, Path(run_dir))
        _check_init_from(config, Path(run_dir))
    return CheckedJob(config, run_dir, sweep_dir)


def _job_config(cfg: DictConfig, overrides: list[str]) -> Config:
    """A job's typed config: the composed one, with the model fields its data and init_from
    decide (`_model_follows_data`, `_model_from_init_from`), checked against the schema."""
    return to_config(_model_from_init_from(_model_follows_data(cfg, overrides), overrides))


def _model_follows_data(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Model fields the data decides, unless the command line gives them: model.vocab_size
    becomes the tokenizer's size (data.tokenizer=bpe: data.vocab_size; a tokenizer.json:
    its vocabulary, added tokens included). Applied wherever a job's config is composed,
    so the check, --plan and every rank see the same model."""
    given = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    if "model.vocab_size" not in given and cfg.data.tokenizer != "bytes":  # bytes: the preset's stands
        from ciuic_train.data.tokenizer import model_vocab_size

        size = model_vocab_size(cfg.data.tokenizer, cfg.data.vocab_size)
        if size is not None:
            cfg.model.vocab_size = size
    return cfg


def _model_from_init_from(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """With init_from=DIR, the model fields its config.json sets, under the command line's
    own model.FIELD=... (ciuic_train/checkpoint/hf.py). Applied wherever a job's config is composed,
    after the data's, so the checkpoint's shape wins over a tokenizer's size."""
    if cfg.init_from:
        from ciuic_train.checkpoint.hf import model_with_init_from

        model = model_with_init_from(OmegaConf.to_container(cfg.model, resolve=True), cfg.init_from, overrides)
        for key, value in model.items():
            cfg.model[key] = value
    return cfg


def _check_init_from(config: Config, run_dir: Path) -> None:
    """Check init_from's tensor names and shapes before Hydra touches the run folder; a run
    that will resume its own checkpoint does not read it."""
    from ciuic_train.checkpoint.checkpointer import resolve_resume
    from ciuic_train.checkpoint.hf import check_init_from

    if config.init_from and resolve_resume(config.resume, run_dir) is None:
        check_init_from(config.model, Path(config.init_from).expanduser())


def _check_resume(config: Config, run_dir: Path) -> None:
    """Refuse a checkpoint this run cannot continue before Hydra touches its folder."""
    from ciuic_train.checkpoint.checkpointer import check_resumable, read_meta, resolve_resume, run_fingerprint

    path = resolve_resume(config.resume, run_dir)
    if path is None:
        return
    world_size, _ = expected_world(config.dist)
    expected = run_fingerprint(config.model, list(config.trick), world_size)
    check_resumable(read_meta(path), expected, config.ckpt.allow_trick_change)


def _unknown_option(err: MissingConfigException) -> str:
    """`model=tyny` -> name the group, the bad option and the valid ones."""
    missing = getattr(err, "missing_cfg_file", None) or ""
    options = list(err.options or [])
    group, _, option = missing.rpartition("/")
    if not group:
        return first_line(err)
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
    msg = first_line(getattr(err, "msg", None) or str(err))
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


