"""Initialization that gives the same weights however the parameters are laid out over ranks.

A parameter's values are a function of the run seed and its name only. The tensor is cut
on dim 0 into blocks of whole rows, about `BLOCK_ELEMENTS` values each (the number of rows
per block follows from the global shape alone), and block b is drawn from its own
generator, seeded by (seed, name, b). A rank that holds rows [start, start + n) of a
parameter draws only the blocks those rows touch: the whole tensor in one process or
under DDP, a dim-0 slice under FSDP2 (`Shard(0)`) and expert parallelism (experts are
dim 0 of the stacked expert weights). So 1 process, DDP, FSDP, HSDP and any `ep` start
from bit-identical weights, and initializing a shard never needs more than the shard plus
one block. The values depend on the device type (CPU and CUDA generators differ), not
on the number of ranks or threads.

Where a parameter's rows are is the caller's to say (`locate`): `whole_rows` for a plain
tensor; `ciuic_train/distributed/materialize.py` reads it off a DTensor's placement.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

# About 4 MiB of fp32 per block: small beside any shard worth splitting, large enough
# that seeding a generator per block costs nothing next to drawing its values.
BLOCK_ELEMENTS = 1 << 20

Draw = Callable[[torch.Tensor, torch.Generator], None]  # fills a block of rows in place


@dataclass(frozen=True)
class Rows:
    """The rows of a parameter this rank holds: `local` is rows [start, start + len(local))
    of a tensor of `global_shape`, and writing to `local` writes the parameter."""

    local: torch.Tensor
    global_shape: torch.Size
    start: int


def whole_rows(tensor: torch.Tensor) -> Rows:
    """A tensor held whole, as in one process or under DDP."""
    return Rows(tensor.data, tensor.shape, 0)


def block_seed(*parts: object) -> int:
    """A 63-bit seed from the run seed, a name and a block index."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class ParameterInit:
    """Draws parameters' values by blocks of rows (see the module docstring).

    `fill_(key, param, draw)` gives `param` the rows of a tensor whose blocks `draw`
    filled, each from the generator of (seed, key, block); `key` is the parameter's name,
    or a name of the caller's own so that two schemes for one parameter differ.
    """

    def __init__(self, seed: int, locate: Callable[[torch.Tensor], Rows] = whole_rows):
        self.seed = seed
        self.locate = locate

    @torch.no_grad()
    def fill_(self, key: str, param: torch.Tensor, draw: Draw) -> None:
        rows = self.locate(param)
        local, shape = rows.local, rows.global_shape
        if local.numel() == 0:  # FSDP's padding ranks hold no row of a short tensor
            return
        row_numel = math.prod(shape[1:])
        per_block = max(1, BLOCK_ELEMENTS // max(1, row_numel))
        start, stop = rows.start, rows.start + local.shape[0]
        for block in range(start // per_block, -(-stop // per_block)):
            first, last = block * per_block, min((block + 1) * per_block, shape[0])
            generator = torch.Generator(device=local.device).manual_seed(block_seed(self.seed, key, block))
            lo, hi = max(first, start), min(last, stop)
            if (lo, hi) == (first, last) and local.is_contiguous():
                draw(local[first - start : last - start], generator)
            else:  # the block straddles this rank's rows: draw it whole, keep what is ours
                values = torch.empty((last - first, *shape[1:]), dtype=local.dtype, device=local.device)
                draw(values, generator)
                local[lo - start : hi - start].copy_(values[lo - first : hi - first])

    def normal_(self, key: str, param: torch.Tensor, std: float) -> None:
        self.fill_(key, param, lambda block, generator: block.normal_(0.0, std, generator=generator))

    @torch.no_grad()
    def constant_(self, param: torch.Tensor, value: float) -> None:
        self.locate(param).local.fill_(value)
