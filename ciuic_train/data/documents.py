"""Where documents start in a token split: the `.idx` file beside each `.bin`.

A document is a text file of a text corpus (a row of a dataset). Tokenizing records the
token offset of each document's first token: `train.idx` beside `train.bin` (and
`train_3.idx` beside a shard `train_3.bin`) holds them as ascending little-endian
uint64, the first 0. `data=tokens` reads the same files where they are there; a corpus
without them trains with attention across documents, and `data.doc_mask=true` refuses it in one line.

`DocumentIndex` answers the one question the batches ask (`window_documents`): for a
window of the split, each position's document, counted from the window's first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ciuic_train.errors import UserError

INDEX_DTYPE = np.dtype("<u8")


def index_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".idx")


def write_index(path: Path, starts) -> None:
    np.asarray(starts, dtype=INDEX_DTYPE).tofile(path)


class DocumentIndex:
    """The document starts of one split: one memory-mapped `.idx` per file (`parts`, each
    at its file's token offset in the split), seen from token `base` on (a validation
    split held out from the tail of the training tokens starts there)."""

    def __init__(self, parts: list[tuple[int, np.ndarray]], base: int = 0):
        self.parts = parts
        self.base = base

    @classmethod
    def beside(cls, bin_paths: list[Path], lengths: list[int]) -> DocumentIndex | None:
        """The index of the split made of `bin_paths` (of `lengths` tokens each), None
        unless each has its `.idx`."""
        paths = [index_path(path) for path in bin_paths]
        if not all(path.is_file() for path in paths):
            return None
        parts, offset = [], 0
        for path, length in zip(paths, lengths):
            if path.stat().st_size % INDEX_DTYPE.itemsize:
                raise UserError(f"{path} is {path.stat().st_size} bytes, not whole uint64 document offsets")
            starts = np.memmap(path, dtype=INDEX_DTYPE, mode="r") if path.stat().st_size else np.empty(0, INDEX_DTYPE)
            parts.append((offset, starts))
            offset += length
        return cls(parts)

    def tail(self, start: int) -> DocumentIndex:
        """The same documents seen from token `start` of this split on."""
        return DocumentIndex(self.parts, self.base + start)

    def count(self) -> int:
        return sum(len(starts) for _, starts in self.parts)

    def window_documents(self, starts: list[int], length: int) -> np.ndarray:
        """[len(starts), length] int64: for the window of `length` tokens at each of
        `starts`, each position's document, 0 for the one the window begins in."""
        docs = np.zeros((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts):
            first = self.base + start
            for offset, part in self.parts:
                # Document starts strictly inside the window: the one at its first token is document 0.
                low = np.searchsorted(part, first - offset + 1, side="left") if first - offset + 1 > 0 else 0
                high = np.searchsorted(part, first - offset + length, side="left") if first - offset + length > 0 else 0
                if high > low:
                    np.add.at(docs[row], np.asarray(part[low:high], dtype=np.int64) + offset - first, 1)
        return np.cumsum(docs, axis=1)
