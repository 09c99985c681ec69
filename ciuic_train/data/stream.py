"""`data=hf data.streaming=true`: windows cut from the rows as each rank reads its share.

Nothing is tokenized ahead and nothing is written: each rank opens the training split as a
stream, takes its share of the rows (`datasets.distributed.split_dataset_by_node`: whole
files per rank where they divide evenly, else every world_size-th row), tokenizes each
row as it arrives (a document, ending as a text file's does) and cuts windows of
`seq_len + 1` tokens from the stream of ids, consecutive windows sharing one token as
they do in a token file. With `data.shuffle` the windows pass through a pool of
`data.shuffle_windows` from which each draw takes one at random (seeded by the run's
seed, the rank and the draw's number); without it they come in stream order.

Where a rank stands is small: the stream's own position (`IterableDataset.state_dict`),
the ids read but not yet cut, the pool, the draws so far and the epoch. It goes into
each rank's checkpoint state, so a resume reads on from exactly there: the batches are
those of a run that never stopped. The position is per rank: a streamed run resumes on
as many data-parallel ranks as it was saved with.

Validation reads the head of the validation split (or of the held-out rows: the hash of
`hf_dataset.held_out`), the same rows on every rank, until `train.eval_windows` windows
are full: a fixed set, as with a token file.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from ciuic_train.config import DataConfig
from ciuic_train.data.documents import DocumentIndex
from ciuic_train.data.hf_dataset import held_out, load_split, require_datasets, row_text
from ciuic_train.data.token_cache import encode_document
from ciuic_train.data.tokenizer import Tokenizer
from ciuic_train.errors import UserError
from ciuic_train.model.documents import document_positions


class StreamedSplit:
    """The training or validation rows of a streamed dataset, and how they become ids."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, validation: bool):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.end_of_text_id() if cfg.eos else None
        self.validation = validation

    def rows(self, rank: int = 0, world: int = 1):
        """The rows of this split, a rank's share of them: an `IterableDataset` of texts."""
        cfg = self.cfg
        named = cfg.val_split if self.validation else cfg.split
        dataset = load_split(cfg, named or cfg.split, streaming=True).select_columns([cfg.text_field])
        if not cfg.val_split:  # validation is the rows whose text hashes below data.val_fraction
            keep_val = self.validation
            dataset = dataset.filter(lambda row: held_out(row_text(row, cfg.text_field), cfg.val_fraction) == keep_val)
        if world > 1:
            require_datasets()
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank, world)
        return dataset

    def encode(self, row: dict) -> np.ndarray:
        return encode_document(row_text(row, self.cfg.text_field), self.tokenizer, self.eos_id).astype(np.int64)


def read_validation(split: StreamedSplit, n_tokens: int) -> tuple[np.ndarray, DocumentIndex]:
    """The first `n_tokens` ids of the validation rows (all of them, if fewer), with
    where their documents start."""
    pieces, starts, total = [], [], 0
    for row in split.rows():
        starts.append(total)
        pieces.append(split.encode(row))
        total += len(pieces[-1])
        if total >= n_tokens:
            break
    tokens = np.concatenate(pieces)[:n_tokens] if pieces else np.empty(0, np.int64)
    if len(tokens) < 2:
        where = f"data.val_split={split.cfg.val_split}" if split.cfg.val_split else (
            f"the rows held out by data.val_fraction={split.cfg.val_fraction}")
        raise UserError(f"{where} of {split.cfg.dataset} hold no tokens; name a validation split (data.val_split) "
                        "or raise data.val_fraction")
    return tokens, DocumentIndex([(0, np.asarray(starts, dtype="<u8"))])


class StreamWindows:
    """This rank's training batches, cut from its share of a streamed split as it reads it
    (the streamed counterpart of `sampler.SampledWindows`, with the same methods)."""

    def __init__(self, split: StreamedSplit, seq_len: int, seed: int, rank: int, world: int, cfg: DataConfig):
        self.split, self.seq_len, self.seed, self.rank, self.world = split, seq_len, seed, rank, world
        self.pool_size = cfg.shuffle_windows if cfg.shuffle else 0
        self.documents, self.restart_positions = cfg.doc_mask, cfg.doc_positions
        self.epoch = 0
        self.draws = 0
        self.pending = np.empty(0, np.int64)  # ids read and not yet cut into windows
        self.pending_starts = np.empty(0, np.int64)  # where documents start among them
        self.pool: list[tuple[np.ndarray, np.ndarray]] = []  # windows and their documents, awaiting a draw
        self.dataset = split.rows(rank, world)
        self.rows: Iterator | None = None
        # The stream's position restored from a checkpoint, until reading on from it moves it.
        self.restored: dict | None = None

    def _next_row(self) -> np.ndarray:
        """The next row's ids; at the end of the share, the next epoch's first."""
        for _ in range(2):  # this epoch's next row, else the next epoch's first
            if self.rows is None:
                self.rows = iter(self.dataset)
            row = next(self.rows, None)
            if row is not None:
                return self.split.encode(row)
            # A fresh stream per epoch: one restored from a checkpoint would restart at that point.
            self.epoch += 1
            self.dataset = self.split.rows(self.rank, self.world)
            self.dataset.set_epoch(self.epoch)
            self.rows = self.restored = None
        raise UserError(f"rank {self.rank}'s share of {self.split.cfg.dataset} ({self.split.cfg.split}) holds no rows; "
                        f"give the dataset at least {self.world} rows (or files), or run on fewer ranks")

    def _cut_window(self) -> tuple[np.ndarray, np.ndarray]:
        """The next window of the stream (seq_len + 1 ids) and its positions' documents."""
        length = self.seq_len + 1
        while len(self.pending) < length:
            ids = self._next_row()
            self.pending_starts = np.append(self.pending_starts, len(self.pending))
            self.pending = np.concatenate([self.pending, ids])
        window = self.pending[:length]
        marks = np.zeros(self.seq_len, dtype=np.int64)
        inside = self.pending_starts[(self.pending_starts > 0) & (self.pending_starts < self.seq_len)]
        marks[inside] = 1
        self.pending = self.pending[self.seq_len:]
        self.pending_starts = self.pending_starts[self.pending_starts >= self.seq_len] - self.seq_len
        return window, np.cumsum(marks)

    def _next_window(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.pool_size:
            return self._cut_window()
        while len(self.pool) < self.pool_size:
            self.pool.append(self._cut_window())
        pick = int(np.random.default_rng([self.seed, self.rank, self.draws]).integers(len(self.pool)))
        self.draws += 1
        drawn, self.pool[pick] = self.pool[pick], self.pool[-1]
        self.pool.pop()
        return drawn

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Inputs, next-token targets and (with data.doc_mask) the document keywords of the
        next `batch_size` windows."""
        windows = [self._next_window() for _ in range(batch_size)]
        rows = torch.from_numpy(np.stack([tokens for tokens, _ in windows]))
        if not self.documents:
            return rows[:, :-1], rows[:, 1:], {}
        docs = torch.from_numpy(np.stack([docs for _, docs in windows]))
        extra = {"docs": docs, "positions": document_positions(docs)} if self.restart_positions else {"docs": docs}
        return rows[:, :-1], rows[:, 1:], extra

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "stream": self.dataset.state_dict() if self.rows is not None else self.restored,
            "pending": self.pending.tolist(),
            "pending_starts": self.pending_starts.tolist(),
            "pool": [[tokens.tolist(), docs.tolist()] for tokens, docs in self.pool],
            "draws": self.draws,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.draws = state["epoch"], state["draws"]
        self.dataset = self.split.rows(self.rank, self.world)
        self.dataset.set_epoch(self.epoch)
        if state["stream"] is not None:
            self.dataset.load_state_dict(state["stream"])
        self.rows, self.restored = None, state["stream"]
        self.pending = np.asarray(state["pending"], dtype=np.int64)
        self.pending_starts = np.asarray(state["pending_starts"], dtype=np.int64)
        self.pool = [(np.asarray(tokens, dtype=np.int64), np.asarray(docs, dtype=np.int64))
                     for tokens, docs in state["pool"]]

    def global_position(self) -> dict[str, Any]:
        """What the checkpoint's meta records: a stream's position is per rank."""
        return {"stream": True, "epoch": self.epoch}

    def share_of(self, global_position: dict[str, Any]) -> dict[str, Any]:
        raise UserError("a streamed data=hf run's position is per rank: resume on as many data-parallel ranks "
                        "as it was saved with")
