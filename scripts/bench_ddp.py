"""Benchmark multi-process training on CPU: one process using every core vs two DDP processes.

Two questions, one run:

1. Throughput. The real CLI trains `--steps` steps as 1 process x all cores' threads and
   as 2 processes (DDP over gloo) x half the threads each; tokens/s comes from each run's
   summary.json (global tokens/s of the training loop, evaluation excluded, start-up and
   the first steps included). With the same per-rank batch, 2 processes train twice the
   tokens per step, so 1 process is also run at twice the batch: that pair compares the
   same global batch. The cases alternate within each round and the order flips every
   round, so machine noise and drift land on every case.

2. Communication share. Under torchrun, each of 2 workers (this file, `--worker`) builds
   three Trainers on the same config, differing only in the DDP communication hook
   (scripts/bench_dist_common.py); a hook cannot be re-registered on an existing DDP model,
   hence three. Their `train_step()`s are timed alternately, step by step, in the same
   processes:
   - ddp: DDP's own bucketed all-reduce, overlapped with backward (what training does);
   - nocomm: a hook that returns each bucket's own gradient, so no gradient leaves the rank;
   - serial: a hook that all-reduces each bucket synchronously and times it, so backward
     waits for it. Its sum per step is the raw all-reduce time, including the wait for the
     slower rank to reach the same bucket. An async all-reduce timed to its future's
     completion would overlap backward and bill compute to communication, hence blocking.
   share = (ddp - nocomm) / ddp is the step time gradient communication costs. The small
   MoE expert-bias all-reduce at the end of each step runs in all three variants.

    python scripts/bench_ddp.py [--model small] [--steps 20] [--rounds 2] [--batch-size 8]
                                [--comm-steps 8] [--json OUT]

The same DDP variants across two emulated hosts at several link rates:
scripts/bench_ddp_links.py. Expert parallelism: scripts/bench_expert_parallel.py. Pipeline
parallelism: scripts/bench_pipeline.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench import results_console
from bench_dist_common import WARMUP_STEPS, build_ddp_variants, grad_bytes, run_logged, run_table, time_ddp_variants
from ciuic_train.launch.modes import quote_override

NPROC = 2

progress = Console(stderr=True)


# ---------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """Time the three DDP variants step by step; rank 0 prints one JSON line."""
    parallel, trainers, serial = build_ddp_variants(args)
    timed = time_ddp_variants(trainers, serial, WARMUP_STEPS, args.comm_steps)
    if parallel.is_main:
        print(
            json.dumps(
                {
                    "world_size": parallel.world_size,
                    "threads_per_rank": torch.get_num_threads(),
                    "batch_size_per_rank": args.batch_size,
                    "grad_mbytes": grad_bytes(trainers["ddp"]) / 2**20,
                    "buckets_per_step": statistics.median(timed["buckets"]),
                    "step_s": timed["step_s"],
                    "all_reduce_s": timed["all_reduce_s"],
                }
            ),
            flush=True,
        )
    parallel.close()


# ---------------------------------------------------------------------------- driver


def cli_run(case: dict, args: argparse.Namespace, work: Path, tag: str) -> dict[str, float]:
    """One training run through the real CLI: its summary.json's global tokens/s, and the noise."""
    run_dir = work / tag
    cmd = [
        sys.executable, "-m", "ciuic_train",
        f"model={args.model}",
        f"train.max_steps={args.steps}",
        f"train.batch_size={case['batch_size']}",
        f"hydra.run.dir={quote_override(str(run_dir))}",
        "progress=plain",
        "sample.max_new_tokens=0",
        "train.eval_every=100000",
        "train.eval_windows=1",
    ]  # fmt: skip
    if case["nproc"] > 1:
        cmd.append(f"dist.nproc_per_node={case['nproc']}")
    env = {**os.environ, "OMP_NUM_THREADS": str(case["threads"])}
    _, other_cores = run_logged(cmd, env, work / f"{tag}.log")
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["world_size"] == case["nproc"], summary
    return {"tokens_per_s": summary["tokens_per_s"], "other_cores": other_cores}


def comm_share(args: argparse.Namespace, threads: int, work: Path) -> dict:
    """The worker's step times under torchrun, reduced to medians and the comm share."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
        __file__, "--worker",
        f"--model={args.model}", f"--batch-size={args.batch_size}", f"--comm-steps={args.comm_steps}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    stdout, other_cores = run_logged(cmd, env, work / "comm.log")
    raw = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    median = {name: statistics.median(times) for name, times in raw["step_s"].items()}
    all_reduce = statistics.median(raw["all_reduce_s"])
    return {
        **raw,
        "median_step_s": median,
        "median_all_reduce_s": all_reduce,
        "comm_share": (median["ddp"] - median["nocomm"]) / median["ddp"],
        "serial_all_reduce_share": all_reduce / median["serial"],
        "other_cores": other_cores,
    }


def main(args: argparse.Namespace) -> None:
    # Another job on these few cores slows every figure; the load says whether one was running.
    load_at_start = os.getloadavg()[0]
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    threads = max(1, cores // NPROC)
    b = args.batch_size
    progress.print(f"torch {torch.__version__}, {cores} cores, load average (1 min) {load_at_start:.2f}")
    cases = {
        f"1x{cores} B{b}": {"nproc": 1, "threads": cores, "batch_size": b},
        f"{NPROC}x{threads} B{b}": {"nproc": NPROC, "threads": threads, "batch_size": b},
        f"1x{cores} B{NPROC * b}": {"nproc": 1, "threads": cores, "batch_size": NPROC * b},
    }
    single, multi, single_big = cases

    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            figures = {}
            for name in order:
                progress.print(f"round {r + 1}/{args.rounds}: {name} ...")
                run = figures[name] = cli_run(cases[name], args, work, f"r{r}-{name.replace(' ', '-')}")
                progress.print(f"  {run['tokens_per_s']:,.0f} tok/s, others kept {run['other_cores']:.2f} cores busy")
            rounds.append({name: figures[name] for name in cases})
        progress.print(f"comm share: {NPROC} workers x 3 DDP variants, {args.comm_steps} timed steps each ...")
        comm = comm_share(args, threads, work)

    # The median, as bench.py reports; the best too, as a neighbour's job only ever slows a run.
    tokens = {
        stat: {name: reduce(r[name]["tokens_per_s"] for r in rounds) for name in cases}
        for stat, reduce in (("median", statistics.median), ("best", max))
    }
    ratios = {
        stat: {"same_rank_batch": t[multi] / t[single], "same_global_batch": t[multi] / t[single_big]}
        for stat, t in tokens.items()
    }
    results = {
        "torch": torch.__version__,
        "cores": cores,
        "load_avg_1min_at_start": load_at_start,
        "load_avg_1min_at_end": os.getloadavg()[0],
        "model": args.model,
        "batch_size_per_rank": b,
        "steps": args.steps,
        "cases": cases,
        "rounds": rounds,
        "tokens_per_s": tokens,
        "ratio_multi_over_single": ratios,
        "comm": comm,
        "wall_s": time.perf_counter() - started,
    }
    show(results, single, multi, single_big)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def show(results: dict, single: str, multi: str, single_big: str) -> None:
    console = results_console()
    summary = run_table(
        "ciuic_train distributed bench", results,
        f"model={results['model']}, per-rank batch {results['batch_size_per_rank']}, {results['steps']} steps per run",
    )
    summary.add_row("wall time", f"{results['wall_s']:.0f} s")
    console.print(summary)

    rounds = results["rounds"]
    per_round = Table(
        title="global tokens/s from the CLI's summary.json (cores other processes kept busy meanwhile)\n"
        "NxT = processes x threads each, B = per-rank batch"
    )
    for column in ("round", *rounds[0], f"{multi} / {single}", f"{multi} / {single_big}"):
        per_round.add_column(column, justify="right")
    for i, r in enumerate(rounds, 1):
        tokens = {name: run["tokens_per_s"] for name, run in r.items()}
        per_round.add_row(
            str(i),
            *(f"{run['tokens_per_s']:,.0f} ({run['other_cores']:.2f})" for run in r.values()),
            f"{tokens[multi] / tokens[single]:.2f}",
            f"{tokens[multi] / tokens[single_big]:.2f}",
        )
    for stat, tokens in results["tokens_per_s"].items():
        ratios = results["ratio_multi_over_single"][stat]
        per_round.add_row(
            stat,
            *(f"{v:,.0f}" for v in tokens.values()),
            f"{ratios['same_rank_batch']:.2f}",
            f"{ratios['same_global_batch']:.2f}",
        )
    console.print(per_round)
    console.print(
        f"{multi} trains {NPROC}x the tokens of {single} per step; {single_big} has the same global batch as {multi}."
    )

    comm = results["comm"]
    median = comm["median_step_s"]
    table = Table(
        title=f"DDP step time, {comm['world_size']} ranks x {comm['threads_per_rank']} thread(s), "
        f"batch {comm['batch_size_per_rank']}/rank (median of {len(comm['step_s']['ddp'])} steps)",
        show_header=False,
    )
    table.add_row("ddp (overlapped all-reduce)", f"{median['ddp'] * 1e3:,.0f} ms")
    table.add_row("nocomm (hook skips all-reduce)", f"{median['nocomm'] * 1e3:,.0f} ms")
    table.add_row("comm share (ddp - nocomm) / ddp", f"{comm['comm_share']:.1%}")
    table.add_row("serial (blocking all-reduce hook)", f"{median['serial'] * 1e3:,.0f} ms")
    table.add_row(
        "raw all-reduce per step (blocking)",
        f"{comm['median_all_reduce_s'] * 1e3:,.0f} ms = {comm['serial_all_reduce_share']:.1%} of serial step, "
        f"{comm['grad_mbytes']:.1f} MiB in {comm['buckets_per_step']:g} buckets",
    )
    table.add_row("cores other processes kept busy", f"{comm['other_cores']:.2f}")
    console.print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="model config (default: small)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per CLI run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every CLI case, interleaved")
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch")
    parser.add_argument("--comm-steps", type=int, default=8, help="timed steps of each DDP variant")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    cli_args = parse_args()
    if cli_args.worker:
        worker(cli_args)
    else:
        main(cli_args)
