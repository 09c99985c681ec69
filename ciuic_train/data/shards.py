"""Token shards (`train_0.bin`, `train_1.bin`, ...) read as one stream.

`TokenShards` stands where a single memory-mapped split stands everywhere else in the
data path: its length, slices (lazy: a slice is the memmap slices it covers, so a tail
held out for validation reads nothing) and `np.asarray` (the tokens, read from each
shard's mapping). Windows are cut from the stream as from one file, so a corpus written
as several shards trains on exactly the windows the same tokens in one file give; a
window may span the end of one shard and the start of the next, as it spans the end of
one text file and the start of the next in a text corpus.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np


class TokenShards:
    def __init__(self, parts: list[np.ndarray]):
        self.parts = [part for part in parts if len(part)]
        self.file_lengths = [len(part) for part in parts]  # empty ones too: the document index's offsets
        self.dtype = parts[0].dtype
        self.ends = list(itertools.accumulate(len(part) for part in self.parts))  # each part's end in the stream

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, key: slice):
        """The tokens in `key` (a slice with step 1): one shard's memmap slice where they lie
        in one shard, else a TokenShards of the pieces."""
        if not isinstance(key, slice):
            raise TypeError(f"TokenShards takes slices, not {type(key).__name__}")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("TokenShards slices take step 1")
        # From the part holding `start` (a window per batch row: found by bisection, not by
        # walking every shard) to the one holding `stop`.
        pieces = []
        for i in range(bisect.bisect_right(self.ends, start), len(self.parts)):
            first = self.ends[i] - len(self.parts[i])
            if first >= stop:
                break
            pieces.append(self.parts[i][start - first if start > first else 0 : min(stop, self.ends[i]) - first])
        if not pieces:
            return np.empty(0, dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else TokenShards(pieces)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        tokens = np.concatenate(self.parts)
        return tokens if dtype is None else tokens.astype(dtype)
