"""Corpora as token memmaps: the train and validation ids a run reads.

Every corpus ends up in the nanoGPT layout: a folder holding `train.bin` and `val.bin`,
flat token ids (uint16, or uint32 for a vocabulary beyond 65,536, as `tokens.json`
beside them says). `data=tokens` is already that (or shards `train_*.bin`, `val_*.bin`,
read as one stream: `shards.py`), and is opened where it is; text
(`data=stdlib`, `data=text`) is tokenized once into the cache (`token_cache.py`) and
opened there; so is a Hugging Face dataset's rows (`data=hf`, `hf_dataset.py`), unless
streamed: then the training split is a `stream.StreamedSplit`, read as it trains, and only
validation is ids here. Beside each `.bin` an `.idx` may say where its documents start
(`documents.py`): the cache writes them, `data=tokens` reads them where they are, and
`data.doc_mask=true` needs them. Which files make a corpus is `sources.py`'s; how windows
are drawn from the ids, `sampler.py`'s.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from ciuic_train.config import DataConfig
from ciuic_train.data.documents import DocumentIndex, index_path
from ciuic_train.data.hf_dataset import DatasetRows
from ciuic_train.data.shards import TokenShards
from ciuic_train.data.sources import Sources, find_sources
from ciuic_train.data.stream import StreamedSplit, read_validation
from ciuic_train.data.token_cache import cache_entry
from ciuic_train.data.tokenizer import (
    BYTES,
    TOKENIZER_FILE,
    ByteTokenizer,
    JsonTokenizer,
    Tokenizer,
    load_tokenizer_file,
    read_token_meta,
)
from ciuic_train.errors import UserError

TOKEN_DTYPES = ("uint16", "uint32")


@dataclass
class TokenSplits:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    # What encodes prompts and decodes samples; bytes unless data.tokenizer says otherwise.
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    # Where each split's documents start; None where the corpus does not record it.
    train_docs: DocumentIndex | None = None
    val_docs: DocumentIndex | None = None

    def streamed(self) -> bool:
        return isinstance(self.train, StreamedSplit)

    def size(self) -> str:
        train = "streamed" if self.streamed() else f"{len(self.train):,}"
        return f"{train} train / {len(self.val):,} val tokens"

    def whole_split(self) -> np.ndarray:
        """The split a statistic over every token reads: the training split, or of a
        stream (read once, never whole), the validation tokens."""
        return self.val if self.streamed() else self.train


def load_tokens(cfg: DataConfig, stream_val_tokens: int = 2**16) -> TokenSplits:
    """Token splits for the configured corpus, tokenizing and caching text on first use;
    of a stream, the validation split's first `stream_val_tokens`."""
    if cfg.name == "hf":  # its cache entries and streams always know their documents
        return _load_dataset(cfg, stream_val_tokens)
    sources = find_sources(cfg)
    if sources.kind == "tokens":
        splits = _load_pretokenized(cfg, sources)
    else:
        splits = _load_cached(cfg, sources)
    if cfg.doc_mask:
        _require_documents(splits, sources)
    return splits


def _load_dataset(cfg: DataConfig, stream_val_tokens: int) -> TokenSplits:
    """data=hf: rows tokenized into the cache once, or streamed (then only the validation
    tokens are read here, a fixed head of them: `stream.read_validation`)."""
    if not cfg.streaming:
        rows = DatasetRows.load(cfg)
        return _load_cached(cfg, rows, f"{cfg.dataset} ({rows.n_rows():,} rows")
    tokenizer = ByteTokenizer(cfg.eos) if cfg.tokenizer == BYTES else load_tokenizer_file(cfg.tokenizer)
    train = StreamedSplit(cfg, tokenizer, validation=False)
    val, val_docs = read_validation(StreamedSplit(cfg, tokenizer, validation=True), stream_val_tokens)
    return TokenSplits(train, val, tokenizer.vocab_size, f"{cfg.dataset} (streamed, {_tokenizer_words(cfg, tokenizer)})",
                       tokenizer, None, val_docs)


def _tokenizer_words(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """How a corpus's description names its tokenizer (and its end-of-text id, under data.eos)."""
    what = "bytes" if cfg.tokenizer == BYTES else f"{cfg.tokenizer}, {tokenizer.vocab_size:,} tokens"
    return what + (f", documents end with id {tokenizer.end_of_text_id()}" if cfg.eos else "")


def _load_cached(cfg: DataConfig, sources: Sources | DatasetRows, origin: str = "") -> TokenSplits:
    """Text (data=stdlib, data=text) or a dataset's rows: its cache entry, tokenized
    first unless it is there. `origin`: the description's start, with its count open."""
    folder = cache_entry(sources, cfg)
    if cfg.tokenizer != BYTES:
        tokenizer = JsonTokenizer(cfg.tokenizer, (folder / TOKENIZER_FILE).read_text(encoding="utf-8"))
    else:
        tokenizer = ByteTokenizer(cfg.eos)
    dtype = read_token_meta(folder).get("dtype", "uint16")  # entries before tokens.json were bytes in uint16
    if not origin:
        where = f"python {sys.version.split()[0]} stdlib" if sources.kind == "stdlib" else cfg.path
        n_files = len(sources.train) + len(sources.val)
        origin = f"{where} ({n_files} file{'s' if n_files != 1 else ''}"
    what = _tokenizer_words(cfg, tokenizer)
    train, val = (_open_bin(folder / name, dtype, allow_empty=True) for name in ("train.bin", "val.bin"))
    for split, tokens in (("training", train), ("validation", val)):
        if len(tokens) < 2:  # said of the corpus: the cache's file would mean nothing to a user
            raise UserError(f"{origin}) leaves its {split} split without tokens (data.val_fraction="
                            f"{cfg.val_fraction:g}); give a larger corpus")
    return TokenSplits(
        train, val, tokenizer.vocab_size, f"{origin}, {what})", tokenizer,
        DocumentIndex.beside([folder / "train.bin"], [len(train)]),
        DocumentIndex.beside([folder / "val.bin"], [len(val)]),
    )


def _require_documents(splits: TokenSplits, sources: Sources) -> None:
    """data.doc_mask=true on a corpus that does not say where its documents start: one line."""
    if splits.train_docs is not None and splits.val_docs is not None:
        return
    missing = next(index_path(path) for path in sources.train + sources.val if not index_path(path).is_file())
    raise UserError(
        f"data.doc_mask=true needs the document starts beside each token file, and {missing} is not there "
        "(uint64 offsets of each document's first token; text corpora get them when tokenized); "
        "or set data.doc_mask=false"
    )


def _load_pretokenized(cfg: DataConfig, sources: Sources) -> TokenSplits:
    """data=tokens: ids as written by any tokenizer; data.tokenizer (a tokenizer.json) decodes samples."""
    dtype = _declared_dtype(cfg, sources.train[0].parent)
    train = _open_split(sources.train, dtype)
    train_docs = DocumentIndex.beside(sources.train, _lengths(train))
    val = _open_split(sources.val, dtype) if sources.val else None
    if val is None:
        train, val = _tail_split(train, sources.tail_fraction)
        val_docs = train_docs.tail(len(train)) if train_docs is not None else None
    else:
        val_docs = DocumentIndex.beside(sources.val, _lengths(val))
    vocab = max(int(chunk.max(initial=0)) for split in (train, val) for chunk in chunks(split)) + 1
    tokenizer = ByteTokenizer() if cfg.tokenizer == BYTES else load_tokenizer_file(cfg.tokenizer)
    if cfg.tokenizer != BYTES:
        vocab = max(vocab, tokenizer.vocab_size)
    shards = f", {len(sources.train)} train / {len(sources.val)} val shards" if len(sources.train) > 1 else ""
    return TokenSplits(train, val, vocab, f"tokens {cfg.path} ({dtype}{shards})", tokenizer, train_docs, val_docs)


def _lengths(split) -> list[int]:
    """The tokens of each file a split was opened from (`_open_split`), empty shards as 0."""
    return split.file_lengths if isinstance(split, TokenShards) else [len(split)]


def _open_split(paths: list[Path], dtype: str):
    """One file's memmap, or shards read as one stream (`TokenShards`; an empty shard is
    left out, a shard that is not whole tokens refused)."""
    if len(paths) == 1:
        return _open_bin(paths[0], dtype)
    parts = [_open_bin(path, dtype, allow_empty=True) for path in paths]
    if sum(len(part) for part in parts) < 2:
        raise UserError(f"the shards {paths[0].parent}/{paths[0].name.split('_')[0]}_*.bin hold no tokens")
    return TokenShards(parts)


def _declared_dtype(cfg: DataConfig, folder: Path) -> str:
    """data.dtype, else the dtype tokens.json beside the files records, else uint16 (nanoGPT's)."""
    recorded = read_token_meta(folder).get("dtype")
    if recorded is not None and recorded not in TOKEN_DTYPES:
        raise UserError(f"{folder / 'tokens.json'} gives dtype {recorded!r}; allowed: {', '.join(TOKEN_DTYPES)}")
    if cfg.dtype and recorded and cfg.dtype != recorded:
        raise UserError(f"data.dtype={cfg.dtype} but {folder / 'tokens.json'} records {recorded}; drop one")
    return cfg.dtype or recorded or "uint16"


def _tail_split(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _open_bin(path: Path, dtype: str = "uint16", allow_empty: bool = False) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if allow_empty and size == 0:
        return np.empty(0, dtype=dtype)
    if size < 2 * itemsize and not allow_empty:
        raise UserError(f"{path} holds no tokens")
    if size % itemsize:
        raise UserError(f"{path} is {size} bytes, not a whole number of {dtype} tokens; set data.dtype to its type")
    return np.memmap(path, dtype=dtype, mode="r")


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats per token) of the token frequencies: the loss of a model that ignores
    context. Counted a chunk at a time (`chunks`), in memory that does not grow with the corpus."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for chunk in chunks(tokens):
        seen = np.bincount(chunk, minlength=len(counts))
        if len(seen) > len(counts):  # ids past vocab_size count too, as they did in the model's loss
            counts = np.pad(counts, (0, len(seen) - len(counts)))
        counts += seen
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# Tokens per chunk of a pass over a whole split: bincount and max widen a chunk to int64,
# 8 MiB at this size, whatever the corpus.
CHUNK_TOKENS = 2**20


def chunks(tokens: np.ndarray, size: int = CHUNK_TOKENS) -> Iterator[np.ndarray]:
    """`tokens` a chunk at a time, for a pass over a whole split. Of a memory-mapped split,
    the pages each chunk read leave this process's resident memory after it (the page
    cache keeps them), so a pass over a corpus larger than the memory left still fits."""
    if isinstance(tokens, TokenShards):
        for part in tokens.parts:
            yield from chunks(part, size)
        return
    mapping = getattr(tokens, "_mmap", None)  # np.memmap's mapping (slices share their base's)
    base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data if mapping is not None else 0
    for start in range(0, len(tokens), size):
        chunk = np.asarray(tokens[start : start + size])
        yield chunk
        if mapping is not None:  # a read-only file mapping: its pages are dropped here, not lost
            begin = chunk.ctypes.data - base
            aligned = begin - begin % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_DONTNEED, aligned, begin + chunk.nbytes - aligned)
