"""Every rule of `dist.*`, each written once.

`check_dist` holds the rules that need no world size: `to_config` runs it (through
`ciuic_train/checks.py`) before any work. What needs the world size is `resolve_mesh`'s
arithmetic (`distributed/mesh.py`: sizes that must multiply out or divide), run by the
CLI's pre-flight check and again by each process as it starts; what needs the resolved
mesh is `check_pipeline_mesh`, run by both and by the pipeline as it is built.
"""

from __future__ import annotations

from ciuic_train.config import Config
from ciuic_train.distributed.mesh import REST, MeshShape
from ciuic_train.distributed.pipeline_split import ONE_STAGE_PER_RANK, V_SHAPED, n_microbatches, n_stages
from ciuic_train.errors import UserError
from ciuic_train.tricks import seam_owner


def check_dist(config: Config) -> None:
    """Refuse, in one line, a `dist.*` value that no world size could make right."""
    dist = config.dist
    if dist.nproc_per_node < 1:
        raise UserError(f"dist.nproc_per_node={dist.nproc_per_node} must be at least 1")
    if dist.nnodes < 1:
        raise UserError(f"dist.nnodes={dist.nnodes} must be at least 1")
    for key in ("dp_replicate", "dp_shard", "ep"):
        value = getattr(dist, key)
        if value < 1 and value != REST:
            raise UserError(f"dist.{key}={value} must be a positive number of ranks, or -1 for the rest")
    if dist.pp < 1:
        raise UserError(f"dist.pp={dist.pp} must be at least 1 (1: no pipeline)")
    if dist.ddp_bucket_mb < 0:
        raise UserError(f"dist.ddp_bucket_mb={dist.ddp_bucket_mb} must be positive, or 0 to size the "
                        "buckets from the model")
    if dist.powersgd_rank < 1 or dist.powersgd_start_step < 2:
        raise UserError(f"dist.powersgd_rank={dist.powersgd_rank} must be at least 1 and "
                        f"dist.powersgd_start_step={dist.powersgd_start_step} at least 2")
    if dist.fsdp_prefetch < 0:
        raise UserError(f"dist.fsdp_prefetch={dist.fsdp_prefetch} must be 0 (FSDP's own order) or more")
    if dist.timeout_s < 1:
        raise UserError(f"dist.timeout_s={dist.timeout_s} must be at least 1")
    _check_pipeline(config)


def _check_pipeline(config: Config) -> None:
    """Refuse, in one line each, a pipeline that cannot run: a schedule and a number of
    stages per rank that do not go together, a split that leaves a stage without layers,
    too few micro-batches for the schedule, a batch that does not divide into them."""
    dist = config.dist
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
    for seam, why in (("transform_loss", "the loss exists on the last stage only"),
                      ("comm_hook", "a pipeline has no DDP all-reduce")):
        owner = seam_owner(config.trick, seam)
        if owner:
            raise UserError(f"trick {owner} replaces the {seam} seam, which dist.pp={dist.pp} cannot honour ({why}); "
                            "use dist.pp=1 with it")
    if config.train.log_grad_consistency:
        raise UserError("train.log_grad_consistency compares replicas' gradients, which a pipeline (dist.pp>1) "
                        "does not have")


def check_pipeline_mesh(config: Config, shape: MeshShape) -> None:
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
