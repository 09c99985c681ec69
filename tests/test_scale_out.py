"""The device mesh: its checks, and real runs of FSDP, HSDP and expert parallelism (gloo, CPU).

Every layout must train the same model as one process does with the same global batch:
ranks take strided shares of each epoch, so 2 ranks of batch 4 (or 4 of batch 2) see the
one-process batch of 8. The runs share module-scoped fixtures: each costs 5-15 s here.
"""

import json
from pathlib import Path

import pytest
import torch

from conftest import compose_config, run_cli, torchrun, write_text_corpus
from train_layouts import launch_layouts, train_here
from ciuic_train.tools.export import export_model
from ciuic_train.checkpoint.resume import check_resumable
from ciuic_train.config import DistConfig, Strategy
from ciuic_train.errors import UserError
from ciuic_train.distributed.mesh import MeshShape, resolve_mesh

STEPS = 20
# With one multi-token-prediction depth: a sharded unit of its own, with its own MoE layer.
COMMON = [
    "model=tiny", "model.n_mtp_layers=1", "train.seq_len=64", "train.eval_windows=16", "sample.max_new_tokens=0", "progress=plain",
    f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=10", "ckpt.every=10",
]


# --- The mesh a configuration asks for -------------------------------------------------------


@pytest.mark.parametrize("overrides, world, local, expected", [
    ({}, 1, 1, MeshShape(1, 1, 1)),
    ({}, 4, 4, MeshShape(4, 1, 1)),  # the default: DDP over every rank
    ({"strategy": Strategy.fsdp}, 4, 4, MeshShape(1, 4, 1)),
    ({"dp_shard": -1}, 4, 4, MeshShape(1, 4, 1)),
    ({"dp_shard": 2}, 4, 4, MeshShape(2, 2, 1)),  # HSDP: the replicas take the rest
    ({"dp_replicate": 2, "dp_shard": -1}, 8, 8, MeshShape(2, 4, 1)),
    ({"strategy": Strategy.hsdp}, 16, 8, MeshShape(2, 8, 1)),  # shard within a node
    ({"dp_shard": 2, "ep": 2}, 2, 2, MeshShape(1, 2, 2)),
    ({"dp_shard": 4, "ep": -1}, 8, 4, MeshShape(2, 4, 4)),
    ({"strategy": Strategy.fsdp, "ep": 2}, 4, 4, MeshShape(1, 4, 2)),
])
def test_the_mesh_follows_the_config(overrides, world, local, expected):
    shape = resolve_mesh(DistConfig(**overrides), world, local, n_routed_experts=4)
    assert shape == expected and shape.world_size == world


@pytest.mark.parametrize("overrides, world, message", [
    ({"dp_replicate": 3}, 4, "dist.dp_replicate=3 x dist.dp_shard=1 = 3 ranks, but the world size is 4"),
    ({"dp_shard": 3}, 4, "dist.dp_shard=3 must divide the world size 4"),
    ({"ep": 2}, 2, "dist.ep=2 must divide dist.dp_shard=1 (expert-parallel ranks are shard ranks)"),
    ({"dp_shard": 4, "ep": 8}, 4, "dist.ep=8 must divide dist.dp_shard=4"),
    ({"dp_shard": 8, "ep": 8}, 8, "dist.ep=8 must divide model.n_routed_experts=4"),
    ({"strategy": Strategy.ddp, "dp_shard": 2}, 4, "dist.strategy=ddp replicates only"),
    ({"strategy": Strategy.fsdp, "dp_replicate": 2}, 4, "dist.strategy=fsdp shards only"),
    ({"strategy": Strategy.none}, 2, "dist.strategy=none with world size 2"),
])
def test_a_wrong_mesh_is_one_line_naming_the_numbers(overrides, world, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        resolve_mesh(DistConfig(**overrides), world, world, n_routed_experts=4)


@pytest.mark.parametrize("override, message", [
    ("dist.dp_shard=0", "dist.dp_shard=0 must be a positive number of ranks, or -1 for the rest"),
    ("dist.ep=-2", "dist.ep=-2 must be a positive number of ranks, or -1 for the rest"),
    ("dist.pp=0", "dist.pp=0 must be at least 1 (1: no pipeline)"),
])
def test_a_size_no_world_could_take_is_refused_with_the_config(override, message):
    """`check_dist` holds the rules that need no world size; `resolve_mesh` only the arithmetic."""
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        compose_config("model=tiny", override)


def test_the_cli_refuses_a_wrong_mesh_before_anything_starts(tmp_path):
    result = run_cli("model=tiny", "dist.nproc_per_node=4", "dist.dp_shard=2", "dist.ep=4",
                     f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ciuic-train: error: dist.ep=4 must divide dist.dp_shard=2 (expert-parallel ranks are shard ranks); "
        "e.g. dist.dp_shard=4 dist.ep=4"
    ]
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_resumes_on_another_world_only_where_its_state_reshards():
    model = {"dim": 64}
    meta = {"model": model, "tricks": [], "world_size": 2, "data": {"epoch": 0, "windows": 80}}
    for world in (1, 4, 8, 16):
        check_resumable(meta, {"model": model, "tricks": [], "world_size": world}, False)
    with pytest.raises(UserError, match="the 80 windows consumed in its epoch do not split evenly over 3 ranks"):
        check_resumable(meta, {"model": model, "tricks": [], "world_size": 3}, False)
    with pytest.raises(UserError, match=r"the state of its tricks \(chaotic_sampler\) is per rank"):
        check_resumable({**meta, "tricks": ["chaotic_sampler"]},
                        {"model": model, "tricks": ["chaotic_sampler"], "world_size": 4}, False)
    with pytest.raises(UserError, match="model.dim is 64 there, 32 now"):
        check_resumable(meta, {"model": {"dim": 32}, "tricks": [], "world_size": 4}, False)


# --- Real runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with a small text corpus, shared by this module's runs."""
    root = tmp_path_factory.mktemp("scale_out")
    write_text_corpus(root / "corpus")
    return root


def data_args(workdir: Path) -> list[str]:
    return ["data=text", f"data.path={workdir / 'corpus'}", f"data.cache_dir={workdir / 'cache'}"]


def train(workdir: Path, name: str, ranks: int, batch_size: int, *extra: str, launcher: tuple = ()) -> Path:
    """`ciuic-train` on `ranks` ranks under torchrun."""
    run_dir = workdir / name
    args = [*COMMON, *data_args(workdir), f"train.batch_size={batch_size}", f"hydra.run.dir={run_dir}", *extra]
    result = torchrun(f"--nproc_per_node={ranks}", *launcher, "-m", "ciuic_train", *args, cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def val_losses(lines: list[dict]) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in lines if "val_loss" in m}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(run_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = export_model(run_dir / "checkpoints" / f"step_{STEPS:06d}", tmp / f"{run_dir.name}.pt")
    return torch.load(out, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def single(workdir) -> Path:
    """One process with the global batch, trained in this one (tests/train_layouts.py)."""
    return train_here(workdir, {"single": ["train.batch_size=8"]}, *COMMON, *data_args(workdir))["single"]


@pytest.fixture(scope="module")
def expert_parallel(workdir) -> Path:
    """2 ranks, each holding 2 of the 4 experts; it also samples, so generation must work under EP."""
    return train(workdir, "ep2", 2, 4, "dist.dp_shard=2", "dist.ep=2", "sample.max_new_tokens=16")


def assert_same_training(run_dir: Path, single: Path, tmp: Path) -> None:
    ours, reference = metrics(run_dir), metrics(single)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    # README and docs/distributed.md state these tolerances (measured: under 1e-6).
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in reference], rel=0, abs=1e-5)
    assert [m["mtp_loss"] for m in ours] == pytest.approx([m["mtp_loss"] for m in reference], rel=0, abs=1e-5)
    # The same validation windows for every layout (train.eval_windows), whatever the batch size.
    assert val_losses(ours) == pytest.approx(val_losses(reference), rel=1e-5) and len(val_losses(ours)) == 2
    # The global per-expert token counts drive the balancing bias and the imbalance figure.
    assert [m["moe_imbalance"] for m in ours] == [m["moe_imbalance"] for m in reference]
    weights, expected = final_weights(run_dir, tmp), final_weights(single, tmp)
    assert weights.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_expert_parallel_on_two_ranks_trains_as_one_process(expert_parallel, single, tmp_path):
    assert_same_training(expert_parallel, single, tmp_path)
    ours, reference = summary(expert_parallel), summary(single)
    assert ours["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "ep": 2} and ours["strategy"] == "fsdp"
    # Each rank stores half of the experts (and no more of them while it computes).
    assert ours["param_bytes_per_rank"]["experts"] * 2 == reference["param_bytes_per_rank"]["experts"]
    assert ours["n_params"] == reference["n_params"]
    assert (expert_parallel / "train.log").read_text().count("sample: ") == 1


@pytest.mark.slow
def test_blocking_token_exchanges_end_bit_identical_to_overlapped_ones(workdir, expert_parallel):
    """dist.ep_overlap=false: the shared experts wait for the exchanges instead of running
    beside them; every sum is the same, in the same order."""
    run_dir = train(workdir, "ep2_blocking", 2, 4, "dist.dp_shard=2", "dist.ep=2", "dist.ep_overlap=false",
                    "sample.max_new_tokens=16")  # fmt: skip
    assert summary(run_dir)["param_checksum"] == summary(expert_parallel)["param_checksum"]
    assert [m["loss"] for m in metrics(run_dir)] == [m["loss"] for m in metrics(expert_parallel)]


@pytest.fixture(scope="module")
def four_ranks(workdir, expert_parallel) -> dict[str, Path]:
    """The module's four-rank runs, one after the other in one launch (tests/train_layouts.py):
    HSDP with and without experts split, and the two-rank expert-parallel run resumed at step 10."""
    saved = expert_parallel / "checkpoints" / "step_000010"
    return launch_layouts(workdir, 4, {
        "hsdp_ep": ["dist.dp_replicate=2", "dist.dp_shard=2", "dist.ep=2"],
        "hsdp": ["dist.dp_replicate=2", "dist.dp_shard=2"],
        "resumed_four_ranks_ep": ["dist.dp_shard=2", "dist.ep=2", f"resume={saved}"],
    }, *COMMON, *data_args(workdir), "train.batch_size=2")


@pytest.mark.slow
def test_hsdp_with_expert_parallelism_on_four_ranks_trains_as_one_process(four_ranks, single, tmp_path):
    run_dir = four_ranks["hsdp_ep"]
    assert_same_training(run_dir, single, tmp_path)
    assert summary(run_dir)["strategy"] == "hsdp"
    assert summary(run_dir)["param_bytes_per_rank"]["experts"] * 2 == summary(single)["param_bytes_per_rank"]["experts"]


@pytest.mark.slow
def test_hsdp_on_four_ranks_trains_as_one_process(four_ranks, single, tmp_path):
    run_dir = four_ranks["hsdp"]
    assert_same_training(run_dir, single, tmp_path)
    assert summary(run_dir)["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "ep": 1}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_process", "four_ranks_ep"])
def test_a_checkpoint_resumes_on_another_layout_with_the_same_curve(workdir, expert_parallel, four_ranks, name):
    """Saved by 2 ranks with ep=2; continued by 1 process, or by 4 ranks (2 x ep=2, in `four_ranks`)."""
    saved = expert_parallel / "checkpoints" / "step_000010"
    if name == "one_process":
        run_dir = train_here(workdir, {"resumed_one_process": ["train.batch_size=8", f"resume={saved}"]},
                             *COMMON, *data_args(workdir))["resumed_one_process"]
    else:
        run_dir = four_ranks[f"resumed_{name}"]
    assert summary(run_dir)["resumed_from"] == str(saved)
    resumed = {m["step"]: m["loss"] for m in metrics(run_dir)}
    uninterrupted = {m["step"]: m["loss"] for m in metrics(expert_parallel) if m["step"] > 10}
    assert resumed.keys() == uninterrupted.keys()
    assert list(resumed.values()) == pytest.approx(list(uninterrupted.values()), rel=1e-5)
    assert val_losses(metrics(run_dir)) == pytest.approx(
        {step: v for step, v in val_losses(metrics(expert_parallel)).items() if step > 10}, rel=1e-5
    )


@pytest.mark.slow
def test_a_killed_rank_under_expert_parallelism_restarts_and_ends_bit_identical(workdir, expert_parallel):
    run_dir = train(
        workdir, "ep2_killed", 2, 4, "dist.dp_shard=2", "dist.ep=2", "sample.max_new_tokens=16",
        "fault.kill_rank=1", "fault.at_step=13", launcher=("--max-restarts=1",),
    )
    assert summary(run_dir)["resumed_from"].endswith("step_000010")
    assert summary(run_dir)["param_checksum"] == summary(expert_parallel)["param_checksum"]
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, STEPS + 1))

