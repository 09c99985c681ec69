"""Benchmark pipeline parallelism on 2 CPU ranks: step time of `dist.pp=2` under each schedule
against DDP and FSDP at the same global batch, and the measured bubble against the schedule's.

    python scripts/bench_pipeline.py [--model small] [--batch-size 8] [--pp-steps 12] [--json OUT]
    python scripts/bench_pipeline.py --netns [--rates 0,1000,300]     # one rank per emulated host (root)

One pair of workers (this file, `--pp-worker`, under torchrun: gloo, one process per rank,
cores / 2 threads each) builds a Trainer per layout from the same seed, in the same
processes, and times their `train_step()`s alternately, step by step, the order rotating
every step, so machine noise lands on every layout alike:

- ddp, fsdp: `batch_size` windows per rank (`dist.dp_replicate=2` / `dist.dp_shard=2`);
- pp_<schedule>: `dist.pp=2`, 2 x `batch_size` windows (the same global batch) in
  `--microbatches` micro-batches (default 4: what dualpipev needs on 2 ranks), two stages
  per rank for interleaved_1f1b, zbv and dualpipev.

A step's first losses must agree across layouts (1e-4): they train the same model on the
same windows. The measured bubble of a pipeline rank is 1 - (time in its stages' forward and
backward computations) / (time in the schedule's step), both read in the worker:
torch's `PipelineStage` forward/backward entry points are wrapped with a timer. It counts
waiting on the other rank and the point-to-point transfers as idle, as a bubble is; the
schedule's own bubble (`ciuic_train.plan.pipeline.bubble_fraction`) assumes equal
stages and free transfers.

`--netns`: the same workers, rank 0 on emulated host 0 and rank 1 on host 1
(scripts/cluster/netns_cluster.sh; one pipeline stage per host), once per link rate in
`--rates` (Mbit/s, 0 = unlimited), the layouts ddp, fsdp, fsdp_own (FSDP in its own
prefetch order: `dist.fsdp_prefetch=0 dist.fsdp_keep_last_gathered=false`), ep2 (FSDP with
`dist.ep=2`: the tokens cross the link instead of the experts' weights), ep2_blocking (the
same, `dist.ep_overlap=false`) and pp_1f1b; each step time is reported over the same
layout's on the unlimited link.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from rich.table import Table

from bench import results_console
from ciuic_train.config import register_configs
from ciuic_train.checks import to_config
from ciuic_train.distributed.pipeline_split import ONE_STAGE_PER_RANK
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.train.trainer import Trainer

NPROC = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
# fsdp_own: FSDP in its own prefetch order (dist.fsdp_prefetch=0, the last block resharded), beside the default;
# ep2: FSDP with the routed experts split over the 2 ranks, ep2_blocking the same with blocking token exchanges.
NETNS_LAYOUTS = ("ddp", "fsdp", "fsdp_own", "ep2", "ep2_blocking", "pp_1f1b")
NETNS_CLUSTER = Path(__file__).resolve().parent / "cluster" / "netns_cluster.sh"
progress = results_console()


def layout_overrides(name: str, batch_size: int, microbatches: int) -> list[str]:
    if name == "ddp":
        return [f"train.batch_size={batch_size}", f"dist.dp_replicate={NPROC}"]
    if name == "fsdp":
        return [f"train.batch_size={batch_size}", f"dist.dp_shard={NPROC}", "dist.dp_replicate=1"]
    if name == "fsdp_own":
        return [*layout_overrides("fsdp", batch_size, microbatches), "dist.fsdp_prefetch=0",
                "dist.fsdp_keep_last_gathered=false"]
    if name.startswith("ep2"):
        overlap = "false" if name == "ep2_blocking" else "true"
        return [*layout_overrides("fsdp", batch_size, microbatches), f"dist.ep={NPROC}", f"dist.ep_overlap={overlap}"]
    schedule = name.removeprefix("pp_")
    per_rank = 1 if schedule in ONE_STAGE_PER_RANK else 2
    return [f"train.batch_size={NPROC * batch_size}", f"dist.pp={NPROC}", f"dist.pp_schedule={schedule}",
            f"dist.pp_stages_per_rank={per_rank}", f"dist.pp_microbatches={microbatches}", "dist.dp_replicate=1"]


class StageTimer:
    """Seconds this process spends inside torch's stage computations (forward, backward,
    weight backward) and inside the pipeline's schedule step."""

    def __init__(self):
        self.compute = self.schedule = 0.0

    def install(self) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        from ciuic_train.distributed.pipeline import Pipeline

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(_PipelineStageBase, name, self._timed(getattr(_PipelineStageBase, name), "compute"))
        Pipeline.train = self._timed(Pipeline.train, "schedule")

    def _timed(self, method, counter: str):
        timer = self

        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                setattr(timer, counter, getattr(timer, counter) + time.perf_counter() - tic)

        return timed


def pp_worker(args: argparse.Namespace) -> None:
    """Time every layout in `--layouts` step by step; rank 0 prints one JSON line."""
    logging.getLogger("ciuic_train").setLevel(logging.WARNING)
    layouts = args.layouts.split(",")
    base = [f"model={args.model}", "device=cpu", "precision=fp32", "dist.backend=gloo", "train.seq_len=128"]
    register_configs()
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        configs = {name: to_config(compose(config_name="config", overrides=[
            *base, *layout_overrides(name, args.batch_size, args.microbatches)])) for name in layouts}
    timer = StageTimer()
    timer.install()
    trainers = {}
    with tempfile.TemporaryDirectory() as run_dir:  # train_step() writes nothing there
        for name in layouts:
            parallel = Parallel(configs[name].dist, torch.device("cpu"), configs[name].model.n_routed_experts)
            trainers[name] = Trainer(configs[name], Path(run_dir), parallel)
    step_s: dict[str, list[float]] = {name: [] for name in layouts}
    busy: dict[str, list[float]] = {name: [] for name in layouts}
    losses: dict[str, list[float]] = {name: [] for name in layouts}
    for i in range(args.pp_warmup + args.pp_steps):
        shift = i % len(layouts)
        for name in layouts[shift:] + layouts[:shift]:
            timer.compute = timer.schedule = 0.0
            dist.barrier()
            tic = time.perf_counter()
            figures = trainers[name].train_step()
            elapsed = time.perf_counter() - tic
            losses[name].append(figures["loss"])
            if i >= args.pp_warmup:
                step_s[name].append(elapsed)
                if name.startswith("pp_"):
                    busy[name].append(timer.compute / timer.schedule)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"step_s": step_s, "busy": busy})
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": everyone, "losses": losses, "layouts": layouts}))


def run_workers(args: argparse.Namespace, layouts: list[str], work: Path, tag: str, hosts: bool = False) -> dict:
    """One pair of `--pp-worker`s (on one machine, or one on each emulated host); rank 0's JSON."""
    threads = max(1, (os.cpu_count() or 1) // NPROC)
    worker = [__file__, "--pp-worker", f"--layouts={','.join(layouts)}", f"--model={args.model}",
              f"--batch-size={args.batch_size}", f"--microbatches={args.microbatches}",
              f"--pp-steps={args.pp_steps}", f"--pp-warmup={args.pp_warmup}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if not hosts:
        commands = [[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}", *worker]]
    else:
        rdzv = f"--rdzv-id=bench-pp-{os.getpid()}-{tag}"
        commands = [[str(NETNS_CLUSTER), "exec", str(h), sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                     "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=host0:{args.port}", rdzv, *worker]
                    for h in range(NPROC)]
    logs = [work / f"{tag}-{i}.log" for i in range(len(commands))]
    procs = [subprocess.Popen(c, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=work)
             for c, log in zip(commands, logs)]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"{tag}: workers exited with {codes}; see {logs}: {logs[0].read_text()[-3000:]}")
    return json.loads([line for line in logs[0].read_text().splitlines() if line.startswith("{")][-1])


def summarize(raw: dict) -> dict[str, Any]:
    """Median step time per layout (the slower rank's step: both wait for each other) and,
    for the pipelines, the measured bubble per rank and the schedule's."""
    from ciuic_train.plan.pipeline import bubble_fraction, schedule_order

    losses = raw["losses"]
    first = {name: values[0] for name, values in losses.items()}
    reference = next(iter(first.values()))
    assert all(abs(v - reference) < 1e-4 for v in first.values()), f"the layouts' first losses differ: {first}"
    out: dict[str, Any] = {}
    for name in raw["layouts"]:
        per_step = [max(rank["step_s"][name][i] for rank in raw["ranks"]) for i in range(len(raw["ranks"][0]["step_s"][name]))]
        row: dict[str, Any] = {"step_s": statistics.median(per_step)}
        if name.startswith("pp_"):
            row["measured_bubble"] = [1 - statistics.median(rank["busy"][name]) for rank in raw["ranks"]]
            schedule = name.removeprefix("pp_")
            per_rank = 1 if schedule in ONE_STAGE_PER_RANK else 2
            dist_cfg = _dist(schedule, per_rank, raw)
            row["schedule_bubble"] = bubble_fraction(schedule_order(dist_cfg), NPROC * per_rank)
        out[name] = row
    return out


def _dist(schedule: str, per_rank: int, raw: dict):
    from ciuic_train.config import DistConfig, PipelineSchedule

    return DistConfig(pp=NPROC, pp_schedule=PipelineSchedule[schedule], pp_stages_per_rank=per_rank,
                      pp_microbatches=raw["microbatches"])


def pp_main(args: argparse.Namespace) -> None:
    started, load = time.perf_counter(), os.getloadavg()[0]
    cores = os.cpu_count() or 1
    progress.print(f"torch {torch.__version__}, {cores} cores, load average (1 min) {load:.2f}")
    results: dict[str, Any] = {"torch": torch.__version__, "cores": cores, "model": args.model,
                               "batch_size_per_data_rank": args.batch_size, "microbatches": args.microbatches,
                               "steps": args.pp_steps, "load_avg_1min_at_start": load}
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        work = Path(tmp)
        if not args.netns:
            layouts = ["ddp", "fsdp", *(f"pp_{s}" for s in SCHEDULES)]
            progress.print(f"{len(layouts)} layouts on {NPROC} ranks, {args.pp_steps} timed steps each ...")
            raw = run_workers(args, layouts, work, "one-host")
            results["one_host"] = summarize({**raw, "microbatches": args.microbatches})
        else:
            results["rates"] = {}
            for mbit in (int(r) for r in args.rates.split(",")):
                progress.print(f"link {mbit or 'unlimited'} Mbit/s: {', '.join(NETNS_LAYOUTS)} across two hosts ...")
                _set_link(mbit)
                try:
                    raw = run_workers(args, list(NETNS_LAYOUTS), work, f"netns-{mbit}", hosts=True)
                finally:
                    _set_link(0)
                results["rates"][mbit] = summarize({**raw, "microbatches": args.microbatches})
    results["load_avg_1min_at_end"] = os.getloadavg()[0]
    results["wall_s"] = time.perf_counter() - started
    show(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def _set_link(mbit: int) -> None:
    env = {**os.environ, "LINK_MBIT": str(mbit), "HOSTS": str(NPROC)}
    done = subprocess.run([str(NETNS_CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"LINK_MBIT={mbit} {NETNS_CLUSTER} up: {done.stderr.strip()}")


def show(results: dict) -> None:
    title = (f"pipeline benchmark: model={results['model']}, {results['batch_size_per_data_rank']} windows x 128 "
             f"tokens per data rank ({NPROC * results['batch_size_per_data_rank']} a step), "
             f"{results['microbatches']} micro-batches, {results['steps']} timed steps; load "
             f"{results['load_avg_1min_at_start']:.2f} -> {results['load_avg_1min_at_end']:.2f}")
    if "one_host" in results:
        rows = results["one_host"]
        table = Table(title=title)
        for column in ("layout", "step (median)", "over DDP", "over FSDP", "bubble measured (rank 0 / 1)",
                       "bubble of the schedule"):
            table.add_column(column, justify="right")
        for name, row in rows.items():
            measured = " / ".join(f"{b:.1%}" for b in row.get("measured_bubble", [])) or "-"
            schedule = f"{row['schedule_bubble']:.1%}" if "schedule_bubble" in row else "-"
            table.add_row(name, f"{row['step_s'] * 1e3:.0f} ms", f"{row['step_s'] / rows['ddp']['step_s']:.2f}",
                          f"{row['step_s'] / rows['fsdp']['step_s']:.2f}", measured, schedule)
        progress.print(table)
    if "rates" in results:
        table = Table(title=title + "; one rank per emulated host: step time over the unlimited link's")
        table.add_column("layout")
        rates = results["rates"]
        for mbit in rates:
            table.add_column(f"{mbit} Mbit/s" if mbit else "unlimited", justify="right")
        unlimited = rates.get(0) or rates.get("0")
        for name in NETNS_LAYOUTS:
            cells = [f"{rates[m][name]['step_s'] * 1e3:.0f} ms" + (
                f" ({rates[m][name]['step_s'] / unlimited[name]['step_s']:.2f}x)" if unlimited else "") for m in rates]
            table.add_row(name, *cells)
        progress.print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp-steps", type=int, default=12, help="--pp: timed steps of each layout")
    parser.add_argument("--pp-warmup", type=int, default=2, help="--pp: untimed steps of each layout first")
    parser.add_argument("--microbatches", type=int, default=4, help="--pp: micro-batches per step")
    parser.add_argument("--pp-worker", action="store_true", help=argparse.SUPPRESS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layouts", default="")
    parser.add_argument("--netns", action="store_true")
    parser.add_argument("--rates", default="0,1000,300")
    parser.add_argument("--port", type=int, default=29471)
    parser.add_argument("--json", type=Path)
    add_arguments(parser)
    parsed = parser.parse_args()
    pp_worker(parsed) if parsed.pp_worker else pp_main(parsed)
