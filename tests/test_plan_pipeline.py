"""`--plan` for pipelines (ciuic_train/plan/pipeline.py): the schedule's order, its
bubble and in-flight micro-batches against the textbook formulas, each rank's parameters
and point-to-point bytes, DeepSeek-V3's own layout."""
import pytest

from ciuic_train.plan.figures import plan_figures
from ciuic_train.plan.memory import GIB
from ciuic_train.plan.pipeline import bubble_fraction, peak_in_flight, schedule_order
from test_plan import V3_ON_2048, compose_config


def order_of(pp: int, micro: int, schedule: str = "1f1b", per_rank: int = 1):
    dist = compose_config(f"dist.pp={pp}", f"dist.pp_microbatches={micro}", f"dist.pp_schedule={schedule}",
                          f"dist.pp_stages_per_rank={per_rank}", "model.n_layers=8", "train.batch_size=16").dist
    return schedule_order(dist), pp * per_rank


@pytest.mark.parametrize("pp, micro", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_gpipe_and_1f1b_have_the_textbook_bubble_and_in_flight_counts(pp, micro):
    for schedule in ("gpipe", "1f1b"):
        order, count = order_of(pp, micro, schedule)
        assert bubble_fraction(order, count) == pytest.approx((pp - 1) / (micro + pp - 1)), schedule
    gpipe, _ = order_of(pp, micro, "gpipe")
    one_f_one_b, _ = order_of(pp, micro)
    for rank in range(pp):
        assert peak_in_flight(gpipe[rank], {rank: 1}) == micro
        assert peak_in_flight(one_f_one_b[rank], {rank: 1}) == min(micro, pp - rank)


@pytest.mark.parametrize("pp, micro", [(2, 4), (4, 8), (4, 16)])
def test_torch_orders_the_interleaved_and_v_schedules_as_their_papers(pp, micro):
    interleaved, count = order_of(pp, micro, "interleaved_1f1b", 2)
    # Megatron's interleaved bubble with v = 2 chunks per rank.
    assert bubble_fraction(interleaved, count) == pytest.approx((pp - 1) / (2 * micro + pp - 1))
    for schedule in ("zbv", "dualpipev"):
        order, count = order_of(pp, micro, schedule, 2)
        for rank, actions in order.items():  # every micro-batch once forward and once backward per stage
            for stage in {s for _, s, _ in actions}:
                forwards = sorted(mb for kind, s, mb in actions if kind == "F" and s == stage)
                backwards = sorted(mb for kind, s, mb in actions if kind in ("B", "I") and s == stage)
                assert forwards == backwards == list(range(micro)), (schedule, rank, stage)
        # Zero-bubble schedules fill what interleaved 1F1B leaves idle.
        assert bubble_fraction(order, count) < bubble_fraction(interleaved, count) / 2, schedule
    zbv, _ = order_of(pp, micro, "zbv", 2)
    # ZB-V keeps 1F1B's activation memory: pp micro-batches of a rank's layers (2 pp stage chunks).
    assert [peak_in_flight(zbv[r], dict.fromkeys(range(2 * pp), 1)) for r in range(pp)] == [2 * pp] * pp


def test_each_pipeline_rank_holds_its_stages_parameters_and_sends_its_boundaries():
    common = ["model=tiny", "model.n_layers=4", "train.seq_len=64", "train.batch_size=8", "dist.pp=2",
              "dist.nproc_per_node=2"]
    f = plan_figures(compose_config(*common))
    ranks = f["pipeline"]["ranks"]
    whole = plan_figures(compose_config("model=tiny", "model.n_layers=4", "train.seq_len=64", "train.batch_size=8"))
    held = [sum(r["memory"]["params"].values()) for r in ranks]
    # The stages split the model's parameters (no embedding copy without MTP or a tied head).
    assert sum(held) == sum(whole["memory"]["params"].values()) and min(held) > 0
    hidden = 4 * 64 * 64 * 4  # micro-batch of 4 sequences x 64 tokens x dim 64, fp32
    # 2 micro-batches: rank 0 sends their activations forward, rank 1 their gradients back.
    assert [r["p2p_bytes"] for r in ranks] == [2 * hidden] * 2
    v = plan_figures(compose_config(*common, "dist.pp_schedule=zbv", "dist.pp_stages_per_rank=2",
                                    "dist.pp_microbatches=2"))
    # The V's stages 0 1 | 2 3 turn on rank 1 (1 -> 2 stays there): each rank sends forward
    # across one boundary and back across the other.
    assert [r["p2p_bytes"] for r in v["pipeline"]["ranks"]] == [4 * hidden] * 2


def test_deepseek_v3_in_its_own_layout_fits_80_gb_only_with_activation_checkpointing():
    """pp=16 x (dp 2 x shard 64, ep=64) on 2048 GPUs, 15,360 sequences of 4,096 a step (the V3
    report's batch): 120 per data share, in micro-batches of one."""
    layout = [*V3_ON_2048, "dist.pp=16", "dist.dp_shard=64", "dist.ep=64", "train.batch_size=120",
              "dist.pp_microbatches=120"]
    f = plan_figures(compose_config(*layout))
    assert f["mesh"]["pp"] == 16 and f["mesh"]["dp_replicate"] == 2 and f["world_size"] == 2048
    p = f["pipeline"]
    assert len(p["ranks"]) == 16 and sum(p["layers_per_stage"]) == 61
    assert [r["in_flight"] for r in p["ranks"]] == [16 - r for r in range(16)]  # 1f1b
    assert not f["fits"]["80 GB"]["no_ac"] and f["fits"]["80 GB"]["ac"]
    assert all(r["memory"]["total"]["ac"] < 79 * GIB for r in p["ranks"])
