"""`ciuic-train-report MULTIRUN_DIR`: compare a sweep's trick sets against the baseline.

Jobs of a Hydra multirun folder are grouped by their trick set and pooled over seeds, so
that an ablation answers "does this trick change final val loss beyond seed noise?" with
a Welch t-test rather than by eye. Writes report.md, report.json, loss_curves.png and
effect.png into the folder and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ciuic_train.errors import UserError

PROG = "ciuic-train-report"
BASELINE = "baseline"
NO_BASELINE = "no baseline in this sweep"
TEST_NAME = "Welch's two-sample t-test (unequal variances), two-sided, on final val loss"
STEP_TIME_METHOD = (
    "per-step seconds = Δelapsed_s / Δstep between consecutive metrics.jsonl lines, leaving out "
    "intervals that end on an eval step or a checkpoint save (their elapsed time includes those)"
)
ALPHA = 0.05


# --- Student t distribution, written out so the report needs no scipy ---------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function, by the modified Lentz method."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for coef in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + coef * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + coef / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The continued fraction converges fast only below (a+1)/(a+b+2); use the symmetry above it.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom (df may be fractional)."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|)."""
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(prob: float, df: float) -> float:
    """Inverse of t_cdf by bisection: plenty fast for a handful of CI widths."""
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > prob:
        lo *= 2.0
    while t_cdf(hi, df) < prob:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < prob:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95% Student-t interval (None below 2 values)."""
    n = len(values)
    mean = float(np.mean(values))
    if n < 2:
        return mean, None
    sem = float(np.std(values, ddof=1)) / math.sqrt(n)
    return mean, t_quantile(1 - ALPHA / 2, n - 1) * sem


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """Welch–Satterthwaite degrees of freedom from sample variances and sizes."""
    qa, qb = var_a / n_a, var_b / n_b
    return (qa + qb) ** 2 / (qa * qa / (n_a - 1) + qb * qb / (n_b - 1))


@dataclass
class Welch:
    diff: float
    ci: tuple[float, float]
    t: float
    df: float
    p: float


def welch_test(a: list[float], b: list[float]) -> Welch:
    """Difference of means a - b with its 95% CI and two-sided p-value, variances not pooled."""
    var_a, var_b = float(np.var(a, ddof=1)), float(np.var(b, ddof=1))
    n_a, n_b = len(a), len(b)
    diff = float(np.mean(a) - np.mean(b))
    se = math.sqrt(var_a / n_a + var_b / n_b)
    if se == 0.0:  # every seed gave the same number in both groups: the difference is exact
        return Welch(diff, (diff, diff), math.copysign(math.inf, diff) if diff else 0.0, math.inf, 0.0 if diff else 1.0)
    df = welch_df(var_a, n_a, var_b, n_b)
    t = diff / se
    half = t_quantile(1 - ALPHA / 2, df) * se
    return Welch(diff, (diff - half, diff + half), t, df, t_two_sided_p(t, df))


# --- reading the multirun folder ----------------------------------------------------------


@dataclass
class Job:
    folder: str
    seed: int | None
    tricks: list[str]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    other_overrides: tuple[str, ...]

    @property
    def evals(self) -> list[tuple[int, float]]:
        return [(r["step"], r["val_loss"]) for r in self.metrics if "val_loss" in r]


def group_name(tricks: list[str]) -> str:
    return "+".join(sorted(tricks)) if tricks else BASELINE


def _job_folders(root: Path) -> list[Path]:
    folders = [p for p in root.iterdir() if (p / ".hydra").is_dir()]
    return sorted(folders, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def _read_job(folder: Path) -> Job:
    """One finished job, or ValueError with the reason it cannot be used."""
    import yaml
    from omegaconf import OmegaConf

    summary_path = folder / "summary.json"
    if not summary_path.is_file():
        hint = " (see train.log)" if (folder / "train.log").is_file() else ""
        raise ValueError(f"no summary.json{hint}")
    try:
        summary = json.loads(summary_path.read_text())
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        overrides = OmegaConf.to_container(OmegaConf.load(folder / ".hydra" / "overrides.yaml")) or []
        seed = OmegaConf.load(folder / ".hydra" / "config.yaml").get("seed")
        missing = [k for k in ("final_val_loss", "tokens_per_s") if k not in summary]
        missing += [f"metrics {k}" for k in ("step", "elapsed_s") if any(k not in r for r in metrics)]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as err:
        raise ValueError(f"unreadable: {(str(err) or type(err).__name__).splitlines()[0]}") from None
    if summary.get("stopped_by") is not None:
        raise ValueError(f"stopped_by {summary['stopped_by']} after {summary.get('steps')} steps")
    final = summary.get("final_val_loss")
    if not isinstance(final, (int, float)) or not math.isfinite(final):
        raise ValueError(f"final_val_loss is {final}")
    other = tuple(sorted(o for o in overrides if o.split("=")[0].lstrip("+~") not in ("seed", "trick")))
    return Job(folder.name, seed, sorted(summary.get("tricks") or []), summary, metrics, other)


def read_multirun(root: Path) -> tuple[dict[str, list[Job]], list[dict[str, str]]]:
    """Usable jobs grouped by trick set, and the failed ones with a reason each."""
    if not root.is_dir():
        raise UserError(f"{root} is not a folder")
    folders = _job_folders(root)
    if not folders:
        raise UserError(f"{root} holds no job folders (subfolders with .hydra/); is it a multirun folder?")
    groups: dict[str, list[Job]] = {}
    failed: list[dict[str, str]] = []
    for folder in folders:
        try:
            job = _read_job(folder)
        except ValueError as err:
            failed.append({"job": folder.name, "reason": str(err)})
            continue
        groups.setdefault(group_name(job.tricks), []).append(job)
    if not groups:
        reasons = "; ".join(f"{f['job']}: {f['reason']}" for f in failed)
        raise UserError(f"no usable jobs in {root} ({len(failed)} failed: {reasons})")
    return groups, failed


# --- per-group figures --------------------------------------------------------------------


def step_seconds(metrics: list[dict[str, Any]]) -> list[float]:
    """Per-step seconds from consecutive lines; see STEP_TIME_METHOD."""
    out = []
    for prev, cur in zip(metrics, metrics[1:]):
        saved = cur.get("checkpoints", 0) != prev.get("checkpoints", 0)
        if "val_loss" in cur or saved or cur["step"] <= prev["step"]:
            continue
        out.append((cur["elapsed_s"] - prev["elapsed_s"]) / (cur["step"] - prev["step"]))
    return out


def trick_figures(jobs: list[Job]) -> dict[str, float]:
    """Each `<trick>/<figure>`: its last logged value per job, averaged over the jobs."""
    per_key: dict[str, list[float]] = {}
    for job in jobs:
        last: dict[str, float] = {}
        for record in job.metrics:
            for key, value in record.items():
                if "/" in key and isinstance(value, (int, float)):
                    last[key] = float(value)
        for key, value in last.items():
            per_key.setdefault(key, []).append(value)
    return {key: float(np.mean(values)) for key, values in sorted(per_key.items())}


def steps_to_target(jobs: list[Job], target: float | None) -> dict[str, Any]:
    """First eval step at or below target, per seed; mean over the seeds that got there."""
    if target is None:
        return {"per_seed": None, "reached": 0, "mean": None}
    per_seed = [next((s for s, v in job.evals if v <= target), None) for job in jobs]
    reached = [s for s in per_seed if s is not None]
    return {"per_seed": per_seed, "reached": len(reached), "mean": float(np.mean(reached)) if reached else None}


def summarize_group(name: str, jobs: list[Job], target: float | None) -> dict[str, Any]:
    finals = [float(j.summary["final_val_loss"]) for j in jobs]
    speeds = [float(j.summary["tokens_per_s"]) for j in jobs]
    times = [t for j in jobs for t in step_seconds(j.metrics)]
    val_mean, val_ci = mean_ci(finals)
    tok_mean, tok_ci = mean_ci(speeds)
    return {
        "name": name,
        "tricks": jobs[0].tricks,
        "n": len(jobs),
        "jobs": [j.folder for j in jobs],
        "seeds": [j.seed for j in jobs],
        "final_val_loss": {"mean": val_mean, "ci95": val_ci, "values": finals},
        "steps_to_target": steps_to_target(jobs, target),
        "tokens_per_s": {"mean": tok_mean, "ci95": tok_ci, "values": speeds},
        "step_time_s": {
            "p50": float(np.percentile(times, 50)) if times else None,
            "p95": float(np.percentile(times, 95)) if times else None,
            "samples": len(times),
        },
        "trick_metrics": trick_figures(jobs),
    }


def compare(group: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The group's final val loss minus the baseline's, with test and verdict."""
    if base is None:
        return {"verdict": NO_BASELINE}
    if group["name"] == base["name"]:
        return {"verdict": "reference"}
    n_g, n_b = group["n"], base["n"]
    if min(n_g, n_b) < 2:
        mean_diff = group["final_val_loss"]["mean"] - base["final_val_loss"]["mean"]
        return {"diff": mean_diff, "verdict": f"n/a (n={n_g} vs {n_b}; needs >= 2 seeds each)"}
    w = welch_test(group["final_val_loss"]["values"], base["final_val_loss"]["values"])
    if w.p < ALPHA and w.diff < 0:
        verdict = "helps"
    elif w.p < ALPHA and w.diff > 0:
        verdict = "hurts"
    else:
        verdict = f"no detectable effect (n={n_g} vs {n_b})"
    return {"diff": w.diff, "ci95": list(w.ci), "t": w.t, "df": w.df, "p": w.p, "verdict": verdict}


def build_report(root: Path, target_loss: float | None, baseline: str | None) -> dict[str, Any]:
    groups, failed = read_multirun(root)
    base_name = group_name(baseline.split("+")) if baseline and baseline != BASELINE else BASELINE
    if baseline and base_name not in groups:
        raise UserError(f"--baseline {baseline}: no such group; the groups are {', '.join(sorted(groups))}")
    base_jobs = groups.get(base_name)
    if target_loss is not None:
        target, target_source = target_loss, "--target-loss"
    elif base_jobs:
        base_mean = float(np.mean([j.summary["final_val_loss"] for j in base_jobs]))
        target, target_source = base_mean * 1.05, f"{base_name} mean final val loss x 1.05"
    else:
        target, target_source = None, NO_BASELINE
    # Baseline first, then the others by name, so the table reads top-down from the reference.
    order = sorted(groups, key=lambda name: (name != base_name, name))
    summaries = [summarize_group(name, groups[name], target) for name in order]
    base = summaries[0] if base_jobs else None
    for summary in summaries:
        summary["vs_baseline"] = compare(summary, base)
    warnings = []
    variants = {j.other_overrides for jobs in groups.values() for j in jobs}
    if len(variants) > 1:
        warnings.append(
            "jobs differ in overrides other than seed and trick, yet are pooled by trick set: "
            + " | ".join(" ".join(v) or "(none)" for v in sorted(variants))
        )
    return {
        "multirun_dir": str(root),
        "baseline": base_name if base_jobs else None,
        "target_loss": target,
        "target_source": target_source,
        "test": TEST_NAME,
        "alpha": ALPHA,
        "step_time_method": STEP_TIME_METHOD,
        "groups": summaries,
        "failed": failed,
        "warnings": warnings,
    }, groups


# --- rendering ----------------------------------------------------------------------------


def _pm(mean: float | None, ci: float | None, fmt: str) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:{fmt}} ± {ci:{fmt}}" if ci is not None else f"{mean:{fmt}} ± n/a"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


MD_HEADER = ["group", "n", "final val loss (95% CI)", "Δ vs baseline (95% CI)", "p", "verdict",
             "steps to target", "tokens/s (95% CI)", "step s p50 / p95"]
# The same columns, short enough for an 80-column terminal to keep most cells on one line.
TERMINAL_HEADER = ["group", "n", "val loss", "Δ [95% CI]", "p", "verdict", "to target", "tok/s", "step s p50/p95"]


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """Cells shared by the terminal table and report.md."""
    rows = []
    for g in report["groups"]:
        cmp = g["vs_baseline"]
        if "ci95" in cmp:
            diff = f"{cmp['diff']:+.4f} [{cmp['ci95'][0]:+.4f}, {cmp['ci95'][1]:+.4f}]"
            p = _p(cmp["p"])
        elif "diff" in cmp:
            diff, p = f"{cmp['diff']:+.4f} [n/a]", "n/a"
        elif cmp["verdict"] == "reference":
            diff, p = "—", "—"
        else:
            diff, p = NO_BASELINE, NO_BASELINE
        reach = g["steps_to_target"]
        if report["target_loss"] is None:
            steps = NO_BASELINE
        elif reach["reached"] == 0:
            steps = "not reached"
        else:
            steps = f"{reach['mean']:.0f} ({reach['reached']}/{g['n']} seeds)"
        st = g["step_time_s"]
        step_time = f"{st['p50']:.3f} / {st['p95']:.3f}" if st["p50"] is not None else "n/a"
        rows.append([
            g["name"], str(g["n"]), _pm(g["final_val_loss"]["mean"], g["final_val_loss"]["ci95"], ".4f"),
            diff, p, cmp["verdict"], steps, _pm(g["tokens_per_s"]["mean"], g["tokens_per_s"]["ci95"], ",.0f"),
            step_time,
        ])
    return rows


def render_markdown(report: dict[str, Any], plots_note: str) -> str:
    rows = table_rows(report)
    target = report["target_loss"]
    lines = [
        f"# Ablation report: {report['multirun_dir']}",
        "",
        f"- Baseline: {report['baseline'] or NO_BASELINE}",
        f"- Test: {report['test']}; verdict \"helps\"/\"hurts\" when p < {report['alpha']} "
        "(no correction for comparing several groups).",
        "- Confidence intervals: 95%, Student t (Welch–Satterthwaite df for the difference).",
        f"- Target val loss: {f'{target:.4f}' if target is not None else 'n/a'} ({report['target_source']}); "
        "steps to target = first eval step at or below it, mean over the seeds that reached it.",
        f"- Step time: {report['step_time_method']}; pooled over seeds.",
        f"- Plots: {plots_note}",
        "",
        "| " + " | ".join(MD_HEADER) + " |",
        "|" + "|".join("---" for _ in MD_HEADER) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "## Trick metrics (last logged value per job, mean over seeds)",
        "",
    ]
    figures = [(g["name"], k, v) for g in report["groups"] for k, v in g["trick_metrics"].items()]
    if figures:
        lines += ["| group | figure | value |", "|---|---|---|"]
        lines += [f"| {name} | {key} | {value:.4g} |" for name, key, value in figures]
    else:
        lines.append("none logged")
    lines += ["", "## Failed jobs", ""]
    lines += [f"- `{f['job']}`: {f['reason']}" for f in report["failed"]] or ["none"]
    if report["warnings"]:
        lines += ["", "## Warnings", "", *(f"- {w}" for w in report["warnings"])]
    return "\n".join(lines) + "\n"


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ablation vs {report['baseline'] or NO_BASELINE}", caption=report["test"])
    for name in TERMINAL_HEADER:
        table.add_column(name, no_wrap=name == "group")
    for row in table_rows(report):
        table.add_row(*row)
    console = Console()
    console.print(table)
    for f in report["failed"]:
        console.print(f"failed job {f['job']}: {f['reason']}", markup=False)
    for w in report["warnings"]:
        console.print(f"warning: {w}", markup=False)


def write_plots(root: Path, report: dict[str, Any], groups: dict[str, list[Job]]) -> list[str]:
    """loss_curves.png and (with a baseline) effect.png; matplotlib is imported only here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(jobs: list[Job]) -> tuple[list[int], list[float], list[float], list[float]]:
        by_step: dict[int, list[float]] = {}
        for job in jobs:
            for step, value in job.evals:
                by_step.setdefault(step, []).append(value)
        steps = sorted(by_step)
        return (steps, [float(np.mean(by_step[s])) for s in steps],
                [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps])

    base = report["baseline"]
    others = [g["name"] for g in report["groups"] if g["name"] != base] or [base]
    cols = min(3, len(others))
    rows = math.ceil(len(others) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, others):
        pairs = [(base, "gray"), (name, "tab:blue")] if base not in (None, name) else [(name, "tab:blue")]
        for label, color in pairs:
            steps, mean, lo, hi = curve(groups[label])
            ax.plot(steps, mean, color=color, label=f"{label} (n={len(groups[label])})")
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in axes.flat[len(others):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("val loss (mean, min–max band)")
    fig.tight_layout()
    fig.savefig(root / "loss_curves.png", dpi=110)
    plt.close(fig)
    written = ["loss_curves.png"]

    compared = [g for g in report["groups"] if "diff" in g["vs_baseline"]]
    if compared:
        fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(compared) + 2), 3.6))
        cmps = [g["vs_baseline"] for g in compared]
        diffs = [c["diff"] for c in cmps]
        # A group with one seed gets its bar without an error bar (its CI is n/a).
        lows = [c["ci95"] if "ci95" in c else (c["diff"], c["diff"]) for c in cmps]
        errors = [[d - lo for d, (lo, _) in zip(diffs, lows)], [hi - d for d, (_, hi) in zip(diffs, lows)]]
        palette = {"helps": "tab:green", "hurts": "tab:red"}
        colors = [palette.get(c["verdict"], "tab:gray") for c in cmps]
        ax.bar(range(len(compared)), diffs, yerr=errors, capsize=4, color=colors)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(compared)), [g["name"] for g in compared], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"final val loss − {base} (95% CI)")
        fig.tight_layout()
        fig.savefig(root / "effect.png", dpi=110)
        plt.close(fig)
        written.append("effect.png")
    return written


def _json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def run(root: Path, target_loss: float | None, baseline: str | None) -> dict[str, Any]:
    report, groups = build_report(root, target_loss, baseline)
    try:
        plots = write_plots(root, report, groups)
        plots_note = ", ".join(plots) + (" (no effect.png: no baseline comparison)" if len(plots) == 1 else "")
    except ImportError:
        plots, plots_note = [], "not drawn: matplotlib is not installed (pip install matplotlib)"
        print(f"{PROG}: matplotlib is not installed; writing report.md and report.json without plots", file=sys.stderr)
    report["plots"] = plots
    (root / "report.md").write_text(render_markdown(report, plots_note))
    (root / "report.json").write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    print_table(report)
    print(f"wrote {', '.join(str(root / name) for name in ['report.md', 'report.json', *plots])}")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("multirun_dir", type=Path, help="a Hydra multirun folder (multirun/DATE/TIME)")
    parser.add_argument("--target-loss", type=float,
                        help="val loss for 'steps to target' (default: baseline mean final val loss x 1.05)")
    parser.add_argument("--baseline", help=f"group to compare against, e.g. warm_restart (default: {BASELINE})")
    args = parser.parse_args(argv)
    try:
        run(args.multirun_dir, args.target_loss, args.baseline)
    except UserError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
