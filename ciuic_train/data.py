"""Corpora as token memmaps, and the samplers that cut them into training windows.

Every corpus ends up in the nanoGPT layout: a folder holding `train.bin` and `val.bin`,
flat uint16 token ids. Text is tokenized to bytes (vocab 256) once and cached under a
key made of the source files' names, sizes and modification times, so a second run with
the same sources starts at once.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ciuic_train.config import DataConfig
from ciuic_train.errors import UserError
from ciuic_train.files import written_atomically

BYTE_VOCAB_SIZE = 256
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


@dataclass
class TokenSplits:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str


def find_sources(cfg: DataConfig) -> Sources:
    """Resolve the configured corpus into files, failing with a clear message if there are none."""
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
    if cfg.name == "tokens":
        path = Path(cfg.path).expanduser()
        if path.is_dir():
            train, val = path / "train.bin", path / "val.bin"
            missing = [p.name for p in (train, val) if not p.is_file()]
            if missing:
                raise UserError(f"data.path={cfg.path} is a folder without {' and '.join(missing)}")
            return Sources("tokens", [train], [val])
        if path.is_file():
            return Sources("tokens", [path], [], tail_fraction=cfg.val_fraction)
        raise UserError(f"data.path={cfg.path} does not exist (expected a folder with train.bin/val.bin or a .bin file)")
    raise UserError(f"data.name={cfg.name!r} is not one of: stdlib, text, tokens")


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


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ciuic-train"


def load_tokens(cfg: DataConfig) -> TokenSplits:
    """Token splits for the configured corpus, tokenizing and caching text on first use."""
    sources = find_sources(cfg)
    if sources.kind == "tokens":
        train = _open_bin(sources.train[0])
        val = _open_bin(sources.val[0]) if sources.val else None
        if val is None:
            train, val = _tail_split(train, sources.tail_fraction)
        vocab = int(max(train.max(initial=0), val.max(initial=0))) + 1
        return TokenSplits(train, val, vocab, f"tokens {cfg.path}")
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    folder = cache / f"{sources.kind}-{_sources_key(sources)}"
    if not (folder / "val.bin").is_file():
        _write_byte_corpus(sources, folder)
    n_files = len(sources.train) + len(sources.val)
    origin = f"python {sys.version.split()[0]} stdlib" if sources.kind == "stdlib" else cfg.path
    return TokenSplits(
        _open_bin(folder / "train.bin"),
        _open_bin(folder / "val.bin"),
        BYTE_VOCAB_SIZE,
        f"{origin} ({n_files} files, bytes)",
    )


def _sources_key(sources: Sources) -> str:
    h = hashlib.sha256(f"v1 {sources.tail_fraction}".encode())
    for split, files in (("train", sources.train), ("val", sources.val)):
        for f in files:
            st = f.stat()
            h.update(f"{split} {f.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _write_byte_corpus(sources: Sources, folder: Path) -> None:
    """Byte-tokenize the files into train.bin / val.bin, visible only once complete."""
    folder.mkdir(parents=True, exist_ok=True)
    train = _read_bytes(sources.train)
    val = _read_bytes(sources.val) if sources.val else None
    if val is None:
        train, val = _tail_split(train, sources.tail_fraction)
    # val.bin is written last: its presence marks a complete cache entry.
    for name, tokens in (("train.bin", train), ("val.bin", val)):
        with written_atomically(folder / name) as tmp:
            tokens.astype(np.uint16).tofile(tmp)


def _read_bytes(files: list[Path]) -> np.ndarray:
    # Files are joined with a blank line so one file's end never runs into the next's start.
    parts = []
    for f in files:
        parts.append(f.read_bytes())
        parts.append(b"\n\n")
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def _tail_split(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _open_bin(path: Path) -> np.ndarray:
    if path.stat().st_size < 4:
        raise UserError(f"{path} holds no tokens")
    return np.memmap(path, dtype=np.uint16, mode="r")


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats per token) of the token frequencies: the loss of a model that ignores context."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class WindowSampler:
    """Yields batches of window indices over one rank's share of a (by default shuffled) epoch.

    Window i covers tokens [i*seq_len, i*seq_len + seq_len] (one extra for the shifted
    target). Each epoch is a permutation drawn from a generator seeded by (seed, epoch),
    never from the global RNG, so the data order does not depend on anything else that
    draws random numbers. Ranks take strided, disjoint shares of equal length. `order`
    is the seam through which a trick may reorder a rank's share.
    """

    def __init__(
        self, n_windows: int, seed: int, rank: int = 0, world_size: int = 1, order=None, shuffle: bool = True
    ):
        if n_windows < world_size:
            raise UserError(f"the training split has {n_windows} windows, fewer than {world_size} ranks")
        self.n_windows = n_windows
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.order = order
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._share = self._epoch_share()

    def _epoch_share(self) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            perm = torch.randperm(self.n_windows, generator=generator)
        else:
            perm = torch.arange(self.n_windows)
        usable = self.n_windows - self.n_windows % self.world_size
        share = perm[:usable][self.rank :: self.world_size]
        return self.order(share, self.epoch) if self.order is not None else share

    def next_indices(self, batch_size: int) -> torch.Tensor:
        taken = []
        while batch_size > 0:
            if self.position >= len(self._share):  # >=: a resharded position can land past a shorter share
                self.epoch += 1
                self.position = 0
                self._share = self._epoch_share()
            chunk = self._share[self.position : self.position + batch_size]
            self.position += len(chunk)
            batch_size -= len(chunk)
            taken.append(chunk)
        return torch.cat(taken)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def global_position(self) -> dict:
        """Where all ranks together are: every rank has taken `position` windows of its
        strided share, so the world has taken the epoch's first `position * world_size`."""
        return {"epoch": self.epoch, "windows": self.position * self.world_size}

    def share_of(self, global_position: dict) -> dict:
        """This rank's state for a `global_position`, possibly written by another world size."""
        return {"epoch": global_position["epoch"], "position": global_position["windows"] // self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._share = self._epoch_share()


def n_windows(tokens: np.ndarray, seq_len: int) -> int:
    return (len(tokens) - 1) // seq_len


def get_batch(tokens: np.ndarray, indices: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for the given windows."""
    rows = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in indices.tolist()])
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def eval_indices(tokens: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """A fixed, evenly spread set of validation windows, the same at every evaluation."""
    available = n_windows(tokens, seq_len)
    if available < 1:
        raise UserError(f"the validation split has fewer than seq_len+1={seq_len + 1} tokens")
    return torch.linspace(0, available - 1, min(count, available)).round().long().unique()
