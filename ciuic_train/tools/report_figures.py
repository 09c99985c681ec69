"""What the ablation report says: a sweep's jobs, grouped by trick set, against the baseline.

Jobs of a Hydra multirun folder are grouped by their trick set and pooled over seeds, so
that an ablation answers "does this trick change final val loss beyond seed noise?" with
a Welch t-test (`report_stats.py`) rather than by eye. `build_report` returns every
figure as a dict (what report.json holds); `report.py` writes and prints it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ciuic_train.errors import UserError
from ciuic_train.tools.report_stats import ALPHA, mean_ci, welch_test

BASELINE = "baseline"
NO_BASELINE = "no baseline in this sweep"
TEST_NAME = "Welch's two-sample t-test (unequal variances), two-sided, on final val loss"
STEP_TIME_METHOD = (
    "per-step seconds = Δelapsed_s / Δstep between consecutive metrics.jsonl lines, leaving out "
    "intervals that end on an eval step or a checkpoint save (their elapsed time includes those)"
)


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
