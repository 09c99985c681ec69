"""Our model against transformers' DeepseekV3 at one config: tokens/s, GFLOP/s, MFU, peak memory.

Both sides train the same shape (`model=bench` by default) with the same loop: forward,
fp32 cross-entropy over every position, backward, fused AdamW (0.9/0.95, weight decay
0.1 on matrices). Ours computes the loss inside the model, `model(inputs, targets)`, over
chunks of tokens (as the trainer does); transformers' variants take the full logits and
run `F.cross_entropy` over them, as its users write it. transformers' model is built
from a config in code (no weights), with SDPA attention and either its eager (per-expert
loop) or grouped_mm experts.

Timing: every variant is built and warmed up first, then rounds run each variant for a
few steps in turn, the order rotating from round to round, so machine noise lands on
every side alike; figures are medians over rounds. "ours / this" is given twice: the
ratio of the two medians, and the median (and range) of the ratios within each round.
MFU is given twice (fp32 peak for fp32, bf16 peak for bf16 autocast): against the matmul
peak timed in the same round, right after the variants, so a slow spell of this shared
machine lowers both sides of the ratio alike (the median over rounds); and, more severely,
against the best peak timed anywhere in the run (start, every round, end).
Peak memory: each variant trains 10 steps in a fresh subprocess that first imports both
stacks; the figure is the growth of its peak RSS (VmHWM) past that point.

Besides `ours` (`model.kernels=auto`), `ours_reference` times the plain formulas
(`model.kernels=reference`), and `--baseline REV` adds `ours@REV`: the model package of git
revision REV, loaded beside today's, so a change to the model is measured side by side
with the code before it, in the same rounds.

    pip install -e '.[bench]'
    python scripts/bench_peer.py [--model bench] [--rounds 5] [--steps 3] [--precision fp32 bf16]
                                 [--compile] [--no-memory] [--baseline REV] [--json OUT]
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from bench import matmul_peak as square_peaks, results_console  # this script's folder is on sys.path
from ciuic_train.errors import UserError
from ciuic_train.checkpoint.hf_config import config_json
from ciuic_train.model import ModelConfig, Transformer, count_parameters
from ciuic_train.model.counting import training_flops_per_token

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("ours", "hf_eager", "hf_grouped_mm", "ours_reference")
BASELINE_PREFIX = "ours@"
WARMUP_STEPS = 2
MEMORY_STEPS = 8
BETAS, WEIGHT_DECAY, LR = (0.9, 0.95), 0.1, 1e-4
progress = Console(stderr=True)


def load_model_config(name: str) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")))


def peer_model(cfg: ModelConfig, experts: str) -> torch.nn.Module:
    """transformers' DeepseekV3ForCausalLM with exactly our shape; `experts` is eager or grouped_mm."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    try:  # our config.json (ciuic_train/checkpoint/hf_config.py), so both models compute the same function
        fields = config_json(cfg)
    except UserError as err:
        raise SystemExit(str(err)) from None
    config = DeepseekV3Config.from_dict(
        {**fields, "use_cache": False}, attn_implementation="sdpa", experts_implementation=experts
    )
    model = DeepseekV3ForCausalLM(config)
    assert model.config._experts_implementation == experts, model.config._experts_implementation
    return model


@lru_cache(maxsize=None)
def model_package_at(revision: str):
    """The model of a git revision, beside today's: its `ciuic_train/model/` package copied
    out of git under a package name of its own, its imports of `ciuic_train.model` pointed
    at the copy. Its `Transformer` comes from the package, which has exported it in every
    layout (one deepseek.py, then one file per part)."""
    package = "model_at_" + re.sub(r"\W", "_", revision)
    root = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, root, ignore_errors=True)

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout

    for name in git("ls-tree", "-r", "--name-only", revision, "ciuic_train/model/").split():
        if name.endswith(".py"):
            target = root / package / Path(name).relative_to("ciuic_train/model")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(git("show", f"{revision}:{name}").replace("ciuic_train.model", package))
    sys.path.insert(0, str(root))
    return importlib.import_module(package)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Fused AdamW, weight decay on matrices except the input embedding, for either model."""
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else model.tok_embeddings.weight
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2 and p is not embedding]
    no_decay = [p for p in params if p.ndim < 2 or p is embedding]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)


@dataclass
class Runner:
    """One variant's model, optimizer and fixed batch; `step()` is one training step."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    autocast: Callable
    hf: bool

    def step(self) -> None:
        if self.hf:
            # transformers: full logits, then the fp32 cross-entropy over them, as its users write it.
            with self.autocast():
                logits = self.model(self.inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten())
        else:
            # ours: the model's own loss, the same fp32 cross-entropy over chunks of tokens.
            with self.autocast():
                loss = self.model(self.inputs, self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def time_steps(self, steps: int) -> tuple[float, float]:
        """Seconds per step and minor page faults per step over `steps` steps."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tic = time.perf_counter()
        for _ in range(steps):
            self.step()
        seconds = (time.perf_counter() - tic) / steps
        return seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps


def build(name: str, cfg: ModelConfig, precision: str, batch: int, seq: int) -> Runner:
    torch.manual_seed(0)
    hf = name.startswith("hf_")
    if hf:
        model = peer_model(cfg, name.removeprefix("hf_"))
    elif name.startswith(BASELINE_PREFIX):
        model = model_package_at(name.removeprefix(BASELINE_PREFIX)).Transformer(cfg)
    else:
        model = Transformer(replace(cfg, kernels="reference") if name == "ours_reference" else cfg)
        if name == "ours_compile":
            for block in model.layers:
                block.compile()
    model.train()
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else nullcontext
    return Runner(name, model, adamw(model), tokens[:, :-1], tokens[:, 1:], autocast, hf)


PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak(dtype: torch.dtype) -> float:
    """The best square `torch.mm` GFLOP/s over bench.py's sizes."""
    return max(square_peaks(dtype, repeats=10).values())


def peak_rss_mib() -> float:
    """This process's peak resident memory: VmHWM, which, unlike ru_maxrss, exec does not inherit."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_child(name: str, model: str, precision: str, batch: int, seq: int) -> None:
    """In a fresh process: peak RSS growth, in MiB, of building and training one variant."""
    import transformers  # noqa: F401  (both stacks loaded before the baseline, on every side)

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    before = peak_rss_mib()
    runner = build(name, load_model_config(model), precision, batch, seq)
    for _ in range(WARMUP_STEPS + MEMORY_STEPS):
        runner.step()
    after = peak_rss_mib()
    print(json.dumps({"peak_rss_growth_mib": after - before, "peak_rss_mib": after}))


def peak_memory(name: str, args: argparse.Namespace, precision: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--memory-child", name, "--model", args.model, "--precision", precision,
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_precision(
    args: argparse.Namespace, cfg: ModelConfig, precision: str, flops: float
) -> tuple[dict, list[float]]:
    """Figures per variant, and the matmul peak timed in each round."""
    names = list(VARIANTS) + (["ours_compile"] if args.compile and precision == "fp32" else [])
    names += [BASELINE_PREFIX + args.baseline] if args.baseline else []
    runners, setup_s = {}, {}
    for name in names:
        progress.print(f"({precision}) building and warming up {name} ...")
        tic = time.perf_counter()
        runners[name] = build(name, cfg, precision, args.batch_size, args.seq_len)
        runners[name].time_steps(WARMUP_STEPS)
        setup_s[name] = time.perf_counter() - tic
    counts = {name: sum(p.numel() for p in r.model.parameters()) for name, r in runners.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"the variants differ in size: {counts}")

    per_round = {name: [] for name in names}
    faults = {name: [] for name in names}
    round_peaks = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            seconds, step_faults = runners[name].time_steps(args.steps)
            per_round[name].append(seconds)
            faults[name].append(step_faults)
        round_peaks.append(matmul_peak(PEAK_DTYPES[precision]))
        progress.print(f"({precision}) round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {args.batch_size * args.seq_len / per_round[n][-1]:,.0f}" for n in names)
            + f" tok/s; matmul peak {round_peaks[-1]:.0f} GFLOP/s")
    del runners

    tokens = args.batch_size * args.seq_len
    results = {}
    for name in names:
        step_s = statistics.median(per_round[name])
        results[name] = {
            "tokens_per_s": tokens / step_s,
            "gflops": tokens / step_s * flops / 1e9,
            "mfu": statistics.median(
                tokens / s * flops / 1e9 / peak for s, peak in zip(per_round[name], round_peaks)
            ),
            "setup_s": setup_s[name],
            "page_faults_per_step": statistics.median(faults[name]),
            "rounds_tokens_per_s": [tokens / s for s in per_round[name]],
        }
        if not args.no_memory and name != "ours_compile":
            progress.print(f"({precision}) peak memory of {name} (subprocess) ...")
            results[name] |= peak_memory(name, args, precision)
    return results, round_peaks


def paired_ratio(ours: list[float], this: list[float]) -> str:
    """Median and range of ours / this tokens/s within each round, as table text (the
    bracket escaped from rich's markup). Paired by round: the two sides of each ratio ran
    seconds apart, so a slow spell that spans a round weighs on both, where the ratio of
    the medians can set a fast round of one side against a slow round of the other."""
    ratios = [o / t for o, t in zip(ours, this)]
    return f"{statistics.median(ratios):.3f} \\[{min(ratios):.2f}-{max(ratios):.2f}]"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time our model with compile=true (fp32)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--baseline", metavar="REV", help="also time our model (ciuic_train/model/) as of this git revision")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.model, args.precision[0], args.batch_size, args.seq_len)
        return
    os.environ["BENCH_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    import transformers

    load_at_start = os.getloadavg()[0]
    cfg = load_model_config(args.model)
    model = Transformer(cfg)
    flops = training_flops_per_token(model, args.seq_len)
    total, active = count_parameters(model)
    del model
    progress.print("timing matmul peak ...")
    # Only the precisions asked for: without AVX-512 a bf16 peak alone takes minutes.
    peaks = {precision: matmul_peak(PEAK_DTYPES[precision]) for precision in args.precision}

    results = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_1min_at_start": load_at_start,
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps_per_round": args.steps,
        "baseline": args.baseline,
        "rounds": args.rounds,
        "params": total,
        "active_params": active,
        "flops_per_token": flops,
        "matmul_peak_gflops_at_start": dict(peaks),
        "precisions": {},
        "rounds_matmul_peak_gflops": {},
    }
    for precision in args.precision:
        figures, round_peaks = run_precision(args, cfg, precision, flops)
        results["precisions"][precision] = figures
        results["rounds_matmul_peak_gflops"][precision] = round_peaks
    results["load_avg_1min_at_end"] = os.getloadavg()[0]
    # Timed again at the end: a busy moment at the start must not flatter the MFU.
    end_peaks = {precision: matmul_peak(PEAK_DTYPES[precision]) for precision in args.precision}
    results["matmul_peak_gflops_at_end"] = end_peaks
    for precision, figures in results["precisions"].items():
        peak = max(peaks[precision], end_peaks[precision], *results["rounds_matmul_peak_gflops"][precision])
        for f in figures.values():
            f["mfu_vs_best_peak"] = f["gflops"] / peak
        peaks[precision] = peak
    results["matmul_peak_gflops"] = peaks

    console = results_console()
    console.print(
        f"model={args.model} ({total / 1e6:.2f} M params, {active / 1e6:.2f} M active), B={args.batch_size} "
        f"S={args.seq_len}, {flops / 1e6:.2f} MFLOP/token; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {args.threads} threads; best matmul peak "
        + ", ".join(f"{precision} {peak:.0f}" for precision, peak in peaks.items())
        + f" GFLOP/s; load {load_at_start:.2f} -> {results['load_avg_1min_at_end']:.2f}"
    )
    for precision, figures in results["precisions"].items():
        table = Table(title=f"{precision}{' autocast' if precision == 'bf16' else ''}: median of {args.rounds} rounds")
        for column in ("variant", "tokens/s", "GFLOP/s", "MFU (round peak)", "MFU (best peak)", "peak mem MiB",
                       "page faults/step", "ours / this", "ours / this per round: median \\[range]",
                       "build+warm-up s"):
            table.add_column(column, justify="right")
        ours, ours_rounds = figures["ours"]["tokens_per_s"], figures["ours"]["rounds_tokens_per_s"]
        for name, f in figures.items():
            memory = f"{f['peak_rss_growth_mib']:,.0f}" if "peak_rss_growth_mib" in f else "-"
            table.add_row(name, f"{f['tokens_per_s']:,.0f}", f"{f['gflops']:.1f}", f"{f['mfu']:.1%}",
                          f"{f['mfu_vs_best_peak']:.1%}", memory, f"{f['page_faults_per_step']:,.0f}",
                          f"{ours / f['tokens_per_s']:.3f}", paired_ratio(ours_rounds, f["rounds_tokens_per_s"]),
                          f"{f['setup_s']:.1f}")
        console.print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
