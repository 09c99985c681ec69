"""`--plan --simulate`: rank 0 of a planned cluster stepped on fake tensors, against the
plan's formulas and against real ranks.

One test starts four real ranks (torchrun, gloo, about 30 s on 2 cores); the others
simulate small layouts in this process (a few seconds each) or run the command.
"""

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from ciuic_train.errors import UserError
from ciuic_train.plan.figures import plan_figures
from ciuic_train.plan.simulate import simulate, simulated_rank_figures, simulated_rows
from conftest import peak_resident_growth, run_cli, torchrun
from test_plan import compose_config

SMALL_ON_4 = [
    "model=small", "dist.nproc_per_node=4", "dist.dp_shard=4", "dist.ep=2", "train.batch_size=2",
    "train.seq_len=64", "device=cpu",
]
HERE = Path(__file__).resolve().parent


def exact_rows(config, measured) -> dict[str, tuple[int, int]]:
    """Parameters, gradients and AdamW state: (the most the step held, --plan's figure)."""
    rows = simulated_rows(config, plan_figures(config), measured)
    return {label: (largest, planned) for label, _, largest, planned in rows[:3]}


@pytest.mark.parametrize(
    "overrides",
    [
        SMALL_ON_4,  # FSDP, experts over ep=2 then efsdp=2, fp32 on CPU (the fp32 grouped matmul)
        # HSDP on a CUDA rank in bf16 (FSDP2's bf16 gathers), with activation checkpointing and an MTP depth
        ["model=tiny", "dist.nnodes=2", "dist.nproc_per_node=4", "dist.dp_shard=4", "dist.ep=4", "precision=bf16",
         "device=cuda", "activation_checkpointing=true", "model.n_mtp_layers=1", "train.seq_len=64"],
        # fp32 on a CUDA rank runs the loop over experts; two micro-batches keep unsharded gradients
        ["model=tiny", "dist.nproc_per_node=2", "dist.dp_shard=2", "device=cuda", "train.grad_accum=2", "train.seq_len=64"],
        ["model=tiny", "train.seq_len=64", "device=cpu"],  # one process
    ],
    ids=["fsdp4_ep2_cpu", "hsdp_cuda_bf16_ac_mtp", "fsdp2_cuda_fp32_accum", "one_process"],
)
def test_simulation_holds_the_plans_exact_bytes(one_thread, overrides):
    config = compose_config(*overrides)
    simulated = []
    grown = peak_resident_growth(lambda: simulated.append(simulate(config)))
    (measured,) = simulated
    for label, (largest, planned) in exact_rows(config, measured).items():
        assert largest == planned, label
    assert measured.uniform_routing == (plan_figures(config)["mesh"]["ep"] > 1)
    # The total is an estimate: it may not understate the measured peak by more than the
    # issue's 15% (the memory check warns from it). model=small on 4 ranks came 6% above it,
    # the tiny layouts 23-25% below (one block's working set is a large share of a tiny model).
    total = plan_figures(config)["memory"]["total"]["ac" if config.activation_checkpointing else "no_ac"]
    assert 0 < measured.peak <= 1.15 * total
    assert grown < 256 * 2**20, grown  # fake tensors hold nothing (measured: tens of MiB, the code torch loads)
    assert not dist.is_initialized()  # the fake process group is gone


def test_a_simulated_step_holds_no_real_memory(one_thread):
    """A step that would need gigabytes, simulated in a few MiB."""
    config = compose_config("model=small", "train.batch_size=64", "train.seq_len=512", "device=cpu")
    simulated = []
    grown = peak_resident_growth(lambda: simulated.append(simulate(config)))
    assert simulated[0].peak > 2 * 2**30, simulated[0].peak
    assert grown < simulated[0].peak / 20, grown


@pytest.mark.slow
def test_simulation_matches_a_real_4_rank_gloo_run(tmp_path, one_thread):
    """The same step on four real CPU ranks, tracked the same way: the state to the byte,
    the peak within 15% (real routing is not uniform)."""
    out = tmp_path / "real.json"
    result = torchrun("--nproc_per_node=4", str(HERE / "simulate_rank.py"), str(out), *SMALL_ON_4, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    real = json.loads(out.read_text())
    simulated = simulate(compose_config(*SMALL_ON_4))
    for category in ("parameters", "gradients", "optimizer"):
        assert simulated.largest[category] == real["largest"][category], category
    assert abs(simulated.peak - real["peak"]) <= 0.15 * real["peak"]


def test_checkpointed_balance_losses_keep_no_recomputed_graph(one_thread):
    """A balance loss kept from a checkpointed block's recomputation would hold that
    block's recomputed activations to the end of backward: the peak would grow with depth."""
    def activations(n_layers: int) -> int:
        measured = simulate(compose_config(
            "model=tiny", f"model.n_layers={n_layers}", "model.seq_aux_loss_alpha=0.01", "activation_checkpointing=true",
            "train.seq_len=64", "device=cpu",
        ))
        return measured.at_peak["activations"] + measured.at_peak["temporaries"]

    shallow = activations(2)
    assert activations(6) - shallow < shallow / 100  # kept, the 4 more blocks' graphs added 140% here


def test_ddp_is_refused_in_one_line():
    with pytest.raises(UserError, match="not DDP"):
        simulate(compose_config("model=tiny", "dist.nproc_per_node=2"))


@pytest.mark.parametrize(
    "overrides",
    [
        ["dist.nproc_per_node=2"],  # 1f1b, one rank per stage
        # 1f1b over stages of 2 ranks, FSDP2 in each with the experts split: an MTP depth's embedding copy
        ["dist.nproc_per_node=4", "dist.dp_shard=2", "dist.ep=2", "model.n_mtp_layers=1"],
        # zbv: rank 0 holds the V's two ends, the embedding and the head with the MTP depth
        ["dist.nproc_per_node=2", "dist.pp_schedule=zbv", "dist.pp_stages_per_rank=2", "model.n_mtp_layers=1"],
    ],
    ids=["1f1b", "1f1b_fsdp2_ep2_mtp", "zbv_mtp"],
)
def test_a_pipeline_rank_is_simulated_beside_its_plan(one_thread, overrides):
    """Pipeline rank 0's stages, run in the schedule's order on fake tensors, hold the plan's
    bytes for that rank, and activations under the plan's bound (held to the weight half
    of a split backward, where the simulation frees them at its first)."""
    config = compose_config("model=tiny", "model.n_layers=4", "train.seq_len=64", "train.batch_size=8",
                            "dist.pp=2", "device=cpu", *overrides)
    measured = simulate(config)
    rank_0 = simulated_rank_figures(plan_figures(config))
    rows = {label: (largest, planned) for label, _, largest, planned in simulated_rows(config, rank_0, measured)}
    for label in ("parameters", "gradients", "AdamW state"):
        assert rows[label][0] == rows[label][1], label
    activations, planned = rows["activations"]
    assert 0.6 * planned < activations <= planned  # measured: 0.81 (1f1b), 0.91 (zbv) of the plan
    assert 0 < measured.peak <= 1.15 * rank_0["memory"]["total"]["no_ac"]
    assert not dist.is_initialized()


def test_a_pipeline_rank_of_several_fsdp2_roots_is_refused_in_one_line(tmp_path: Path):
    result = run_cli("model=tiny", "model.n_layers=4", "dist.pp=2", "dist.nproc_per_node=4", "dist.pp_schedule=zbv",
                     "dist.pp_stages_per_rank=2", "--plan", "--simulate", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ciuic-train: error: --simulate follows one FSDP2 root per rank, and dist.pp_stages_per_rank=2 with data "
        "parallelism in the stages (pp=2 x dp_replicate=2 x dp_shard=1, ep=1) gives a rank more; simulate gpipe or "
        "1f1b, or --plan alone")


def test_cli_plan_simulate_prints_the_simulation_beside_the_plan(tmp_path: Path):
    result = run_cli(*SMALL_ON_4, "--plan", "--simulate", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())  # rich wraps
    assert "simulated: rank 0 of 4, one training step on fake tensors" in out
    assert "expert dispatch used uniform counts" in out
    assert "at the peak" in out and "--plan" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_simulate_needs_plan_and_is_one_line(tmp_path: Path):
    for args in (["--simulate"], ["--plan", "--simulate", "dist.nproc_per_node=2"]):
        result = run_cli("model=tiny", *args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ciuic-train: error: "), result.stderr
        assert result.stdout == ""
