"""Files that appear whole or not at all."""

from __future__ import annotations

import json
import os
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
