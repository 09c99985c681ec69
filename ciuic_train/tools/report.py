"""`ciuic-train-report MULTIRUN_DIR`: compare a sweep's trick sets against the baseline.

Writes report.md, report.json, loss_curves.png and effect.png into the folder and prints
the table. The figures are `report_figures.build_report`'s (the groups, each against the
baseline by Welch's t-test); this module lays them out, and draws the plots when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ciuic_train.errors import UserError
from ciuic_train.tools.report_figures import BASELINE, NO_BASELINE, Job, build_report

PROG = "ciuic-train-report"


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
    console = Console(markup=False)  # overrides such as +trick=[a,b] are no markup
    console.print(table)
    for f in report["failed"]:
        console.print(f"failed job {f['job']}: {f['reason']}")
    for w in report["warnings"]:
        console.print(f"warning: {w}")


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
