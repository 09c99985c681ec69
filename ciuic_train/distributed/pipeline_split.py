"""A pipeline's shape: which stages each rank runs, which layers each stage holds, and
the checks its config must pass before any process starts (no torch needed).

Stages are numbered in the order the activations flow, 0 (the embedding) to S-1 (the
final norm, the head and the MTP depths), S = `dist.pp x dist.pp_stages_per_rank`. Rank r
of the pipeline runs stage r under gpipe and 1f1b; stages r, r + pp, r + 2 pp, ... under
interleaved_1f1b (torch's loop placement); stages r and 2 pp - 1 - r under zbv and
dualpipev (the V), so rank 0 holds the first and the last, the embedding with the head.
"""

from __future__ import annotations

from typing import Any

from ciuic_train.errors import UserError

# The config's types (ciuic_train.config's Config and DistConfig), not imported: the
# config's validation calls `check_pipeline`.
Config = DistConfig = Any

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


def check_pipeline(config: Config) -> None:
    """Refuse, in one line each, a pipeline that cannot run: a schedule and a number of
    stages per rank that do not go together, a split that leaves a stage without layers,
    too few micro-batches for the schedule, a batch that does not divide into them."""
    dist = config.dist
    if dist.pp < 1:
        raise UserError(f"dist.pp={dist.pp} must be at least 1 (1: no pipeline)")
    if dist.pp == 1:
        return
    schedule, per_rank = dist.pp_schedule.value, dist.pp_stages_per_rank
    if schedule in ONE_STAGE_PER_RANK and per_rank != 1:
        raise UserError(
            f"dist.pp_schedule={schedule} runs one stage per rank, not dist.pp_stages_per_rank={per_rank}; "
            "use interleaved_1f1b for several (or zbv, dualpipev for two)"
        )
    if schedule == "interleaved_1f1b" and per_rank < 2:
        raise UserError(
            f"dist.pp_schedule=interleaved_1f1b needs dist.pp_stages_per_rank of 2 or more, not {per_rank} "
            "(with one stage per rank use 1f1b)"
        )
    if schedule in V_SHAPED and per_rank != 2:
        raise UserError(f"dist.pp_schedule={schedule} runs two stages per rank in a V: set dist.pp_stages_per_rank=2")
    stages, layers = n_stages(dist), config.model.n_layers
    if dist.pp_layers:
        if len(dist.pp_layers) != stages or min(dist.pp_layers) < 1 or sum(dist.pp_layers) != layers:
            raise UserError(
                f"dist.pp_layers={list(dist.pp_layers)} must give each of the {stages} stages at least one layer "
                f"and sum to model.n_layers={layers}"
            )
    elif layers < stages:
        raise UserError(
            f"model.n_layers={layers} cannot give each of the {stages} pipeline stages a layer "
            f"(dist.pp={dist.pp} x dist.pp_stages_per_rank={per_rank}); use fewer stages"
        )
    if dist.pp_microbatches < 0:
        raise UserError(f"dist.pp_microbatches={dist.pp_microbatches} must be positive, or 0 for one per stage")
    micro = n_microbatches(dist)
    needed = {"1f1b": dist.pp, "dualpipev": stages}.get(schedule, 1)
    if micro < needed:
        raise UserError(
            f"dist.pp_schedule={schedule} needs at least {needed} micro-batches, not dist.pp_microbatches={micro}"
        )
    rounds = max(1, micro // dist.pp)
    if schedule == "interleaved_1f1b" and micro % rounds:
        raise UserError(
            f"dist.pp_schedule=interleaved_1f1b runs micro-batches in rounds of dist.pp={dist.pp}: "
            f"dist.pp_microbatches={micro} must be a multiple of {rounds}"
        )
    if config.train.batch_size % micro:
        raise UserError(
            f"train.batch_size={config.train.batch_size} does not divide into dist.pp_microbatches={micro} "
            "equal micro-batches"
        )
    if config.compile and schedule in V_SHAPED:
        raise UserError(f"dist.pp_schedule={schedule} splits backward in two, which torch.compile does not support; "
                        "set compile=false or use 1f1b or interleaved_1f1b")
    from ciuic_train.tricks import seam_owner

    for seam, why in (("transform_loss", "the loss exists on the last stage only"),
                      ("comm_hook", "a pipeline has no DDP all-reduce")):
        owner = seam_owner(config.trick, seam)
        if owner:
            raise UserError(f"trick {owner} replaces the {seam} seam, which dist.pp={dist.pp} cannot honour ({why}); "
                            "use dist.pp=1 with it")
    if config.train.log_grad_consistency:
        raise UserError("train.log_grad_consistency compares replicas' gradients, which a pipeline (dist.pp>1) "
                        "does not have")


def check_pipeline_mesh(config: Config, shape: Any) -> None:
    """Refuse what a pipeline cannot run on its resolved mesh (`shape`, a MeshShape): the
    CLI calls it before anything starts, the pipeline again when it is built.

    In a V the first and last stages share rank 0, and the last one uses the embedding too
    where MTP depths look tokens up or the head is tied: both stages hold it. FSDP2 takes
    each stage as a root and gathers a module in one root only, so with data parallelism
    in the stages that sharing is refused.
    """
    cfg, model = config.dist, config.model
    users = [f"model.n_mtp_layers={model.n_mtp_layers}"] * bool(model.n_mtp_layers) + \
        ["model.tie_embeddings=true"] * bool(model.tie_embeddings)
    if cfg.pp > 1 and shape.data_parallel_size > 1 and users and cfg.pp_schedule.value in V_SHAPED:
        raise UserError(
            f"{' and '.join(users)} with dist.pp_schedule={cfg.pp_schedule.value} and data parallelism in the "
            f"stages ({shape.describe()}): the V's first and last stages on rank 0 both use the embedding, which "
            "FSDP2 gathers in one stage only; use 1f1b or interleaved_1f1b, or one rank per stage"
        )


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
