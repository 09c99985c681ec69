"""What runs inside Hydra's job: one training run in its run (or sweep job's) folder.

`hydra_job` is the function @hydra.main calls. It holds the folder's lock, lets the
launch path start worker processes (`ciuic_train.launch.modes`) or trains in this one,
and turns every way a run can end into one line and an exit status: 2 for a mistake
found only once the job started (its fresh folder removed again), 1 for lost workers or
peers, RUN_FAILED_STATUS for a run that stopped itself (diverged, or cannot save).
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import sys
import unicodedata
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ciuic_train.cli.compose import CONFIG_MODULE, CONFIG_NAME, job_config
from ciuic_train.cli.flags import PROG
from ciuic_train.cli.messages import fail, is_rank_0, print_error
from ciuic_train.cli.startup import start_up, thaw
from ciuic_train.config import Config
from ciuic_train.errors import RUN_FAILED_STATUS, RankFailed, RunFailed, UserError
from ciuic_train.launch import modes as launch, runlock
from ciuic_train.launch.slurm import end_stopped_task, in_slurm_task

log = logging.getLogger("ciuic_train")

# Write errors of the run folder's filesystem: no space, quota, read-only, I/O, file size limit.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def hydra_job(cfg: DictConfig) -> float:
    """One training job inside Hydra's run (or sweep) folder; returns the final val loss for sweepers."""
    overrides = list(HydraConfig.get().overrides.task)
    config = job_config(cfg, overrides)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if is_rank_0():  # a sweep's job, or a task of our Hydra launchers; a run's is held since `main`
            runlock.acquire(run_dir)
        summary = launch.current().start_workers(config, run_dir)
        if summary is None:
            summary = _train_in_this_process(cfg, config, run_dir)
    except UserError as err:
        fail(str(err))
    except launch.NodeFailed as err:
        print_error(str(err))
        sys.exit(1)
    except launch.WorkersFailed as err:
        fail(str(err), status=1)
    except RunFailed as err:
        _run_failed(str(err), speaks=is_rank_0() or isinstance(err, RankFailed))
    finally:
        runlock.release(run_dir)
    if summary["stopped_by"]:
        _after_stop(summary["stopped_by"], is_rank_0())
    return summary["final_val_loss"]


def _train_in_this_process(cfg: DictConfig, config: Config, run_dir: Path) -> dict[str, Any]:
    with start_up():  # torch only when a job runs; start-up lasts until the steps begin (cli/startup.py)
        from ciuic_train.distributed.process_group import Parallel, RankInfo, lost_peers_message
        from ciuic_train.train.trainer import Trainer, resolve_device

    info = RankInfo.from_env()
    if not info.is_main and config.dist.rank_logs:
        logging.getLogger().addHandler(_rank_log_handler(run_dir / f"rank{info.rank}.log"))
    parallel, finished = None, False
    try:
        with start_up():
            device = resolve_device(config.device, info.local_rank)
            parallel = Parallel(config.dist, device, config.model.n_routed_experts)
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
        print_error(message)
        sys.exit(1)
    finally:
        if parallel is not None:
            parallel.close(clean=finished)
        thaw()
    if info.is_main and not summary["stopped_by"]:
        show_results(summary, sample, config.sample.prompt)
    return summary


class SweepJobFailed(CompactHydraException):
    """A sweep's job that stopped itself; Hydra raises the first once every job has run,
    printing this one line (a compact exception has no traceback)."""


def _run_failed(message: str, speaks: bool) -> None:
    """A run that stopped itself (diverged, cannot save, out of memory): one line (empty:
    a worker already printed it), also in train.log, and RUN_FAILED_STATUS. The rank that
    `speaks` says it: rank 0 for what the ranks agreed on, the failing rank for its own
    failure (`RankFailed`). In a sweep the other jobs still run: one diverging learning
    rate must not end an lr sweep."""
    if message and speaks:
        _write_to_log_files(message)
    if HydraConfig.get().mode is RunMode.MULTIRUN:
        if message:
            print_error(message)
        raise SweepJobFailed(
            f"{PROG}: error: sweep job #{HydraConfig.get().job.num} failed (see above and its train.log); "
            "the other jobs ran"
        )
    if message and speaks:
        print_error(message)
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
    from rich.text import Text

    from ciuic_train.train.metrics import summary_table

    console = Console(markup=False)  # a path, a prompt or a sample is shown as it is: "[/x]" is no markup
    console.print(summary_table(summary))
    if sample is not None:
        log.info(f"sample: {sample!r}")
        console.print(Panel(shown_on_a_terminal(sample), title=Text(f"sample from prompt {prompt!r}")))


def shown_on_a_terminal(text: str) -> str:
    """`text` with its control characters but newlines and tabs written out (`\\x1b`): a
    barely trained byte-level model samples any byte, and an escape sequence printed raw
    would act on the user's terminal (clear it, retitle it, reset it)."""
    return "".join(
        char if char in "\n\t" or unicodedata.category(char) != "Cc" else repr(char)[1:-1] for char in text
    )
