"""Launch paths without starting processes: which path the environment names, and what each adds.

The paths at work, with real processes: tests/test_distributed.py (torchrun, the CLI's own
launcher) and tests/test_slurm.py (srun, the Hydra launchers).
"""

import json
import os

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from ciuic_train.launch import modes as launch
from ciuic_train.cli.preflight import check_request
from ciuic_train.errors import UserError
from ciuic_train.launch.slurm import WORKER_OVERRIDES, Task
from conftest import free_port

# Everything a path reads from the environment, or a path's hook writes into it.
LAUNCH_ENV = (
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS", "SUBMITIT_FOLDER", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "OMP_NUM_THREADS", "SLURM_CPUS_ON_NODE", "SLURM_CPUS_PER_TASK",
)


@pytest.fixture
def env(monkeypatch):
    """A clean launch environment; whatever a test or a hook sets is undone after it."""
    for name in LAUNCH_ENV:
        monkeypatch.setenv(name, "")  # so that monkeypatch restores the variable, set or not
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(
    "variables, path",
    [
        ({}, launch.ElasticLauncher),
        ({"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2", "RANK": "1"}, launch.ElasticWorker),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}, launch.SrunTask),
        # One srun task is a plain process, free to start workers of its own.
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}, launch.ElasticLauncher),
        # torchrun inside an sbatch job.
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "TORCHELASTIC_RUN_ID": "r",
          "WORLD_SIZE": "4"}, launch.ElasticWorker),
        # A task of hydra/launcher=slurm: the launcher exported its rank before the job.
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SUBMITIT_FOLDER": "f",
          "WORLD_SIZE": "2"}, launch.LauncherTask),
        # Its one task (one node, one rank): nothing exported, free to start workers.
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SUBMITIT_FOLDER": "f"},
         launch.ElasticLauncher),
    ],
)
def test_the_environment_names_the_launch_path(env, variables, path):
    for name, value in variables.items():
        env.setenv(name, value)
    assert type(launch.current()) is path


@pytest.mark.parametrize("rank", [0, 1])
def test_srun_tasks_take_their_rank_from_slurm_and_share_a_folder_named_after_the_step(env, rank):
    env.setenv("SLURM_JOB_ID", "41")
    env.setenv("SLURM_STEP_ID", "3")
    env.setattr(Task, "from_slurm", classmethod(lambda cls: Task("41", rank, rank, 2, 1, "node1")))
    overrides = launch.SrunTask().overrides_before_check(["model=tiny"])
    assert overrides == ["hydra.run.dir='outputs/slurm-41.3'", *(WORKER_OVERRIDES if rank else ())]
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == (str(rank), "2", "node1")
    assert os.environ["OMP_NUM_THREADS"]  # set before torch is imported
    named = launch.SrunTask().overrides_before_check(["hydra.run.dir=mine"])
    assert not any(o.startswith("hydra.run.dir=") for o in named)


def test_elastic_workers_take_the_first_proposed_folder(env, tmp_path):
    """Ranks resolve `${now:}` a moment apart; the agent's store settles on one folder."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    agent_store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    env.setenv("TORCHELASTIC_RUN_ID", "run-1")
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    env.setenv("MASTER_ADDR", "127.0.0.1")
    env.setenv("MASTER_PORT", str(port))
    env.setenv("RANK", "0")
    first = launch.ElasticWorker().run_folder(str(tmp_path / "12-00-00"))
    assert launch.ElasticWorker().overrides_after_check(first) == []
    env.setenv("RANK", "1")
    second = launch.ElasticWorker().run_folder(str(tmp_path / "12-00-01"))
    assert launch.ElasticWorker().overrides_after_check(second) == list(WORKER_OVERRIDES)
    assert first == second == str(tmp_path / "12-00-00")
    assert agent_store.get("ciuic_train/run_dir/run-1").decode() == str(tmp_path / "12-00-00")


def test_workers_without_the_agents_store_need_a_named_folder(env):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a replaced node's rejoin needs it) takes the store
    the ranks agree on a folder through: several ranks must be given one."""
    env.setenv("TORCHELASTIC_RUN_ID", "run-1")
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    env.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.*name it: hydra.run.dir=DIR"):
        launch.ElasticWorker().overrides_before_check(["model=tiny"])
    assert launch.ElasticWorker().overrides_before_check(["model=tiny", "hydra.run.dir=/shared/run"]) == []
    env.setenv("WORLD_SIZE", "1")
    assert launch.ElasticWorker().overrides_before_check(["model=tiny"]) == []
    env.setenv("WORLD_SIZE", "2")
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert launch.ElasticWorker().overrides_before_check(["model=tiny"]) == []


@pytest.mark.parametrize("path", [launch.SrunTask(), launch.ElasticWorker()])
def test_a_sweep_is_refused_where_every_rank_would_run_all_of_it(path):
    with pytest.raises(UserError, match=f"-m under {path.name} would run the whole sweep on every rank"):
        check_request(["-m", "seed=0,1", "model=tiny"], path)


@pytest.mark.parametrize("value", ["/runs/a b/lr=1e-3", "it's", "a\\b", "a\\'b", "a\\\\'b", "ends\\", "ends\\\\", "''"])
def test_quoted_values_read_back_verbatim(value):
    (override,) = OverridesParser.create().parse_overrides([f"hydra.run.dir={launch.quote_override(value)}"])
    assert override.value() == value


@pytest.mark.parametrize(
    "exit_codes, reported",
    [
        ({0: 2, 1: 2}, 2),
        ({0: 2, 1: -15}, 2),  # rank 1, still on its way to the same mistake, stopped by the launcher
        ({0: 2, 1: -9}, 2),
        ({0: 2, 1: 1}, None),  # a crash beside the mistake
        ({0: 2, 1: -11}, None),
        ({0: -15, 1: 2}, None),  # rank 0 was stopped before it could say what was wrong
        ({0: 1}, None),
        ({0: 3, 1: 3}, 3),  # the run stopped itself (diverged, cannot save) and rank 0 said why
        ({0: 3, 1: -15}, 3),
        ({0: -15, 1: 3}, 3),  # all ranks stopped the run; rank 0 said why, then was stopped on its way out
        ({0: -15, 1: 3, 2: 1}, None),  # and a crash beside it
        ({0: 3, 1: 2}, None),  # rank 1 met something else
    ],
)
def test_workers_exit_as_reported_only_when_rank_0_said_why_and_no_rank_crashed(exit_codes, reported):
    assert launch.reported_exit_status(exit_codes) == reported


def test_workers_stopped_by_a_signal_count_as_stopped_beside_an_earlier_runs_summary(tmp_path):
    """Rank 0 writes no summary when a signal stops the run; the folder may still hold the
    summary of a shorter run it continues, which is not this run's result."""
    assert launch.workers_result(tmp_path, 20)["stopped_by"] == "a signal"
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 10, "stopped_by": None, "final_val_loss": 2.5}))
    assert launch.workers_result(tmp_path, 20)["stopped_by"] == "a signal"  # extended to 20, stopped before
    assert launch.workers_result(tmp_path, 10) == {"steps": 10, "stopped_by": None, "final_val_loss": 2.5}
