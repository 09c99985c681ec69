"""The command as users type it: installed console script, run from a folder outside the repo."""

import json
from pathlib import Path

import pytest

from conftest import run_cli

SUMMARY_KEYS = {
    "steps", "final_train_loss", "final_val_loss", "tokens_per_s", "wall_s", "world_size",
    "tricks", "n_params", "n_active_params", "param_checksum",
}
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "moe_imbalance", "tokens_per_s", "elapsed_s"}


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
        (["data=text", "data.path=/nonexistent"], "data.path=/nonexistent"),
        (["model=tyny"], "did you mean 'tiny'?"),
        (["device=gpu"], "expected one of [auto, cpu, cuda]"),
        (["train.lr=1,2"], "add -m"),
        (["-m", "train.lr=1,abc"], "train.lr"),
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


@pytest.mark.parametrize(
    "exit_codes, user_error",
    [
        ({0: 2, 1: 2}, True),
        ({0: 2, 1: -15}, True),  # rank 1, still on its way to the same mistake, stopped by the launcher
        ({0: 2, 1: -9}, True),
        ({0: 2, 1: 1}, False),  # a crash beside the mistake
        ({0: 2, 1: -11}, False),
        ({0: -15, 1: 2}, False),  # rank 0 was stopped before it could say what was wrong
        ({0: 1}, False),
    ],
)
def test_workers_exit_as_a_user_error_only_when_rank_0_reported_one_and_no_rank_crashed(exit_codes, user_error):
    from ciuic_train.cli import is_user_error_exit

    assert is_user_error_exit(exit_codes) is user_error
