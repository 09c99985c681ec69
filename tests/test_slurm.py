"""Cluster submission, against a real Slurm (scripts/slurm/local_cluster.sh start).

Tests marked `slurm` submit real jobs. Without a cluster they are skipped, unless
CIUIC_REQUIRE_SLURM=1 (set by .ci/run once it has started one), where that is a failure.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ciuic_train.cli.preflight import check_request
from ciuic_train.config import DistConfig
from ciuic_train.errors import UserError
from conftest import compose_config, run_cli, torchrun

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "scripts" / "slurm" / "train.sbatch"
TINY = ("model=tiny", "sample.max_new_tokens=0")


def _cluster_problem() -> str | None:
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:
        return "hydra-submitit-launcher is not installed (pip install '.[slurm]')"
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH"
    deadline = time.monotonic() + 60  # the job of the test before may still be completing
    while True:
        try:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return "sinfo does not answer"
        if {"idle", "mixed"} & set(state):
            return None
        if time.monotonic() > deadline:
            return f"no idle Slurm node (sinfo: {state})"
        time.sleep(1)


@pytest.fixture(scope="module")
def slurm() -> None:
    problem = _cluster_problem()
    if problem and os.environ.get("CIUIC_REQUIRE_SLURM") == "1":
        pytest.fail(f"CIUIC_REQUIRE_SLURM=1 but {problem}")
    if problem:
        pytest.skip(f"{problem}: start one with scripts/slurm/local_cluster.sh start")


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def wait_for_step(metrics: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and sum(1 for _ in metrics.open()) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"{metrics} did not reach step {step} in {timeout} s")


def job_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def wait_until_gone(job: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while job_state(job):
        assert time.monotonic() < deadline, f"job {job} still {job_state(job)} after {timeout} s"
        time.sleep(0.3)


def sbatch(*args: str, cwd: Path, wait: bool = True) -> str:
    """Submit a batch job; with wait, return once it has left the queue (`sbatch --wait`
    polls with a back-off of up to half a minute, longer than these jobs run)."""
    # This interpreter's scripts (torchrun, ciuic-train) on the job's PATH (--export=ALL), as
    # an activated environment puts them there.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    job = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True,
                         check=True)
    job_id = job.stdout.strip().split(";")[0]
    if wait:
        wait_until_gone(job_id)
    return job_id


def exit_code(job: str, timeout: float = 30) -> str:
    """The job's exit code as accounting records it, once the record says the job ended: a
    job that has left the queue can still read RUNNING there, with exit code 0:0."""
    deadline = time.monotonic() + timeout
    while True:
        state, code = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,ExitCode"],
                                     capture_output=True, text=True).stdout.strip().partition("|")[::2]
        if state not in ("", "PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED"):
            return code
        assert time.monotonic() < deadline, f"accounting still has job {job} {state or 'unrecorded'} after {timeout} s"
        time.sleep(0.2)


def release_when_requeued(job: str, timeout: float = 60) -> None:
    """Slurm holds a requeued job back for two minutes; start it as soon as its last run
    has been cleaned up (a few seconds), to keep the test short."""
    deadline = time.monotonic() + timeout
    while job_state(job) != "PENDING":
        assert time.monotonic() < deadline, f"job {job} was not requeued (state {job_state(job)!r})"
        time.sleep(0.2)
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)


def array_job_ids(sweep: Path, count: int = 1, timeout: float = 60) -> list[str]:
    """The Slurm ids of a sweep's jobs, from the submitit folders: `<array>_<index>` for
    the elements of an array (beside the array's own folder), the plain id for one job."""
    deadline = time.monotonic() + timeout
    while True:
        names = sorted(p.name for p in (sweep / ".submitit").glob("*") if p.name[0].isdigit())
        ids = [n for n in names if "_" in n] or names
        if len(ids) >= count:
            return ids
        assert time.monotonic() < deadline, f"no {count} submitted jobs under {sweep}"
        time.sleep(0.1)


# --- without a cluster -------------------------------------------------------------


class EndedJob:
    """A submitit job that has ended in `state`, with or without its result file."""

    def __init__(self, state: str, result_file: Path):
        self.state, self.paths = state, SimpleNamespace(result_pickle=result_file)

    def wait(self) -> None:
        pass

    def results(self) -> list:
        return ["its return"]


def test_a_job_slurm_stopped_is_reported_without_waiting_for_a_result_that_cannot_come(tmp_path):
    launchers = pytest.importorskip("hydra_plugins.ciuic_train_launcher._launchers")  # the `slurm` extra
    job_result, UncompletedJobError = launchers._result, pytest.importorskip("submitit.core.utils").UncompletedJobError
    missing = tmp_path / "no_result.pkl"
    with pytest.raises(UncompletedJobError, match="CANCELLED by 0"):
        job_result(EndedJob("CANCELLED by 0", missing))
    assert job_result(EndedJob("COMPLETED", missing)) == "its return"  # submitit's own wait for the file
    missing.touch()  # written before the cancel came
    assert job_result(EndedJob("CANCELLED by 0", missing)) == "its return"


def test_launcher_mistakes_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # a login node, cluster or not
    with pytest.raises(UserError, match=r"hydra/launcher=slurm acts only with -m"):
        check_request(["hydra/launcher=slurm", *TINY])
    with pytest.raises(UserError, match=r"set hydra.launcher.tasks_per_node=N instead of dist.nproc_per_node=N"):
        check_request(["-m", "hydra/launcher=local", "dist.nproc_per_node=2", *TINY])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserError, match=r"Slurm's sbatch, which is not on PATH.*hydra/launcher=local"):
        check_request(["-m", "hydra/launcher=slurm", *TINY])


def test_missing_slurm_extra_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "submitit" in name else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'ciuic-train\[slurm\]'"):
        check_request(["-m", "hydra/launcher=local", *TINY])


def test_a_cancel_outranks_a_time_limit_warning_in_one_process():
    """SIGTERM (a cancel) must not become a requeue, whichever came first."""
    import torch

    from ciuic_train.distributed.process_group import Parallel
    from ciuic_train.train.stop_request import StopRequest

    single = Parallel(DistConfig(), torch.device("cpu"), n_routed_experts=4)
    with StopRequest() as stop:
        assert StopRequest.decide(single.sum(stop.votes())) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert StopRequest.decide(single.sum(stop.votes())) == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert StopRequest.decide(single.sum(stop.votes())) == "SIGTERM"
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # restored


@pytest.mark.slow
def test_ranks_that_saw_different_signals_agree_on_one(tmp_path):
    """3 gloo ranks (tests/signal_vote_rank.py), each sent its own signals: every rank
    decides the same, from the votes summed over the group."""
    scenarios = {  # what each rank saw -> what all decide
        "a cancel on one rank outranks a warning on another": ([["SIGUSR1"], ["SIGTERM"], []], "SIGTERM"),
        "one rank's warning stops them all": ([[], [], ["SIGUSR1"]], "SIGUSR1"),
        "none": ([[], [], []], None),
    }
    result = torchrun("--nproc_per_node=3", str(Path(__file__).with_name("signal_vote_rank.py")), str(tmp_path),
                      json.dumps([seen for seen, _ in scenarios.values()]), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = [decided for _, decided in scenarios.values()]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)] == [expected] * 3


def test_rendezvous_port_follows_the_job(monkeypatch):
    from ciuic_train.launch.slurm import PORT_BASE, PORT_SPAN, Task

    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    ports = set()
    for job in ("41", "42", "43"):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        ports.add(Task(job, 0, 0, 2, 1, "node1").master_port)
    assert len(ports) == 3 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)


def test_ft_under_a_submitit_launcher_takes_one_task_per_job_that_starts_the_groups(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    ft = ["-m", "hydra/launcher=slurm", "ft.enabled=true", *TINY]
    with pytest.raises(UserError, match=r"set hydra.launcher.tasks_per_node=1, not 2"):
        check_request([*ft, "hydra.launcher.tasks_per_node=2", "dist.nproc_per_node=2"])
    with pytest.raises(UserError, match=r"set hydra.launcher.tasks_per_node=1, not 2"):  # each job of a sweep
        check_request([*ft, "hydra.launcher.tasks_per_node=1,2", "dist.nproc_per_node=2"])
    with pytest.raises(UserError, match=r"ft.groups=2 does not divide dist.nproc_per_node=3"):
        check_request([*ft, "dist.nproc_per_node=3"])
    assert len(check_request([*ft, "dist.nproc_per_node=4"])) == 1  # two groups of two ranks in one task
    # On several nodes each node's task starts ft.groups / nodes of them.
    with pytest.raises(UserError, match=r"^ft.groups=3 does not divide among the job's 2 nodes"):
        check_request([*ft, "hydra.launcher.nodes=2", "ft.groups=3", "dist.nproc_per_node=3"])
    with pytest.raises(UserError, match=r"^ft.groups=4 \(2 per node\) does not divide dist.nproc_per_node=3"):
        check_request([*ft, "hydra.launcher.nodes=2", "ft.groups=4", "dist.nproc_per_node=3"])
    assert len(check_request([*ft, "hydra.launcher.nodes=2", "ft.groups=2", "dist.nproc_per_node=1"])) == 1


def test_ft_under_srun_takes_one_task_per_node_that_starts_its_groups():
    from ciuic_train.launch.replica_groups import NodeShare, check_ft_launch

    config = compose_config(*TINY, "ft.enabled=true", "ft.groups=4", "dist.nproc_per_node=2")
    with pytest.raises(UserError, match=r"^ft.enabled=true under srun with 2 tasks per node: .* --ntasks-per-node=1"):
        check_ft_launch(config, False, srun_tasks_per_node=2, nodes=2)
    check_ft_launch(config, False, srun_tasks_per_node=1, nodes=2)  # two groups of one rank on each node
    with pytest.raises(UserError, match=r"^ft.groups=4 does not divide among the job's 3 nodes"):
        check_ft_launch(config, False, srun_tasks_per_node=1, nodes=3)
    shares = [NodeShare(node, 2, "host0", 20000).groups(4) for node in range(2)]
    assert [list(groups) for groups in shares] == [[0, 1], [2, 3]]


@pytest.mark.slow
def test_local_launcher_trains_two_ranks_in_one_folder(tmp_path):
    """hydra/launcher=local: the Slurm launcher's path (one task per rank) without Slurm."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "hydra/launcher=local", "hydra.launcher.tasks_per_node=2", *TINY, "train.max_steps=4",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    job = summary(sweep / "0")
    assert job["world_size"] == 2 and job["strategy"] == "ddp" and job["steps"] == 4
    # Rank 0 alone wrote the Hydra files and the log: one config, one log, no worker logs.
    assert (sweep / "0" / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in (sweep / "0").glob("*.log")) == ["train.log"]


# --- on the cluster -----------------------------------------------------------------


@pytest.mark.slurm
def test_sweep_becomes_a_job_array_with_a_summary_per_job(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "hydra/launcher=slurm", "+trick=[],[chaotic_sampler]", *TINY, "train.max_steps=10",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [summary(sweep / n)["tricks"] for n in ("0", "1")] == [[], ["chaotic_sampler"]]
    ids = array_job_ids(sweep, count=2)
    assert len(ids) == 2 and len({i.split("_")[0] for i in ids}) == 1, ids  # one array, two elements


@pytest.mark.slurm
def test_two_task_job_trains_one_run_with_world_size_two(slurm, tmp_path):
    """Two srun tasks are two ranks of one run; the same run as plain `srun -n 2 ciuic-train`."""
    sweep = tmp_path / "sweep"
    common = (*TINY, "train.max_steps=6")
    result = run_cli(
        "-m", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", *common, f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    launched = summary(sweep / "0")
    assert launched["world_size"] == 2 and launched["strategy"] == "ddp"

    exe = Path(sys.executable).with_name("ciuic-train")
    job = sbatch("--ntasks=2", f"--output={tmp_path / 'srun.out'}", f"--wrap=srun {exe} {' '.join(common)}", cwd=tmp_path)
    assert exit_code(job) == "0:0", (tmp_path / "srun.out").read_text()[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("slurm-*")
    assert summary(run_dir)["world_size"] == 2
    # Both ranks checked the checksum against each other (the run fails otherwise), and
    # the two ways of starting the tasks train the same model.
    assert summary(run_dir)["param_checksum"] == launched["param_checksum"]


@pytest.mark.slurm
def test_a_slurm_job_of_ft_starts_its_replica_groups_in_its_one_task(slurm, tmp_path):
    """`ft.enabled=true` through hydra/launcher=slurm: the job's task starts the lighthouse
    and two groups of one rank on its node, which train together (both in every step's
    average) and end with the same weights."""
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=2", *TINY, "train.max_steps=10",
        "train.log_every=5", "dist.nproc_per_node=2", "ft.enabled=true", "ft.groups=2", f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = sweep / "0"
    first, second = summary(run), summary(run / "group_1")
    assert first["replica_groups"] == 2 and (first["replica_group"], second["replica_group"]) == (0, 1)
    assert first["steps"] == second["steps"] == 10 and first["param_checksum"] == second["param_checksum"]
    participants = [json.loads(line)["participants"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert participants == [2, 2]


@pytest.mark.slurm
def test_cancelled_job_is_reported_failed_with_its_log(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    exe = Path(sys.executable).with_name("ciuic-train")
    sweep_process = subprocess.Popen(
        [str(exe), "-m", "hydra/launcher=slurm", *TINY, "train.max_steps=100000", "train.log_every=1",
         f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_step(sweep / "0" / "metrics.jsonl", 2)
        (job,) = array_job_ids(sweep)
        subprocess.run(["scancel", job], check=True)
        _, err = sweep_process.communicate(timeout=120)
    finally:
        sweep_process.kill()
    assert sweep_process.returncode == 1, err[-3000:]
    assert "1 of 1 jobs failed" in err and "job #0" in err and "CANCELLED" in err, err[-3000:]
    log = Path(err.split("log: ")[1].split()[0])
    assert log.is_file() and job.split("_")[0] in log.name


@pytest.mark.slurm
def test_time_limit_signal_requeues_and_resumes_to_the_uninterrupted_result(slurm, tmp_path):
    """Two identical jobs; Slurm's pre-timeout signal (USR1) goes to the second, which saves,
    requeues itself and resumes. Both must end with bit-identical weights."""
    sweep = tmp_path / "sweep"
    exe = Path(sys.executable).with_name("ciuic-train")
    sweep_process = subprocess.Popen(
        [str(exe), "-m", "hydra/launcher=slurm", *TINY, "seed=0,0", "train.max_steps=120", "train.log_every=1",
         "ckpt.every=0", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_step(sweep / "1" / "metrics.jsonl", 3)
        preempted = array_job_ids(sweep, count=2)[1]
        subprocess.run(["scancel", "--signal=USR1", preempted], check=True)
        release_when_requeued(preempted)
        _, err = sweep_process.communicate(timeout=300)
    finally:
        sweep_process.kill()
    assert sweep_process.returncode == 0, err[-3000:]
    uninterrupted, resumed = summary(sweep / "0"), summary(sweep / "1")
    assert uninterrupted["resumed_from"] is None and resumed["resumed_from"] is not None
    assert resumed["steps"] == uninterrupted["steps"] == 120
    assert resumed["param_checksum"] == uninterrupted["param_checksum"]


@pytest.mark.slurm
def test_sbatch_template_runs_torchrun_and_requeues_before_the_time_limit(slurm, tmp_path):
    """The template: two torchrun workers, once uninterrupted, once signalled as
    `--signal=B:USR1@120` does (USR1 to the batch script), requeued and resumed."""
    args = ["--cpus-per-task=2", str(TEMPLATE), *TINY, "train.max_steps=60", "train.log_every=1", "ckpt.every=0"]
    reference = sbatch(f"--output={tmp_path / 'ref.out'}", "--export=ALL,NPROC_PER_NODE=2,RUN_DIR=ref", *args,
                       cwd=tmp_path)
    assert exit_code(reference) == "0:0", (tmp_path / "ref.out").read_text()[-3000:]
    uninterrupted = summary(tmp_path / "ref")
    assert uninterrupted["world_size"] == 2 and uninterrupted["resumed_from"] is None

    job = sbatch(f"--output={tmp_path / 'job.out'}", "--export=ALL,NPROC_PER_NODE=2,RUN_DIR=run", *args,
                 cwd=tmp_path, wait=False)
    wait_for_step(tmp_path / "run" / "metrics.jsonl", 3)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    release_when_requeued(job)
    wait_until_gone(job)
    log = (tmp_path / "job.out").read_text()
    assert "requeueing job" in log, log[-3000:]
    resumed = summary(tmp_path / "run")
    assert resumed["resumed_from"] is not None and resumed["steps"] == 60, log[-3000:]
    assert resumed["param_checksum"] == uninterrupted["param_checksum"]
