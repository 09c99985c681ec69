"""The memory check before a run starts, the limits it reads, and an out-of-memory during a run."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ciuic_train.cli.main import main
from ciuic_train.cli.preflight import MEMORY_CHECKED_BY, check_request
from ciuic_train.errors import RankFailed, UserError
from ciuic_train.launch import modes as launch
from ciuic_train import memory_limits
from ciuic_train.plan.memory_check import OutOfMemoryGuard, as_launched, check_memory
from ciuic_train.memory_limits import Room, cgroup_memory_left, usable_bytes_per_rank
from ciuic_train.plan.figures import plan_figures
from conftest import compose_config
from test_checkpoint import TINY, corpus, make_trainer

GIB = 2**30
# model=small with wide experts: 4.8 GiB of weights, gradients and AdamW state on one rank.
WIDE = ["model=small", "model.moe_ffn_dim=8192", "model.n_routed_experts=16", "train.batch_size=1", "train.seq_len=64"]
# model=small at 64 x 512 tokens: 105 MiB of state, about 4.6 GiB in all (activations).
LONG = ["model=small", "train.batch_size=64", "train.seq_len=512"]


def figures(*overrides):
    config = compose_config(*overrides)
    f = plan_figures(config)
    return config, f["memory"]["state"], f["memory"]["total"]["ac" if config.activation_checkpointing else "no_ac"]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("[")]


# --- the limits -----------------------------------------------------------------------------


def fake_cgroup(root: Path, membership: str, mount: str, folders: dict[str, dict[str, str]]) -> Path:
    """A /proc/self and a cgroup filesystem under `root`: `folders` maps paths to their files."""
    proc = root / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(membership + "\n")
    (proc / "mountinfo").write_text(
        "22 1 0:21 / / rw - ext4 /dev/root rw\n" + mount + "\n"
    )
    for folder, files in folders.items():
        path = root / folder.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (path / name).write_text(text)
    return proc


def test_cgroup_v2_takes_the_tightest_of_the_cgroup_and_its_parents(tmp_path):
    proc = fake_cgroup(
        tmp_path, "0::/user.slice/job.scope",
        "30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate",
        {
            "/sys/fs/cgroup/user.slice/job.scope": {
                "memory.max": f"{8 * GIB}\n", "memory.current": f"{3 * GIB}\n",
                "memory.stat": f"anon 1\ninactive_file {GIB}\nactive_file 5\n",
            },
            "/sys/fs/cgroup/user.slice": {"memory.max": "max\n", "memory.current": f"{20 * GIB}\n"},
        },
    )
    assert cgroup_memory_left(proc, tmp_path) == Room(6 * GIB, "cgroup memory.max")  # 8 - (3 - 1 reclaimable)
    (tmp_path / "sys/fs/cgroup/user.slice/memory.max").write_text(f"{22 * GIB}\n")
    assert cgroup_memory_left(proc, tmp_path) == Room(2 * GIB, "cgroup memory.max")  # the parent is tighter
    (tmp_path / "sys/fs/cgroup/user.slice/memory.max").write_text("max\n")
    (tmp_path / "sys/fs/cgroup/user.slice/job.scope/memory.max").write_text("max\n")
    assert cgroup_memory_left(proc, tmp_path) is None


def test_cgroup_v1_inside_a_container_reads_the_mounted_folder(tmp_path):
    """A container sees its own cgroup mounted at the top of the hierarchy (mount root
    /docker/abc), and cgroup v1 writes 2^63 rounded to a page for no limit."""
    proc = fake_cgroup(
        tmp_path, "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/",
        "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory",
        {"/sys/fs/cgroup/memory": {
            "memory.limit_in_bytes": f"{4 * GIB}\n", "memory.usage_in_bytes": f"{GIB}\n",
            "memory.stat": "cache 7\ntotal_inactive_file 0\n",
        }},
    )
    assert cgroup_memory_left(proc, tmp_path) == Room(3 * GIB, "cgroup memory.limit_in_bytes")
    (tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory_left(proc, tmp_path) is None
    assert cgroup_memory_left(tmp_path / "no" / "proc", tmp_path) is None  # no /proc: nothing said


def test_proc_readers_and_the_address_space_limit(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemTotal:       24683584 kB\nMemAvailable:    1048576 kB\n")
    (tmp_path / "status").write_text("Name:\tpython\nVmPeak:\t 9999 kB\nVmSize:\t  524288 kB\nVmRSS:\t 1 kB\n")
    assert memory_limits.mem_available(tmp_path / "meminfo") == GIB
    assert memory_limits.mem_available(tmp_path / "missing") is None
    assert memory_limits.mapped_bytes(tmp_path / "status") == GIB // 2
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memory_limits.address_space_left(tmp_path / "status") is None
    monkeypatch.setattr(resource, "getrlimit", lambda _: (2 * GIB, resource.RLIM_INFINITY))
    assert memory_limits.address_space_left(tmp_path / "status") == 3 * GIB // 2  # the limit less VmSize


def test_a_rank_gets_the_tightest_bound_and_its_share_of_the_node(monkeypatch):
    monkeypatch.setattr(memory_limits, "address_space_left", lambda: 5 * GIB)  # per process: not divided
    monkeypatch.setattr(memory_limits, "cgroup_memory_left", lambda: Room(16 * GIB, "cgroup memory.max"))
    monkeypatch.setattr(memory_limits, "mem_available", lambda: 12 * GIB)
    assert usable_bytes_per_rank("cpu", 1) == Room(5 * GIB, "address-space limit (ulimit -v)")
    assert usable_bytes_per_rank("cpu", 2) == Room(5 * GIB, "address-space limit (ulimit -v)")
    assert usable_bytes_per_rank("cpu", 4) == Room(3 * GIB, "available memory / 4 local ranks")
    monkeypatch.setattr(memory_limits, "mem_available", lambda: None)
    assert usable_bytes_per_rank("cpu", 4) == Room(4 * GIB, "cgroup memory.max / 4 local ranks")


# --- the check ------------------------------------------------------------------------------


def test_the_refusal_names_the_need_the_room_and_a_layout_that_fits():
    config, exact, _ = figures(*WIDE)
    room = Room(2 * GIB, "available memory")
    assert exact > room.bytes
    verdict = check_memory(config, room)
    assert not verdict.fits and not verdict.fits_total
    line = verdict.line
    assert "\n" not in line
    assert line.startswith("model=small on 1 rank does not fit in memory: each rank needs 4.81 GiB for its weights")
    assert "a rank here has 2.00 GiB (available memory)" in line
    assert "it would fit with dist.nnodes=8 dist.dp_shard=8 (8 nodes like this one; about 1.40 GiB per rank in all)" in line
    assert line.endswith("to start anyway: train.check_memory=false")
    _, on_3, total_on_3 = figures(*WIDE, "dist.nnodes=3", "dist.dp_shard=3")
    _, on_2, _ = figures(*WIDE, "dist.nnodes=2", "dist.dp_shard=2")
    assert on_3 <= room.bytes < on_2  # 3 nodes are the fewest for the exact part,
    _, _, total_on_4 = figures(*WIDE, "dist.nnodes=4", "dist.dp_shard=4", "activation_checkpointing=true", "train.batch_size=1")
    assert total_on_3 > room.bytes and total_on_4 > room.bytes  # but the total needs the next power of two


def test_the_refusal_shards_over_the_ranks_the_run_has_before_asking_for_more():
    # DDP: every rank holds it all, as one process does (its gradients are its buckets).
    config = compose_config(*WIDE, "dist.nproc_per_node=4")
    verdict = check_memory(config, Room(4 * GIB, "available memory / 4 local ranks"))
    assert not verdict.fits and "on 4 ranks" in verdict.line and "each rank needs 4.81 GiB" in verdict.line
    assert "it would fit with dist.dp_shard=4 (about 2.00 GiB per rank in all);" in verdict.line
    # With less room the total needs more shards: whole nodes like this one, of 4 ranks each.
    verdict = check_memory(config, Room(2 * GIB, "available memory / 4 local ranks"))
    assert "it would fit with dist.nnodes=2 dist.dp_shard=8 (2 nodes like this one; about 1.40 GiB per rank in all)" in verdict.line


def test_the_warning_names_single_changes_that_bring_the_total_within_reach():
    config, exact, total = figures(*LONG)
    room = Room((exact + total) // 2, "address-space limit (ulimit -v)")
    verdict = check_memory(config, room)
    assert verdict.fits and not verdict.fits_total
    assert "may not fit in memory: its estimated total is" in verdict.line
    assert "it would fit with activation_checkpointing=true (about" in verdict.line
    assert "train.batch_size=" in verdict.line and verdict.line.endswith("going on (the total is an estimate)")
    _, _, with_ac = figures(*LONG, "activation_checkpointing=true")
    assert with_ac <= room.bytes
    assert check_memory(config, Room(total, "available memory")).fits_total


def test_the_plan_describes_the_world_this_process_was_launched_into():
    config = compose_config("model=tiny")
    launched = as_launched(config, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (launched.dist.nnodes, launched.dist.nproc_per_node) == (2, 4)
    assert as_launched(config, {}).dist == config.dist


# --- where the CLI checks -------------------------------------------------------------------


@pytest.fixture
def room_of(monkeypatch):
    """Pretend a rank here has `room` bytes."""
    def pretend(size: int) -> None:
        monkeypatch.setattr(memory_limits, "usable_bytes_per_rank", lambda *_: Room(size, "available memory"))
    return pretend


def test_preflight_refuses_warns_or_lets_the_user_skip(tmp_path, text_corpus, room_of, capsys):
    args = [*corpus(text_corpus, tmp_path), f"hydra.run.dir={tmp_path / 'run'}"]
    room_of(2 * GIB)
    with pytest.raises(UserError, match=r"does not fit in memory: each rank needs 4.81 GiB .* has 2.00 GiB"):
        check_request([*args, *WIDE], check_memory=True)
    (job,) = check_request([*args, *WIDE, "train.check_memory=false"], check_memory=True)
    assert job.config.train.check_memory is False
    check_request([*args, *WIDE], check_memory=False)  # --plan reports instead
    assert capsys.readouterr().err == ""
    main([*args, *WIDE, "--plan"])  # which is what the command asks for under --plan
    assert "per rank" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()

    _, exact, total = figures(*LONG)
    room_of((exact + total) // 2)
    check_request([*args, *LONG], check_memory=True)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ciuic-train: warning: model=small on 1 rank may not fit in memory")
    assert not (tmp_path / "run").exists()


def test_workers_of_the_cli_launcher_leave_the_check_to_it(tmp_path, text_corpus, room_of, monkeypatch):
    args = [*corpus(text_corpus, tmp_path), *WIDE, f"hydra.run.dir={tmp_path / 'run'}"]
    room_of(2 * GIB)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with pytest.raises(UserError, match="does not fit"):  # a worker torchrun started checks its own share
        check_request(args, launch.ElasticWorker(), check_memory=True)
    monkeypatch.setenv(MEMORY_CHECKED_BY, str(os.getppid()))  # ... one our launcher started does not
    check_request(args, launch.ElasticWorker(), check_memory=True)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv(MEMORY_CHECKED_BY)
    room_of(100 * GIB)
    check_request([*args, "dist.nproc_per_node=2"], launch.ElasticLauncher(), check_memory=True)
    assert os.environ[MEMORY_CHECKED_BY] == str(os.getpid())  # the launcher checked the node for its workers


def test_a_machine_too_small_refuses_in_one_line_and_writes_nothing(tmp_path, text_corpus):
    """For real: 3 GiB of address space (less what torch maps) against 4.8 GiB of state."""
    exe = Path(sys.executable).with_name("ciuic-train")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(exe), *corpus(text_corpus, tmp_path), *WIDE, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "MALLOC_ARENA_MAX": "2"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 * GIB, resource.RLIM_INFINITY)),
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ciuic-train: error: model=small on 1 rank does not fit in memory: each rank needs 4.81 GiB")
    assert "(address-space limit (ulimit -v)); it would fit with dist.nnodes=" in line
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


# --- out of memory during the run -----------------------------------------------------------


def test_the_guard_turns_only_allocator_failures_into_one_line(tmp_path):
    guard = OutOfMemoryGuard(compose_config("model=tiny", "resume=none"), 1, tmp_path)
    with pytest.raises(RankFailed) as failure:
        with guard.during("step 7"):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 8 bytes. Error code 12 (Cannot allocate memory)")
    line = str(failure.value)
    assert line.startswith("out of memory on rank 1 in step 7 (DefaultCPUAllocator: can't allocate memory")
    assert "no checkpoint was saved yet" in line and f"hydra.run.dir={tmp_path} resume=auto" in line
    with pytest.raises(RankFailed, match="in the evaluation after step 3"):
        with guard.during("the evaluation after step 3"):
            raise MemoryError()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with guard.during("step 1"):
            raise RuntimeError("shape mismatch")


def test_out_of_memory_in_a_step_is_one_line_and_the_checkpoint_before_it_resumes(tmp_path, text_corpus, one_thread):
    """Rank 0's address space is capped before step 3 (fault.oom_*): the step's next fresh
    allocation fails in torch's CPU allocator, as under `ulimit -v`. glibc's malloc would
    serve this small step from memory it holds already; MALLOC_MMAP_THRESHOLD_ makes
    every tensor of 128 KiB or more a fresh map."""
    run_dir = tmp_path / "run"
    overrides = [*TINY, *corpus(text_corpus, tmp_path), "train.seq_len=128", "train.batch_size=8", "train.max_steps=4",
                 "ckpt.every=1"]
    exe = Path(sys.executable).with_name("ciuic-train")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [str(exe), *overrides, "fault.oom_rank=0", "fault.oom_at_step=3", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env,
    )
    assert result.returncode == 3, result.stderr
    (line,) = error_lines(result.stderr)
    assert line.startswith("ciuic-train: error: out of memory on rank 0 in step 3 (DefaultCPUAllocator: ")
    assert "the plan puts a rank at" in line
    assert f"the last complete checkpoint {run_dir / 'checkpoints' / 'step_000002'} is intact" in line
    assert f"then rerun with hydra.run.dir={run_dir} to continue from it" in line
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]

    resumed = make_trainer(run_dir, text_corpus, tmp_path, *overrides[len(TINY) + 3:])  # resume=auto, no fault
    assert resumed.resumed_from.name == "step_000002" and resumed.step == 2
    assert resumed.fit()["steps"] == 4


@pytest.mark.slow
def test_the_rank_that_runs_out_says_so_whichever_it_is(tmp_path, text_corpus):
    """Rank 1 of the CLI's two workers runs out: its own line reaches the user (rank 0
    then loses its peer and says that too), and the checkpoint before it is intact."""
    run_dir = tmp_path / "run"
    exe = Path(sys.executable).with_name("ciuic-train")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [str(exe), *TINY, *corpus(text_corpus, tmp_path), "train.seq_len=128", "train.batch_size=8",
         "train.max_steps=4", "ckpt.every=1", "dist.nproc_per_node=2", "dist.timeout_s=60",
         "fault.oom_rank=1", "fault.oom_at_step=3", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env,
    )
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert any(line.startswith("ciuic-train: error: out of memory on rank 1 in step 3 (") for line in lines), lines
    assert "Traceback" not in result.stdout + result.stderr
    assert (run_dir / "checkpoints" / "step_000002" / "meta.json").is_file()
