"""The training loop, its schedule and optimizer, and the seams tricks plug into."""

import json
import math
import re
from dataclasses import dataclass

import pytest
import torch

from ciuic_train.config import Device, Precision
from ciuic_train.errors import UserError
from ciuic_train.model import Transformer
from ciuic_train.config import DecayShape, Schedule
from ciuic_train.train.throughput import Throughput
from ciuic_train.train.metrics import format_step
from ciuic_train.step.optim import LrSchedule, build_optimizer
from ciuic_train.distributed.params import param_checksum
from ciuic_train.train.trainer import Trainer, resolve_device
from ciuic_train.tricks import Trick, TrickContext, TrickSet, build_tricks, check_tricks
from conftest import compose_config

CTX = TrickContext(seed=0, rank=0, world_size=1, max_steps=10, grad_accum=2)


def tiny_trainer(tmp_path, text_corpus, *overrides):
    config = compose_config(
        "model=tiny", "data=text", f"data.path={text_corpus}", f"data.cache_dir={tmp_path / 'cache'}",
        "train.seq_len=64", "train.batch_size=4", "train.eval_windows=8", *overrides,
    )
    return Trainer(config, tmp_path)


def test_warmup_cosine_shape():
    schedule = LrSchedule(peak=1.0, warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)
    values = [schedule(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("shape, at_half", [(DecayShape.cosine, 0.55), (DecayShape.linear, 0.55),
                                             (DecayShape.sqrt, 1 - 0.9 * 0.5 ** 0.5)])
def test_wsd_holds_the_peak_then_decays_over_its_fraction(shape, at_half):
    schedule = LrSchedule(peak=1.0, warmup_steps=10, total_steps=110, min_ratio=0.1, kind=Schedule.wsd,
                          decay_fraction=0.2, decay_shape=shape)
    assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
    assert schedule.decay_start == 88  # 110 - round(0.2 * 110)
    assert all(schedule(s) == 1.0 for s in range(10, 89))  # stable
    assert schedule(99) == pytest.approx(at_half)  # half way through the decay
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)
    values = [schedule(s) for s in range(88, 111)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_constant_schedule_and_the_config_reach_the_trainer(tmp_path, text_corpus):
    constant = LrSchedule(peak=2.0, warmup_steps=4, total_steps=50, min_ratio=0.1, kind=Schedule.constant)
    assert [constant(s) for s in (0, 3, 4, 49, 80)] == [0.5, 2.0, 2.0, 2.0, 2.0]
    cosine = LrSchedule(peak=1.0, warmup_steps=10, total_steps=110, min_ratio=0.1)
    # optim.decay_shape belongs to wsd: the cosine schedule stays the cosine whatever it says
    trainer = tiny_trainer(tmp_path, text_corpus, "optim.decay_shape=sqrt", "train.lr=1.0",
                           "train.warmup_steps=10", "train.max_steps=110")
    assert [trainer.lr_schedule(s) for s in range(120)] == [cosine(s) for s in range(120)]
    wsd = tiny_trainer(tmp_path, text_corpus, "optim.schedule=wsd", "optim.decay_fraction=0.5", "train.max_steps=20",
                       "train.warmup_steps=2")
    assert wsd.lr_schedule.kind is Schedule.wsd and wsd.lr_schedule.decay_start == 10


def test_the_deepseek_v3_preset_is_the_published_curve():
    """Report section 4.2: 2K warmup steps to 2.2e-4, constant until 10T of 14.8T tokens,
    then a cosine decay to 2.2e-5 (here one step per billion tokens)."""
    config = compose_config("optim=deepseek_v3", "train.max_steps=14800")
    schedule = LrSchedule.from_config(config.optim, config.train.lr, config.train.warmup_steps, 14800)
    assert (config.optim.beta1, config.optim.beta2, config.optim.weight_decay, config.train.grad_clip) == (
        0.9, 0.95, 0.1, 1.0)
    assert schedule(1999) == pytest.approx(2.2e-4) and schedule(9999) == pytest.approx(2.2e-4)
    assert 9990 <= schedule.decay_start <= 10010
    assert schedule(14799) == pytest.approx(2.2e-5, rel=1e-3)
    assert compose_config("optim=deepseek_v3", "train.lr=1e-3").train.lr == 1e-3  # overridable


def test_step_schedule_multiplies_at_its_fractions():
    schedule = LrSchedule(peak=1.0, warmup_steps=10, total_steps=200, min_ratio=0.1, kind=Schedule.step,
                          step_fractions=(0.8, 0.9), step_factor=0.5)
    assert schedule.drops == [160, 180]
    assert schedule(0) == pytest.approx(0.1) and schedule(10) == 1.0 and schedule(159) == 1.0
    assert schedule(160) == 0.5 and schedule(179) == 0.5 and schedule(180) == 0.25 and schedule(500) == 0.25


def test_the_deepseek_v2_lite_preset_is_the_published_curve():
    """Report appendix B.1: 2K warmup steps to 4.2e-4, x 0.316 after 80% and again after 90% of the tokens."""
    config = compose_config("optim=deepseek_v2_lite", "train.max_steps=10000")
    schedule = LrSchedule.from_config(config.optim, config.train.lr, config.train.warmup_steps, 10000)
    assert (config.optim.beta1, config.optim.beta2, config.optim.weight_decay, config.train.grad_clip) == (
        0.9, 0.95, 0.1, 1.0)
    assert schedule(999) == pytest.approx(4.2e-4 / 2) and schedule(7999) == pytest.approx(4.2e-4)
    assert schedule(8000) == pytest.approx(4.2e-4 * 0.316) and schedule(9000) == pytest.approx(4.2e-4 * 0.316**2)


@pytest.mark.parametrize("override, message", [
    ("optim.step_fractions=[0.9,0.8]", "optim.step_fractions=[0.9, 0.8] must rise strictly"),
    ("optim.step_fractions=[0.5,1.5]", "each between 0 and 1"),
    ("optim.step_factor=0", "optim.step_factor=0.0 must be above 0"),
    ("train.mtp_loss_weight=-1", "train.mtp_loss_weight=-1.0 must be positive"),
    ("train.straggler_factor=0.5", "train.straggler_factor=0.5 must be above 1, or 0 (off)"),
    ("train.straggler_windows=0", "train.straggler_windows=0 must be at least 1"),
])
def test_bad_schedule_and_mtp_settings_are_user_errors(override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        compose_config(override)


def test_mtp_needs_a_weight_and_a_sequence_longer_than_its_depths():
    with pytest.raises(UserError, match=re.escape("train.mtp_loss_weight=0.0 must be positive with model.n_mtp_layers=1")):
        compose_config("model=tiny", "model.n_mtp_layers=1", "train.mtp_loss_weight=0")
    with pytest.raises(UserError, match=re.escape("train.seq_len=2 must exceed model.n_mtp_layers=2")):
        compose_config("model=tiny", "model.n_mtp_layers=2", "train.seq_len=2")


def test_mtp_loss_is_logged_beside_the_next_token_loss(tmp_path, text_corpus):
    plain = _first_step_grads(tiny_trainer(tmp_path / "a", text_corpus, "train.grad_clip=0"))
    trainer = tiny_trainer(tmp_path / "b", text_corpus, "train.grad_clip=0", "model.n_mtp_layers=1")
    figures = trainer.train_step()
    assert figures["loss"] == plain[0]  # the same first weights, the same next-token loss
    assert 0 < figures["mtp_loss"] < 2 * figures["loss"]
    record = trainer.record.metrics_line(trainer.step, figures, [figures["loss"]], Throughput(1), None, False)
    assert record["mtp_loss"] == figures["mtp_loss"]
    assert f"mtp_loss {figures['mtp_loss']:.4f}" in format_step(record)  # the progress line shows it


def test_a_run_resumed_mid_decay_continues_the_same_lr_curve(tmp_path, text_corpus, one_thread):
    overrides = ["optim.schedule=wsd", "optim.decay_fraction=0.5", "optim.decay_shape=linear", "train.max_steps=10",
                 "train.warmup_steps=2", "train.log_every=1", "ckpt.every=0", "sample.max_new_tokens=0"]
    (tmp_path / "straight").mkdir()
    straight = tiny_trainer(tmp_path / "straight", text_corpus, *overrides).fit()
    (tmp_path / "resumed").mkdir()
    first = tiny_trainer(tmp_path / "resumed", text_corpus, *overrides)
    for _ in range(7):  # into the decay, which starts at step 5
        first.train_step()
    first.save_checkpoint()
    resumed = tiny_trainer(tmp_path / "resumed", text_corpus, *overrides).fit()

    def lrs(folder):
        return [json.loads(line)["lr"] for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert lrs(tmp_path / "resumed")[-3:] == lrs(tmp_path / "straight")[-3:]
    assert resumed["param_checksum"] == straight["param_checksum"]


def test_weight_decay_skips_norms_and_embeddings():
    model = Transformer(compose_config("model=tiny").model)
    optimizer = build_optimizer(model, compose_config("model=tiny").optim, lr=1e-3)
    decayed, plain = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 and "tok_embeddings" not in names[id(p)] for p in decayed["params"])
    assert any("tok_embeddings" in names[id(p)] for p in plain["params"])
    assert any("norm" in names[id(p)] for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_training_lowers_the_loss_and_writes_metrics(tmp_path, text_corpus):
    trainer = tiny_trainer(
        tmp_path, text_corpus, "train.max_steps=40", "train.eval_every=20", "train.log_every=10",
        "train.lr=3e-3", "train.warmup_steps=5",
    )
    before = trainer.evaluate()
    summary = trainer.fit()
    assert summary["final_val_loss"] < before - 1.0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["param_checksum"] == param_checksum(trainer.model) == summary["param_checksum"]
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20, 30, 40]


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, text_corpus):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        trainer = tiny_trainer(tmp_path / name, text_corpus, f"seed={seed}")
        for _ in range(3):
            trainer.train_step()
        runs[name] = param_checksum(trainer.model)
    assert runs["a"] == runs["b"] != runs["c"]


def test_one_process_agrees_with_itself(tmp_path, text_corpus):
    """Gradient consistency of a single rank is its gradient against itself: 1, measured on logging steps only."""
    trainer = tiny_trainer(tmp_path, text_corpus, "train.log_grad_consistency=true", "train.log_every=2")
    assert "grad_consistency" not in trainer.train_step()
    assert trainer.train_step()["grad_consistency"] == pytest.approx(1.0, abs=1e-12)


def test_grad_accum_equals_one_big_batch(tmp_path, text_corpus):
    """Two micro-batches of 4 weighted 1/2 each give the gradient of one batch of 8."""
    accum = tiny_trainer(tmp_path / "a", text_corpus, "train.grad_accum=2", "train.grad_clip=0")
    big = tiny_trainer(tmp_path / "b", text_corpus, "train.batch_size=8", "train.grad_clip=0")
    grads = []
    for trainer in (accum, big):
        trainer.optimizer.step = lambda: None  # keep the gradients for comparison
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        trainer.train_step()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_bf16_autocast_trains(tmp_path, text_corpus):
    trainer = tiny_trainer(tmp_path, text_corpus, "precision=bf16", "train.lr=3e-3")
    assert trainer.config.precision is Precision.bf16
    first = trainer.train_step()["loss"]
    for _ in range(15):
        last = trainer.train_step()["loss"]
    assert math.isfinite(last) and last < first
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


class ConstantLR(Trick):
    name = "constant_lr"

    def lr_at(self, step, schedule):
        return 0.0


class HalfLR(Trick):
    name = "half_lr"

    def lr_at(self, step, schedule):
        return schedule(step) / 2


class Reverse(Trick):
    name = "reverse"

    @dataclass
    class Params:
        times: int = 1

    def __init__(self, ctx, params=None):
        super().__init__(ctx, params)
        self.calls = 0

    def order_indices(self, share, epoch):
        self.calls += 1
        return share.flip(0)

    def metrics(self):
        return {"calls": self.calls}


@pytest.mark.parametrize("overrides", [
    ["model.n_dense_layers=2"],  # dense: nothing in the model needs a value on the host
    ["train.grad_accum=2", "model.n_mtp_layers=1", "model.aux_loss_alpha=0.01"],  # side losses ride along
])
def test_a_step_that_logs_nothing_waits_for_the_device_once(tmp_path, text_corpus, monkeypatch, overrides):
    """A GPU runs ahead of the host until something needs a value there: the step's one
    agreement (apply, skip or stop; its loss and norm), not each micro-batch's loss, the
    side losses, clipping or the expert balancing. Counts the package's own reads of a
    tensor's value (item, tolist, float, int, bool) during a step; the MoE in the second
    case reads its expert counts on CPU (the loop over experts), so only reads from the
    training loop, the distributed helpers and the model's top level are counted."""
    import sys
    from pathlib import Path as P

    import ciuic_train

    trainer = tiny_trainer(tmp_path, text_corpus, "train.log_every=100", *overrides)
    trainer.train_step()
    watched = [P(ciuic_train.__file__).parent / sub for sub in ("train", "distributed", "model/transformer.py")]
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        def spy(self, *args, _original=getattr(torch.Tensor, name), _name=name):
            caller = P(sys._getframe(1).f_code.co_filename)
            if any(caller == w or w in caller.parents for w in watched):
                reads.append(f"{caller.name}:{sys._getframe(1).f_lineno} {_name}")
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, name, spy)
    figures = trainer.train_step()
    monkeypatch.undo()
    assert len(reads) == 1 and reads[0].startswith("loss_watch.py:") and reads[0].endswith(" tolist"), reads
    assert figures["applied"] and math.isfinite(figures["loss"]) and math.isfinite(figures["grad_norm"])
    if "model.n_mtp_layers=1" in overrides:
        assert {"mtp_loss", "aux_loss"} <= set(figures) and all(isinstance(figures[k], float) for k in ("mtp_loss", "aux_loss"))


def test_a_seam_has_one_owner_and_conflicts_are_refused():
    tricks = TrickSet([ConstantLR(CTX), Reverse(CTX)], CTX)
    assert tricks.lr_at(5, lambda step: 1.0) == 0.0
    assert torch.equal(tricks.order_indices(torch.arange(3), 0), torch.tensor([2, 1, 0]))
    assert tricks.micro_batch_weights(0, 4) == [0.25] * 4
    assert tricks.metrics() == {"reverse/calls": 1}
    with pytest.raises(UserError, match="constant_lr and half_lr both replace the lr_at seam"):
        TrickSet([ConstantLR(CTX), HalfLR(CTX)], CTX)


def test_the_trainer_routes_through_the_seams(tmp_path, text_corpus, monkeypatch):
    monkeypatch.setattr("ciuic_train.tricks.registry", lambda: {"constant_lr": ConstantLR})
    trainer = tiny_trainer(tmp_path, text_corpus, "+trick.constant_lr={}")
    before = param_checksum(trainer.model)
    figures = trainer.train_step()
    assert figures["lr"] == 0.0 and param_checksum(trainer.model) == before
    assert trainer.tricks.names == ["constant_lr"]


def test_unknown_trick_and_bad_parameters_are_user_errors(monkeypatch):
    monkeypatch.setattr("ciuic_train.tricks.registry", lambda: {"reverse": Reverse, "constant_lr": ConstantLR})
    with pytest.raises(UserError, match="unknown trick 'nope'; available tricks: constant_lr, reverse"):
        build_tricks({"nope": {}}, CTX)
    with pytest.raises(UserError, match="trick.reverse.tims: .*parameters of reverse: times"):
        check_tricks({"reverse": {"tims": 2}})
    with pytest.raises(UserError, match="trick.reverse.times: .*could not be converted"):
        check_tricks({"reverse": {"times": "abc"}})
    assert build_tricks({"reverse": {"times": 3}}, CTX).resolved_params() == {"reverse": {"times": 3}}


def _first_step_grads(trainer):
    trainer.optimizer.step = lambda: None
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    loss = trainer.train_step()["loss"]
    return loss, torch.cat([p.grad.flatten() for p in trainer.model.parameters()])


def test_activation_checkpointing_gives_the_same_gradients_and_parameter_names(tmp_path, text_corpus):
    plain_trainer = tiny_trainer(tmp_path / "a", text_corpus, "train.grad_clip=0")
    plain = _first_step_grads(plain_trainer)
    recomputed = tiny_trainer(tmp_path / "b", text_corpus, "train.grad_clip=0", "activation_checkpointing=true")
    # The blocks' forward is wrapped, not the blocks: checkpoints load either way.
    assert list(recomputed.model.state_dict()) == list(plain_trainer.model.state_dict())
    calls, attn = [], recomputed.model.layers[0].attn
    original = attn.forward
    attn.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)  # hooks are muted in recompute
    loss, grads = _first_step_grads(recomputed)
    assert len(calls) == 2  # once forward, once recomputed during backward
    assert loss == pytest.approx(plain[0], rel=1e-6)
    torch.testing.assert_close(grads, plain[1], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # inductor compiles C++ for most of a minute on 2 cores
def test_compiled_blocks_match_eager(tmp_path, text_corpus):
    """torch.compile (inductor, C++ on CPU) of each block; about a minute of compiling on 2 cores.
    The MoE block, balance loss included, at the shapes of test_pipeline's compiled stages
    (4 windows of 64 tokens), so that the two tests share inductor's cache of compiled graphs."""
    overrides = ["train.grad_clip=0", "model.aux_loss_alpha=0.01"]
    eager = _first_step_grads(tiny_trainer(tmp_path / "a", text_corpus, *overrides))
    trainer = tiny_trainer(tmp_path / "b", text_corpus, *overrides, "compile=true")
    assert all(block._compiled_call_impl is not None for block in trainer.model.layers)
    compiled = _first_step_grads(trainer)
    assert compiled[0] == pytest.approx(eager[0], rel=1e-4)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-3, atol=1e-5)


def test_balance_losses_are_logged_and_survive_activation_checkpointing(tmp_path, text_corpus):
    balanced = ["train.grad_clip=0", "model.aux_loss_alpha=0.01", "model.seq_aux_loss_alpha=0.01"]
    plain = _first_step_grads(tiny_trainer(tmp_path / "a", text_corpus, *balanced))
    unweighted = _first_step_grads(tiny_trainer(tmp_path / "b", text_corpus, "train.grad_clip=0"))
    assert plain[0] == unweighted[0]  # the logged loss is the LM loss
    assert not torch.allclose(plain[1], unweighted[1])  # the gradient is not
    recomputed = _first_step_grads(tiny_trainer(tmp_path / "c", text_corpus, *balanced,
                                                 "activation_checkpointing=true"))
    torch.testing.assert_close(recomputed[1], plain[1], rtol=1e-5, atol=1e-7)

    figures = tiny_trainer(tmp_path / "d", text_corpus, *balanced).train_step()
    assert figures["aux_loss"] > 0 and figures["seq_aux_loss"] > 0
    assert "aux_loss" not in tiny_trainer(tmp_path / "e", text_corpus).train_step()


def test_a_local_rank_without_a_gpu_of_its_own_is_one_line(monkeypatch):
    """Two ranks on a node that shows one GPU: rank 1 is told so, not CUDA's "invalid device
    ordinal" at its first kernel. (CUDA is pretended here; rank 0's real path runs in test_gpu.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    for choice in (Device.auto, Device.cuda):
        with pytest.raises(UserError) as refused:
            resolve_device(choice, local_rank=1)
        assert str(refused.value) == (
            "local rank 1 has no GPU of its own: this node shows 1 (CUDA_VISIBLE_DEVICES=3); "
            "run at most dist.nproc_per_node=1 ranks per node, or device=cpu"
        )
    assert resolve_device(Device.cpu, local_rank=1) == torch.device("cpu")


def test_more_local_workers_than_gpus_is_refused_before_any_starts(monkeypatch, tmp_path):
    """`ciuic-train dist.nproc_per_node=2` on a node with one GPU: one line from the
    launcher, before a worker starts (CUDA pretended), for device=cuda and auto alike."""
    from ciuic_train.cli.preflight import check_request
    from ciuic_train.launch import modes as launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    base = ["model=tiny", "dist.nproc_per_node=2", "train.check_memory=false", f"hydra.run.dir={tmp_path / 'run'}"]
    for device in ("cuda", "auto"):
        with pytest.raises(UserError) as refused:
            check_request([*base, f"device={device}"], launch.ElasticLauncher())
        assert str(refused.value) == (
            "dist.nproc_per_node=2 ranks on CUDA, but this node shows 1 GPU(s) (CUDA_VISIBLE_DEVICES=0): "
            "one rank per GPU; run at most dist.nproc_per_node=1, or device=cpu"
        )
    check_request([*base, "device=cpu"], launch.ElasticLauncher())  # gloo ranks share the CPU
    check_request([*base[:1], "dist.nproc_per_node=1", "device=cuda", *base[2:]], launch.ElasticLauncher())
    assert not (tmp_path / "run").exists()


def test_tf32_is_the_cuda_default_for_fp32_and_a_key_turns_it_off(tmp_path, text_corpus):
    """fp32 matmuls on CUDA use TF32 unless `tf32=false`; a CPU run leaves the flag alone.
    (The flag is host state, so it is set and read here without a GPU; test_gpu runs it.)"""
    from ciuic_train.train.trainer import use_tf32

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert compose_config().tf32 is True and compose_config("tf32=false").tf32 is False
        tiny_trainer(tmp_path, text_corpus, "device=cpu")
        assert matmul.allow_tf32 is False
        use_tf32(torch.device("cuda", 0), True)
        assert matmul.allow_tf32 is True
        use_tf32(torch.device("cpu"), False)
        assert matmul.allow_tf32 is True
        use_tf32(torch.device("cuda", 0), False)
        assert matmul.allow_tf32 is False
    finally:
        matmul.allow_tf32 = before


def test_the_profiler_writes_a_trace_of_the_active_steps_and_logs_the_top_operators(tmp_path, text_corpus, caplog):
    """profile.wait=1 warmup=1 active=2 over 5 steps: one Chrome trace in RUN/profile/ whose
    steps are the recorded two and whose events are the training step's operators."""
    trainer = tiny_trainer(tmp_path, text_corpus, "profile.enabled=true", "profile.wait=1", "profile.warmup=1",
                           "profile.active=2", "train.max_steps=5", "sample.max_new_tokens=0")
    with caplog.at_level("INFO", logger="ciuic_train"):
        trainer.fit()
    (trace,) = (tmp_path / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name", "") for event in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    assert {"aten::mm", "aten::bmm", "aten::addmm", "aten::linear"} & names, sorted(names)[:50]
    (table,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile: 1 trace(s) per rank")]
    assert "Self CPU" in table and "aten::" in table


def test_no_profiler_runs_unless_asked_and_a_cycle_longer_than_the_run_is_refused(tmp_path, text_corpus, monkeypatch):
    import torch.profiler

    monkeypatch.setattr(torch.profiler, "profile", lambda *a, **k: pytest.fail("a profiler was created"))
    tiny_trainer(tmp_path, text_corpus, "train.max_steps=2", "sample.max_new_tokens=0").fit()
    assert not (tmp_path / "profile").exists()
    with pytest.raises(UserError, match=r"^profile.wait\+warmup\+active=9 steps exceed train.max_steps=4: no trace"):
        compose_config("profile.enabled=true", "train.max_steps=4")
    with pytest.raises(UserError, match=r"^profile.active=0 must be at least 1$"):
        compose_config("profile.active=0")
