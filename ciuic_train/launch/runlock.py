"""One job per run folder: an exclusive OS lock on the folder, held for the job's life.

Two jobs writing one folder corrupt each other's checkpoints and metrics, and the second
"resumes" from a checkpoint the first is still writing. So a job locks its folder
before anything is written there (before Hydra writes `.hydra/`), with `flock` on
`<folder>/.ciuic-train.lock`. The kernel releases the lock when the holder dies, however
it dies, so a killed, preempted or requeued job never leaves a stale lock, and its next
attempt simply takes it again. The holder writes who it is into the file, for the error
a second job gets.

One process per job holds it: the process the user started (which may start the
workers itself: `HELD_ENV` tells them), or rank 0 where a launcher (torchrun, srun)
started every rank. On a shared filesystem `flock` locks across hosts only where the
filesystem supports it (NFSv4 and Lustre's `flock` mount option do; some do not).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ciuic_train.errors import UserError

LOCK_NAME = ".ciuic-train.lock"
# Set by a process that holds its folder's lock for the workers it starts.
HELD_ENV = "CIUIC_TRAIN_HELD_RUN_DIR"

_held: dict[str, int] = {}  # folders this process holds -> the lock file's descriptor


def _key(folder: Path | str) -> str:
    return os.path.realpath(folder)


def holds_for_job(folder: Path | str) -> bool:
    """Whether this process, or the parent that started it, holds `folder` for its job."""
    return _key(folder) in _held or os.environ.get(HELD_ENV) == _key(folder)


def acquire(folder: Path | str) -> None:
    """Take `folder`'s lock for this process (creating the folder), unless its job holds it.

    A folder in use by another job is a UserError naming the holder; nothing is written.
    """
    if holds_for_job(folder):
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise UserError(
            f"run folder {path} is in use by another job ({holder}); wait for it to end, or give this run "
            "another hydra.run.dir"
        ) from None
    os.ftruncate(fd, 0)
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["ciuic-train", *sys.argv[1:]]),  # also under torchrun's `-m ciuic_train`
    }
    os.write(fd, (json.dumps(me) + "\n").encode())
    _held[_key(folder)] = fd


def lend_to_children(folder: Path | str) -> None:
    """Tell the processes this one starts from now on that their job holds `folder`."""
    os.environ[HELD_ENV] = _key(folder)


def release(folder: Path | str) -> None:
    """Give back a lock this process took (a process that ends gives back all of them)."""
    fd = _held.pop(_key(folder), None)
    if fd is not None:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        who = json.loads(os.pread(fd, 4096, 0))
        return f"pid {who['pid']} on {who['host']}, started {who['started']}: {who['command']}"
    except (OSError, ValueError, KeyError):  # the holder is still writing who it is
        return "holder unknown"
