"""Documents inside a window: which positions may attend to which, and where positions restart.

With `data.doc_mask=true` a batch comes with `docs` [B, T]: each position's document
number within its window (0 for the document the window starts in, rising by one at
each document start the corpus's index records). Attention then stays inside a
document: position i sees j <= i only where docs[i] == docs[j]. With
`data.doc_positions=true` the positions RoPE rotates by restart at 0 at each document
start too; RoPE scores depend only on the distance between two positions, so this
changes results by rounding only, and is there for models whose inference restarts them.
"""

from __future__ import annotations

import torch


def document_causal_mask(docs: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool, True where query i may attend to key j: j <= i, same document."""
    seq = docs.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal


def document_first_positions(docs: torch.Tensor) -> torch.Tensor:
    """[B, T]: for each position, the first position of its document in the window."""
    seq = docs.shape[1]
    index = torch.arange(seq, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    # The running maximum of the start positions seen so far is the current document's start.
    return torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """[B, T]: each position's distance from its document's first position in the window."""
    return torch.arange(docs.shape[1], device=docs.device) - document_first_positions(docs)
