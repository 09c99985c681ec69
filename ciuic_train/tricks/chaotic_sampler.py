"""chaotic_sampler (混沌洗牌): a rank- and epoch-dependent re-ordering of each rank's share.

    ciuic-train +trick=chaotic_sampler data.shuffle=false

For each epoch every rank computes `chaos = (epoch + offset_per_rank * rank) % period`
(defaults 3 and 7): 0 reverses the rank's share of windows, 1, 3 and 5 put its even
positions before the odd ones, anything else leaves it alone. The permutation applies to
the share the sampler already gave this rank, so the shares stay disjoint and together
cover the same windows as without the trick; the order is a function of (seed, epoch,
rank), so a resumed run continues it mid-epoch. With `data.shuffle=true` (the default)
the share is already a random permutation and a fixed re-ordering of it changes nothing
statistically: the trick only has a real effect with `data.shuffle=false`.
Logged into `metrics.jsonl`: `chaotic_sampler/chaos`, rank 0's value for the current
epoch (-1 before the sampler's first share).

The article's version and its defects
-------------------------------------
The article subclassed DistributedSampler and picked `chaos = (epoch + 3*rank) % 7`, with
the same three cases; these are exactly the permutations applied here. Its defect is the
one noted above: under shuffling it re-orders an order that is already random.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ciuic_train.tricks.base import Trick

if TYPE_CHECKING:
    import torch


class ChaoticSampler(Trick):
    name = "chaotic_sampler"
    summary = "reverse or even-then-odd reorder of each rank's share, by (epoch + 3*rank) % 7"

    @dataclass
    class Params:
        offset_per_rank: int = 3
        period: int = 7

        def __post_init__(self) -> None:
            if self.period < 1:
                raise ValueError(f"period={self.period} must be at least 1")

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.last_chaos = -1

    def chaos(self, epoch: int) -> int:
        return (epoch + self.params.offset_per_rank * self.ctx.rank) % self.params.period

    def order_indices(self, share: torch.Tensor, epoch: int) -> torch.Tensor:
        import torch

        self.last_chaos = self.chaos(epoch)
        if self.last_chaos == 0:
            return share.flip(0)
        if self.last_chaos in (1, 3, 5):
            return torch.cat([share[0::2], share[1::2]])
        return share

    def metrics(self) -> dict[str, float]:
        return {"chaos": self.last_chaos}
