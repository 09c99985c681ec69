"""The `ciuic-train` command: answer what only prints, check what runs, hand it to Hydra.

Before Hydra runs, every job the command line describes is composed and checked
(`cli.preflight`); the first mistake is printed as one line and the process exits with
status 2, writing nothing. Then the folder the run (or sweep) will write is locked and
Hydra runs the job (`cli.job`). How this process was started, and what that asks of it,
is `ciuic_train.launch.modes`'s.

Importing torch takes longer than everything else a command that only prints does, so
`--help`, `--cfg` and `--list-tricks` never import it (tests/test_cli.py checks).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ciuic_train.cli.flags import (
    LIST_TRICKS_FLAG, PLAN_FLAG, PROG, SIMULATE_FLAG, VERSION_FLAG, composes_our_config, parse_hydra_command_line,
    runs_jobs, versions,
)
from ciuic_train.cli.help import list_tricks, print_help
from ciuic_train.cli.job import hydra_job
from ciuic_train.cli.messages import fail, is_rank_0
from ciuic_train.cli.preflight import CheckedJob, check_request
from ciuic_train.cli.startup import start_up
from ciuic_train.errors import UserError
from ciuic_train.launch import modes as launch, runlock


def main(argv: list[str] | None = None) -> None:
    """The console script: answer what only prints, check what runs, then hand over to Hydra."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Our flags stay out of what Hydra's parser reads: it would set aside the overrides after
    # one of them as that flag's, and exit at --version with Hydra's own.
    ours = (PLAN_FLAG, SIMULATE_FLAG, VERSION_FLAG, LIST_TRICKS_FLAG)
    args, _ = parse_hydra_command_line([a for a in argv if a not in ours])
    only_prints = any(flag in argv for flag in ours) or not runs_jobs(args)
    # A command that only prints ends as any Unix tool does when its reader leaves
    # (`ciuic-train --help | head`): quietly, by SIGPIPE, not with a traceback (Hydra prints
    # one for --cfg, whatever we catch). Restored after, for a caller in the same process.
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL) if only_prints else None
    try:
        _run_command(argv, args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGPIPE, previous)


def _run_command(argv: list[str], args: argparse.Namespace) -> None:
    plan, simulate = PLAN_FLAG in argv, SIMULATE_FLAG in argv
    argv = [a for a in argv if a not in (PLAN_FLAG, SIMULATE_FLAG)]
    if VERSION_FLAG in argv:  # Hydra's names Hydra's own version
        print(versions())
        return
    if LIST_TRICKS_FLAG in argv:
        list_tricks()
        return
    if simulate and not plan:
        fail(f"{SIMULATE_FLAG} steps one rank of the cluster --plan describes: use it with --plan")
    try:
        if args.help and composes_our_config(args):
            print_help(args)
            return
        if runs_jobs(args):
            path = launch.current()
            argv += path.overrides_before_check(argv)
            with start_up():  # imports torch and composes every job: start-up (cli/startup.py)
                jobs = check_request(argv, path, check_memory=not plan)
            if plan:
                from ciuic_train.plan.tables import print_plan

                for job in jobs:
                    print_plan(job.config, simulate=simulate)
                return
            if jobs:
                argv += _claim_folder(jobs[0], path, args.multirun)
        elif args.cfg:
            check_request(argv, config_only=True)
        # Hydra's own answers: --hydra-help, --info, --shell-completion, --help on another primary config.
    except UserError as err:
        fail(str(err))
    run_hydra_main(argv)


def _claim_folder(job: CheckedJob, path: launch.LaunchPath, multirun: bool) -> list[str]:
    """Lock the folder the job (or sweep) will write, before Hydra writes anything there,
    and pin it: Hydra resolves `${now:}` again when the job starts, maybe a second later.
    Where a launcher started every rank, rank 0 holds the lock for all."""
    if multirun:
        sweep_dir = str(Path(job.sweep_dir).absolute())
        runlock.acquire(sweep_dir)
        return [f"hydra.sweep.dir={launch.quote_override(sweep_dir)}"]
    run_dir = path.run_folder(job.run_dir)
    if is_rank_0():
        runlock.acquire(run_dir)
    return [f"hydra.run.dir={launch.quote_override(run_dir)}", *path.overrides_after_check(run_dir)]


def run_hydra_main(argv: list[str]) -> None:
    """Run @hydra.main on `argv`. It reads its arguments only from sys.argv (hydra-core 1.3
    takes no others), so sys.argv holds them for the call."""
    saved = sys.argv
    sys.argv = [PROG, *argv]
    try:
        hydra_job()
    finally:
        sys.argv = saved
