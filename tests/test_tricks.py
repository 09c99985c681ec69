"""The tricks of TRICKS.md: their invariants, one process and real gloo processes."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ciuic_train.data.sampler import WindowSampler
from ciuic_train.errors import UserError
from ciuic_train.model import Transformer
from ciuic_train.model.init import ParameterInit
from ciuic_train.step.optim import LrSchedule
from ciuic_train.distributed.params import param_checksum
from ciuic_train.train.trainer import Trainer
from ciuic_train.tricks import CommHook, check_tricks, registry
from ciuic_train.tricks.async_smoothed_loss import AsyncSmoothedLoss
from ciuic_train.tricks.base import SEAMS, Trick, TrickContext, TrickSet
from ciuic_train.tricks.chaotic_sampler import ChaoticSampler
from ciuic_train.tricks.constellation_init import ConstellationInit
from ciuic_train.tricks.delayed_sync import DelayedSync
from ciuic_train.tricks.quantum_save import QuantumSave
from ciuic_train.tricks.time_folded_accum import TimeFoldedAccum
from ciuic_train.tricks.warm_restart import WarmRestart
from conftest import compose_config, run_cli, write_text_corpus
from train_layouts import launch_layouts

REPO = Path(__file__).parents[1]
ALL_TRICKS = sorted(registry())
TINY = ["model=tiny", "train.seq_len=64", "train.batch_size=4", "train.eval_windows=8", "sample.max_new_tokens=0"]


def ctx(rank=0, world=1, max_steps=100, grad_accum=1, seed=0):
    return TrickContext(seed, rank, world, max_steps, grad_accum)


def trainer_for(tmp_path, text_corpus, *overrides):
    config = compose_config(*TINY, "data=text", f"data.path={text_corpus}", f"data.cache_dir={tmp_path / 'cache'}", *overrides)
    return Trainer(config, tmp_path)


def test_every_trick_has_a_config_file_and_a_one_line_summary():
    assert ALL_TRICKS == [
        "async_smoothed_loss", "chaotic_sampler", "constellation_init", "delayed_sync",
        "quantum_save", "time_folded_accum", "warm_restart",
    ]
    assert sorted(p.stem for p in (REPO / "conf" / "trick").glob("*.yaml")) == ALL_TRICKS
    for name, cls in registry().items():
        assert cls.summary and "\n" not in cls.summary
        check_tricks({name: {}})


def typed(value):
    """A value with the type of every scalar in it, so that 10 and 10.0 differ."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return type(value).__name__, value


@pytest.mark.parametrize("name", ALL_TRICKS)
def test_a_trick_config_file_sets_exactly_its_params_defaults(name):
    """Hydra composes the YAML, while --list-tricks and parameter checks read `Params`:
    the defaults are written in both places, so they must agree field for field."""
    path = REPO / "conf" / "trick" / f"{name}.yaml"
    assert path.read_text().splitlines()[0] == f"# @package trick.{name}"
    in_yaml = OmegaConf.to_container(OmegaConf.load(path))
    assert typed(in_yaml) == typed(dataclasses.asdict(registry()[name].Params()))


def test_a_trick_set_binds_each_seam_to_the_trick_claiming_it_else_to_the_default():
    assert not any(seam in vars(TrickSet) for seam in SEAMS)  # no forwarding method per seam
    tricks = [cls(ctx()) for cls in registry().values()]
    combined = TrickSet(tricks, ctx())
    for trick in tricks:
        for seam in trick.claimed_seams():
            bound = getattr(combined, seam)
            assert bound.__self__ is trick and bound.__func__ is getattr(type(trick), seam)
    restart = WarmRestart(ctx())
    one = TrickSet([restart], ctx())
    for seam in SEAMS:
        owner, method = (restart, WarmRestart.lr_at) if seam == "lr_at" else (one, getattr(Trick, seam))
        assert getattr(one, seam).__self__ is owner and getattr(one, seam).__func__ is method
    assert one.should_save(4, 2) and one.comm_hook() is None


def test_comm_hook_has_one_shape_on_a_trick_and_on_the_set():
    trick = DelayedSync(ctx())
    hook = trick.comm_hook()
    assert isinstance(hook, CommHook) and (hook.trick, hook.state) == ("delayed_sync", None) and callable(hook.hook)
    assert TrickSet([trick], ctx()).comm_hook() == hook


def test_the_tricks_package_imports_without_torch():
    """The CLI lists and checks tricks before any process starts; importing torch takes seconds."""
    code = (
        "import sys, ciuic_train.tricks as t; t.check_tricks({n: {} for n in t.registry()}); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_seven_tricks_claim_distinct_seams_so_all_combine():
    check_tricks({name: {} for name in ALL_TRICKS})
    claimed = [seam for name in ALL_TRICKS for seam in registry()[name].claimed_seams()]
    assert len(claimed) == len(set(claimed)) == len(ALL_TRICKS)


def test_conflicting_tricks_are_refused_at_compose_time(monkeypatch):
    class OtherSchedule(Trick):
        name = "other_schedule"

        def lr_at(self, step, schedule):
            return 1.0

    monkeypatch.setattr("ciuic_train.tricks.registry", lambda: {**registry.__wrapped__(), "other_schedule": OtherSchedule})
    with pytest.raises(UserError, match="both replace the lr_at seam"):
        compose_config("model=tiny", "+trick=warm_restart", "+trick.other_schedule={}")


# --- warm_restart ------------------------------------------------------------------------


def test_warm_restart_lr_is_the_formula_at_every_step():
    schedule = LrSchedule(peak=1.0, warmup_steps=10, total_steps=100, min_ratio=0.1)
    trick = WarmRestart(ctx(max_steps=100), WarmRestart.Params(at=[0.2, 50], factor=0.7))
    for step in range(100):
        if step < 20:
            expected = schedule(step)
        else:
            start, end = (20, 50) if step < 50 else (50, 100)
            expected = 0.1 + (0.7 - 0.1) * 0.5 * (1 + math.cos(math.pi * (step - start) / (end - start)))
        assert trick.lr_at(step, schedule) == pytest.approx(expected, abs=1e-12), step
    assert trick.lr_at(20, schedule) == pytest.approx(0.7) and trick.restarts_hit == 3  # 20, 50, 20 again


# --- chaotic_sampler ---------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_chaotic_sampler_permutes_shares_disjointly_and_completely(shuffle):
    n, world, per_rank = 101, 4, 25
    for epoch in range(7):
        plain, chaotic = [], []
        for rank in range(world):
            base = WindowSampler(n, 5, rank, world, shuffle=shuffle)
            trick = ChaoticSampler(ctx(rank, world))
            mixed = WindowSampler(n, 5, rank, world, order=trick.order_indices, shuffle=shuffle)
            for s in (base, mixed):
                s.load_state_dict({"epoch": epoch, "position": 0})
            share, reordered = base.next_indices(per_rank), mixed.next_indices(per_rank)
            chaos = (epoch + 3 * rank) % 7
            if chaos == 0:
                assert torch.equal(reordered, share.flip(0))
            elif chaos in (1, 3, 5):
                assert torch.equal(reordered, torch.cat([share[0::2], share[1::2]]))
            else:
                assert torch.equal(reordered, share)
            plain.append(share)
            chaotic.append(reordered)
        assert sorted(torch.cat(chaotic).tolist()) == sorted(torch.cat(plain).tolist())
        assert len(set(torch.cat(chaotic).tolist())) == world * per_rank


def test_chaotic_sampler_resumes_mid_epoch():
    first = WindowSampler(50, 1, 1, 2, order=ChaoticSampler(ctx(1, 2)).order_indices)
    first.next_indices(7)
    state = first.state_dict()
    expected = first.next_indices(30)
    resumed = WindowSampler(50, 1, 1, 2, order=ChaoticSampler(ctx(1, 2)).order_indices)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_indices(30), expected)


# --- constellation_init ------------------------------------------------------------------


def test_constellation_init_keeps_the_global_rng_and_gives_same_shape_layers_different_weights():
    model = Transformer(compose_config("model=tiny").model)
    rng_before = torch.get_rng_state()
    ConstellationInit(ctx()).init_weights(model, ParameterInit(0))
    assert torch.equal(torch.get_rng_state(), rng_before)
    a, b = model.layers[0].attn.wkv_b.weight, model.layers[1].attn.wkv_b.weight
    assert a.shape == b.shape and not torch.equal(a, b)


def test_constellation_init_is_the_same_for_every_rank_and_world_size():
    weights = []
    for rank, world in ((0, 1), (1, 2), (3, 8)):
        torch.manual_seed(rank)  # a different global RNG must not matter either
        model = Transformer(compose_config("model=tiny").model)
        ConstellationInit(ctx(rank, world)).init_weights(model, ParameterInit(0))
        weights.append(model.lm_head.weight.clone())
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[0], weights[2])


def test_constellation_init_modulates_xavier_columns_by_one_percent():
    model = Transformer(compose_config("model=tiny").model)
    ConstellationInit(ctx()).init_weights(model, ParameterInit(0))
    plain = Transformer(compose_config("model=tiny").model)
    ConstellationInit(ctx(), ConstellationInit.Params(modulation=0.0)).init_weights(plain, ParameterInit(0))
    ratio = model.lm_head.weight / plain.lm_head.weight
    expected = 1 + 0.01 * torch.sin(torch.linspace(0, 2 * math.pi, ratio.shape[1]))
    torch.testing.assert_close(ratio, expected.expand_as(ratio), rtol=1e-5, atol=1e-6)
    # Unmodulated, the columns are Xavier-uniform: U(-b, b), b = sqrt(6 / (fan_in + fan_out)),
    # whose standard deviation is b / sqrt(3), its extremes near b (tens of thousands of draws).
    bound = math.sqrt(6 / sum(plain.lm_head.weight.shape))
    assert 0.99 * bound < plain.lm_head.weight.abs().max() <= bound
    assert plain.lm_head.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)


# --- time_folded_accum -------------------------------------------------------------------


def test_time_folded_weights_are_positive_normalised_and_follow_the_sine():
    trick = TimeFoldedAccum(ctx(grad_accum=4))
    seen = []
    for step in range(50):
        weights = trick.micro_batch_weights(step, 4)
        assert sum(weights) == pytest.approx(1.0) and min(weights) > 0
        seen.extend(weights)
    assert max(seen) / min(seen) > 1.5  # the sine actually varies the weights
    raw = [max(0.1, 0.5 + 0.5 * math.sin((7 * 4 + i) / 10)) for i in range(4)]
    assert trick.micro_batch_weights(7, 4) == pytest.approx([w / sum(raw) for w in raw])
    equal = TimeFoldedAccum(ctx(grad_accum=4), TimeFoldedAccum.Params(amplitude=0.0))
    assert equal.micro_batch_weights(3, 4) == [0.25] * 4


# --- async_smoothed_loss -----------------------------------------------------------------


def test_async_smoothed_loss_reports_the_ema_with_raw_gradients_and_keeps_no_graph():
    trick = AsyncSmoothedLoss(ctx(), AsyncSmoothedLoss.Params(every=1, decay=0.5, start_step=2))
    weight = torch.tensor(2.0, requires_grad=True)
    reported = []
    for step, value in enumerate([4.0, 2.0, 6.0, 1.0]):
        raw = weight * value
        out = trick.transform_loss(raw, step)
        out.backward()
        assert weight.grad.item() == value  # d(raw)/d(weight), untouched by the smoothing
        weight.grad = None
        reported.append(out.item())
        assert trick._pending[1].grad_fn is None and not trick._pending[1].requires_grad
    # Reduced losses arrive one step late: EMA after steps 0, 1 = 8, 0.5*8 + 0.5*4 = 6; then 0.5*6 + 0.5*12 = 9.
    assert reported == [8.0, 4.0, 6.0, 9.0]


# --- quantum_save ------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1e-3, 0.3])
def test_quantum_save_never_skips_more_than_max_skips_and_is_deterministic(p):
    params = QuantumSave.Params(p=p, max_skips=3)
    first, second = QuantumSave(ctx(), params), QuantumSave(ctx(), params)
    decisions = [first.should_save(step, 10) for step in range(1, 5001)]
    assert decisions == [second.should_save(step, 10) for step in range(1, 5001)]
    candidates = [d for step, d in zip(range(1, 5001), decisions) if step % 10 == 0]
    assert not any(d for step, d in zip(range(1, 5001), decisions) if step % 10)
    gaps, run = [], 0
    for saved in candidates:
        run = 0 if saved else run + 1
        gaps.append(run)
    assert max(gaps) == first.longest_gap <= 3
    rate = sum(candidates) / len(candidates)
    assert rate == pytest.approx(0.25, abs=0.01) if p < 0.01 else 0.35 < rate < 0.55
    assert first.metrics() == {"candidates": 500, "saves": sum(candidates), "longest_gap": max(gaps)}


# --- bitwise: a trick switched off by its parameters is the baseline ----------------------

NEUTRAL = {
    "warm_restart": ["trick.warm_restart.at=[]"],
    "async_smoothed_loss": ["trick.async_smoothed_loss.start_step=1000"],
    "delayed_sync": ["trick.delayed_sync.max_delay_s=0"],
    "time_folded_accum": ["trick.time_folded_accum.amplitude=0"],
    "quantum_save": ["trick.quantum_save.p=1"],
}
NO_NEUTRAL_SETTING = {
    "chaotic_sampler": "its job is a re-ordering; every setting reorders some epoch",
    "constellation_init": "its job is a different init; no setting gives the model's own",
}


@pytest.mark.parametrize("name", ALL_TRICKS)
def test_a_trick_switched_off_by_its_parameters_is_bitwise_the_baseline(tmp_path, text_corpus, name):
    if name in NO_NEUTRAL_SETTING:
        pytest.skip(f"{name} has no neutral setting: {NO_NEUTRAL_SETTING[name]}")
    common = ["train.grad_accum=2", "train.max_steps=4", "ckpt.every=2", "train.log_every=1"]
    runs = {}
    for label, extra in (("baseline", []), ("trick", [f"+trick={name}", *NEUTRAL[name]])):
        (tmp_path / label).mkdir()
        summary = trainer_for(tmp_path / label, text_corpus, *common, *extra).fit()
        losses = [json.loads(line)["loss"] for line in (tmp_path / label / "metrics.jsonl").read_text().splitlines()]
        checkpoints = sorted(p.name for p in (tmp_path / label / "checkpoints").iterdir())
        runs[label] = (losses, summary["param_checksum"], checkpoints)
    assert runs["trick"] == runs["baseline"]


@pytest.mark.parametrize("name", ALL_TRICKS)
def test_a_trick_leaves_init_and_data_order_alone_unless_that_is_its_job(tmp_path, text_corpus, name):
    baseline = trainer_for(tmp_path / "b", text_corpus)
    trainer = trainer_for(tmp_path / "t", text_corpus, f"+trick={name}")
    same_init = param_checksum(trainer.model) == param_checksum(baseline.model)
    same_order = torch.equal(trainer.windows.sampler.next_indices(64), baseline.windows.sampler.next_indices(64))
    assert same_init == (name != "constellation_init")
    assert same_order == (name != "chaotic_sampler")


def test_summary_lists_tricks_with_resolved_parameters(tmp_path, text_corpus):
    trainer = trainer_for(tmp_path, text_corpus, "+trick=[warm_restart,time_folded_accum]",
                          "trick.warm_restart.factor=0.5", "train.max_steps=2", "train.grad_accum=2")
    summary = trainer.fit()
    assert summary["tricks"] == ["time_folded_accum", "warm_restart"]
    assert summary["trick_params"]["warm_restart"] == {"at": [0.2, 0.4, 0.7], "factor": 0.5}
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert "time_folded_accum/min_weight" in record and "warm_restart/restarts_hit" in record


# --- real processes ----------------------------------------------------------------------


DDP_STEPS = ["train.max_steps=6", "train.grad_accum=2", "train.log_every=2"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict[str, Path]:
    """The module's two-rank DDP runs, one after the other in one launch (tests/train_layouts.py)."""
    folder = tmp_path_factory.mktemp("ddp")
    corpus = write_text_corpus(folder / "corpus")
    return launch_layouts(folder, 2, {
        "base": DDP_STEPS,
        "neutral_tricks": [
            *DDP_STEPS, "+trick=[delayed_sync,async_smoothed_loss,time_folded_accum]",
            "trick.delayed_sync.max_delay_s=0.05", "trick.delayed_sync.exempt_ranks=[1]",
            "trick.async_smoothed_loss.every=1", "trick.async_smoothed_loss.start_step=2",
            "trick.time_folded_accum.amplitude=0",
        ],
        "combined": [
            "+trick=[warm_restart,chaotic_sampler,constellation_init,time_folded_accum]", "train.grad_accum=2",
            "train.max_steps=10", "train.log_every=1", "train.warmup_steps=2", "data.shuffle=false",
        ],
        **{f"alone_{trick}": [f"+trick={trick}", "train.max_steps=3", "train.grad_accum=2"] for trick in ALL_TRICKS},
    }, *TINY, "data=text", f"data.path={corpus}", f"data.cache_dir={folder / 'cache'}", "progress=plain")


@pytest.mark.slow
def test_gradient_neutral_tricks_under_ddp_end_bit_identical_to_the_baseline(ddp_runs):
    """delayed_sync (a comm hook that sleeps), async_smoothed_loss (straight-through) and
    time_folded_accum with equal weights must leave every gradient, hence the weights, unchanged."""
    base = json.loads((ddp_runs["base"] / "summary.json").read_text())
    summary = json.loads((ddp_runs["neutral_tricks"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["tricks"]) == 3
    assert summary["param_checksum"] == base["param_checksum"]
    last = json.loads((ddp_runs["neutral_tricks"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < last["delayed_sync/slept_s"] <= 6 * 0.05 and last["delayed_sync/sleeps"] == 6
    assert last["async_smoothed_loss/reductions"] == 6 and last["loss"] != last["async_smoothed_loss/raw_loss"]


@pytest.mark.slow
def test_tricks_that_change_training_combine_under_ddp(ddp_runs):
    records = [json.loads(line) for line in (ddp_runs["combined"] / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((ddp_runs["combined"] / "summary.json").read_text())["world_size"] == 2
    schedule = LrSchedule(2e-3, 2, 10, 0.1)
    trick = WarmRestart(ctx(max_steps=10))
    assert [r["lr"] for r in records] == pytest.approx([trick.lr_at(s, schedule) for s in range(10)])
    assert records[-1]["warm_restart/restarts_hit"] == 3


@pytest.mark.slow
def test_each_trick_alone_trains_on_two_ranks(ddp_runs):
    """Each trick under DDP (in `ddp_runs`' launch). A sweep over the tricks is
    test_glob_sweeps_every_trick_alone_in_one_process's; a sweep whose every job runs on
    two processes, tests/test_distributed.py's."""
    for trick in ALL_TRICKS:
        summary = json.loads((ddp_runs[f"alone_{trick}"] / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["tricks"] == [trick] and summary["steps"] == 3


@pytest.mark.parametrize("mesh, strategy", [
    (["dist.strategy=fsdp"], "fsdp"),
    (["dist.dp_shard=2", "dist.ep=2"], "fsdp"),
    (["dist.nproc_per_node=4", "dist.dp_shard=2"], "hsdp"),
])
def test_a_comm_hook_trick_under_fsdp_is_a_clear_error(tmp_path, text_corpus, mesh, strategy):
    result = run_cli(
        "+trick=delayed_sync", "dist.nproc_per_node=2", *mesh, *TINY, "data=text",
        f"data.path={text_corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    message = f"trick delayed_sync needs DDP's communication hook, which dist.strategy={strategy} does not have"
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_comm_hook_trick_is_allowed_with_replicas_only():
    """The check the CLI and `parallelize` share: DDP has the hook, any sharded mesh not."""
    from ciuic_train.errors import UserError
    from ciuic_train.distributed.mesh import MeshShape, refuse_comm_hook

    refuse_comm_hook("delayed_sync", MeshShape(2, 1, 1))  # DDP: fine
    with pytest.raises(UserError, match="dist.strategy=hsdp does not have"):
        refuse_comm_hook("delayed_sync", MeshShape(2, 2, 1))


def test_glob_sweeps_every_trick_alone_in_one_process(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_cli("-m", "+trick=glob(*)", "model=tiny", "train.max_steps=5", "sample.max_new_tokens=0",
                     "train.eval_windows=8", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/summary.json"))]
    assert sorted(s["tricks"][0] for s in summaries) == ALL_TRICKS and len(summaries) == 7
