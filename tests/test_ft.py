"""Fault tolerance across replica groups (`ft.*`, torchft): real processes, gloo, a real
lighthouse. The CLI's launcher starts the lighthouse and one torchrun per group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_refused, compose_config, descendants, free_port, kill_tree, run_cli
from train_layouts import launch_layouts
from ciuic_train import faults
from ciuic_train.faults import FaultConfig

TINY = ["model=tiny", "sample.max_new_tokens=0", "train.log_every=5", "train.eval_every=1000", "progress=plain"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# Two groups of two ranks in two of the tests below: a two-stage pipeline in each, FSDP2 with
# ep=2 in each; each against the one world of four ranks it equals (`one_world`).
PIPELINES = ["model=tiny", "model.n_layers=4", "train.seq_len=64", "sample.max_new_tokens=0", "progress=plain",
             "train.max_steps=10", "train.log_every=1", "train.eval_every=10", "dist.pp=2"]
FSDP_EP = [*TINY, "train.max_steps=10", "dist.dp_shard=2", "dist.ep=2"]


@pytest.fixture(scope="module")
def one_world(tmp_path_factory) -> dict[str, Path]:
    """The four-rank references, one after the other in one launch (tests/train_layouts.py):
    the pipelines replicated twice, and HSDP (2 x 2, ep=2)."""
    folder = tmp_path_factory.mktemp("one_world")
    return launch_layouts(folder, 4, {"pipelines": [*PIPELINES, "dist.dp_replicate=2"], "hsdp": FSDP_EP},
                          f"data.cache_dir={folder / 'cache'}")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["ft.enabled=true", "dist.nproc_per_node=3", "ft.groups=2"],
         "ft.groups=2 does not divide dist.nproc_per_node=3"),
        (["ft.enabled=true"], "needs the lighthouse they share: ft.lighthouse=http://host:port"),
        (["ft.enabled=true", "ft.lighthouse=http://127.0.0.1:9"], "ft.lighthouse=http://127.0.0.1:9 does not answer"),
        (["ft.enabled=true", "ft.lighthouse=127.0.0.1:9"], "must be an address http://host:port"),
        (["ft.enabled=true", "ft.group=2"], "ft.group=2 must be between 0 and ft.groups-1=1"),
        (["ft.enabled=true", "dist.nproc_per_node=2", "ft.min_groups=3"], "ft.min_groups=3 must be between 1"),
        (["ft.enabled=true", "ft.timeout_s=0"], "ft.timeout_s=0.0 must be positive"),
        (["fault.slow_alone=true"], "fault.slow_alone=true slows a replica group while the others are gone"),
    ],
)
def test_ft_mistakes_get_one_line_and_start_nothing(tmp_path: Path, args, expected):
    run_dir = tmp_path / "run"
    result = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=60)
    assert_refused(result, expected, run_dir)


def test_slow_alone_sleeps_only_on_the_slow_rank_while_its_group_is_alone(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    always, alone_only = FaultConfig(slow_rank=0, slow_s=0.5), FaultConfig(slow_rank=0, slow_s=0.5, slow_alone=True)
    for fault, rank, alone in [(always, 0, False), (alone_only, 0, False), (alone_only, 1, True), (alone_only, 0, True)]:
        faults.slow_down(fault, rank, alone)
        slept.append("|")
    assert slept == [0.5, "|", "|", "|", 0.5, "|"]


def test_ft_is_off_by_default_and_typed():
    config = compose_config()
    assert config.ft.enabled is False and config.ft.groups == 2 and config.ft.timeout_s == 10.0


@pytest.mark.slow
def test_two_groups_without_faults_train_as_ddp_of_the_same_global_batch(tmp_path: Path):
    """2 groups of 1 rank against 2-rank DDP: the same losses and bit-identical weights."""
    common = [*TINY, "train.max_steps=20", "dist.nproc_per_node=2", f"data.cache_dir={tmp_path / 'cache'}"]
    ft_run, ddp_run = tmp_path / "ft", tmp_path / "ddp"
    result = run_cli(*common, "ft.enabled=true", "ft.groups=2", f"hydra.run.dir={ft_run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(*common, f"hydra.run.dir={ddp_run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    groups = [metrics(ft_run), metrics(ft_run / "group_1")]
    ddp = metrics(ddp_run)
    for group in groups:
        assert [r["step"] for r in group] == [r["step"] for r in ddp] == [5, 10, 15, 20]
        assert all(r["participants"] == 2 for r in group)
        for mine, theirs in zip(group, ddp):
            assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], abs=1e-6)
    checksums = {summary(ft_run)["param_checksum"], summary(ft_run / "group_1")["param_checksum"],
                 summary(ddp_run)["param_checksum"]}
    assert len(checksums) == 1
    # The lowest group wrote the checkpoint, into the run's one folder; torchft's lines went to train.log.
    assert summary(ft_run)["checkpoint_saves"] == 1 and summary(ft_run / "group_1")["checkpoint_saves"] == 0
    assert (ft_run / "checkpoints" / "step_000020").is_dir() and not (ft_run / "group_1" / "checkpoints").exists()
    assert "torchft" in (ft_run / "train.log").read_text() and "torchft" not in result.stdout + result.stderr


@pytest.mark.slow
def test_pipelines_inside_two_groups_train_as_one_world_of_replicated_pipelines(tmp_path: Path, one_world):
    """2 groups, each a 2-stage pipeline, against one world of 4: 2 stages x 2 replicas.
    Each stage rank averages its own stage's gradients with the same rank of the other
    group; the sums run in another order than the world's, so the figures agree to 1e-6,
    not bit for bit."""
    ft_run, world_run = tmp_path / "ft", one_world["pipelines"]
    result = run_cli(*PIPELINES, "dist.nproc_per_node=4", f"data.cache_dir={tmp_path / 'cache'}", "ft.enabled=true",
                     "ft.groups=2", f"hydra.run.dir={ft_run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(ft_run)["mesh"]["pp"] == 2 and summary(world_run)["mesh"]["dp_replicate"] == 2
    reference = metrics(world_run)
    for group in (metrics(ft_run), metrics(ft_run / "group_1")):
        assert [r["step"] for r in group] == list(range(1, 11)) and all(r["participants"] == 2 for r in group)
        for mine, theirs in zip(group, reference):
            for key in ("loss", "grad_norm"):
                assert mine[key] == pytest.approx(theirs[key], abs=1e-6), (mine["step"], key)
        assert group[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], abs=1e-6)
    assert summary(ft_run)["param_checksum"] == summary(ft_run / "group_1")["param_checksum"]


def _assert_survived_and_healed(run_dir: Path, max_steps: int) -> tuple[dict, list[dict]]:
    survivor = metrics(run_dir)
    steps = [r["step"] for r in survivor]
    assert steps == sorted(set(steps)) and steps[-1] == max_steps  # strictly increasing: no step redone
    assert any(r["participants"] == 1 for r in survivor)  # it trained on alone
    assert survivor[-1]["participants"] == 2  # and the restarted group came back
    rejoined = run_dir / "group_1"
    log = (rejoined / "train.log").read_text()
    assert "received from a peer" in log and "resumed from" not in log  # the live state, no checkpoint read
    mine, theirs = summary(run_dir), summary(rejoined)
    assert mine["param_checksum"] == theirs["param_checksum"]
    return mine, [json.loads(line) for line in (rejoined / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_group_killed_between_steps_leaves_the_other_training_and_heals_on_restart(tmp_path: Path):
    """Group 1 dies after step 20 and its torchrun restarts it. The lighthouse drops it
    within a second (ft.timeout_s=2); group 0 trains alone (each step logged), 0.5 s a
    step while alone (`fault.slow_alone`: 50 s for 100 steps, however long the restart
    takes), so the restarted group finds it mid-run and heals from it; then both train
    at full speed."""
    run_dir = tmp_path / "run"
    result = run_cli(
        *TINY, "train.max_steps=120", "train.log_every=1", "dist.nproc_per_node=2", "ft.enabled=true",
        "ft.timeout_s=2", "dist.max_restarts=1", "fault.kill_rank=1", "fault.at_step=20", "fault.slow_rank=0",
        "fault.slow_s=0.5", "fault.slow_alone=true", f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={run_dir}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    mine, rejoined = _assert_survived_and_healed(run_dir, 120)
    assert mine["retried_steps"] == 0  # lost between two steps: the next quorum went on without it
    assert 0 < mine["longest_stall_s"] < 30
    assert "1 of 2 groups take part from step 21" in result.stdout + result.stderr
    steps = [r["step"] for r in rejoined]
    assert steps[:20] == list(range(1, 21)) and steps == sorted(set(steps)) and steps[-1] == 120
    assert steps[20] > 21  # it came back at the live step, not where it died


def _worker_pids(launcher: subprocess.Popen, group: int) -> list[int]:
    """The training processes (not torchrun) of replica group `group` under `launcher`: only
    its own, since another test's ft run may train a group of the same number beside it."""
    pids = []
    for pid in descendants(launcher.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"ft.group={group}".encode() in argv and b"torch.distributed.run" not in argv:
            pids.append(pid)
    return pids


@pytest.mark.slow
def test_a_group_killed_during_a_step_costs_the_other_one_retried_step(tmp_path: Path):
    """Group 1 sleeps before each step's exchange, so group 0 waits in the collective
    when group 1 is SIGKILLed: the collective fails, the step is
    dropped and retried without group 1, none is applied twice. Group 1 is not
    restarted (dist.max_restarts=0): the job still ends well, on group 0's summary."""
    run_dir = tmp_path / "run"
    command = [
        str(Path(sys.executable).with_name("ciuic-train")), *TINY, "train.max_steps=30", "dist.nproc_per_node=2",
        "ft.enabled=true", "ft.timeout_s=5", "fault.slow_rank=1", "fault.slow_s=0.5",
        f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
    ]
    launcher = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").is_file() or not metrics(run_dir):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.2)
        time.sleep(0.2)  # inside group 1's pause: group 0 is waiting in the exchange
        victims = _worker_pids(launcher, 1)
        assert victims, "group 1's worker is not among the launcher's processes"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=300)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, out[-3000:]
    survivor = metrics(run_dir)
    steps = [r["step"] for r in survivor]
    assert steps == sorted(set(steps)) and steps[-1] == 30  # strictly increasing: no step redone
    assert survivor[0]["participants"] == 2 and survivor[-1]["participants"] == 1
    mine = summary(run_dir)
    assert mine["steps"] == 30 and mine["retried_steps"] >= 1, out[-3000:]
    assert "is retried: a group was lost during it" in out
    # A SIGKILL closes the dead group's sockets: the collective fails at once, not after
    # ft.timeout_s; the retry waits for the lighthouse to drop the group (no heartbeat).
    assert 0 < mine["longest_stall_s"] < 30


@pytest.mark.slow
def test_fsdp_and_ep_inside_two_groups_train_as_hsdp_over_all_ranks(tmp_path: Path, one_world):
    """2 groups of 2 ranks, each FSDP2 x ep=2, against one world of 4 (HSDP 2 x 2, ep=2):
    the groups average each rank's own shards, so the weights are bit-identical."""
    ft_run, hsdp_run = tmp_path / "ft", one_world["hsdp"]
    result = run_cli(*FSDP_EP, "dist.nproc_per_node=4", f"data.cache_dir={tmp_path / 'cache'}", "ft.enabled=true",
                     "ft.groups=2", f"hydra.run.dir={ft_run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(ft_run)["strategy"] == "fsdp" and summary(hsdp_run)["strategy"] == "hsdp"
    for mine, theirs in zip(metrics(ft_run), metrics(hsdp_run)):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
    checksums = {summary(run)["param_checksum"] for run in (ft_run, ft_run / "group_1", hsdp_run)}
    assert len(checksums) == 1


@pytest.mark.slow
def test_a_lost_lighthouse_stops_the_run_with_one_line(tmp_path: Path):
    """A group started by hand on a lighthouse that dies mid-run: its next quorum fails
    after ft.quorum_timeout_s and the run stops with one line, exit 3, saying that
    nothing was saved, why, and how to continue."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1", "--bind", f"[::]:{port}",
         "--join_timeout_ms", "100"], env={**os.environ, "RUST_LOG": "warn"})
    run_dir = tmp_path / "run"
    command = [
        str(Path(sys.executable).with_name("ciuic-train")), *TINY, "train.max_steps=100000", "train.log_every=1",
        "ft.enabled=true", "ft.groups=1", f"ft.lighthouse=http://127.0.0.1:{port}", "ft.quorum_timeout_s=3",
        "ft.timeout_s=2", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
    ]
    run = None
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"http://127.0.0.1:{port}"):
            assert lighthouse.poll() is None and time.monotonic() < deadline, "the lighthouse never answered"
            time.sleep(0.1)
        run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or len(metrics(run_dir)) < 3:
            assert run.poll() is None and time.monotonic() < deadline, "the run never logged 3 steps"
            time.sleep(0.1)
        lighthouse.kill()
        _, err = run.communicate(timeout=120)
    finally:
        for process in (lighthouse, run):
            if process is not None and process.poll() is None:
                process.kill()
    assert run.returncode == 3, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "no quorum from the lighthouse" in last and "within ft.quorum_timeout_s=3 s" in last, err[-3000:]
    assert "without a save (with no quorum no group knows whether it is the one that saves)" in last
    assert "Traceback" not in err and not (run_dir / "checkpoints").exists()


def _answers(address: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(address, timeout=1).close()
        return True
    except (urllib.error.URLError, OSError):
        return False
