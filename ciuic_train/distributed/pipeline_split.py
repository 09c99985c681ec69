"""A pipeline's shape: which stages each rank runs and which layers each stage holds
(no torch needed; its config's rules are in `distributed/checks.py`).

Stages are numbered in the order the activations flow, 0 (the embedding) to S-1 (the
final norm, the head and the MTP depths), S = `dist.pp x dist.pp_stages_per_rank`. Rank r
of the pipeline runs stage r under gpipe and 1f1b; stages r, r + pp, r + 2 pp, ... under
interleaved_1f1b (torch's loop placement); stages r and 2 pp - 1 - r under zbv and
dualpipev (the V), so rank 0 holds the first and the last, the embedding with the head.
"""

from __future__ import annotations

from ciuic_train.config import DistConfig


ONE_STAGE_PER_RANK = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")


def n_stages(dist: DistConfig) -> int:
    return dist.pp * dist.pp_stages_per_rank


def n_microbatches(dist: DistConfig) -> int:
    """`dist.pp_microbatches`, or by default one per stage: the fewest that fill the pipeline."""
    return dist.pp_microbatches or n_stages(dist)


def stages_of_rank(pp_rank: int, dist: DistConfig) -> list[int]:
    """The stages pipeline rank `pp_rank` runs, in increasing order."""
    pp, schedule = dist.pp, dist.pp_schedule.value
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(dist.pp_stages_per_rank)]


def stage_owners(dist: DistConfig) -> dict[int, int]:
    """The pipeline rank that runs each stage."""
    return {stage: rank for rank in range(dist.pp) for stage in stages_of_rank(rank, dist)}


def balanced_split(layer_costs: list[float], first_extra: float, last_extra: float, stages: int) -> list[int]:
    """Layers per stage, in order, each at least one, that make the costliest stage as
    cheap as it can be; the first stage also carries `first_extra`, the last `last_extra`.

    Exact (a dynamic programme over where each stage ends), cheap for any real depth.
    """
    n = len(layer_costs)
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][e]: the least possible maximum over stages 0..s when stage s ends at layer e.
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for end in range(1, n + 1):
        best[0][end] = cost(0, 0, end)
    for s in range(1, stages):
        for end in range(s + 1, n + 1):
            for start in range(s, end):
                value = max(best[s - 1][start], cost(s, start, end))
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, start
    sizes, end = [], n
    for s in range(stages - 1, 0, -1):
        start = cut[s][end]
        sizes.append(end - start)
        end = start
    sizes.append(end)
    return sizes[::-1]
