"""Reliability: a diverging run, a folder two jobs want, a save that cannot be written."""

import json
import logging
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ciuic_train.launch import runlock
from ciuic_train.config import TrainConfig
from ciuic_train.errors import RunFailed, UserError
from ciuic_train.train.loss_watch import LossWatch, StepCheck
from conftest import run_cli, write_text_corpus
from test_checkpoint import TINY, corpus, make_trainer

DIVERGES = ["train.lr=1e4", "train.warmup_steps=1", "train.grad_clip=0"]


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors a checkpoint holds, read as DCP stores them (no model needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=True)["model"]


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def error_lines(stderr: str) -> list[str]:
    """What a user reads on stderr: everything but log lines."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("[")]


# --- the non-finite guard ------------------------------------------------------------------


def test_a_diverging_run_stops_before_its_update_and_keeps_its_checkpoints(tmp_path, text_corpus, one_thread):
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, *DIVERGES, "train.max_steps=40", "ckpt.every=1",
                           "ckpt.keep_last=2")
    with pytest.raises(RunFailed, match=r"training diverged at step (\d+): loss (nan|inf)") as failure:
        trainer.fit()
    step = int(failure.value.args[0].split("step ")[1].split(":")[0])
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == [f"step_{step - 2:06d}", f"step_{step - 1:06d}"]  # none pruned after it
    assert f"last good checkpoint {saved[-1]}" in str(failure.value)
    assert f"rerun with train.lr=1000 hydra.run.dir={tmp_path / 'run'}" in str(failure.value)
    assert trainer.step == step - 1  # the failed step was not counted, nor applied:
    assert all_finite(trainer.model.state_dict().values())
    assert all_finite(checkpoint_weights(saved[-1]).values())
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_skipped_step_leaves_the_weights_and_the_checkpoints_alone(tmp_path, text_corpus, one_thread):
    """One NaN step (planted) is skipped, counted and not saved; the run then goes on."""
    overrides = ["train.max_steps=6", "ckpt.every=1", "train.log_every=1", "train.on_nonfinite=skip",
                 "fault.nan_rank=0", "fault.nan_at_step=4"]
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, *overrides)
    for _ in range(3):
        trainer.train_step()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    figures = trainer.train_step()
    assert not figures["applied"] and math.isnan(figures["loss"])
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # not even the expert bias moved

    summary = make_trainer(tmp_path / "fit", text_corpus, tmp_path, *overrides).fit()
    assert summary["steps"] == 6 and summary["skipped_steps"] == 1 and math.isfinite(summary["final_val_loss"])
    saved = [p.name for p in (tmp_path / "fit" / "checkpoints").glob("step_*")]
    assert "step_000004" not in saved and "step_000005" in saved
    metrics = [json.loads(line) for line in (tmp_path / "fit" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [0, 0, 0, 1, 1, 1]


def test_skipping_stops_after_max_skipped_steps_in_a_row(tmp_path, text_corpus, one_thread):
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, *DIVERGES, "train.max_steps=40",
                           "train.on_nonfinite=skip", "train.max_skipped_steps=3")
    with pytest.raises(RunFailed, match=r"3 non-finite steps in a row \(train.max_skipped_steps\)"):
        trainer.fit()
    assert trainer.watch.skipped_steps == 3
    assert all_finite(trainer.model.state_dict().values())


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_with_one_line(tmp_path, text_corpus):
    """Rank 1 alone sees a NaN loss: both ranks stop at that step, no hang, one line, status 3."""
    run_dir = tmp_path / "run"
    result = run_cli(*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=8", "ckpt.every=2",
                     "fault.nan_rank=1", "fault.nan_at_step=5", "dist.nproc_per_node=2", "dist.timeout_s=60",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=240)
    assert result.returncode == 3, result.stderr[-3000:]
    (line,) = error_lines(result.stderr)
    assert line.startswith("ciuic-train: error: training diverged at step 5: loss nan"), line
    assert f"last good checkpoint {run_dir / 'checkpoints' / 'step_000004'}" in line
    assert "diverged at step 5" in (run_dir / "train.log").read_text()  # the log says it too

    skipped = run_cli(*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=8", "train.on_nonfinite=skip",
                      "fault.nan_rank=1", "fault.nan_at_step=5", "dist.nproc_per_node=2",
                      f"hydra.run.dir={tmp_path / 'skip'}", cwd=tmp_path, timeout=240)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 8  # and the ranks agree (checked at the end)


def test_a_diverging_job_does_not_end_its_sweep(tmp_path, text_corpus):
    result = run_cli("-m", *TINY, *corpus(text_corpus, tmp_path), "train.max_steps=6", "train.warmup_steps=1",
                     "train.grad_clip=0", "train.lr=1e4,1e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                     cwd=tmp_path, timeout=240)
    assert result.returncode != 0
    assert "sweep job #0 failed" in result.stderr
    assert not (tmp_path / "sweep" / "0" / "summary.json").exists()
    assert (tmp_path / "sweep" / "1" / "summary.json").exists()  # the next job still ran


def test_loss_spikes_are_counted_and_warned_not_acted_on(caplog):
    config = TrainConfig(spike_factor=2.0, spike_window=10)
    watch = LossWatch(config, is_main=True)

    def step(n, loss):
        return watch.judge(n, StepCheck(loss, 1.0, finite=True, stop_signal=None))

    for n in range(1, 10):
        assert step(n, 10.0) == "apply"
    assert step(10, 50.0) == "apply" and watch.loss_spikes == 0  # nine steps are too few to judge
    for n in range(11, 21):
        step(n, 3.0)  # the window now holds these alone
    with caplog.at_level(logging.WARNING, logger="ciuic_train"):
        assert step(21, 7.0) == "apply"
    assert watch.loss_spikes == 1 and "step 21: loss spike, 7.0000 is 2.3x the median 3.0000" in caplog.text
    step(22, 5.0)  # below 2x the median
    assert watch.loss_spikes == 1
    resumed = LossWatch(config, is_main=False)
    resumed.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert resumed.state_dict() == watch.state_dict()
    off = LossWatch(TrainConfig(spike_factor=0), is_main=True)
    for n in range(1, 30):
        off.judge(n, StepCheck(1.0 if n < 29 else 100.0, 1.0, finite=True, stop_signal=None))
    assert off.loss_spikes == 0


def test_a_finished_run_never_fails_on_its_sample(tmp_path, text_corpus, caplog):
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, "sample.max_new_tokens=4")
    with torch.no_grad():
        trainer.model.lm_head.weight.fill_(float("inf"))
    with caplog.at_level(logging.WARNING, logger="ciuic_train"):
        assert trainer.sample() is None
    assert "no sample" in caplog.text


def test_a_fresh_start_forgets_metrics_of_an_attempt_that_saved_nothing(tmp_path, text_corpus):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 5.0}) + "\n")
    make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=2")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


# --- one job per run folder ----------------------------------------------------------------

HOLD = """
import sys, time
from ciuic_train.launch import runlock
runlock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def hold_in_another_process(folder: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_folder_is_held_until_its_holder_dies_however_it_dies(tmp_path):
    holder = hold_in_another_process(tmp_path / "run")
    with pytest.raises(UserError, match=rf"run folder {tmp_path / 'run'} is in use by another job \(pid {holder.pid} "):
        runlock.acquire(tmp_path / "run")
    holder.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel releases the lock
    holder.wait()
    runlock.acquire(tmp_path / "run")
    runlock.release(tmp_path / "run")


def test_a_second_job_in_a_busy_folder_exits_2_and_writes_nothing(tmp_path, text_corpus):
    run_dir = tmp_path / "run"
    first = run_cli(*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=2", f"hydra.run.dir={run_dir}",
                    cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    holder = hold_in_another_process(run_dir)  # as a running job would
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    try:
        second = run_cli(*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=4", "train.lr=1e-3",
                         f"hydra.run.dir={run_dir}", cwd=tmp_path)
        swept = run_cli("-m", *TINY, *corpus(text_corpus, tmp_path), "seed=0,1", f"hydra.sweep.dir={run_dir}",
                        cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    for result in (second, swept):
        assert result.returncode == 2
        (line,) = error_lines(result.stderr)
        assert line.startswith(f"ciuic-train: error: run folder {run_dir} is in use by another job (pid {holder.pid}")
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # .hydra/ included: Hydra never started


# --- saves that cannot be written ----------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_save_that_cannot_be_written_stops_the_run_and_leaves_nothing_behind(tmp_path, text_corpus, one_thread,
                                                                              asynchronous):
    """Written in the background (ckpt.async_save), the failure stops the run where it waits for the save."""
    async_save = f"ckpt.async_save={str(asynchronous).lower()}"
    trainer = make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=10", async_save)
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.checkpointer.wait()
    trainer.train_step()
    # A real write error without root: files may not grow past 64 KiB (Python ignores the
    # SIGXFSZ this raises, so the write fails, as one on a full disk does).
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))
    try:
        with pytest.raises(RunFailed) as failure:
            trainer.save_checkpoint()
            trainer.checkpointer.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    message = str(failure.value)
    assert message.startswith(f"saving checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_000002'} failed: ")
    assert f"the previous checkpoint {first} is intact" in message and "free" in message
    assert sorted(p.name for p in first.parent.iterdir()) == ["step_000001"]
    assert make_trainer(tmp_path / "run", text_corpus, tmp_path, "train.max_steps=10", async_save).step == 1


def test_a_short_disk_is_warned_about_at_start(tmp_path, text_corpus, monkeypatch, caplog):
    monkeypatch.setattr("ciuic_train.checkpoint.checkpointer.free_bytes", lambda path: 1000)
    with caplog.at_level(logging.WARNING, logger="ciuic_train"):
        make_trainer(tmp_path / "run", text_corpus, tmp_path, "ckpt.keep_last=2")
    assert "only 1000 B free" in caplog.text and "room for 3 checkpoints" in caplog.text


def can_mount() -> str | None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "needs root and mount(8) to make a small filesystem"
    return None


@pytest.fixture
def small_filesystem(tmp_path):
    """A 4 MiB tmpfs: room for two checkpoints of the tiny model, not three."""
    reason = can_mount()
    if reason:
        pytest.skip(reason)
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def full_disk_args(text_corpus: Path, tmp_path: Path, asynchronous: bool) -> list[str]:
    return [*TINY, *corpus(text_corpus, tmp_path), "train.max_steps=10", "ckpt.every=2", "ckpt.keep_last=3",
            "dist.nproc_per_node=2", "dist.timeout_s=60", f"ckpt.async_save={str(asynchronous).lower()}"]


def uninterrupted_checksum(folder: Path) -> str:
    """The full-disk runs' reference, made once for both: their 10 steps on two ranks with
    room on the disk and synchronous saves (how a save is written changes no weight), and
    the same corpus (written alike in its own folder)."""
    args = full_disk_args(write_text_corpus(folder / "corpus"), folder, asynchronous=False)
    straight = run_cli(*args, f"hydra.run.dir={folder / 'straight'}", cwd=folder, timeout=240)
    assert straight.returncode == 0, straight.stderr[-3000:]
    return json.loads((folder / "straight" / "summary.json").read_text())["param_checksum"]


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes_once_there_is_room(
        tmp_path, text_corpus, small_filesystem, asynchronous, made_once):
    args = full_disk_args(text_corpus, tmp_path, asynchronous)
    run_dir = small_filesystem / "run"
    full = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=240)
    assert full.returncode == 3, full.stderr[-3000:]
    (line,) = error_lines(full.stderr)
    assert line.startswith(f"ciuic-train: error: saving checkpoint {run_dir / 'checkpoints'}/step_"), line
    assert "not enough space" in line and "is intact; the run stops here" in line
    assert "only" in (run_dir / "train.log").read_text()  # warned at start
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names and all(n.startswith("step_") for n in names)  # no partial folder left

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_filesystem)], check=True)
    resumed = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    checksum = json.loads((run_dir / "summary.json").read_text())["param_checksum"]
    assert checksum == made_once(uninterrupted_checksum)  # nothing was lost
