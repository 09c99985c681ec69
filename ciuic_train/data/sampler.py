"""Training windows: which ones each rank reads in an epoch, and the batches they make.

A corpus split is one flat array of token ids (`corpus.py`); a window is `seq_len + 1`
consecutive ids of it (inputs and their shifted targets), and window i starts at token
i * seq_len. The sampler decides the order, the functions below cut the batches.
"""

from __future__ import annotations

import numpy as np
import torch

from ciuic_train.config import DataConfig
from ciuic_train.data.documents import DocumentIndex
from ciuic_train.data.stream import StreamedSplit, StreamWindows
from ciuic_train.errors import UserError
from ciuic_train.model.documents import document_positions


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


class SampledWindows:
    """This rank's training batches from a token split it can read anywhere (a memmap,
    shards): the sampler's windows, cut from the split, with their documents where
    data.doc_mask asks. `stream.StreamWindows` offers the same methods for a stream."""

    def __init__(self, tokens: np.ndarray, index: DocumentIndex | None, seq_len: int, sampler: WindowSampler,
                 documents: bool = False, restart_positions: bool = False):
        self.tokens, self.index, self.seq_len, self.sampler = tokens, index, seq_len, sampler
        self.documents, self.restart_positions = documents, restart_positions

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        indices = self.sampler.next_indices(batch_size)
        inputs, targets = get_batch(self.tokens, indices, self.seq_len)
        extra = window_documents(self.index, indices, self.seq_len, self.restart_positions) if self.documents else {}
        return inputs, targets, extra

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def global_position(self) -> dict:
        return self.sampler.global_position()

    def share_of(self, global_position: dict) -> dict:
        return self.sampler.share_of(global_position)


def train_windows(splits, data: DataConfig, seq_len: int, seed: int, rank: int, world: int, order=None):
    """This rank's training batches of `splits` (`corpus.TokenSplits`): sampled from its
    token split, or cut from its stream."""
    if isinstance(splits.train, StreamedSplit):
        return StreamWindows(splits.train, seq_len, seed, rank, world, data)
    sampler = WindowSampler(n_windows(splits.train, seq_len), seed, rank, world, order=order, shuffle=data.shuffle)
    return SampledWindows(splits.train, splits.train_docs, seq_len, sampler, data.doc_mask, data.doc_positions)


def n_windows(tokens: np.ndarray, seq_len: int) -> int:
    return (len(tokens) - 1) // seq_len


def get_batch(tokens: np.ndarray, indices: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for the given windows, each in memory of its own:
    evaluation masks the targets of filler rows in place, which through a shared storage
    would turn their inputs into ids no embedding has."""
    rows = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in indices.tolist()])
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def window_documents(
    index: DocumentIndex, indices: torch.Tensor, seq_len: int, restart_positions: bool = False
) -> dict[str, torch.Tensor]:
    """The model's document inputs for the given windows' inputs: `docs` [B, T], each
    position's document in its window, and with `restart_positions` the `positions` [B, T]
    RoPE rotates by, 0 at each document's first token (`model/documents.py`)."""
    docs = torch.from_numpy(index.window_documents([i * seq_len for i in indices.tolist()], seq_len))
    if not restart_positions:
        return {"docs": docs}
    return {"docs": docs, "positions": document_positions(docs)}


def eval_indices(tokens: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """A fixed, evenly spread set of validation windows, the same at every evaluation."""
    available = n_windows(tokens, seq_len)
    if available < 1:
        raise UserError(f"the validation split has {len(tokens):,} tokens, fewer than train.seq_len+1={seq_len + 1}; "
                        "give a larger corpus, raise data.val_fraction or lower train.seq_len")
    return torch.linspace(0, available - 1, min(count, available)).round().long().unique()
