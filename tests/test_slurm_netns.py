"""A two-node Slurm on the emulated hosts: one slurmd per host, jobs across both.

`scripts/cluster/netns_cluster.sh up` makes the hosts and `scripts/slurm/local_cluster.sh
start-netns` runs slurmctld on host0 and a slurmd on each host (as root; `.ci/run` does
both). Slurm's commands run on host0, as on a login node. Without that cluster these tests
are skipped, unless CIUIC_REQUIRE_SLURM=1 and CIUIC_REQUIRE_NETNS=1 say it must be there.
"""

import contextlib
import json
import os
import signal
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import descendants, free_port, kill_tree, torchrun

pytestmark = [pytest.mark.slurm, pytest.mark.netns]

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "scripts" / "slurm" / "local_cluster.sh"
CLUSTER = REPO / "scripts" / "cluster" / "netns_cluster.sh"
TEMPLATE = REPO / "scripts" / "slurm" / "train.sbatch"
# Two ranks of batch 4 each, whatever starts them: every run below trains the same model.
RUN = ("model=tiny", "sample.max_new_tokens=0", "train.max_steps=6", "train.batch_size=4")
# The jobs inherit it (sbatch and srun export the caller's environment): the venv's
# torchrun and ciuic-train on PATH, one thread per rank on a small machine.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def on_host0(*command: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """A command on host0, the login node of the two-node cluster."""
    return subprocess.run([str(CLUSTER), "exec", "0", *command], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _hosts_up() -> bool:
    status = subprocess.run([str(CLUSTER), "status"], capture_output=True, text=True)
    return status.returncode == 0 and "host1" in status.stdout


def _problem() -> str | None:
    if not _hosts_up():
        return "no emulated hosts"
    if shutil.which("sbatch") is None:
        return "no Slurm installed (no sbatch on PATH)"
    ping = on_host0("scontrol", "ping").stdout
    if "UP" not in ping:  # and sinfo would retry for 10 s
        return f"no Slurm controller on host0 ({ping.splitlines()[0] if ping else 'scontrol ping failed'})"
    deadline = time.monotonic() + 60  # the job of the test before may still be completing
    while (nodes := sorted(on_host0("sinfo", "-h", "-N", "-o", "%N=%T").stdout.split())) != ["host0=idle", "host1=idle"]:
        if time.monotonic() > deadline:
            return f"no two idle Slurm nodes on the emulated hosts (sinfo on host0: {nodes})"
        time.sleep(1)
    return None


@pytest.fixture(scope="module")
def two_nodes() -> None:
    required = os.environ.get("CIUIC_REQUIRE_SLURM") == "1" and os.environ.get("CIUIC_REQUIRE_NETNS") == "1"
    problem = _problem()  # the cluster as .ci/run (or its user) started it: no test here restarts a part
    if problem and required:
        pytest.fail(f"CIUIC_REQUIRE_SLURM=1 and CIUIC_REQUIRE_NETNS=1 but {problem}")
    if problem:
        pytest.skip(f"{problem}: as root, run {CLUSTER} up, then {SLURM} start-netns")


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> dict:
    """The same run as two ranks on one host, without Slurm."""
    root = tmp_path_factory.mktemp("one_host")
    result = torchrun("--nproc_per_node=2", "-m", "ciuic_train", *RUN, f"hydra.run.dir={root / 'run'}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return summary(root / "run")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def accounted(name: str, timeout: float = 30) -> str:
    """`NodeList|ExitCode` of the job called `name`, once sacct has it ended."""
    deadline = time.monotonic() + timeout
    while True:
        rows = on_host0("sacct", "-n", "-X", "-P", f"--name={name}", "-o", "State,NodeList,ExitCode")
        rows = rows.stdout.splitlines()
        ended = rows and rows[0].split("|")[0] not in ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED")
        if ended or time.monotonic() > deadline:
            return " ".join(row.split("|", 1)[1] for row in rows)
        time.sleep(0.3)


def test_srun_starts_one_rank_per_node_and_trains_the_one_host_model(two_nodes, one_host, tmp_path):
    name = f"srun-{uuid.uuid4().hex[:8]}"
    result = on_host0("srun", "-N", "2", "--ntasks-per-node=1", f"--job-name={name}", "--kill-on-bad-exit=1",
                      "ciuic-train", *RUN, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert accounted(name) == "host[0-1]|0:0"
    across = summary(tmp_path / "run")
    assert across["world_size"] == 2 and across["strategy"] == "ddp"
    assert across["param_checksum"] == one_host["param_checksum"]


def test_sbatch_template_runs_one_torchrun_per_node(two_nodes, one_host, tmp_path):
    name = f"sbatch-{uuid.uuid4().hex[:8]}"
    submit = on_host0("sbatch", "--parsable", "-N", "2", f"--job-name={name}", f"--output={tmp_path / 'job.out'}",
                      f"--export=ALL,RUN_DIR={tmp_path / 'run'}", str(TEMPLATE), *RUN, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    job, deadline = submit.stdout.strip(), time.monotonic() + 240
    while on_host0("squeue", "-h", "-j", job, "-o", "%T").stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued or running after 240 s"
        time.sleep(0.3)
    log = (tmp_path / "job.out").read_text()
    assert accounted(name) == "host[0-1]|0:0", log[-3000:]
    across = summary(tmp_path / "run")
    assert across["world_size"] == 2 and across["param_checksum"] == one_host["param_checksum"], log[-3000:]


def assert_two_groups_trained_together(run_dir: Path, log: str) -> None:
    """Group 0 in the run folder, group 1 in group_1/: every step averaged over both, the
    same weights at the end."""
    first, second = summary(run_dir), summary(run_dir / "group_1")
    assert (first["replica_group"], second["replica_group"]) == (0, 1), log[-3000:]
    assert first["steps"] == second["steps"] == 6 and first["param_checksum"] == second["param_checksum"]
    participants = [json.loads(line)["participants"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert participants and set(participants) == {2}, participants
    # Each group's torchft checkpoint server (its peer's source of live weights) runs on its node.
    assert "CheckpointServer on http://host0:" in (run_dir / "train.log").read_text(), log[-3000:]
    assert "CheckpointServer on http://host1:" in (run_dir / "group_1" / "train.log").read_text(), log[-3000:]


def test_ft_under_srun_starts_one_replica_group_on_each_node(two_nodes, tmp_path):
    """`srun -N 2 --ntasks-per-node=1` with ft.enabled=true: each node's task starts its group;
    the first node's runs the lighthouse, which the other finds through the job's store."""
    name = f"srun-ft-{uuid.uuid4().hex[:8]}"
    result = on_host0("srun", "-N", "2", "--ntasks-per-node=1", f"--job-name={name}", "--kill-on-bad-exit=1",
                      "ciuic-train", *RUN, "train.log_every=1", "ft.enabled=true", "ft.groups=2",
                      f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert accounted(name) == "host[0-1]|0:0"
    assert_two_groups_trained_together(tmp_path / "run", log)


def test_ft_under_hydras_slurm_launcher_spans_the_job_nodes(two_nodes, tmp_path):
    """`hydra/launcher=slurm hydra.launcher.nodes=2` with ft.enabled=true: the job's task on
    each node starts that node's replica group."""
    sweep = tmp_path / "sweep"
    result = on_host0("ciuic-train", "-m", "hydra/launcher=slurm", "hydra.launcher.nodes=2", *RUN,
                      "train.log_every=1", "ft.enabled=true", "ft.groups=2", f"hydra.sweep.dir={sweep}",
                      cwd=tmp_path, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert_two_groups_trained_together(sweep / "0", log)


def test_ft_across_nodes_losing_the_lighthouses_node_stops_the_other_with_one_line(two_nodes, tmp_path):
    """The first node's task holds the lighthouse and the job's store: with that node lost,
    the other node's group finds no quorum within ft.quorum_timeout_s and its task ends
    in one line, with no traceback, though the store it would report to is gone too."""
    run_dir = tmp_path / "run"
    out, ended_after = _lose_the_first_node(run_dir, "train.max_steps=100000", "ft.quorum_timeout_s=5")
    second_task = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("1:")]
    errors = [line for line in second_task if line.startswith("ciuic-train: error:")]
    # Said by the task of node 1, though not the job's rank 0 (node 0, which would speak, is
    # gone), with what its group said in its console.log.
    assert len(errors) == 1 and "node 1 of 2: every replica group failed (group 1 exit code 1: " in errors[0], out[-3000:]
    assert "no quorum from the lighthouse" in errors[0] and "within ft.quorum_timeout_s=5 s" in errors[0], errors[0]
    assert not any("Traceback" in line for line in second_task), out[-3000:]
    assert ended_after < 60, f"the other node took {ended_after:.0f} s to stop"  # not NODES_WAIT_S, nor a hang


def test_ft_across_nodes_with_the_lighthouse_outside_the_job_outlives_the_first_node(two_nodes, tmp_path):
    """A lighthouse of its own (torchft_lighthouse on host1, `ft.lighthouse=URL`): the first
    node lost, the other node's group trains on alone to the last step and its task ends
    well."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(CLUSTER), "exec", "1", str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1",
         "--bind", f"[::]:{port}", "--join_timeout_ms", "100"], env={**ENV, "RUST_LOG": "warn"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    run_dir, deadline = tmp_path / "run", time.monotonic() + 60
    try:
        answers = f"import urllib.request; urllib.request.urlopen('http://host1:{port}', timeout=1)"
        while on_host0(sys.executable, "-c", answers).returncode != 0:  # host0 reaches host1 by name
            assert lighthouse.poll() is None and time.monotonic() < deadline, "the lighthouse never answered"
            time.sleep(0.2)
        out, _ = _lose_the_first_node(run_dir, "train.max_steps=60", f"ft.lighthouse=http://host1:{port}")
    finally:
        kill_tree(lighthouse)
    second_task = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("1:")]
    assert not any(line.startswith("ciuic-train: error:") or "Traceback" in line for line in second_task), out[-3000:]
    assert "the first node's store at host0" in out, out[-3000:]  # what it could not report to, said
    records = [json.loads(line) for line in (run_dir / "group_1" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == list(range(1, 61)), steps  # every step, none redone
    assert records[0]["participants"] == 2 and records[-1]["participants"] == 1
    assert summary(run_dir / "group_1")["steps"] == 60


def _lose_the_first_node(run_dir: Path, *extra: str) -> tuple[str, float]:
    """srun two ft nodes (one group each) and, once group 1 has logged 3 steps, SIGKILL the
    first node's task and all below it, as a node that lost power would lose them (slurmd
    lives on); the job's output (each line labelled by its task) and the seconds from the
    loss to the job's end. No --kill-on-bad-exit: Slurm would end the other task itself."""
    command = [str(CLUSTER), "exec", "0", "srun", "-N", "2", "--ntasks-per-node=1", "--label",
               f"--job-name=srun-ft-lost-{uuid.uuid4().hex[:8]}", "ciuic-train", *RUN, "train.log_every=1",
               "ft.enabled=true", "ft.groups=2", "ft.timeout_s=2", "fault.slow_rank=0", "fault.slow_s=0.05", *extra,
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    job = subprocess.Popen(command, cwd=run_dir.parent, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)  # fmt: skip
    try:
        deadline, second = time.monotonic() + 180, run_dir / "group_1" / "metrics.jsonl"
        while not second.is_file() or len(second.read_text().splitlines()) < 3:
            if job.poll() is not None or time.monotonic() > deadline:
                kill_tree(job)
                raise AssertionError(f"group 1 never logged 3 steps:\n{job.stdout.read()[-3000:]}")
            time.sleep(0.1)
        first_task = _task_on_host0(run_dir)
        lost = time.monotonic()
        for pid in [*descendants(first_task), first_task]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = job.communicate(timeout=180)
        return out, time.monotonic() - lost
    finally:
        kill_tree(job)


def _task_on_host0(run_dir: Path) -> int:
    """The job's task on host0: the `ciuic-train` of this run that slurmstepd started there."""
    pids = subprocess.run(["ip", "netns", "pids", "ciuic-host0"], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            parent_name = Path(f"/proc/{parent}/comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if parent_name == "slurmstepd" and f"hydra.run.dir={run_dir}".encode() in argv:
            return pid
    raise AssertionError(f"no task of {run_dir} on host0 among {pids}")
