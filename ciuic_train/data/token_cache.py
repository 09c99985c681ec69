"""The tokenized cache: text corpora tokenized once, in bounded memory, shared by runs and ranks.

An entry is a folder in the nanoGPT layout (`train.bin`, `val.bin`: flat token ids, uint16
or uint32 as `tokens.json` beside them says, the tokenizer.json that made them, and where
each file's tokens start: `train.idx`, `val.idx`, `documents.py`). Its name is a key made
of the source files' names, sizes and modification times, of the tokenizer (bytes, a
tokenizer.json, or a BPE trained here on the training split) and of `data.eos`, so a
second run with the same sources starts at once. A Hugging Face dataset's rows
(`hf_dataset.DatasetRows`) are cached the same way, keyed by the dataset's fingerprint.

A file (a dataset's row) is a document: it ends with the tokenizer's end-of-text id under `data.eos=true`,
else with a blank line (the cache key's version covers the document index, so an entry
without one is tokenized again).

Tokenizing streams: files, cut into chunks of `data.chunk_mb` at newlines (rows, a
batch at a time), go to worker processes and their ids are appended to the token files in order, so memory stays
bounded whatever the corpus size. An entry is built in a temporary folder renamed into
place when complete, under a lock on the cache: one process tokenizes (one per node
without a shared filesystem), the others wait for it and then read its entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import multiprocessing
import os
import shutil
import socket
from collections import deque
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Iterator

import numpy as np

from ciuic_train.config import DataConfig
from ciuic_train.data.documents import write_index
from ciuic_train.data.hf_dataset import DatasetRows
from ciuic_train.data.sources import Sources
from ciuic_train.data.tokenizer import (
    BPE,
    BYTES,
    TOKENIZER_FILE,
    ByteTokenizer,
    JsonTokenizer,
    Tokenizer,
    cut_points,
    load_tokenizer_file,
    train_bpe,
)
from ciuic_train.files import user_cache_dir, write_json_atomic
from ciuic_train.environment import launcher_rank
from ciuic_train.progress import WorkProgress

log = logging.getLogger("ciuic_train")

# Files are joined with a blank line so one file's end never runs into the next's start.
FILE_SEPARATOR = b"\n\n"


def cache_entry(sources: Sources | DatasetRows, cfg: DataConfig) -> Path:
    """The cache folder holding `sources` (text files, or a dataset's rows) tokenized as
    `cfg` says, built first unless it is there."""
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else user_cache_dir()
    tokenizer = None if cfg.tokenizer in (BYTES, BPE) else load_tokenizer_file(cfg.tokenizer)
    suffix = f"-tok{tokenizer.fingerprint()}" if tokenizer else {BYTES: "", BPE: f"-bpe{cfg.vocab_size}"}[cfg.tokenizer]
    if cfg.eos:
        suffix += "-eos"
        if tokenizer is not None:
            tokenizer.end_of_text_id()  # a tokenizer.json without one fails here, before any work
    key = _sources_key(sources) if isinstance(sources, Sources) else sources.cache_key()
    folder = cache / f"{sources.kind}-{key}{suffix}"
    if not _complete(folder):
        with _cache_lock(folder):
            if not _complete(folder):
                _build_entry(sources, cfg, folder, tokenizer or ByteTokenizer(cfg.eos))
    return folder


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
            if launcher_rank() == 0:
                log.info(f"waiting for another process that is tokenizing into {folder}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # a filesystem without flock (some NFS mounts): each builds, the first rename wins
            log.warning(f"cannot lock {folder.parent} ({err.strerror}); every process tokenizes for itself")
        yield
    finally:
        os.close(fd)


def _sources_key(sources: Sources) -> str:
    h = hashlib.sha256(f"v2 {sources.tail_fraction}".encode())  # v2: with the document index
    for split, files in (("train", sources.train), ("val", sources.val)):
        for f in files:
            st = f.stat()
            h.update(f"{split} {f.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _build_entry(sources: Sources | DatasetRows, cfg: DataConfig, folder: Path, tokenizer: Tokenizer) -> None:
    """Tokenize the sources into a new folder (training the BPE first if asked), renamed
    to `folder` once complete."""
    chunk_bytes = max(1, int(cfg.chunk_mb * 2**20))
    tmp = folder.with_name(f".{folder.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # unique on a shared disk
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if cfg.tokenizer == BPE:
            if launcher_rank() == 0:
                what = f"{len(sources.train)} files" if isinstance(sources, Sources) else f"the rows of {cfg.dataset}"
                log.info(f"training a byte-level BPE of {cfg.vocab_size} tokens on {what}")
            texts = _texts(sources.train, chunk_bytes) if isinstance(sources, Sources) else sources.texts()
            tokenizer = train_bpe(texts, cfg.vocab_size, cfg.eos)
        if tokenizer.to_str() is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer.to_str(), encoding="utf-8")
        eos_id = tokenizer.end_of_text_id() if cfg.eos else None
        counts = _write_tokens(sources, tokenizer, tmp, chunk_bytes, cfg.workers, eos_id)
        dtype = np.dtype(tokenizer.dtype).name
        meta = {"tokenizer": tokenizer.name, "dtype": dtype, "vocab_size": tokenizer.vocab_size, **counts}
        if eos_id is not None:
            meta["eos_id"] = eos_id
        write_json_atomic(tmp / "tokens.json", meta)
        if folder.exists() and not _complete(folder):  # an unfinished entry of an older version, built in place
            shutil.rmtree(folder)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _complete(folder):
                raise  # else another process, not locked out (`_cache_lock`), finished first: its entry serves
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _texts(files: list[Path], chunk_bytes: int) -> Iterator[str]:
    """The files' text, a chunk at a time (what the BPE trainer reads)."""
    for f in files:
        for start, end in pairwise(cut_points(f, chunk_bytes)):
            yield _read_range(f, start, end).decode("utf-8", errors="replace")


def _read_range(path: Path, start: int, end: int) -> bytes:
    with path.open("rb") as f:
        f.seek(start)
        return f.read(end - start)


# (split, file, start, end): one chunk of work, a file's bytes [start, end).
Chunk = tuple[str, Path, int, int]


def _chunks(sources: Sources, chunk_bytes: int) -> list[Chunk]:
    return [
        (split, f, start, end)
        for split, files in (("train", sources.train), ("val", sources.val))
        for f in files
        for start, end in pairwise(cut_points(f, chunk_bytes))
    ]


# (split, ids, whether a document starts with them, work done: bytes or rows)
Piece = tuple[str, np.ndarray, bool, int]


def _file_pieces(sources: Sources, tokenizer: Tokenizer, chunk_bytes: int, workers: int,
                 eos_id: int | None) -> tuple[Iterator[Piece], int, str]:
    """A text corpus's pieces: each chunk of each file, a document starting at a file's
    first; with the work's total (bytes) and its name."""
    chunks = _chunks(sources, chunk_bytes)
    total = sum(end - start for _, _, start, end in chunks)
    in_process = isinstance(tokenizer, ByteTokenizer) or total <= chunk_bytes
    tokenized = _in_order(_work, chunks, tokenizer, workers, eos_id, in_process)
    pieces = ((split, tokens, start == 0, end - start) for (split, tokens), (_, _, start, end) in zip(tokenized, chunks))
    return pieces, total, f"tokenizing {len(sources.train) + len(sources.val)} files"


def _row_pieces(rows: DatasetRows, tokenizer: Tokenizer, workers: int,
                eos_id: int | None) -> tuple[Iterator[Piece], int, str]:
    """A dataset's pieces: each row a document."""
    in_process = isinstance(tokenizer, ByteTokenizer)
    tokenized = _in_order(_work_rows, rows.batches(), tokenizer, workers, eos_id, in_process)
    pieces = ((split, ids, True, 1) for split, batch in tokenized for ids in batch)
    return pieces, rows.n_rows(), f"tokenizing {rows.n_rows():,} rows of {rows.cfg.dataset}"


def _write_tokens(sources: Sources | DatasetRows, tokenizer: Tokenizer, folder: Path, chunk_bytes: int, workers: int,
                  eos_id: int | None = None) -> dict[str, int]:
    """Append each piece's ids to train.bin / val.bin in order, and each document's first
    token's offset to train.idx / val.idx; a split left empty is the tail of the training
    tokens (the training split is never left empty: the validation rows become it).
    Returns the token and document counts."""
    if isinstance(sources, Sources):
        pieces, total, what = _file_pieces(sources, tokenizer, chunk_bytes, workers, eos_id)
    else:
        pieces, total, what = _row_pieces(sources, tokenizer, workers, eos_id)
    dtype = np.dtype(tokenizer.dtype)
    written = {"train": 0, "val": 0}
    starts: dict[str, list[int]] = {"train": [], "val": []}
    with (folder / "train.bin").open("wb") as train, (folder / "val.bin").open("wb") as val, \
            WorkProgress(what, total, enabled=launcher_rank() == 0) as progress:
        outputs = {"train": train, "val": val}
        for split, tokens, starts_document, work in pieces:
            if starts_document:
                starts[split].append(written[split])
            tokens.astype(dtype, copy=False).tofile(outputs[split])
            written[split] += len(tokens)
            progress.advance(work)
    if not written["train"]:  # every row hashed to validation (a dataset of a few rows)
        os.replace(folder / "val.bin", folder / "train.bin")
        starts = {"train": starts["val"], "val": []}
        written = {"train": written["val"], "val": 0}
    if not written["val"]:
        cut = _move_tail(folder / "train.bin", folder / "val.bin", dtype, sources.tail_fraction)
        # The validation tokens start inside a document, or at one: either way at one of theirs.
        starts = {"train": [s for s in starts["train"] if s < cut],
                  "val": [0] + [s - cut for s in starts["train"] if s > cut]}
    for split in ("train", "val"):
        write_index(folder / f"{split}.idx", starts[split])
    counts = {f"{split}_tokens": (folder / f"{split}.bin").stat().st_size // dtype.itemsize for split in ("train", "val")}
    return {**counts, **{f"{split}_documents": len(starts[split]) for split in ("train", "val")}}


def _move_tail(train: Path, val: Path, dtype: np.dtype, fraction: float) -> int:
    """The last `fraction` of train.bin's tokens become val.bin, copied a block at a time;
    returns the token they started at."""
    n = train.stat().st_size // dtype.itemsize
    cut = n - max(1, int(n * fraction))
    with train.open("rb") as source, val.open("wb") as target:
        source.seek(cut * dtype.itemsize)
        shutil.copyfileobj(source, target, 1 << 24)
    os.truncate(train, cut * dtype.itemsize)
    return cut


def _in_order(work, items, tokenizer: Tokenizer, workers: int, eos_id: int | None, in_process: bool) -> Iterator:
    """`work(item)` of each item, in order. Bytes need no tokenizer work, and a corpus of
    one chunk is not worth starting processes for: `in_process` keeps them here."""
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if in_process or workers == 1:
        _start_worker(tokenizer, eos_id)
        for item in items:
            yield work(item)
        return
    # fork (as torch's DataLoader workers): `python -m ciuic_train` runs its main at
    # import, which spawn would repeat in each worker. The workers are the parallelism,
    # one tokenizer thread each; this also keeps tokenizers from warning about the fork.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=_start_forked_worker,
                      initargs=(tokenizer.name, tokenizer.to_str(), eos_id)) as pool:
        # At most 2 items per worker are read or held at once: memory stays bounded
        # however far the writer lags.
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(work, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        for result in pending:
            yield result.get()


_worker_tokenizer: Tokenizer | None = None
_worker_eos_id: int | None = None


def _start_worker(tokenizer: Tokenizer, eos_id: int | None) -> None:
    global _worker_tokenizer, _worker_eos_id
    _worker_tokenizer, _worker_eos_id = tokenizer, eos_id


def _start_forked_worker(name: str, json_text: str, eos_id: int | None) -> None:
    """A worker process's own tokenizer, made from its JSON (not the parent's, whose
    threads a fork does not carry)."""
    _start_worker(JsonTokenizer(name, json_text), eos_id)


def _work(chunk: Chunk) -> tuple[str, np.ndarray]:
    return _tokenize_chunk(chunk, _worker_tokenizer, _worker_eos_id)


def _work_rows(batch: tuple[str, list[str]]) -> tuple[str, list[np.ndarray]]:
    split, texts = batch
    return split, [encode_document(text, _worker_tokenizer, _worker_eos_id) for text in texts]


def encode_document(text: str, tokenizer: Tokenizer, eos_id: int | None) -> np.ndarray:
    """One row's ids, ending as a text file's do: with `eos_id`, or (None) a blank line."""
    data = text.encode("utf-8")
    if eos_id is None:
        return tokenizer.encode_bytes(data + FILE_SEPARATOR)
    tokens = tokenizer.encode_bytes(data)
    return np.append(tokens, np.asarray(eos_id, dtype=tokens.dtype))


def _tokenize_chunk(chunk: Chunk, tokenizer: Tokenizer, eos_id: int | None = None) -> tuple[str, np.ndarray]:
    """A chunk's ids; a file's last chunk ends with `eos_id`, or (None) a blank line."""
    split, path, start, end = chunk
    data = _read_range(path, start, end)
    last = end == path.stat().st_size
    if last and eos_id is None:
        data += FILE_SEPARATOR
    tokens = tokenizer.encode_bytes(data)
    return split, np.append(tokens, np.asarray(eos_id, dtype=tokens.dtype)) if last and eos_id is not None else tokens

