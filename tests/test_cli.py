"""The command as users type it: installed console script, run from a folder outside the repo."""

import gc
import json
import re
import signal
import subprocess
import sys
import weakref
from importlib.metadata import version
from pathlib import Path

import pytest

from ciuic_train.cli.flags import parse_hydra_command_line
from ciuic_train.cli.preflight import check_request
from ciuic_train.cli.startup import start_up, thaw
from ciuic_train.errors import UserError
from ciuic_train.tricks import registry
from conftest import run_cli

SUMMARY_KEYS = {
    "steps", "final_train_loss", "final_val_loss", "tokens_per_s", "wall_s", "world_size",
    "tricks", "n_params", "n_active_params", "param_checksum",
}
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "moe_imbalance", "tokens_per_s", "elapsed_s"}


def test_results_show_paths_prompts_and_samples_as_they_are(capsys):
    """Rich reads "[/x]" as markup (and fails on a closing tag that closes nothing) and
    passes escape sequences to the terminal; a barely trained byte model samples both."""
    from ciuic_train.cli.job import show_results

    show_results({"steps": 3, "resumed_from": "/runs/[train]/step_2"}, "x = r'[/\\]'\n\x1b[2J\tdone", "[/p]")
    out = capsys.readouterr().out
    assert "/runs/[train]/step_2" in out and "x = r'[/\\]'" in out and "prompt '[/p]'" in out
    assert "\x1b" not in out and re.search(r"\\x1b\[2J +done", out)  # the tab kept (as spaces)


def test_tiny_run_from_another_folder_writes_the_run_folder(tmp_path: Path):
    run_dir = tmp_path / "run"
    result = run_cli(
        "model=tiny", "train.max_steps=30", "train.eval_every=15", "train.log_every=5",
        f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["steps"] == 30 and summary["world_size"] == 1 and summary["tricks"] == []
    assert 0 < summary["n_active_params"] < summary["n_params"] < 1_000_000
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    assert all(METRIC_KEYS <= r.keys() for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [15, 30]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert summary["final_val_loss"] == records[-1]["val_loss"]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "sample from prompt" in result.stdout
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["+trick=does_not_exist"], "unknown trick 'does_not_exist'"),
        (["train.max_steps=abc"], "train.max_steps"),
        (["train.lr_typo=1"], "unknown config key 'train.lr_typo'"),
        (["+train.lr_typo=1"], "unknown config key 'train.lr_typo'"),
        (["trick.chaotic_sampler.period=5"], "trick.chaotic_sampler sets a parameter of a trick this run does not "
                                             "select; add +trick=chaotic_sampler"),
        (["+trick=chaotic_sampler", "trick.chaotic_samplr.period=5"], "unknown trick 'chaotic_samplr' in "
                                                                      "trick.chaotic_samplr (did you mean 'chaotic_sampler'?)"),
        (["data=text", "data.path=/nonexistent"], "data.path=/nonexistent"),
        (["model=tyny"], "did you mean 'tiny'?"),
        (["device=gpu"], "expected one of [auto, cpu, cuda]"),
        (["train.lr=1,2"], "add -m"),
        (["-m", "train.lr=1,abc"], "train.lr"),
        (["dist.ddp_bucket_mb=-1"], "dist.ddp_bucket_mb=-1.0 must be positive, or 0 to size the buckets from the model"),
    ],
)
def test_user_mistakes_get_one_line_and_leave_nothing(tmp_path: Path, args, expected):
    run_dir = tmp_path / "run"
    result = run_cli(*args, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ciuic-train: error: ") and expected in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


def test_plan_counts_deepseek_v3_on_meta_and_writes_nothing(tmp_path: Path):
    result = run_cli("model=deepseek_v3", "--plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "671,026,404,352" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_help_lists_the_config_groups(tmp_path: Path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    for group in ("model:", "data:", "optim:"):
        assert group in result.stdout
    assert "Usage: ciuic-train" in result.stdout and "--list-tricks" in result.stdout  # conf/config.yaml's header
    assert "model: bench, deepseek_v2_lite, deepseek_v3, small, tiny\n" in result.stdout
    assert "trick: async_smoothed_loss, chaotic_sampler," in result.stdout
    assert "hydra/launcher" not in result.stdout  # Hydra's groups are --hydra-help's


def test_help_shows_the_config_its_overrides_compose_and_refuses_a_mistake(tmp_path: Path):
    result = run_cli("model=tiny", "train.lr=0.5", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "name: tiny" in result.stdout and "lr: 0.5" in result.stdout
    mistake = run_cli("model=tyny", "--help", cwd=tmp_path)
    assert mistake.returncode == 2 and mistake.stdout == ""
    assert mistake.stderr.strip().splitlines() == [
        "ciuic-train: error: unknown model 'tyny' (did you mean 'tiny'?); "
        "available: bench, deepseek_v2_lite, deepseek_v3, small, tiny"
    ]


def test_cfg_checks_the_config_but_not_the_corpus(tmp_path: Path):
    """Printing a config needs no corpus yet (and no torch to look for one)."""
    result = run_cli("--cfg", "job", "data=text", "data.path=/nonexistent", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "path: /nonexistent" in result.stdout
    for args, expected in [
        (["train.lr_typo=1"], "unknown config key 'train.lr_typo'"),
        (["-m", "seed=0,1"], "--cfg prints the config of one job; leave out -m"),
    ]:
        mistake = run_cli("--cfg", "job", *args, cwd=tmp_path)
        assert mistake.returncode == 2
        (line,) = mistake.stderr.strip().splitlines()
        assert line.startswith("ciuic-train: error: ") and expected in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, shows",
    [(["--cfg", "job"], "max_steps: 300"), (["--list-tricks"], "chaotic_sampler"), (["--help"], "optim: adamw"),
     (["--version"], f"ciuic-train {version('ciuic-train')} (torch {version('torch')}"),
     (["--help", "model=tiny", "--plan", "train.max_steps=7"], "max_steps: 7")],  # an override after our flag too
)
def test_commands_that_only_print_do_not_import_torch(tmp_path: Path, args, shows):
    """Importing torch takes longer than all these commands do without it."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ciuic_train", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert shows in result.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "ciuic_train.cli.main" in imported  # the import list is there to look at
    assert sorted(m for m in imported if m.split(".")[0] == "torch") == []


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["--list-tricks"], ["--plan"]])
def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path, args):
    """`ciuic-train --help | head -1`: the reader gone before the output ends stops the
    command as it stops any Unix tool, by SIGPIPE, with no traceback."""
    process = subprocess.Popen([str(Path(sys.executable).with_name("ciuic-train")), *args], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # gone before the first line
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == -signal.SIGPIPE and err == ""


def test_hydra_parses_the_command_line_as_we_read_it():
    """`parse_hydra_command_line` uses Hydra's private parser (hydra-core 1.3 has no public
    one): this fails if an upgrade renames a flag or an attribute the command reads."""
    args, unknown = parse_hydra_command_line(
        ["-m", "a=1", "+b=[x,y]", "--cfg", "job", "--resolve", "-p", "model", "-cn", "c", "-cp", "p", "-cd", "d", "--typo"]
    )
    assert args.overrides == ["a=1", "+b=[x,y]"] and unknown == ["--typo"]
    assert args.multirun and args.cfg == "job" and args.resolve and args.package == "model"
    assert (args.config_name, args.config_path, args.config_dir) == ("c", "p", "d")
    assert not (args.help or args.hydra_help or args.info or args.shell_completion)
    flags = {"-h": "help", "--help": "help", "--hydra-help": "hydra_help", "-i": "info", "--info": "info",
             "-sc": "shell_completion", "--shell-completion": "shell_completion"}
    for flag, attribute in flags.items():
        assert getattr(parse_hydra_command_line([flag])[0], attribute), flag
    assert parse_hydra_command_line([])[0].overrides == []


def test_a_sweep_expands_as_hydra_runs_it():
    """-m: one job per point of the product of the sweeps; glob() lists the trick group."""
    jobs = check_request(["-m", "seed=0,1", "train.lr=1e-3,3e-3", "model=tiny"], config_only=True)
    assert [(j.config.seed, j.config.train.lr) for j in jobs] == [(0, 1e-3), (0, 3e-3), (1, 1e-3), (1, 3e-3)]
    jobs = check_request(["-m", "+trick=glob(*)", "model=tiny"], config_only=True)
    assert sorted(name for job in jobs for name in job.config.trick) == sorted(registry())
    assert all(len(job.config.trick) == 1 for job in jobs)
    with pytest.raises(UserError, match=re.escape("'seed=interval(0,1)': an interval has no points to run")):
        check_request(["-m", "seed=interval(0,1)"], config_only=True)


def test_a_mistake_found_inside_the_job_removes_the_fresh_run_folder(tmp_path: Path):
    """Token ids beyond the model's vocabulary are only seen once the data is opened."""
    import numpy as np

    (tmp_path / "train.bin").write_bytes(np.full(5000, 300, dtype=np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(np.full(5000, 300, dtype=np.uint16).tobytes())
    run_dir = tmp_path / "run"
    result = run_cli("model=tiny", "data=tokens", f"data.path={tmp_path}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2
    assert "model.vocab_size=256; set model.vocab_size=301 or more" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists()


def test_the_world_size_is_the_launchers_else_nodes_times_ranks_per_node():
    from ciuic_train.distributed.mesh import expected_world
    from conftest import compose_config

    dist = compose_config("dist.nnodes=3", "dist.nproc_per_node=2").dist
    assert expected_world(dist, environ={}) == (6, 2)
    assert expected_world(dist, environ={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}) == (4, 1)


def test_the_resume_check_counts_every_node_s_ranks(tmp_path: Path, text_corpus: Path, monkeypatch):
    """A checkpoint of 2 ranks whose trick state cannot be resharded resumes on
    dist.nnodes=2 x dist.nproc_per_node=1 ranks, and only there."""
    from ciuic_train.checkpoint.resume import run_fingerprint

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    base = ["model=tiny", "data=text", f"data.path={text_corpus}", "+trick=chaotic_sampler", "dist.nproc_per_node=1"]
    (job,) = check_request(base, config_only=True)
    step = tmp_path / "old_run" / "checkpoints" / "step_10"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps(run_fingerprint(job.config.model, ["chaotic_sampler"], 2)))
    resume = [*base, f"resume={step}", f"hydra.run.dir={tmp_path / 'run'}"]
    (job,) = check_request([*resume, "dist.nnodes=2"])
    assert job.config.dist.nnodes == 2
    with pytest.raises(UserError, match="checkpoint was written by 2 ranks, this run has 1: the state of its tricks"):
        check_request([*resume, "dist.nnodes=1"])


class Cycle:
    def __init__(self):
        self.me = self


def test_start_up_pauses_the_collector_then_freezes_what_it_made_until_the_job_ends():
    try:
        gc.enable()
        with start_up():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # containers the collector tracks
            cycle = Cycle()
        assert gc.isenabled() and gc.get_freeze_count() >= len(made)
        dropped = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert dropped() is not None  # frozen: no collection looks at it
        thaw()
        assert gc.get_freeze_count() == 0 and dropped() is None  # collected with the job's end
        gc.disable()
        with start_up():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.unfreeze()
        gc.enable()
