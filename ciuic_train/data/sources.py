"""The files a corpus is made of: `data=stdlib` (the default), `data=text`, `data=tokens`
(`data=hf` is a dataset's rows: checked here, read by `hf_dataset.py`).

`find_sources` turns the data config into files split into train and validation, and
fails in one line on a corpus that is not there (or a tokenizer that is not), which the
CLI checks before any run folder exists: nothing here imports torch. Text files are
split by a hash of their path, so the split stays put when files come and go; with a
single file (or a split that leaves a side empty) the tail of its tokens is held out.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ciuic_train.config import DataConfig
from ciuic_train.data.tokenizer import BPE, BYTES, load_tokenizer_file, require_tokenizers
from ciuic_train.errors import UserError

# Standard-library folders left out of the default corpus: test suites hold
# deliberately odd encodings and generated data, idlelib is a GUI.
_STDLIB_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass
class Sources:
    """The files a corpus is built from, already split into train and validation."""

    kind: str
    train: list[Path]
    val: list[Path]
    # With a single file (or a split that leaves a side empty) the tail of the tokens is held out.
    tail_fraction: float = 0.0


def _token_folder(cfg: DataConfig, folder: Path) -> Sources:
    """nanoGPT's `train.bin` and `val.bin`, or shards `train_*.bin` (and `val_*.bin`; without
    them the tail of the training shards is held out), in natural order: train_2 before train_10."""
    single = folder / "train.bin"
    shards = sorted(folder.glob("train_*.bin"), key=_natural_key)
    if single.is_file() and shards:
        raise UserError(f"data.path={cfg.path} holds both train.bin and train_*.bin shards; keep one layout")
    if shards:
        val = sorted(folder.glob("val_*.bin"), key=_natural_key)
        return Sources("tokens", shards, val, tail_fraction=0.0 if val else cfg.val_fraction)
    missing = [p.name for p in (single, folder / "val.bin") if not p.is_file()]
    if missing:
        raise UserError(
            f"data.path={cfg.path} is a folder without {' and '.join(missing)} (or train_*.bin shards)"
        )
    return Sources("tokens", [single], [folder / "val.bin"])


def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def find_sources(cfg: DataConfig) -> Sources:
    """Resolve the configured corpus into files, failing with a clear message if there are none
    (or if the tokenizer named is not there)."""
    if cfg.tokenizer == BPE:
        require_tokenizers(BPE)
    elif cfg.tokenizer != BYTES:
        load_tokenizer_file(cfg.tokenizer)
    if cfg.name == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _stdlib_sources(root)
        if not files:
            raise UserError(f"data=stdlib found no .py files under {root}")
        return _split_by_file("stdlib", files, root, cfg.val_fraction)
    if cfg.name == "text":
        files, root = _expand_path(cfg.path)
        files = [f for f in files if f.stat().st_size > 0]
        if not files:
            raise UserError(f"data.path={cfg.path} holds only empty files")
        return _split_by_file("text", files, root, cfg.val_fraction)
    if cfg.name == "hf":
        from ciuic_train.data.hf_dataset import check_dataset

        check_dataset(cfg)
        return Sources("hf", [], [])
    if cfg.name == "tokens":
        path = Path(cfg.path).expanduser()
        if path.is_dir():
            return _token_folder(cfg, path)
        if path.is_file():
            return Sources("tokens", [path], [], tail_fraction=cfg.val_fraction)
        raise UserError(f"data.path={cfg.path} does not exist (expected a folder with train.bin/val.bin or a .bin file)")
    raise UserError(f"data.name={cfg.name!r} is not one of: stdlib, text, tokens, hf")


def _stdlib_sources(root: Path) -> list[Path]:
    """The .py files under the stdlib folder, pruning excluded folders instead of walking them."""
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _STDLIB_EXCLUDED_DIRS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


def _expand_path(pattern: str) -> tuple[list[Path], Path]:
    """A file, every file below a folder, or a glob; returns the files and the root they are named from."""
    path = Path(pattern).expanduser()
    if path.is_file():
        return [path], path.parent
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise UserError(f"data.path={pattern} is an empty folder")
        return files, path
    matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
    if not matches:
        raise UserError(f"data.path={pattern} matches no file (give a file, a folder or a glob)")
    return matches, Path(os.path.commonpath([str(m.parent) for m in matches]))


def _split_by_file(kind: str, files: list[Path], root: Path, val_fraction: float) -> Sources:
    """Assign each file to train or val by a hash of its relative path: stable when files come and go."""
    train, val = [], []
    for f in files:
        digest = hashlib.sha256(str(f.relative_to(root)).encode()).digest()
        (val if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else train).append(f)
    if not train or not val:
        return Sources(kind, files, [], tail_fraction=val_fraction)
    return Sources(kind, train, val)

