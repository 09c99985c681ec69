"""ciuic-train-report on hand-built multirun folders whose answers are known in advance."""

from __future__ import annotations

import json
import math
import sys

import pytest

from ciuic_train.tools import report, report_figures, report_stats
from ciuic_train.errors import UserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_job(root, num, tricks, seed, final_val, *, stopped_by=None, summary=True, steps=20):
    """One job folder as ciuic-train writes it: .hydra files, metrics.jsonl, summary.json."""
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    trick_override = "trick=[" + ",".join(tricks) + "]"
    (job / ".hydra" / "overrides.yaml").write_text(f"- {trick_override}\n- seed={seed}\n")
    (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\ntrain:\n  max_steps: {steps}\n")
    if not summary:
        (job / "train.log").write_text("Traceback ...\n")
        return
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.0, "tokens_per_s": 1000.0, "elapsed_s": 0.1 * step, "checkpoints": 0}
        if step % 5 == 0:
            # Val loss falls linearly from final_val + 1 to final_val; eval steps take 1 s extra.
            record["val_loss"] = final_val + 1.0 - step / steps
            record["elapsed_s"] += 1.0
        for trick in tricks:
            record[f"{trick}/count"] = step
        lines.append(json.dumps(record))
    (job / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (job / "summary.json").write_text(json.dumps({
        "steps": steps, "final_train_loss": 5.0, "final_val_loss": final_val, "tokens_per_s": 1000.0 + seed,
        "wall_s": 3.0, "world_size": 1, "tricks": sorted(tricks), "trick_params": {}, "param_checksum": "x",
        "stopped_by": stopped_by, "checkpoint_saves": 1, "checkpoint_seconds": 0.1,
    }))


# Fixed seed noise (mean 0, sd ~0.016 in both groups) so that the verdicts are exact, not 95%.
BASE_NOISE = [-0.02, -0.01, 0.0, 0.01, 0.02]
TRICK_NOISE = [0.02, -0.015, 0.005, -0.02, 0.01]


def sweep(root, effect, seeds=5):
    """Baseline around 4.0 and trick A shifted by `effect`, one job per seed."""
    num = 0
    for tricks, shift, noise in (([], 0.0, BASE_NOISE), (["a"], effect, TRICK_NOISE)):
        for seed in range(seeds):
            write_job(root, num, tricks, seed, 4.0 + shift + noise[seed])
            num += 1
    return num


def group(data, name):
    return next(g for g in data["groups"] if g["name"] == name)


@pytest.mark.parametrize(
    "t, df, p", [(2.0, 10, 0.07339), (1.0, 1, 0.5), (0.0, 7, 1.0), (3.0, 2, 1 - 3 / math.sqrt(11))]
)
def test_t_two_sided_p_matches_known_values(t, df, p):
    # df=2 has the closed form 1 - t / sqrt(2 + t^2).
    assert report_stats.t_two_sided_p(t, df) == pytest.approx(p, abs=1e-5)


def test_t_two_sided_p_fractional_df_matches_integrated_density():
    """Welch gives fractional df: compare against the density integrated numerically."""
    import numpy as np

    t, df = 3.0, 2.5
    x = np.concatenate([np.linspace(t, 50.0, 200_001), np.geomspace(50.0, 1e7, 200_001)[1:]])
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(log_norm - (df + 1) / 2 * np.log1p(x * x / df))
    tail = float(np.sum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x)))
    assert report_stats.t_two_sided_p(t, df) == pytest.approx(2 * tail, abs=1e-6)


def test_t_cdf_and_quantile_are_inverse():
    assert report_stats.t_cdf(-1.0, 1) == pytest.approx(0.25, abs=1e-12)  # Cauchy: 1/2 + atan(t)/pi
    assert report_stats.t_quantile(0.975, 10) == pytest.approx(2.228139, abs=1e-5)
    assert report_stats.t_quantile(0.975, 1e6) == pytest.approx(1.959966, abs=1e-4)


def test_betainc_closed_forms():
    assert report_stats.betainc(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform
    assert report_stats.betainc(2.0, 1.0, 0.3) == pytest.approx(0.09)  # x^2
    assert report_stats.betainc(0.5, 0.5, 0.5) == pytest.approx(0.5)


def test_welch_df_by_hand():
    # s1^2=4, n1=5; s2^2=9, n2=10: (0.8 + 0.9)^2 / (0.64/4 + 0.81/9) = 2.89 / 0.25 = 11.56
    assert report_stats.welch_df(4.0, 5, 9.0, 10) == pytest.approx(11.56)
    test = report_stats.welch_test([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert test.diff == pytest.approx(-2.0)
    assert test.df == pytest.approx(2.0 * (1 / 3 + 4 / 3) ** 2 / ((1 / 3) ** 2 + (4 / 3) ** 2))
    assert test.p == pytest.approx(report_stats.t_two_sided_p(-2.0 / math.sqrt(5 / 3), test.df))


def test_planted_effect_helps(tmp_path):
    sweep(tmp_path, effect=-0.3)
    report.main([str(tmp_path)])
    data = json.loads((tmp_path / "report.json").read_text())
    a = group(data, "a")["vs_baseline"]
    assert a["verdict"] == "helps"
    assert a["p"] < 0.01
    assert a["ci95"][0] < -0.3 < a["ci95"][1]
    assert group(data, "baseline")["n"] == 5
    # Eval steps (every 5th) take 1 s extra and are left out: every remaining step is 0.1 s.
    assert group(data, "a")["step_time_s"]["p95"] == pytest.approx(0.1)
    assert group(data, "a")["trick_metrics"] == {"a/count": 20.0}
    md = (tmp_path / "report.md").read_text()
    assert "Welch" in md and "| a | 5 |" in md


def test_planted_harm_hurts_and_steps_to_target(tmp_path):
    sweep(tmp_path, effect=+0.3)
    report.main([str(tmp_path), "--target-loss", "4.2"])
    data = json.loads((tmp_path / "report.json").read_text())
    assert group(data, "a")["vs_baseline"]["verdict"] == "hurts"
    # val = final + 1 - step/20 at steps 5, 10, 15, 20: the baseline (final ~4.0) first gets
    # to 4.2 at step 20 (4.25 at 15); trick A (final ~4.3) never does.
    assert group(data, "baseline")["steps_to_target"] == {"per_seed": [20] * 5, "reached": 5, "mean": 20.0}
    assert group(data, "a")["steps_to_target"]["reached"] == 0
    assert "not reached" in (tmp_path / "report.md").read_text()


def test_null_effect_is_no_detectable_effect(tmp_path):
    sweep(tmp_path, effect=0.0)
    report.main([str(tmp_path)])
    verdict = group(json.loads((tmp_path / "report.json").read_text()), "a")["vs_baseline"]["verdict"]
    assert verdict == "no detectable effect (n=5 vs 5)"


def test_failed_jobs_are_listed(tmp_path):
    num = sweep(tmp_path, effect=-0.3, seeds=2)
    write_job(tmp_path, num, ["a"], 7, 4.0, summary=False)
    write_job(tmp_path, num + 1, ["a"], 8, 4.0, stopped_by="SIGTERM")
    (tmp_path / str(num + 2) / ".hydra").mkdir(parents=True)
    (tmp_path / str(num + 2) / "summary.json").write_text("{not json")
    report.main([str(tmp_path)])
    failed = {f["job"]: f["reason"] for f in json.loads((tmp_path / "report.json").read_text())["failed"]}
    assert failed[str(num)] == "no summary.json (see train.log)"
    assert failed[str(num + 1)].startswith("stopped_by SIGTERM")
    assert failed[str(num + 2)].startswith("unreadable")
    assert "## Failed jobs" in (tmp_path / "report.md").read_text()


def test_one_seed_and_no_baseline(tmp_path, capsys, monkeypatch):
    write_job(tmp_path, 0, ["a"], 0, 4.0)
    write_job(tmp_path, 1, ["b"], 0, 4.1)
    data = report.run(tmp_path, None, None)
    assert {g["vs_baseline"]["verdict"] for g in data["groups"]} == {report_figures.NO_BASELINE}
    data = report.run(tmp_path, None, "a")
    assert group(data, "b")["vs_baseline"]["verdict"].startswith("n/a (n=1 vs 1")
    with pytest.raises(UserError, match="no such group"):
        report.run(tmp_path, None, "c")
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "200")  # no cell wrapped
    report.print_table(data)
    assert "+0.1000 [n/a]" in capsys.readouterr().out  # the terminal's table: "[n/a]" is no markup


@pytest.mark.parametrize("make", ["empty", "only_failed"])
def test_no_usable_jobs_exits_2_with_one_line(tmp_path, capsys, make):
    if make == "only_failed":
        write_job(tmp_path, 0, [], 0, 4.0, summary=False)
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ciuic-train-report: error: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_plots_are_png(tmp_path):
    pytest.importorskip("matplotlib")
    sweep(tmp_path, effect=-0.3, seeds=3)
    report.main([str(tmp_path)])
    for name in ("loss_curves.png", "effect.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE


def test_without_matplotlib_still_writes_md_and_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    sweep(tmp_path, effect=-0.3, seeds=2)
    report.main([str(tmp_path)])
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert "not drawn: matplotlib is not installed" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["plots"] == []
    assert not (tmp_path / "loss_curves.png").exists()
