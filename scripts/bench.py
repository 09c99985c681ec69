"""Benchmark this machine and the trainer: matmul peak, training tokens/s and MFU, trainer overhead.

MFU is measured against a peak timed here (not a datasheet figure), so it says how much of
what this machine can actually do the model uses. The trainer is compared with a bare loop
(forward, loss, backward, optimizer step, nothing else) in alternating rounds of the same
process, so machine noise lands on both sides and their ratio is the trainer's own overhead.

    python scripts/bench.py [--model small] [--steps 20] [--rounds 3] [--batch-size 8]
                            [--seq-len 256] [--precision fp32|bf16] [--json OUT]
                            [--device cpu|cuda] [--override KEY=VALUE ...]
                            [--mtp-depths N] [--datasheet-tflops 989] [--fp32-gemm]

`--mtp-depths N` adds a side-by-side comparison of the bare loop without multi-token
prediction and with N MTP depths (`model.n_mtp_layers`), in alternating rounds, with the
FLOPs per token each counts.

`--fp32-gemm` adds the bare loop with the model's linear layers on MKL (what `F.linear`
runs), on what `model.kernels=auto` chooses here, and on oneDNN (`CIUIC_FP32_GEMM=mkl|
auto|onednn`, ciuic_train/model/kernels/gemm_choice.py), in rotating rounds, with the
GFLOP/s each reaches against both backends' square fp32 peaks, and the choice. Under
bf16 autocast the linears take neither backend's fp32 path (the sides should tie).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
from hydra import compose, initialize_config_module
from rich.console import Console
from rich.table import Table

from ciuic_train.config import Config, Precision, register_configs
from ciuic_train.checks import to_config
from ciuic_train.model import Transformer
from ciuic_train.model.counting import training_flops_per_token
from ciuic_train.model.kernels import gemm_choice
from ciuic_train.step.optim import build_optimizer
from ciuic_train.train.trainer import Trainer

MATMUL_SIZES = (1024, 2048)
# On a GPU the CPU sizes take microseconds, too short to time; these reach its peak.
CUDA_MATMUL_SIZES = (4096, 8192)
MATMUL_REPEATS = 5
# Steps of an untimed bare loop before round 1, so one-time lazy setup (autograd threads,
# kernel selection, oneDNN primitives) is not billed to whichever side runs first.
WARMUP_STEPS = 2

progress = Console(stderr=True)


def results_console() -> Console:
    """Where the result tables go: a terminal at its own width; piped to a file, 200 columns,
    where rich would otherwise assume 80 and cut the tables' labels short."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def matmul_peak(
    dtype: torch.dtype, repeats: int = MATMUL_REPEATS, mm: Callable = torch.mm, device: str = "cpu"
) -> dict[int, float]:
    """GFLOP/s of a square `torch.mm` (or another `mm` of two n x n) per size, best of
    several repeats after a warm-up. On CUDA each product is waited for before the clock stops."""
    figures = {}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for n in MATMUL_SIZES if torch.device(device).type == "cpu" else CUDA_MATMUL_SIZES:
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        mm(a, b)
        sync()
        best = float("inf")
        for _ in range(repeats):
            tic = time.perf_counter()
            mm(a, b)
            sync()
            best = min(best, time.perf_counter() - tic)
        figures[n] = 2 * n**3 / best / 1e9
    return figures


def compose_config(args: argparse.Namespace) -> Config:
    """The config exactly as the CLI would build it, with no evaluation or sample mid-run."""
    overrides = [
        f"model={args.model}",
        f"train.max_steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.seq_len={args.seq_len}",
        f"train.eval_every={args.steps + 1}",
        f"train.eval_windows={args.batch_size}",
        "train.warmup_steps=2",
        f"precision={args.precision}",
        f"device={args.device}",
        "progress=plain",
        "sample.max_new_tokens=0",
        *args.override,
    ]
    register_configs()
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


def trainer_tokens_per_s(config: Config) -> float:
    """The full trainer (data, step, clipping, bias update, logging); its final eval is excluded."""
    with tempfile.TemporaryDirectory() as run_dir:
        return Trainer(config, Path(run_dir)).fit()["tokens_per_s"]


def bare_tokens_per_s(config: Config, steps: int) -> float:
    """Forward, loss, backward, step on one fixed random batch: the floor the trainer adds to."""
    device = torch.device(config.device.value)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(config.seed)
    with device:  # built where it runs: a large model initialised on CPU would take long
        model = Transformer(config.model)
    model.train()
    optimizer = build_optimizer(model, config.optim, config.train.lr)
    batch, seq = config.train.batch_size, config.train.seq_len
    tokens = torch.randint(config.model.vocab_size, (batch, seq + 1)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if config.precision is Precision.bf16 else nullcontext()
    )
    sync()
    tic = time.perf_counter()
    for _ in range(steps):
        with autocast:
            # fp32 cross-entropy over chunks of tokens, and the MTP depths' where on, as in the trainer
            loss = model(inputs, targets, mtp_loss_weight=config.train.mtp_loss_weight)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    return batch * seq * steps / (time.perf_counter() - tic)


def mtp_side_by_side(args: argparse.Namespace, config: Config) -> dict:
    """Bare-loop tokens/s without MTP and with `args.mtp_depths` depths, in alternating rounds."""
    sides = {
        "off": compose_config(argparse.Namespace(**{**vars(args), "override": [*args.override, "model.n_mtp_layers=0"]})),
        "on": compose_config(
            argparse.Namespace(**{**vars(args), "override": [*args.override, f"model.n_mtp_layers={args.mtp_depths}"]})
        ),
    }
    figures = {}
    for name, side in sides.items():
        with torch.device("meta"):
            figures[name] = {"flops_per_token": training_flops_per_token(Transformer(side.model), args.seq_len),
                             "tokens_per_s": []}
        bare_tokens_per_s(side, WARMUP_STEPS)
    for i in range(args.rounds):
        for name, side in sides.items():
            figures[name]["tokens_per_s"].append(bare_tokens_per_s(side, args.steps))
        progress.print(f"MTP round {i + 1}/{args.rounds}: " + ", ".join(
            f"{name} {figures[name]['tokens_per_s'][-1]:,.0f} tok/s" for name in sides))
    for side in figures.values():
        side["median_tokens_per_s"] = statistics.median(side["tokens_per_s"])
    figures["depths"] = args.mtp_depths
    figures["tokens_per_s_ratio"] = figures["on"]["median_tokens_per_s"] / figures["off"]["median_tokens_per_s"]
    figures["flops_ratio"] = figures["on"]["flops_per_token"] / figures["off"]["flops_per_token"]
    return figures


def mtp_table(figures: dict, peak_flops: float) -> Table:
    table = Table(title=f"bare loop without MTP and with {figures['depths']} depth(s), alternating rounds")
    for column in ("MTP", "FLOPs / token", "tokens/s (median)", "MFU"):
        table.add_column(column, justify="right")
    for name in ("off", "on"):
        side = figures[name]
        mfu = side["median_tokens_per_s"] * side["flops_per_token"] / peak_flops
        table.add_row(name, f"{side['flops_per_token'] / 1e6:,.2f} M", f"{side['median_tokens_per_s']:,.0f}",
                      f"{mfu:.1%}")
    table.add_row("on / off", f"{figures['flops_ratio']:.3f}", f"{figures['tokens_per_s_ratio']:.3f}", "")
    return table


def gemm_side_by_side(args: argparse.Namespace, config: Config, flops: float) -> dict:
    """Bare-loop tokens/s with the linears' fp32 GEMMs on MKL, as `auto` chooses, and on
    oneDNN, in rotating rounds; GFLOP/s against each backend's square fp32 peak; what `auto` chooses."""
    from dataclasses import asdict

    def use(backend: str | None) -> None:
        if backend in (None, "auto"):
            os.environ.pop(gemm_choice.ENV, None)
        else:
            os.environ[gemm_choice.ENV] = backend
        gemm_choice.fp32_gemm_plan.cache_clear()

    previous = os.environ.get(gemm_choice.ENV)
    sides = ("mkl", "auto", "onednn")
    figures = {side: {"tokens_per_s": []} for side in sides}
    peaks = {"mkl": max(matmul_peak(torch.float32).values()),  # a @ b^T by oneDNN: the same FLOPs
             "onednn": max(matmul_peak(torch.float32, mm=gemm_choice.onednn_mm_nt).values())}
    try:
        for side in sides:
            use(side)
            bare_tokens_per_s(config, WARMUP_STEPS)
        for i in range(args.rounds):
            for side in sides[i % 3:] + sides[:i % 3]:
                use(side)
                figures[side]["tokens_per_s"].append(bare_tokens_per_s(config, args.steps))
            progress.print(f"fp32 GEMM round {i + 1}/{args.rounds}: " + ", ".join(
                f"{side} {figures[side]['tokens_per_s'][-1]:,.0f} tok/s" for side in sides))
        use(None)
        figures["auto_chooses"] = asdict(gemm_choice.fp32_gemm_plan())
    finally:
        use(previous)
    for side in sides:
        median = statistics.median(figures[side]["tokens_per_s"])
        figures[side]["median_tokens_per_s"] = median
        figures[side]["gflops"] = median * flops / 1e9
    figures["square_peak_gflops"] = peaks
    for side in ("auto", "onednn"):
        figures[f"{side}_over_mkl"] = figures[side]["median_tokens_per_s"] / figures["mkl"]["median_tokens_per_s"]
    return figures


def gemm_table(figures: dict, precision: str) -> Table:
    peaks = figures["square_peak_gflops"]
    table = Table(title=f"bare loop, {precision}, linears on MKL, as auto chooses, on oneDNN; rotating rounds")
    for column in ("linears", "tokens/s (median)", "GFLOP/s", f"% MKL peak {peaks['mkl']:.0f}",
                   f"% oneDNN peak {peaks['onednn']:.0f}"):
        table.add_column(column, justify="right")
    for side in ("mkl", "auto", "onednn"):
        rate = figures[side]["gflops"]
        table.add_row(side, f"{figures[side]['median_tokens_per_s']:,.0f}", f"{rate:.1f}",
                      f"{rate / peaks['mkl']:.1%}", f"{rate / peaks['onednn']:.1%}")
    for side in ("auto", "onednn"):
        table.add_row(f"{side} / mkl", f"{figures[f'{side}_over_mkl']:.3f}", "", "", "")
    chosen = ", ".join(f"{product} {'oneDNN' if on else 'MKL'}" for product, on in figures["auto_chooses"].items())
    table.caption = f"auto chooses: {chosen}"
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each side, interleaved")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--precision", choices=[p.value for p in Precision], default="fp32")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--datasheet-tflops", type=float, default=0.0,
                        help="also give MFU against this datasheet peak, e.g. 989 (H100/H200 SXM dense bf16)")
    parser.add_argument("--mtp-depths", type=int, default=0,
                        help="also time the bare loop with this many MTP depths against none, side by side")
    parser.add_argument("--fp32-gemm", action="store_true",
                        help="also time the bare loop with the linears on MKL and on oneDNN, side by side")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for both sides, e.g. model.dim=1024 (repeatable; applied last)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Another job on these few cores slows every figure; the load says whether one was running.
    load_at_start = os.getloadavg()[0]
    logging.getLogger("ciuic_train").setLevel(logging.WARNING)
    config = compose_config(args)

    progress.print("timing matmul peak ...")
    peaks = {"fp32": matmul_peak(torch.float32, device=args.device)}
    if config.precision is Precision.bf16:
        peaks["bf16"] = matmul_peak(torch.bfloat16, device=args.device)
    peak_gflops = max(peaks[args.precision].values())
    peak_size = max(peaks[args.precision], key=peaks[args.precision].get)

    with torch.device("meta"):  # only counted: a large model would take long to initialise
        flops = training_flops_per_token(Transformer(config.model), args.seq_len)
    bare_tokens_per_s(config, WARMUP_STEPS)
    rounds = []
    for i in range(args.rounds):
        trainer = trainer_tokens_per_s(config)
        bare = bare_tokens_per_s(config, args.steps)
        rounds.append({"trainer_tokens_per_s": trainer, "bare_tokens_per_s": bare, "ratio": trainer / bare})
        progress.print(f"round {i + 1}/{args.rounds}: trainer {trainer:,.0f} tok/s, bare {bare:,.0f} tok/s")

    trainer_median = statistics.median(r["trainer_tokens_per_s"] for r in rounds)
    bare_median = statistics.median(r["bare_tokens_per_s"] for r in rounds)
    peak_flops = peak_gflops * 1e9
    results = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": gemm_choice.cpu_info()[1],
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "overrides": args.override,
        "load_avg_1min_at_start": load_at_start,
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "precision": args.precision,
        "matmul_gflops": {dtype: {str(n): g for n, g in sizes.items()} for dtype, sizes in peaks.items()},
        "peak_gflops": peak_gflops,
        "peak_size": peak_size,
        "flops_per_token": flops,
        "tokens_per_s": bare_median,
        "mfu": bare_median * flops / peak_flops,
        "trainer_tokens_per_s": trainer_median,
        "trainer_mfu": trainer_median * flops / peak_flops,
        "trainer_bare_ratio": trainer_median / bare_median,
        "rounds": rounds,
    }
    if args.datasheet_tflops:
        results["datasheet_tflops"] = args.datasheet_tflops
        results["datasheet_mfu"] = bare_median * flops / (args.datasheet_tflops * 1e12)
        results["trainer_datasheet_mfu"] = trainer_median * flops / (args.datasheet_tflops * 1e12)

    summary = Table(title="ciuic_train bench", show_header=False)
    summary.add_row("torch / threads", f"{results['torch']} / {results['threads']}")
    summary.add_row("cpu", results["cpu"])
    if args.device == "cuda":
        summary.add_row("gpu", results["gpu"])
    summary.add_row("load average at start", f"{load_at_start:.2f}")
    summary.add_row(
        "config", f"model={args.model} B={args.batch_size} S={args.seq_len} {args.precision}, {args.steps} steps"
    )
    if args.override:
        summary.add_row("overrides", " ".join(args.override))
    for dtype, sizes in peaks.items():
        summary.add_row(f"matmul {dtype} GFLOP/s", ", ".join(f"{n}: {g:,.1f}" for n, g in sizes.items()))
    summary.add_row("peak used for MFU", f"{peak_gflops:,.1f} GFLOP/s ({args.precision}, n={peak_size})")
    summary.add_row("FLOPs / token", f"{flops / 1e6:,.2f} M")
    summary.add_row("bare loop tokens/s (median)", f"{bare_median:,.0f}")
    summary.add_row("bare loop MFU", f"{results['mfu']:.1%}")
    summary.add_row("trainer tokens/s (median)", f"{trainer_median:,.0f}")
    summary.add_row("trainer MFU", f"{results['trainer_mfu']:.1%}")
    summary.add_row("trainer / bare", f"{results['trainer_bare_ratio']:.3f}")
    if args.datasheet_tflops:
        summary.add_row(f"MFU vs datasheet {args.datasheet_tflops:g} TFLOP/s",
                        f"bare {results['datasheet_mfu']:.1%}, trainer {results['trainer_datasheet_mfu']:.1%}")

    per_round = Table(title="rounds (trainer, then bare loop)")
    for column in ("round", "trainer tok/s", "bare tok/s", "trainer / bare"):
        per_round.add_column(column, justify="right")
    for i, r in enumerate(rounds, 1):
        per_round.add_row(
            str(i), f"{r['trainer_tokens_per_s']:,.0f}", f"{r['bare_tokens_per_s']:,.0f}", f"{r['ratio']:.3f}"
        )

    console = results_console()
    console.print(summary)
    console.print(per_round)
    if args.mtp_depths:
        results["mtp"] = mtp_side_by_side(args, config)
        console.print(mtp_table(results["mtp"], peak_flops))
    if args.fp32_gemm:
        results["fp32_gemm"] = gemm_side_by_side(args, config, flops)
        console.print(gemm_table(results["fp32_gemm"], args.precision))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(summary_line(results))


def summary_line(results: dict) -> str:
    """The run in one plain line (scripts/gpu_check.sh shows it as its bench stage's)."""
    datasheet = (f"; vs datasheet {results['datasheet_tflops']:g} TFLOP/s: bare {results['datasheet_mfu']:.1%}, "
                 f"trainer {results['trainer_datasheet_mfu']:.1%}") if "datasheet_mfu" in results else ""
    return (f"summary: {results['gpu'] or results['cpu']}, model={results['model']} {results['precision']} "
            f"B={results['batch_size']} S={results['seq_len']}: bare {results['tokens_per_s']:,.0f} tok/s, "
            f"trainer {results['trainer_tokens_per_s']:,.0f} tok/s (x{results['trainer_bare_ratio']:.3f}); "
            f"MFU vs measured {results['peak_gflops'] / 1e3:,.1f} TFLOP/s: bare {results['mfu']:.1%}, "
            f"trainer {results['trainer_mfu']:.1%}{datasheet}")


if __name__ == "__main__":
    main()
