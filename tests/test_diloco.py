"""DiLoCo across replica groups (`ft.sync=diloco`): the outer step, the fragments, the
schedule, the mistakes; then real processes (gloo, a real lighthouse, the CLI's launcher)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_refused, run_cli
from ciuic_train.ft.diloco import boundary_plan, outer_sgd_, split_fragments
from ciuic_train.model import Transformer
from ciuic_train.model.config import ModelConfig

TINY = ["model=tiny", "sample.max_new_tokens=0", "progress=plain", "dist.nproc_per_node=2", "ft.enabled=true"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_outer_step_is_torch_sgd_with_nesterov_momentum(momentum: float):
    torch.manual_seed(0)
    weight = torch.randn(5, 3)
    reference = weight.clone().requires_grad_(True)
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=momentum, nesterov=momentum > 0)
    buffer = torch.zeros_like(weight)
    for _ in range(4):
        grad = torch.randn(5, 3)
        reference.grad = grad.clone()
        sgd.step()
        outer_sgd_(weight, buffer, grad, 0.7, momentum)
        assert torch.equal(weight, reference.detach())


def test_fragments_are_consecutive_layers_and_hold_every_parameter_once():
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=2, n_dense_layers=1))
    fragments = split_fragments(model, 2)
    names = [name for fragment in fragments for name in fragment.names]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    first, last = fragments
    assert {n.split(".")[1] for n in first.names if n.startswith("layers.")} == {"0", "1"}
    assert {n.split(".")[1] for n in last.names if n.startswith("layers.")} == {"2", "3"}
    assert any(n.startswith("tok_embeddings.") for n in first.names)
    assert any(n.startswith("lm_head.") for n in last.names) and any(n.startswith("norm.") for n in last.names)
    # Layer 0 is dense: fragment 0 balances layer 1's experts, fragment 1 those of layers 2 and 3.
    moes = model.moe_layers()
    assert [b.data_ptr() for b in first.biases] == [moes[1].expert_bias.data_ptr()]
    assert [b.data_ptr() for b in last.biases] == [moes[i].expert_bias.data_ptr() for i in (2, 3)]
    # The anchors are copies of the weights, the outer momentum starts at zero.
    assert all(torch.equal(a, p) and a.data_ptr() != p.data_ptr() for a, p in zip(first.anchors, first.params))
    assert all(not m.any() for m in first.momenta)


def test_the_schedule_syncs_each_fragment_once_a_round_and_every_fragment_at_the_end():
    between, fragments, delay, max_steps = 3, 2, 1, 14
    plans = {step: boundary_plan(step, between, fragments, delay, max_steps) for step in range(max_steps + 1)}
    syncs = [(step, f) for step, plan in plans.items() for kind, f in plan if kind == "sync"]
    starts = [(step, f) for step, plan in plans.items() for kind, f in plan if kind == "start"]
    assert syncs[:4] == [(3, 0), (6, 1), (9, 0), (12, 1)]
    # Each exchange starts `delay` steps before its sync, none beyond the run's end.
    assert starts == [(2, 0), (5, 1), (8, 0), (11, 1)]
    assert plans[14] == [("sync", 0), ("sync", 1)]  # the end: every fragment
    assert boundary_plan(12, 3, 2, 0, 12) == [("sync", 1), ("sync", 0)]  # its own turn first
    assert boundary_plan(4, 4, 1, 0, 12) == [("sync", 0)] and boundary_plan(5, 4, 1, 0, 12) == []


@pytest.mark.parametrize(
    "args, expected",
    [
        (["ft.sync=diloco", "ft.sync_every=4", "ft.fragments=3"], "ft.fragments=3 must divide ft.sync_every=4"),
        (["ft.sync=diloco", "ft.sync_every=8", "ft.fragments=2", "ft.sync_delay=4"],
         "ft.sync_delay=4 must be between 0 and 3"),
        (["ft.sync=diloco", "ft.sync_every=8", "ft.fragments=4"], "ft.fragments=4 is more than the model's"),
        (["ft.sync=diloco", "ft.outer_momentum=1"], "ft.outer_momentum=1.0 must be at least 0 and below 1"),
        (["ft.sync=diloco", "ft.outer_lr=0"], "ft.outer_lr=0.0 must be positive"),
        (["ft.sync=diloco", "ft.merge_alpha=2"], "ft.merge_alpha=2.0 must be between 0 and 1"),
        (["ft.sync=sometimes"], "ft.sync"),
        (["optim.name=adam"], "optim.name='adam' is not an optimizer; choose one of adamw, sgd"),
    ],
)
def test_diloco_mistakes_get_one_line_and_start_nothing(tmp_path: Path, args, expected):
    run_dir = tmp_path / "run"
    result = run_cli(*TINY, *args, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=60)
    assert_refused(result, expected, run_dir)


def test_diloco_without_replica_groups_is_refused(tmp_path: Path):
    run_dir = tmp_path / "run"
    result = run_cli("model=tiny", "ft.sync=diloco", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=60)
    assert_refused(result, "ft.sync=diloco trains across replica groups: add ft.enabled=true", run_dir)


@pytest.mark.slow
def test_diloco_syncing_every_step_with_plain_outer_sgd_is_synchronous_training(tmp_path: Path):
    """H=1, outer lr 1, no outer momentum: the new weights are the mean of the groups'
    weights after one inner step. With an inner update linear in the gradient (SGD with
    momentum; no clipping, no balancing bias: both nonlinear) that is the update of the
    mean gradient, which 2 groups averaging gradients every step take."""
    common = [*TINY, "train.max_steps=10", "train.log_every=1", "train.eval_every=5", "optim=sgd", "train.lr=0.2",
              "train.grad_clip=0", "model.bias_update_rate=0", f"data.cache_dir={tmp_path / 'cache'}"]
    diloco, synchronous = tmp_path / "diloco", tmp_path / "sync"
    result = run_cli(*common, "ft.sync=diloco", "ft.sync_every=1", "ft.outer_lr=1", "ft.outer_momentum=0",
                     f"hydra.run.dir={diloco}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(*common, f"hydra.run.dir={synchronous}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    groups, reference = [metrics(diloco), metrics(diloco / "group_1")], metrics(synchronous)
    assert [r["step"] for r in reference] == list(range(1, 11))
    for step, (mine, theirs, ref) in enumerate(zip(*groups, reference), start=1):
        # DiLoCo logs each group's own loss; synchronous training their mean.
        assert (mine["loss"] + theirs["loss"]) / 2 == pytest.approx(ref["loss"], abs=1e-6), step
        assert mine["loss"] != theirs["loss"]  # the groups did read different data
        assert mine["syncs"] == theirs["syncs"] == step
        if "val_loss" in ref:
            assert mine["val_loss"] == theirs["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-6)


@pytest.mark.slow
def test_diloco_groups_drift_apart_between_syncs_agree_after_each_and_resume_exactly(tmp_path: Path):
    """H=4: every group evaluates the same validation windows, so equal val losses mean
    equal weights (and balancing biases): after steps 4, 8 and 12, not after 2, 6, 10.
    The checkpoint of step 8 holds the anchors and the outer momentum: with an inner
    optimizer that keeps no state (SGD without momentum), a restart of both groups from
    it ends bit for bit where the uninterrupted run did; without the outer momentum it
    would not (its first sync after the resume would apply plain SGD)."""
    run_dir, resumed = tmp_path / "run", tmp_path / "resumed"
    common = [*TINY, "train.max_steps=12", "train.log_every=1", "train.eval_every=2", "ft.sync=diloco",
              "ft.sync_every=4", "optim=sgd", "optim.momentum=0", "train.lr=0.2", f"data.cache_dir={tmp_path / 'cache'}"]
    result = run_cli(*common, "ckpt.every=8", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    groups = [metrics(run_dir), metrics(run_dir / "group_1")]
    val = [{r["step"]: r["val_loss"] for r in group if "val_loss" in r} for group in groups]
    assert sorted(val[0]) == [2, 4, 6, 8, 10, 12]
    for step in (2, 6, 10):
        assert val[0][step] != val[1][step], step
    for step in (4, 8, 12):
        assert val[0][step] == val[1][step], step
    assert [r["syncs"] for r in groups[0]] == [step // 4 for step in range(1, 13)]
    first, second = summary(run_dir), summary(run_dir / "group_1")
    assert first["param_checksum"] == second["param_checksum"]
    assert first["syncs"] == 3 and first["retried_syncs"] == 0 and first["checkpoint_saves"] == 2
    import torch.distributed.checkpoint as dcp

    step_8 = run_dir / "checkpoints" / "step_000008"
    saved = dcp.FileSystemReader(str(step_8)).read_metadata().state_dict_metadata
    assert any(key.startswith("ft.anchor.layers.0.") for key in saved)
    assert any(key.startswith("ft.outer_momentum.lm_head.") for key in saved)
    result = run_cli(*common, f"resume={step_8}", f"hydra.run.dir={resumed}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(resumed)["resumed_from"] == str(step_8) and summary(resumed)["steps"] == 12
    for group in (resumed, resumed / "group_1"):
        assert summary(group)["param_checksum"] == first["param_checksum"]


@pytest.mark.slow
def test_streaming_diloco_overlaps_each_fragment_and_ends_on_common_weights(tmp_path: Path):
    """2 fragments, one synced every 2 steps, each exchange overlapping 1 step: 7 steps
    end on a final sync of both, so the groups hold the same weights; a restart of
    everything resumes from the checkpoint with its anchors and trains on to 11."""
    run_dir = tmp_path / "run"
    common = [*TINY, "train.log_every=1", "train.eval_every=1000", "model.n_layers=2", "ft.sync=diloco",
              "ft.sync_every=4", "ft.fragments=2", "ft.sync_delay=1", f"data.cache_dir={tmp_path / 'cache'}",
              f"hydra.run.dir={run_dir}"]
    result = run_cli(*common, "train.max_steps=7", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = summary(run_dir), summary(run_dir / "group_1")
    assert first["syncs"] == second["syncs"] == 3 + 2  # after steps 2, 4, 6, and both at 7
    assert first["param_checksum"] == second["param_checksum"]
    result = run_cli(*common, "train.max_steps=11", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in (run_dir / "train.log").read_text()
    first, second = summary(run_dir), summary(run_dir / "group_1")
    assert first["steps"] == 11 and first["param_checksum"] == second["param_checksum"]


@pytest.mark.slow
def test_a_group_killed_under_diloco_leaves_the_other_training_and_heals_at_a_sync(tmp_path: Path):
    """Group 1 dies after step 20 and its torchrun restarts it; group 0 trains on alone,
    syncing with itself, 0.5 s a step while a sync has found it alone (`fault.slow_alone`:
    however long the restart takes); the restarted group waits for group 0's next sync,
    heals in it (no checkpoint read) and both end on the same weights."""
    run_dir = tmp_path / "run"
    result = run_cli(
        *TINY, "train.max_steps=120", "train.log_every=1", "train.eval_every=1000", "ft.sync=diloco",
        "ft.sync_every=4", "ft.timeout_s=2", "dist.max_restarts=1", "fault.kill_rank=1", "fault.at_step=20",
        "fault.slow_rank=0", "fault.slow_s=0.5", "fault.slow_alone=true", f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={run_dir}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    survivor = metrics(run_dir)
    steps = [r["step"] for r in survivor]
    assert steps == list(range(1, 121))  # no step redone, none lost
    assert any(r["participants"] == 1 for r in survivor) and survivor[-1]["participants"] == 2
    assert survivor[-1]["syncs"] == 30
    rejoined = run_dir / "group_1"
    log = (rejoined / "train.log").read_text()
    assert "received from a peer" in log and "resumed from" not in log
    mine, theirs = summary(run_dir), summary(rejoined)
    assert mine["param_checksum"] == theirs["param_checksum"]
    assert mine["retried_syncs"] == 0 and mine["longest_stall_s"] < 10
    back = [r["step"] for r in metrics(rejoined)]
    assert back[:20] == list(range(1, 21)) and back == sorted(set(back)) and back[20] % 4 == 1 and back[20] > 21
