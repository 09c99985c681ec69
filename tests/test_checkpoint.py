"""Checkpoints: complete, atomic, resumable bit for bit; refusals; signals; elastic restarts."""

import json
import os
import signal
import subprocess
import sys
import shutil
import time
from pathlib import Path

import pytest
import torch

from ciuic_train.checkpoint.resume import check_resumable
from ciuic_train.errors import UserError
from ciuic_train.model import ModelConfig, Transformer
from ciuic_train.train.trainer import Trainer
from ciuic_train.tricks import registry
from conftest import compose_config, kill_tree, run_cli, torchrun, write_text_corpus

TINY = ["model=tiny", "train.seq_len=64", "train.batch_size=4", "train.eval_windows=8", "sample.max_new_tokens=0",
        "progress=plain"]


def corpus(text_corpus, tmp_path):
    return ["data=text", f"data.path={text_corpus}", f"data.cache_dir={tmp_path / 'cache'}"]


def make_trainer(run_dir, text_corpus, tmp_path, *overrides):
    run_dir.mkdir(exist_ok=True)
    return Trainer(compose_config(*TINY, *corpus(text_corpus, tmp_path), *overrides), run_dir)


@pytest.mark.parametrize("extra", [[], ["model.n_mtp_layers=1"], ["ckpt.async_save=true"],
                                   *([f"+trick={name}"] for name in sorted(registry()))],
                         ids=lambda extra: extra[0] if extra else "plain")
def test_resume_ends_bit_identical_to_an_uninterrupted_run(tmp_path, text_corpus, extra):
    """Asynchronous saves: the step after the save runs while it is written, and changes
    nothing of what it writes."""
    overrides = ["train.max_steps=10", "train.grad_accum=2", "ckpt.every=3", "train.eval_every=5", "train.log_every=1",
                 *extra]
    whole = make_trainer(tmp_path / "whole", text_corpus, tmp_path, *overrides).fit()

    interrupted = make_trainer(tmp_path / "cut", text_corpus, tmp_path, *overrides)
    for _ in range(6):  # as if killed after step 7, past the step-6 checkpoint
        interrupted.train_step()
    interrupted.save_checkpoint()
    interrupted.train_step()
    interrupted.checkpointer.wait()
    resumed = make_trainer(tmp_path / "cut", text_corpus, tmp_path, *overrides)
    assert resumed.step == 6 and resumed.resumed_from.name == "step_000006"
    summary = resumed.fit()
    assert summary["param_checksum"] == whole["param_checksum"]
    assert summary["final_val_loss"] == whole["final_val_loss"]


def test_an_async_save_is_written_while_steps_go_on_and_the_next_save_waits_for_it(tmp_path, text_corpus,
                                                                                  one_thread, monkeypatch):
    """`ckpt.async_save=true`: DCP's real background write, held back by the test until it
    lets it finish. Training advances while step 1's save is unpublished; step 3's save
    starts writing only after step 1's is published. A save that blocked the loop would
    never let the steps run (the held write gives up after HOLD_S and the test fails)."""
    import threading
    import torch.distributed.checkpoint as dcp

    HOLD_S = 30
    released, writes = threading.Event(), []
    real_async_save = dcp.async_save

    class HeldWrite:
        def __init__(self, upload):
            self.upload = upload

        def result(self):
            assert released.wait(HOLD_S), "the save was waited for before any step could run past it"
            return self.upload.result()

    def held_async_save(*args, **kwargs):
        first = Path(writes[0][0]).with_name("step_000001") if writes else None
        writes.append((kwargs["checkpoint_id"], first is not None and (first / "meta.json").is_file()))
        response = real_async_save(*args, **kwargs)
        return HeldWrite(getattr(response, "upload_completion", response))

    monkeypatch.setattr(dcp, "async_save", held_async_save)
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=10", "ckpt.async_save=true")
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.train_step()
    trainer.train_step()
    assert trainer.step == 3 and not first.exists()  # two steps done, the save still in flight
    assert (first.parent / ".tmp-step_000001").is_dir()
    threading.Timer(2.0, released.set).start()  # let it finish only once the next save is waiting
    second = trainer.save_checkpoint()
    trainer.checkpointer.wait()
    assert [published for _, published in writes] == [False, True]  # step 3's began after step 1's was whole
    assert (first / "meta.json").is_file() and (second / "meta.json").is_file()
    assert json.loads((second / "meta.json").read_text())["step"] == 3


def test_a_resume_restores_the_global_random_streams_as_they_were_at_the_save(tmp_path, text_corpus, one_thread):
    """Nothing in training draws from torch's or Python's global RNG today (each stream has
    its own generator), so the bit-identical resume above cannot see these two go
    unrestored; a later draw from them (dropout, say) would."""
    import random

    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=4")
    trainer.train_step()
    torch.manual_seed(1234), random.seed(5678)
    trainer.save_checkpoint()
    expected = torch.rand(4), random.random()
    torch.manual_seed(0), random.seed(0)
    make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=4")
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]


def test_resume_continues_metrics_without_duplicated_steps(tmp_path, text_corpus):
    overrides = ["train.max_steps=8", "ckpt.every=4", "train.log_every=2"]
    first = make_trainer(tmp_path / "run", text_corpus, tmp_path, *overrides)
    first.fit()
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    # Pretend the run died after step 6: the last checkpoint is step 4, metrics went on to 6.
    metrics.write_text("\n".join(lines[:3]) + "\n")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000008")
    make_trainer(tmp_path / "run", text_corpus, tmp_path, *overrides).fit()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [2, 4, 6, 8]


def test_a_run_resumed_at_its_end_trains_nothing_and_keeps_its_summary(tmp_path, text_corpus):
    """Its command run again, or a requeue after the final save: the summary stands, and
    one stopped before writing it is written with the final step's losses (a sweep's
    job returns the final val loss)."""
    overrides = ["train.max_steps=6", "ckpt.every=3", "train.log_every=2"]
    run_dir = tmp_path / "run"
    first = make_trainer(run_dir, text_corpus, tmp_path, *overrides).fit()
    written = {name: (run_dir / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}

    again = make_trainer(run_dir, text_corpus, tmp_path, *overrides)
    assert again.step == 6
    assert again.fit()["final_val_loss"] == first["final_val_loss"]
    assert {name: (run_dir / name).read_bytes() for name in written} == written
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000003", "step_000006"]

    (run_dir / "summary.json").unlink()  # as if stopped between the final save and the summary
    summary = make_trainer(run_dir, text_corpus, tmp_path, *overrides).fit()
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["steps"] == 6 and summary["param_checksum"] == first["param_checksum"]
    assert summary["final_val_loss"] == first["final_val_loss"]
    assert summary["final_train_loss"] == first["final_train_loss"]
    assert summary["tokens_per_s"] != summary["tokens_per_s"]  # NaN: no step trained in that attempt
    assert (run_dir / "metrics.jsonl").read_bytes() == written["metrics.jsonl"]


def test_keep_last_prunes_only_after_a_new_checkpoint_is_complete(tmp_path, text_corpus):
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=10", "ckpt.every=2",
                           "ckpt.keep_last=2")
    trainer.fit()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_000008", "step_000010"]


def test_at_end_false_skips_only_the_save_after_the_last_step(tmp_path, text_corpus):
    saved = {}
    for at_end in ("true", "false"):
        run_dir = tmp_path / at_end
        summary = make_trainer(run_dir, text_corpus, tmp_path, "train.max_steps=5", "ckpt.every=3",
                               f"ckpt.at_end={at_end}").fit()
        saved[at_end] = (sorted(p.name for p in (run_dir / "checkpoints").iterdir()), summary["checkpoint_saves"])
    assert saved == {"true": (["step_000003", "step_000005"], 2), "false": (["step_000003"], 1)}


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path, text_corpus, monkeypatch):
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=10")
    for _ in range(3):
        trainer.train_step()
    trainer.save_checkpoint()
    trainer.train_step()

    def dies_halfway(state, checkpoint_id):
        (open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb")).write(b"partial")
        raise KeyboardInterrupt  # the process is killed mid-write

    monkeypatch.setattr("ciuic_train.checkpoint.checkpointer.dcp.save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint()
    monkeypatch.undo()
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-step_000004", "step_000003"]
    resumed = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=10")
    assert resumed.step == 3


def test_corrupt_checkpoint_is_a_clear_error_not_a_fresh_start(tmp_path, text_corpus):
    make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=4", "ckpt.every=0").fit()
    (shard,) = (tmp_path / "run" / "checkpoints" / "step_000004").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(UserError, match="checkpoint .*step_000004 is corrupt or incomplete"):
        make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=8")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run folder with a complete checkpoint (3 steps of model=tiny), made once for the module."""
    root = tmp_path_factory.mktemp("trained")
    run_dir = root / "run"
    args = [*TINY, *corpus(write_text_corpus(root / "corpus"), root), "train.max_steps=3", f"hydra.run.dir={run_dir}"]
    assert run_cli(*args, cwd=root).returncode == 0
    return run_dir


@pytest.mark.parametrize(
    "change, message",
    [
        (["model.dim=32"], "checkpoint model differs: model.dim is 64 there, 32 now"),
        (["+trick=warm_restart"], "checkpoint tricks [] differ from this run's ['warm_restart']"),
        (["dist.nproc_per_node=5"], "checkpoint was written by 1 ranks, this run has 5: the 12 windows consumed "
                                    "in its epoch do not split evenly over 5 ranks"),
        (["resume=/nonexistent/x"], "no complete checkpoint at /nonexistent/x"),
    ],
)
def test_incompatible_resume_is_refused_before_the_run_folder_is_touched(trained_run, tmp_path, change, message):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)  # a copy of one trained run folder per case
    common = [*TINY, *corpus(trained_run.parent / "corpus", trained_run.parent), "train.max_steps=3",
              f"hydra.run.dir={run_dir}"]
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    result = run_cli(*common, *change, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before


def test_trick_change_can_be_forced(tmp_path, text_corpus):
    make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=4").fit()
    resumed = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=6", "+trick=warm_restart",
                           "ckpt.allow_trick_change=true")
    assert resumed.step == 4


def start_training(args: list[str], metrics: Path, cwd: Path) -> subprocess.Popen:
    """`ciuic-train ARGS` in the background, returned once it has logged its first step
    (`kill_tree` ends it and whatever it started)."""
    exe = os.path.join(os.path.dirname(sys.executable), "ciuic-train")
    process = subprocess.Popen([exe, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not metrics.is_file() or not metrics.read_text():
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.2)
    return process


def test_sigterm_saves_and_exits_cleanly_then_resume_finishes(tmp_path, text_corpus):
    run_dir = tmp_path / "run"
    args = [*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=100000", "train.log_every=1",
            "ckpt.every=0", f"hydra.run.dir={run_dir}"]
    process = start_training(args, run_dir / "metrics.jsonl", cwd=tmp_path)
    logged = len((run_dir / "metrics.jsonl").read_text().splitlines())  # one line a step: the step it is at, or past
    process.send_signal(signal.SIGTERM)
    try:
        out, err = process.communicate(timeout=60)
    finally:
        kill_tree(process)
    assert process.returncode == 0, err
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert "stopped by SIGTERM" in out and not (run_dir / "summary.json").exists()
    step = int(checkpoint.name.split("_")[1])
    # It stopped at the step after the signal, however slow the machine: the step it was
    # in when the signal came, saved once that step ended (a step's own line may not be
    # flushed yet when it is read: one more).
    assert logged <= step <= logged + 2, (logged, step)
    finish = run_cli(*args[:-3], f"train.max_steps={step + 3}", "ckpt.every=0", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert finish.returncode == 0, finish.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == step + 3


@pytest.mark.slow
def test_torchrun_restarts_after_a_killed_rank_and_ends_like_an_uninterrupted_run(tmp_path, text_corpus):
    common = [*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=30", "ckpt.every=5", "train.log_every=5"]

    def restartable(*extra):
        # A rank that hangs on its way out is stopped by its own watchdog (exit status 1,
        # every thread's stack on stderr: Parallel.close), so it fails here, with the stacks.
        return torchrun("--nproc_per_node=2", "--max-restarts=1", "-m", "ciuic_train", *common, *extra,
                        cwd=tmp_path, timeout=420)

    whole = restartable(f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = restartable("fault.kill_rank=1", "fault.at_step=23", f"hydra.run.dir={tmp_path / 'killed'}")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "fault injection: rank 1 kills itself after step 23" in killed.stderr
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_000020")
    assert summary["param_checksum"] == json.loads((tmp_path / "whole" / "summary.json").read_text())["param_checksum"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 15, 20, 25, 30]


def test_export_gives_one_file_that_loads_without_distributed(tmp_path, text_corpus):
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=3")
    trainer.fit()
    exe = os.path.join(os.path.dirname(sys.executable), "ciuic-train-export")
    result = subprocess.run([exe, str(tmp_path / "run")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    exported = torch.load(tmp_path / "run" / "model_step3.pt", weights_only=True)
    model = Transformer(ModelConfig(**exported["model_config"]))
    model.load_state_dict(exported["state_dict"])
    tokens = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(model.eval()(tokens), trainer.model.eval()(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("workers", [pytest.param([], id="in_process"),
                                     pytest.param(["dist.nproc_per_node=2"], id="cli_launcher", marks=pytest.mark.slow)])
def test_sigterm_stops_a_sweep_after_saving_the_running_job(tmp_path, text_corpus, workers):
    """A signal ends the whole sweep: the running job saves, later jobs do not start. With
    the CLI's launcher, the signal reaches the launching process only (a `kill` of it)."""
    sweep = tmp_path / "sweep"
    args = [*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=100000", "train.log_every=1", "ckpt.every=0",
            "seed=0,1", f"hydra.sweep.dir={sweep}", *workers]
    process = start_training(["-m", *args], sweep / "0" / "metrics.jsonl", cwd=tmp_path)
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=60)
    finally:
        kill_tree(process)
    assert process.returncode == 1, err
    assert "sweep stopped by SIGTERM during job #0; later jobs were not started" in err
    assert any((sweep / "0" / "checkpoints").iterdir()) and not (sweep / "1").exists()


def test_a_model_field_newer_than_the_checkpoint_counts_as_its_default():
    """A checkpoint written before a model field existed ran with that field's default."""
    from dataclasses import asdict

    now = asdict(ModelConfig())
    before = {k: v for k, v in now.items() if k != "n_expert_groups"}
    meta = {"model": before, "tricks": [], "world_size": 1}
    check_resumable(meta, {"model": now, "tricks": [], "world_size": 1}, False)
    grouped = {**now, "n_routed_experts": 8, "n_expert_groups": 4}
    with pytest.raises(UserError, match="model.n_expert_groups is 1 there, 4 now"):
        check_resumable({**meta, "model": {**before, "n_routed_experts": 8}},
                        {"model": grouped, "tricks": [], "world_size": 1}, False)


def test_a_checkpoint_with_the_optimizer_by_group_index_still_resumes(tmp_path):
    """Checkpoints written before the optimizer was keyed by parameter name hold its groups by
    index; they load as they were written, Adam's moments and step included."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ciuic_train.checkpoint.checkpointer import Checkpointer, _encode_rng

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(),
                                                                           "weight_decay": 0.0}], lr=0.1)
        return model, optimizer

    model, optimizer = model_and_optimizer()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    old = tmp_path / "step_000001"
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the former layout: groups by index
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(old))
    assert "optim.param_groups.0.lr" in dcp.FileSystemReader(str(old)).read_metadata().state_dict_metadata
    (old / "rank0.json").write_text(json.dumps({"rng": _encode_rng()}))

    restored, restored_optimizer = model_and_optimizer()
    Checkpointer(tmp_path, 0, 1, keep_last=1).load(old, restored, restored_optimizer)
    for p, q in zip(model.parameters(), restored.parameters()):
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], restored_optimizer.state[q]["exp_avg"])
    assert [g["weight_decay"] for g in restored_optimizer.param_groups] == [0.01, 0.0]

