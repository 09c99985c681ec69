"""What one optimizer step reads, computed once for the trainer and for `--plan`."""

from __future__ import annotations

from ciuic_train.config import TrainConfig


def tokens_per_step(train: TrainConfig, data_parallel_size: int) -> int:
    """Training tokens in one optimizer step of a replica group (all of the run without
    `ft`): `train.grad_accum` micro-batches of `train.batch_size` windows on each of the
    `data_parallel_size` ranks that read different data; a pipeline's stages share theirs."""
    return train.batch_size * train.seq_len * train.grad_accum * data_parallel_size
