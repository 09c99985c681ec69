"""How one micro-batch goes forward and backward, and what follows on the gradients: the
trainer's one interface to the model's layout, declared as `Passes`.

`ModelPasses` runs the whole model on each rank (one process, DDP, FSDP2, HSDP, expert
parallelism); `ciuic_train.distributed.pipeline.Pipeline` runs a pipeline's stages
through torch's schedules. `step/layout.py` chooses between them. With `data.doc_mask`
the trainer hands `train`, `eval_sum` and `loss` the batch's documents as keywords
(`docs`, `positions`: `sampler.window_documents`), which go to the model's forward; a
pipeline is refused them (`data/checks.py`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ciuic_train.config import Config
from ciuic_train.distributed.data_parallel import grads_are_bucket_views
from ciuic_train.distributed.grads import clip_grad_norm_, grad_sync
from ciuic_train.model import Transformer
from ciuic_train.faults import poison_loss


class Passes(Protocol):
    """What the trainer asks of a layout, whatever it is."""

    # Whether every evaluation batch must be `train.batch_size` windows (a pipeline's
    # stages are built for one micro-batch shape).
    full_batches: bool
    # Whether this rank computes the loss (a pipeline: its last stage's ranks).
    holds_loss: bool

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
             **documents: torch.Tensor) -> torch.Tensor:
        """The batch's loss (`mean` per token or `sum`), 0 where this rank does not hold it."""

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float, step: int,
              sync: bool, **documents: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss times `weight` goes backward, gradients crossing ranks if
        `sync`; returns the loss and the side losses (0-d tensors on the device; 0 for the
        loss where this rank does not hold it)."""

    def eval_sum(self, inputs: torch.Tensor, targets: torch.Tensor, **documents: torch.Tensor) -> torch.Tensor:
        """The summed validation loss of a batch (0 where not held)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (across every mesh); returns it, before clipping."""

    def balance_experts(self) -> torch.Tensor:
        """The MoE bias step from the step's token counts; returns the imbalance (0-d)."""

    def grads_are_bucket_views(self) -> bool:
        """Whether the gradients are DDP's buckets, zeroed in place after a step rather than set to None."""

    def sampling_model(self) -> Transformer | None:
        """The whole model to sample from (on rank 0; None elsewhere where it had to be
        gathered, a collective every rank calls)."""


class ModelPasses:
    """The whole model on every rank: `wrapped_model` is what `parallelize` returned for
    `model` on a mesh of `strategy` (`MeshShape.strategy`). `rank` is this process's rank
    (for `fault.nan_rank`), `all_reduce` sums a tensor in place over the ranks (the
    experts' token counts; None: this rank's alone), `transform_loss` a trick's seam."""

    full_batches = False
    holds_loss = True

    def __init__(self, model: Transformer, wrapped_model: nn.Module, config: Config, *, strategy: str,
                 rank: int = 0, all_reduce: Callable[[torch.Tensor], Any] | None = None,
                 transform_loss: Callable[[torch.Tensor, int], torch.Tensor] | None = None, autocast: Any = None):
        self.model, self.wrapped_model, self.config = model, wrapped_model, config
        self.strategy, self.rank, self.all_reduce = strategy, rank, all_reduce
        self.transform_loss = transform_loss or (lambda loss, step: loss)
        self.autocast = autocast or nullcontext()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
             **documents: torch.Tensor) -> torch.Tensor:
        # The model computes the fp32 cross-entropy itself (see its forward).
        with self.autocast:
            return self.wrapped_model(
                inputs, targets, reduction=reduction, mtp_loss_weight=self.config.train.mtp_loss_weight, **documents
            )

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float, step: int,
              sync: bool, **documents: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with grad_sync(self.wrapped_model, self.strategy, enabled=sync):
            loss = self.transform_loss(self.loss(inputs, targets, **documents), step)
            loss = poison_loss(self.config.fault, self.rank, step + 1, loss)
            (loss * weight).backward()
        return loss.detach(), self.model.loss_figures()

    def eval_sum(self, inputs: torch.Tensor, targets: torch.Tensor, **documents: torch.Tensor) -> torch.Tensor:
        return self.loss(inputs, targets, reduction="sum", **documents)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(list(self.model.parameters()), max_norm)

    def grads_are_bucket_views(self) -> bool:
        return grads_are_bucket_views(self.wrapped_model)

    def balance_experts(self) -> torch.Tensor:
        return self.model.balance_experts(all_reduce=self.all_reduce)

    def sampling_model(self) -> Transformer:
        return self.model
