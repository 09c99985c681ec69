"""The command's flags: our own (`--plan`, `--simulate`, `--list-tricks`) and Hydra's, read as Hydra reads them.

Hydra has no public parser for its command line, so `parse_hydra_command_line` borrows its
private one; this is the only module that does, and everything else reads the flags
through it.
"""

from __future__ import annotations

import argparse

from ciuic_train.cli.compose import CONFIG_NAME

PROG = "ciuic-train"
PLAN_FLAG = "--plan"
SIMULATE_FLAG = "--simulate"  # only with --plan: rank 0 of the planned cluster, one step on fake tensors
LIST_TRICKS_FLAG = "--list-tricks"
VERSION_FLAG = "--version"


def parse_hydra_command_line(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command line as @hydra.main reads it, and the arguments it would refuse.

    Both sides then read every flag alike. Checked against hydra-core 1.3.8;
    tests/test_cli.py::test_hydra_parses_the_command_line_as_we_read_it fails if a flag we
    read changes. `--version` would print Hydra's version and exit here, as @hydra.main
    would: `main` answers it first (`versions`).
    """
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_known_args(argv)


def composes_our_config(args: argparse.Namespace) -> bool:
    """Whether the command composes our primary config (not a user-supplied one)."""
    return args.config_name in (None, CONFIG_NAME) and not args.config_path and not args.config_dir


def runs_jobs(args: argparse.Namespace) -> bool:
    """Whether Hydra will run jobs, rather than only print something."""
    return not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion)


def versions() -> str:
    """`--version`: ours, and the versions of what a run's results depend on most (read
    from the installed packages' metadata: importing torch would take longer)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"{PROG} {of('ciuic-train')} (torch {of('torch')}, hydra-core {of('hydra-core')}, omegaconf {of('omegaconf')})"
