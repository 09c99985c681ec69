"""The `ciuic-train` command: check the whole request, then hand it to Hydra.

Hydra reports configuration mistakes as multi-line messages (or tracebacks) and only
after it has created a run folder. So before Hydra runs, every job the command line
describes (one, or each point of a `-m` sweep) is composed and checked here; the first
mistake is printed as one line and the process exits with status 2, writing nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
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
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ciuic_train.config import Config, register_configs, to_config
from ciuic_train.errors import UserError

PROG = "ciuic-train"
CONFIG_MODULE = "ciuic_train.conf"
CONFIG_NAME = "config"
# Flags that only print information: Hydra answers them without running a job.
_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--info", "-i", "--shell-completion", "-sc"}
PLAN_FLAG = "--plan"

log = logging.getLogger("ciuic_train")

register_configs()


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def _hydra_job(cfg: DictConfig) -> float:
    """One training job inside Hydra's run (or sweep) folder; returns the final val loss for sweepers."""
    config = to_config(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    from ciuic_train.trainer import Trainer  # torch is imported only when a job runs

    try:
        trainer = Trainer(config, run_dir)
        summary = trainer.fit()
    except UserError as err:
        _remove_unused_run_dir(run_dir)
        fail(str(err))
    show_results(summary, trainer.sample(), config.sample.prompt)
    return summary["final_val_loss"]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    plan = PLAN_FLAG in argv
    argv = [a for a in argv if a != PLAN_FLAG]
    if not _INFO_FLAGS.intersection(argv):
        try:
            configs = check_request(argv)
        except UserError as err:
            fail(str(err))
        if plan:
            from ciuic_train.plan import print_plan

            for config in configs:
                print_plan(config)
            return
    sys.argv = [PROG, *argv]
    try:
        _hydra_job()
    except BrokenPipeError:  # `ciuic-train --help | head`: the reader left, nothing is wrong
        sys.stderr.close()


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


def fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_request(argv: list[str]) -> list[Config]:
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
        if not args.multirun and any(o.is_sweep_override() for o in parsed):
            sweep = next(o.input_line for o in parsed if o.is_sweep_override())
            raise UserError(f"{sweep!r} is a sweep; add -m (--multirun) to run one job per value")
        return [_check_job(job) for job in jobs]


def _check_job(overrides: list[str]) -> Config:
    try:
        cfg = hydra.compose(config_name=CONFIG_NAME, overrides=overrides)
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
    return config


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
    node: Any = Config
    for part in filter(None, path.split(".")):
        node = typing.get_type_hints(node).get(part)
        if not dataclasses.is_dataclass(node):
            return None
    return [f.name for f in dataclasses.fields(node)]


def _first_line(err: Any) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
