"""Pipeline parallelism (`dist.pp`): the split, the checks before anything starts, and real
two-rank pipelines over gloo against one process at the same global batch."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import compose_config, run_cli, torchrun
from train_layouts import launch_layouts, train_here
from ciuic_train.checkpoint.checkpointer import load_model
from ciuic_train.config import DistConfig
from ciuic_train.distributed.mesh import MeshShape, resolve_mesh
from ciuic_train.distributed.checks import check_pipeline_mesh
from ciuic_train.distributed.pipeline_split import balanced_split, stages_of_rank
from ciuic_train.errors import UserError
from ciuic_train.plan.figures import plan_figures

# Four layers (one dense, three MoE), so two ranks can hold two stages each; a balance
# loss on, so its gradient must cross stages; 8 windows per batch.
TINY = ["model=tiny", "model.n_layers=4", "model.aux_loss_alpha=0.01", "train.seq_len=64", "train.batch_size=8",
        "train.eval_windows=16", "train.eval_every=10", "sample.max_new_tokens=0", "progress=plain"]


def test_the_balanced_split_gives_each_stage_a_layer_and_evens_the_costliest():
    assert balanced_split([1.0] * 4, 0.0, 0.0, 2) == [2, 2]
    # The last stage carries the head: it gets fewer layers.
    assert balanced_split([1.0, 2, 2, 2, 2, 2], 0.0, 3.0, 3) == [3, 2, 1]
    # A head that outweighs everything still leaves the last stage a layer.
    assert balanced_split([1.0, 1.0], 0.0, 50.0, 2) == [1, 1]
    assert balanced_split([5.0, 1, 1, 1, 1, 1], 0.0, 0.0, 2) == [1, 5]


def test_stages_sit_on_ranks_in_a_loop_or_in_a_v():
    loop = compose_config("dist.pp=2", "dist.pp_schedule=interleaved_1f1b", "dist.pp_stages_per_rank=2",
                          "model.n_layers=4").dist
    assert [stages_of_rank(r, loop) for r in (0, 1)] == [[0, 2], [1, 3]]
    v = compose_config("dist.pp=2", "dist.pp_schedule=zbv", "dist.pp_stages_per_rank=2", "model.n_layers=4").dist
    assert [stages_of_rank(r, v) for r in (0, 1)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize("overrides, message", [
    (["dist.pp_layers=[3,0]"], r"dist.pp_layers=\[3, 0\] must give each of the 2 stages at least one layer"),
    (["dist.pp_layers=[1,1]"], r"sum to model.n_layers=4"),
    (["model.n_layers=1"], r"model.n_layers=1 cannot give each of the 2 pipeline stages a layer"),
    (["dist.pp_microbatches=1"], r"dist.pp_schedule=1f1b needs at least 2 micro-batches"),
    (["dist.pp_microbatches=3"], r"train.batch_size=8 does not divide into dist.pp_microbatches=3"),
    (["dist.pp_schedule=interleaved_1f1b"], r"needs dist.pp_stages_per_rank of 2 or more"),
    (["dist.pp_schedule=zbv"], r"dist.pp_schedule=zbv runs two stages per rank in a V"),
    (["dist.pp_stages_per_rank=2"], r"dist.pp_schedule=1f1b runs one stage per rank"),
    (["dist.pp_schedule=dualpipev", "dist.pp_stages_per_rank=2", "dist.pp_microbatches=2"],
     r"needs at least 4 micro-batches"),
    (["+trick=async_smoothed_loss"], r"replaces the transform_loss seam"),
])
def test_a_pipeline_that_cannot_run_is_refused_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        compose_config(*TINY, "dist.pp=2", *overrides)


@pytest.mark.parametrize("overrides, world, expected", [
    ({"pp": 2}, 2, MeshShape(pp=2)),
    ({"pp": 2}, 4, MeshShape(2, 1, 1, 2)),  # the replicas take the rest of each stage's ranks
    ({"pp": 2, "dp_shard": 2, "ep": 2}, 4, MeshShape(1, 2, 2, 2)),
    ({"pp": 2, "dp_replicate": 2, "dp_shard": 2}, 8, MeshShape(2, 2, 1, 2)),
])
def test_data_and_expert_parallelism_fill_each_stage(overrides, world, expected):
    shape = resolve_mesh(DistConfig(**overrides), world, world, n_routed_experts=4)
    assert shape == expected and shape.world_size == world and shape.data_parallel_size == world // 2


def test_a_stage_mesh_that_does_not_multiply_out_names_the_stage_size():
    with pytest.raises(UserError, match=r"^dist.dp_replicate=1 x dist.dp_shard=4 = 4 ranks, but the stage size "
                                        r"\(world size / dist.pp=2\) is 2$"):
        resolve_mesh(DistConfig(pp=2, dp_replicate=1, dp_shard=4), 4, 4, n_routed_experts=4)


@pytest.mark.parametrize("user", ["model.tie_embeddings=true", "model.n_mtp_layers=1"])
def test_a_v_whose_ends_share_the_embedding_is_refused_with_sharded_stages(user):
    config = compose_config(*TINY, "dist.pp=2", "dist.pp_schedule=zbv", "dist.pp_stages_per_rank=2", user)
    check_pipeline_mesh(config, MeshShape(pp=2))  # one rank per stage: both ends hold it on rank 0
    with pytest.raises(UserError, match=rf"^{user} with dist.pp_schedule=zbv and data parallelism in the stages"):
        check_pipeline_mesh(config, MeshShape(1, 2, 1, 2))


def test_the_cli_refuses_a_pipeline_on_the_wrong_world_before_starting(tmp_path):
    result = run_cli(*TINY, "dist.pp=2", "dist.nproc_per_node=3", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2
    assert "dist.pp=2 must divide the world size 3 (each pipeline stage gets world / pp ranks)" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run" / "checkpoints").exists()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    model, _ = load_model(latest)
    return model.state_dict()


def run_pipeline(tmp_path: Path, name: str, *overrides: str, steps: int = 20, ranks: int = 2) -> Path:
    run_dir = tmp_path / name
    result = torchrun(f"--nproc_per_node={ranks}", "-m", "ciuic_train", *TINY, f"train.max_steps={steps}",
                      "train.log_every=1", "dist.pp=2", *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path,
                      timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def run_one_process(tmp_path: Path, name: str, micro_batches: int, *overrides: str, data_shares: int = 1) -> Path:
    """One process at the pipeline's global batch (`data_shares` x 8 windows), in micro-batches
    of the pipeline's size, 20 steps: trained in this test's process (tests/train_layouts.py)."""
    own = [f"train.batch_size={8 // micro_batches}", f"train.grad_accum={micro_batches * data_shares}", *overrides]
    return train_here(tmp_path, {name: own}, *TINY, "train.max_steps=20", "train.log_every=1")[name]


# With data parallelism in the stages, each data rank takes a strided share of the windows,
# so a micro-batch holds other sequences than one process's: the balance loss here is the
# sequence-wise one (a mean over sequences, the same whatever the grouping), not TINY's
# batch-wise one (a statistic of each micro-batch).
SEQUENCE_BALANCE = ["model.aux_loss_alpha=0", "model.seq_aux_loss_alpha=0.01"]
MTP = ["model.n_mtp_layers=1"]
BF16_AND_CHECKPOINTING = ["precision=bf16", "activation_checkpointing=true"]
TRICKS_A_PIPELINE_HONOURS = ["chaotic_sampler", "constellation_init", "quantum_save", "warm_restart"]
TIME_FOLDED = [*SEQUENCE_BALANCE, "+trick=time_folded_accum", "train.grad_accum=2"]
# Every block a MoE block: one kind of block to compile (the compiled test; a 20-s shorter
# compile on 2 cores than with TINY's dense first block, which test_trainer compiles).
MOE_BLOCKS = ["model.n_dense_layers=0"]
# Every two-rank pipeline below that needs nothing of the CLI's (its log, its sample), by
# name: one launch trains them all (`two_rank_pipelines`), each as `run_pipeline` would.
# "pp" is the plain pipeline several tests compare with (saving changes no loss).
PIPELINES = {
    "pp": ["ckpt.every=10"],
    "pp_sequence_balance": [*SEQUENCE_BALANCE, "ckpt.every=10"],
    **{f"mtp_{schedule}": [f"dist.pp_schedule={schedule}", *MTP] for schedule in ("1f1b", "gpipe")},
    **{f"v_{schedule}": [f"dist.pp_schedule={schedule}", "dist.pp_stages_per_rank=2", *MTP]
       for schedule in ("interleaved_1f1b", "zbv", "dualpipev")},
    "bf16": BF16_AND_CHECKPOINTING,
    **{f"trick_{trick}": [f"+trick={trick}", "ckpt.every=5"] for trick in TRICKS_A_PIPELINE_HONOURS},
    "time_folded": TIME_FOLDED,
    "moe_blocks": MOE_BLOCKS,
}


def two_rank_pipelines(folder: Path) -> dict[str, Path]:
    """The run folder of each of PIPELINES, trained one after the other in one two-rank
    launch (tests/train_layouts.py): one start-up instead of one per pipeline."""
    return launch_layouts(folder, 2, PIPELINES, *TINY, "train.max_steps=20", "train.log_every=1", "dist.pp=2")


def assert_same_training(pipeline: Path, single: Path, balance_loss: str = "aux_loss") -> None:
    piped, alone = metrics(pipeline), metrics(single)
    assert len(piped) == len(alone) == 20
    for key in ("loss", balance_loss, "grad_norm", "moe_imbalance"):
        assert [m[key] for m in piped] == pytest.approx([m[key] for m in alone], abs=1e-4), key
    assert piped[-1]["val_loss"] == pytest.approx(alone[-1]["val_loss"], abs=1e-4)
    a, b = final_weights(pipeline), final_weights(single)
    assert a.keys() == b.keys()
    for name in a:  # the expert biases too: each stage balanced from the same counts
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)
    # The runs differ: a pipeline that trained nothing would fail above, not here.
    assert metrics(pipeline)[-1]["loss"] < metrics(pipeline)[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_pipeline_with_mtp_trains_as_one_process(made_once, schedule):
    pipeline = made_once(two_rank_pipelines)[f"mtp_{schedule}"]
    summary = json.loads((pipeline / "summary.json").read_text())
    assert summary["mesh"]["pp"] == 2 and summary["world_size"] == 2
    assert_same_training(pipeline, made_once(run_one_process, "one", 2, *MTP))
    assert "mtp_loss" in metrics(pipeline)[-1]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv", "dualpipev"])
def test_two_stages_per_rank_with_mtp_train_as_one_process(made_once, schedule):
    """In the V (zbv, dualpipev) the MTP depths sit on rank 0 with the embedding they look up,
    as DeepSeek placed them: both of rank 0's stages hold it, each for its own gradient."""
    pipeline = made_once(two_rank_pipelines)[f"v_{schedule}"]
    single = made_once(run_one_process, "one", 4, *MTP)
    assert_same_training(pipeline, single)
    assert metrics(pipeline)[-1]["mtp_loss"] == pytest.approx(metrics(single)[-1]["mtp_loss"], abs=1e-4)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_in_one_process_on_the_same_curve(tmp_path, made_once):
    """Saved with pp=2 at step 10, continued with pp=1: the pp=2 run's steps 11-20."""
    pipeline = made_once(two_rank_pipelines)["pp"]
    resumed = tmp_path / "resumed"
    shutil.copytree(pipeline, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000020")
    result = run_cli(*TINY, "train.max_steps=20", "train.log_every=1", "train.batch_size=4",
                     "train.grad_accum=2", "resume=auto", f"hydra.run.dir={resumed}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    later = [m for m in metrics(pipeline) if m["step"] > 10]
    again = metrics(resumed)[-10:]
    assert [m["step"] for m in again] == list(range(11, 21))
    assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in later], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout, mesh", [
    (["dist.dp_shard=2", "dist.ep=2"], {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "ep": 2}),
    (["dist.dp_replicate=2"], {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "ep": 1}),
], ids=["fsdp2_ep2", "replicas"])
def test_a_pipeline_of_data_parallel_stages_trains_as_one_process(tmp_path, made_once, layout, mesh):
    """pp=2 on 4 ranks, 1f1b with MTP, each stage's two ranks splitting the data: FSDP2 with
    the experts split over them (the MTP's embedding copy sharded too), or replicas (FSDP2's
    HSDP with one shard)."""
    model = [*SEQUENCE_BALANCE, *MTP]
    pipeline = run_pipeline(tmp_path, "pp_dp", *model, *layout, "sample.max_new_tokens=8", ranks=4)
    summary = json.loads((pipeline / "summary.json").read_text())
    assert summary["mesh"] == mesh and summary["world_size"] == 4
    # --plan's figure for pipeline rank 0 is what rank 0 stores.
    planned = plan_figures(compose_config(*TINY, *model, "dist.pp=2", *layout, "dist.nproc_per_node=4"))
    assert planned["pipeline"]["ranks"][0]["memory"]["params"] == summary["param_bytes_per_rank"]
    # ... and its tokens per step and micro-batches are what the run trains (the stages share their data).
    assert summary["tokens_per_step"] == planned["tokens_per_step"] == 2 * 8 * 64
    micro = planned["pipeline"]
    assert f" {micro['microbatches']} micro-batches of {micro['micro_batch_size']});" in (pipeline / "train.log").read_text()
    one = made_once(run_one_process, "one", 2, *model, data_shares=2)
    assert_same_training(pipeline, one, "seq_aux_loss")
    # The one process reads the same tokens per step, in 4 micro-batches of 4 windows.
    assert json.loads((one / "summary.json").read_text())["tokens_per_step"] == summary["tokens_per_step"] == \
        plan_figures(compose_config(*TINY, *model, "train.batch_size=4", "train.grad_accum=4"))["tokens_per_step"]
    assert (pipeline / "train.log").read_text().count("sample: ") == 1  # gathered from the stages


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_with_sharded_stages_on_the_same_curve(tmp_path, made_once):
    """Saved with pp=2 at step 10, continued with pp=2 x dp_shard=2 on 4 ranks at the same
    global batch (4 windows per data rank): the pp=2 run's steps 11-20."""
    pipeline = made_once(two_rank_pipelines)["pp_sequence_balance"]
    resumed = tmp_path / "resumed"
    shutil.copytree(pipeline, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000020")
    run_pipeline(tmp_path, "resumed", *SEQUENCE_BALANCE, "train.batch_size=4", "dist.dp_shard=2", "resume=auto",
                 ranks=4)
    later = [m for m in metrics(pipeline) if m["step"] > 10]
    again = metrics(resumed)[-10:]
    assert [m["step"] for m in again] == list(range(11, 21))
    for key in ("loss", "seq_aux_loss", "grad_norm"):
        assert [m[key] for m in again] == pytest.approx([m[key] for m in later], abs=1e-5), key
    assert again[-1]["val_loss"] == pytest.approx(later[-1]["val_loss"], abs=1e-5)


@pytest.mark.slow
def test_a_nan_on_a_stage_without_the_loss_stops_every_rank_with_one_line(tmp_path):
    """Rank 0 (the first stage) sends NaN activations in step 5: both stages stop at that
    step, in one line, status 3, with the last good checkpoint named."""
    run_dir = tmp_path / "run"
    result = run_cli(*TINY, "train.max_steps=8", "ckpt.every=2", "dist.pp=2", "dist.nproc_per_node=2",
                     "fault.nan_rank=0", "fault.nan_at_step=5", "dist.timeout_s=60", f"hydra.run.dir={run_dir}",
                     cwd=tmp_path, timeout=240)
    assert result.returncode == 3, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert line.startswith("ciuic-train: error: training diverged at step 5: loss nan"), line
    assert f"last good checkpoint {run_dir / 'checkpoints' / 'step_000004'}" in line


@pytest.mark.slow
def test_a_killed_stage_restarts_and_ends_bit_identical(tmp_path, made_once):
    """Rank 1 (the last stage) SIGKILLs itself after step 13; torchrun restarts both ranks,
    which resume from step 10 and end with the uninterrupted run's weights, bit for bit."""
    whole = made_once(two_rank_pipelines)["pp"]
    killed = tmp_path / "killed"
    result = torchrun("--nproc_per_node=2", "--max-restarts=1", "-m", "ciuic_train", *TINY, "train.max_steps=20",
                      "train.log_every=1", "dist.pp=2", "ckpt.every=10", "fault.kill_rank=1", "fault.at_step=13",
                      f"hydra.run.dir={killed}", cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_000010")
    assert summary["param_checksum"] == json.loads((whole / "summary.json").read_text())["param_checksum"]
    assert [m["step"] for m in metrics(killed)] == list(range(1, 21))


@pytest.mark.slow
def test_bf16_and_activation_checkpointing_run_in_the_stages(tmp_path, made_once):
    """precision=bf16 with activation checkpointing: the stages run under autocast (the first
    steps equal one process's bf16 steps, and differ from the fp32 pipeline's), and bf16's
    rounding then keeps the curves within its noise."""
    pipeline = metrics(made_once(two_rank_pipelines)["bf16"])
    alone = metrics(run_one_process(tmp_path, "one", 2, *BF16_AND_CHECKPOINTING))
    fp32 = metrics(made_once(two_rank_pipelines)["pp"])  # checkpoints change no loss
    assert [m["loss"] for m in pipeline[:2]] == pytest.approx([m["loss"] for m in alone[:2]], abs=1e-6)
    assert abs(pipeline[0]["loss"] - fp32[0]["loss"]) > 1e-5  # autocast acted
    assert [m["loss"] for m in pipeline] == pytest.approx([m["loss"] for m in alone], abs=3e-3)


@pytest.mark.slow
@pytest.mark.parametrize("trick", TRICKS_A_PIPELINE_HONOURS)
def test_a_trick_a_pipeline_can_honour_trains_as_in_one_process(tmp_path, made_once, trick):
    """The tricks whose seams a pipeline keeps (the data order, the init, saving, the lr)
    give the pipeline the one-process curve; those replacing transform_loss or comm_hook
    are refused before anything starts (above)."""
    pipeline = made_once(two_rank_pipelines)[f"trick_{trick}"]
    alone = run_one_process(tmp_path, "one", 2, f"+trick={trick}", "ckpt.every=5")
    assert [m["loss"] for m in metrics(pipeline)] == pytest.approx([m["loss"] for m in metrics(alone)], abs=1e-4)
    saved = lambda run: sorted(p.name for p in (run / "checkpoints").glob("step_*"))  # noqa: E731
    assert saved(pipeline) == saved(alone)


@pytest.mark.slow
def test_time_folded_accumulation_weighs_a_pipelines_accumulated_steps(tmp_path, made_once):
    """time_folded_accum weighs the step's train.grad_accum micro-steps; under a pipeline each
    is a whole schedule run over the pipeline's micro-batches, so the one-process twin
    weighs the same windows in the same proportions: 8 windows per micro-step (in 2
    micro-batches of 4 in the pipeline; a sequence-wise balance loss, which does not see the
    grouping)."""
    piped = metrics(made_once(two_rank_pipelines)["time_folded"])
    single = metrics(run_one_process(tmp_path, "one", 1, *TIME_FOLDED))
    assert [m["loss"] for m in piped] == pytest.approx([m["loss"] for m in single], abs=1e-4)


@pytest.mark.slow
def test_compiled_blocks_in_the_stages_train_as_eager(tmp_path, made_once):
    """compile=true under 1f1b: each stage's blocks compiled (inductor, C++ on CPU; most of a
    minute on 2 cores, or a few seconds where test_trainer's compiled test has filled
    inductor's cache with the same MoE block), the curve and the final validation the eager
    pipeline's (the shared reference run)."""
    compiled_run = run_pipeline(tmp_path, "compiled", "compile=true", *MOE_BLOCKS)
    eager_run = made_once(two_rank_pipelines)["moe_blocks"]
    # Rank 0's stage ran dynamo's graphs; the eager run counts none.
    assert json.loads((compiled_run / "summary.json").read_text())["compiled_graphs"] > 0
    assert "compiled_graphs" not in json.loads((eager_run / "summary.json").read_text())
    compiled, eager = metrics(compiled_run), metrics(eager_run)
    assert [m["loss"] for m in compiled] == pytest.approx([m["loss"] for m in eager], abs=1e-4)
    assert [m["grad_norm"] for m in compiled] == pytest.approx([m["grad_norm"] for m in eager], rel=1e-3)
    assert compiled[-1]["val_loss"] == pytest.approx(eager[-1]["val_loss"], abs=1e-4)
