"""Files that appear whole or not at all, and the space they take."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def written_atomically(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; it replaces `path` only if the block ends normally.

    A reader (or a crash) never sees a half-written file; the pid in the name keeps two
    processes writing the same file (e.g. a shared corpus cache) from mixing their bytes.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    with written_atomically(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def user_cache_dir() -> Path:
    """ciuic-train's folder in the user's cache ($XDG_CACHE_HOME, else ~/.cache): what is
    costly to make and safe to lose (tokenized corpora; `model/kernels/gemm_choice.py`
    restates it for the machine's GEMM measurement, as model/ imports only itself)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ciuic-train"


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the filesystem that holds `path` (or
    would hold it: the nearest folder above that exists)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def tree_bytes(folder: Path) -> int:
    """The size of the files under `folder`."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
