"""Corpora as token memmaps, and the samplers that cut them into training windows.

Every corpus ends up in the nanoGPT layout: a folder holding `train.bin` and `val.bin`,
flat token ids (uint16, or uint32 for a vocabulary beyond 65,536, as `tokens.json`
beside them says). Text is tokenized (bytes, a tokenizer.json, or a BPE trained here on
the training split) once and cached under a key made of the source files' names, sizes
and modification times and of the tokenizer, so a second run with the same sources
starts at once.

Tokenizing streams: files (a large one in pieces cut at newlines) go to worker
processes and their ids are appended to the token files in order, so memory stays
bounded whatever the corpus size. An entry is built in a temporary folder renamed into
place when complete, under a lock on the cache: one process tokenizes (one per node
without a shared filesystem), the others wait for it and then read its entry.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import multiprocessing
import os
import shutil
import socket
import sys
import sysconfig
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ciuic_train.config import DataConfig
from ciuic_train.errors import UserError
from ciuic_train.files import write_json_atomic, written_atomically
from ciuic_train.data.tokenizer import (
    BPE,
    BYTES,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    ByteTokenizer,
    JsonTokenizer,
    Tokenizer,
    cut_points,
    load_tokenizer_file,
    read_token_meta,
    require_tokenizers,
    train_bpe,
)

log = logging.getLogger("ciuic_train")

TOKEN_DTYPES = ("uint16", "uint32")
# Files are joined with a blank line so one file's end never runs into the next's start.
FILE_SEPARATOR = b"\n\n"
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
    # What encodes prompts and decodes samples; bytes unless data.tokenizer says otherwise.
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)


def run_tokenizer_file(run_dir: Path | str) -> Path | None:
    """The tokenizer.json a run trained with (None: bytes), for export to carry."""
    path = Path(run_dir) / TOKENIZER_FILE
    return path if path.is_file() else None


def save_tokenizer(tokenizer: Tokenizer, run_dir: Path) -> None:
    """Keep the run's tokenizer in its folder (bytes need none), with the tokenizer_config.json
    found beside a tokenizer.json it was given (its special tokens and chat template)."""
    text = tokenizer.to_str()
    if text is None:
        return
    with written_atomically(run_dir / TOKENIZER_FILE) as tmp:
        tmp.write_text(text, encoding="utf-8")
    given = Path(tokenizer.name).expanduser().parent / TOKENIZER_CONFIG_FILE
    if tokenizer.name != BPE and given.is_file():
        with written_atomically(run_dir / TOKENIZER_CONFIG_FILE) as tmp:
            shutil.copyfile(given, tmp)


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
        return _load_pretokenized(cfg, sources)
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    tokenizer = None if cfg.tokenizer in (BYTES, BPE) else load_tokenizer_file(cfg.tokenizer)
    suffix = f"-tok{tokenizer.fingerprint()}" if tokenizer else {BYTES: "", BPE: f"-bpe{cfg.vocab_size}"}[cfg.tokenizer]
    folder = cache / f"{sources.kind}-{_sources_key(sources)}{suffix}"
    if not _complete(folder):
        with _cache_lock(folder):
            if not _complete(folder):
                _build_entry(sources, cfg, folder, tokenizer or ByteTokenizer())
    if cfg.tokenizer != BYTES:
        tokenizer = JsonTokenizer(cfg.tokenizer, (folder / TOKENIZER_FILE).read_text(encoding="utf-8"))
    else:
        tokenizer = ByteTokenizer()
    dtype = read_token_meta(folder).get("dtype", "uint16")  # entries before tokens.json were bytes in uint16
    n_files = len(sources.train) + len(sources.val)
    origin = f"python {sys.version.split()[0]} stdlib" if sources.kind == "stdlib" else cfg.path
    what = "bytes" if cfg.tokenizer == BYTES else f"{cfg.tokenizer}, {tokenizer.vocab_size:,} tokens"
    return TokenSplits(
        _open_bin(folder / "train.bin", dtype),
        _open_bin(folder / "val.bin", dtype),
        tokenizer.vocab_size,
        f"{origin} ({n_files} files, {what})",
        tokenizer,
    )


def _load_pretokenized(cfg: DataConfig, sources: Sources) -> TokenSplits:
    """data=tokens: ids as written by any tokenizer; data.tokenizer (a tokenizer.json) decodes samples."""
    dtype = _declared_dtype(cfg, sources.train[0].parent)
    train = _open_bin(sources.train[0], dtype)
    val = _open_bin(sources.val[0], dtype) if sources.val else None
    if val is None:
        train, val = _tail_split(train, sources.tail_fraction)
    vocab = int(max(train.max(initial=0), val.max(initial=0))) + 1
    tokenizer = ByteTokenizer() if cfg.tokenizer == BYTES else load_tokenizer_file(cfg.tokenizer)
    if cfg.tokenizer != BYTES:
        vocab = max(vocab, tokenizer.vocab_size)
    return TokenSplits(train, val, vocab, f"tokens {cfg.path} ({dtype})", tokenizer)


def _declared_dtype(cfg: DataConfig, folder: Path) -> str:
    """data.dtype, else the dtype tokens.json beside the files records, else uint16 (nanoGPT's)."""
    recorded = read_token_meta(folder).get("dtype")
    if recorded is not None and recorded not in TOKEN_DTYPES:
        raise UserError(f"{folder / 'tokens.json'} gives dtype {recorded!r}; allowed: {', '.join(TOKEN_DTYPES)}")
    if cfg.dtype and recorded and cfg.dtype != recorded:
        raise UserError(f"data.dtype={cfg.dtype} but {folder / 'tokens.json'} records {recorded}; drop one")
    return cfg.dtype or recorded or "uint16"


def _complete(folder: Path) -> bool:
    # An entry appears by renaming its finished folder; folders of older versions were
    # complete once val.bin (written last) was there.
    return (folder / "val.bin").is_file()


@contextmanager
def _cache_lock(folder: Path) -> Iterator[None]:
    """One process at a time builds the cache entry `folder`; the kernel drops the lock of
    a process that dies, so a killed tokenizer never blocks the next run."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder.parent / f".{folder.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if int(os.environ.get("RANK", 0)) == 0:
                log.info(f"waiting for another process that is tokenizing into {folder}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # a filesystem without flock (some NFS mounts): each builds, the first rename wins
            log.warning(f"cannot lock {folder.parent} ({err.strerror}); every process tokenizes for itself")
        yield
    finally:
        os.close(fd)


def _sources_key(sources: Sources) -> str:
    h = hashlib.sha256(f"v1 {sources.tail_fraction}".encode())
    for split, files in (("train", sources.train), ("val", sources.val)):
        for f in files:
            st = f.stat()
            h.update(f"{split} {f.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _build_entry(sources: Sources, cfg: DataConfig, folder: Path, tokenizer: Tokenizer) -> None:
    """Tokenize the sources into a new folder (training the BPE first if asked), renamed
    to `folder` once complete."""
    chunk = max(1, int(cfg.chunk_mb * 2**20))
    tmp = folder.with_name(f".{folder.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # unique on a shared disk
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if cfg.tokenizer == BPE:
            if int(os.environ.get("RANK", 0)) == 0:
                log.info(f"training a byte-level BPE of {cfg.vocab_size} tokens on {len(sources.train)} files")
            tokenizer = train_bpe(_texts(sources.train, chunk), cfg.vocab_size)
        if tokenizer.to_str() is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer.to_str(), encoding="utf-8")
        counts = _write_tokens(sources, tokenizer, tmp, chunk, cfg.workers)
        dtype = np.dtype(tokenizer.dtype).name
        write_json_atomic(tmp / "tokens.json",
                          {"tokenizer": tokenizer.name, "dtype": dtype, "vocab_size": tokenizer.vocab_size, **counts})
        if folder.exists() and not _complete(folder):  # an unfinished entry of an older version, built in place
            shutil.rmtree(folder)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _complete(folder):
                raise  # else another process, not locked out (`_cache_lock`), finished first: its entry serves
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _texts(files: list[Path], chunk: int) -> Iterator[str]:
    """The files' text, a chunk at a time (what the BPE trainer reads)."""
    for f in files:
        for start, end in pairwise(cut_points(f, chunk)):
            yield _read_range(f, start, end).decode("utf-8", errors="replace")


def _read_range(path: Path, start: int, end: int) -> bytes:
    with path.open("rb") as f:
        f.seek(start)
        return f.read(end - start)


# (split, file, start, end): one piece of work, a file's bytes [start, end).
Unit = tuple[str, Path, int, int]


def _units(sources: Sources, chunk: int) -> list[Unit]:
    return [
        (split, f, start, end)
        for split, files in (("train", sources.train), ("val", sources.val))
        for f in files
        for start, end in pairwise(cut_points(f, chunk))
    ]


def _write_tokens(sources: Sources, tokenizer: Tokenizer, folder: Path, chunk: int, workers: int) -> dict[str, int]:
    """Append each unit's ids to train.bin / val.bin in order; a missing val split is the
    tail of the training tokens. Returns the token counts."""
    units = _units(sources, chunk)
    dtype = np.dtype(tokenizer.dtype)
    with (folder / "train.bin").open("wb") as train, (folder / "val.bin").open("wb") as val:
        outputs = {"train": train, "val": val}
        for split, tokens in _tokenized(units, tokenizer, chunk, workers):
            tokens.astype(dtype, copy=False).tofile(outputs[split])
    if not sources.val:
        _move_tail(folder / "train.bin", folder / "val.bin", dtype, sources.tail_fraction)
    return {f"{split}_tokens": (folder / f"{split}.bin").stat().st_size // dtype.itemsize for split in ("train", "val")}


def _move_tail(train: Path, val: Path, dtype: np.dtype, fraction: float) -> None:
    """The last `fraction` of train.bin's tokens become val.bin, copied a block at a time."""
    n = train.stat().st_size // dtype.itemsize
    cut = (n - max(1, int(n * fraction))) * dtype.itemsize
    with train.open("rb") as source, val.open("wb") as target:
        source.seek(cut)
        shutil.copyfileobj(source, target, 1 << 24)
    os.truncate(train, cut)


def _tokenized(units: list[Unit], tokenizer: Tokenizer, chunk: int, workers: int) -> Iterator[tuple[str, np.ndarray]]:
    """Each unit's (split, ids), in order. Bytes need no tokenizer work, and a corpus of one
    chunk is not worth starting processes for: both stay in this process."""
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    total = sum(end - start for _, _, start, end in units)
    if isinstance(tokenizer, ByteTokenizer) or workers == 1 or total <= chunk:
        for unit in units:
            yield _tokenize_unit(unit, tokenizer)
        return
    # fork (as torch's DataLoader workers): `python -m ciuic_train` runs its main at
    # import, which spawn would repeat in each worker. The workers are the parallelism,
    # one tokenizer thread each; this also keeps tokenizers from warning about the fork.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer.name, tokenizer.to_str())) as pool:
        # At most 2 units per worker are read or held at once: memory stays bounded
        # however far the writer lags.
        pending: deque = deque()
        for unit in units:
            pending.append(pool.apply_async(_work, (unit,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        for result in pending:
            yield result.get()


_worker_tokenizer: Tokenizer | None = None


def _start_worker(name: str, json_text: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = JsonTokenizer(name, json_text)


def _work(unit: Unit) -> tuple[str, np.ndarray]:
    return _tokenize_unit(unit, _worker_tokenizer)


def _tokenize_unit(unit: Unit, tokenizer: Tokenizer) -> tuple[str, np.ndarray]:
    split, path, start, end = unit
    data = _read_range(path, start, end)
    if end == path.stat().st_size:
        data += FILE_SEPARATOR
    return split, tokenizer.encode_bytes(data)


def _tail_split(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _open_bin(path: Path, dtype: str = "uint16") -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size < 2 * itemsize:
        raise UserError(f"{path} holds no tokens")
    if size % itemsize:
        raise UserError(f"{path} is {size} bytes, not a whole number of {dtype} tokens; set data.dtype to its type")
    return np.memmap(path, dtype=dtype, mode="r")


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
