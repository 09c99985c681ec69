"""What an fp32 matmul can reach on this machine: the square peak, and the model's own shapes.

MFU in `bench.py` and `bench_peer.py` divides by the best square `torch.mm` (bench.py's
sizes, operands hot in cache). This script says how far that figure is from what the
model's matmuls can do, two ways:

- backend: `torch.mm` runs fp32 through the build's BLAS (MKL in torch's x86 wheels);
  oneDNN, through torch's oneDNN linear operator (`torch.ops.mkldnn._linear_pointwise`),
  is a second full-fp32 GEMM. Where its square peak is higher, that is the machine's
  better fp32 figure.
- operands: in a training step each activation is read a few times and then goes, so
  the model's matmuls (model=bench's shapes: K of 256 for most) find their inputs out of
  cache. "cold" cycles through 128 MiB of operand sets (4x this machine's L3 cache), so
  none is cached when used; "hot" repeats one set, as the square peak does.

The square peak is `bench.py`'s `matmul_peak`, the one MFU divides by, taken for each
backend. Every figure is the best of `--rounds` rounds, the backends alternating from
round to round.

    python scripts/bench_matmul.py [--model bench] [--batch-size 8] [--seq-len 256]
                                   [--rounds 3] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from bench import MATMUL_SIZES, matmul_peak, results_console
from bench_peer import load_model_config
from ciuic_train.model.kernels import gemm_choice
from ciuic_train.model.kernels.loss import loss_chunk_tokens

COLD_BYTES = 128 * 2**20
CALLS_PER_ROUND = 24


def onednn_linear() -> Callable | None:
    """x @ w.T by oneDNN in full fp32, or None where this torch build has no such op."""
    return gemm_choice.onednn_mm_nt if gemm_choice.onednn_available() else None


def time_cycle(mm: Callable, sets: list[tuple[torch.Tensor, ...]], calls: int) -> float:
    """Seconds per `mm(*operands)`, cycling through the operand sets for `calls` calls."""
    for operands in sets[:2]:
        mm(*operands)
    tic = time.perf_counter()
    for i in range(calls):
        mm(*sets[i % len(sets)])
    return (time.perf_counter() - tic) / calls


def operand_sets(shapes: tuple[tuple[int, int], ...], cold: bool) -> list[tuple[torch.Tensor, ...]]:
    """One set for hot operands; for cold ones, enough sets that the cycle outgrows the caches."""
    size = sum(4 * rows * cols for rows, cols in shapes)
    count = max(2, -(-COLD_BYTES // size)) if cold else 1
    return [tuple(torch.randn(rows, cols) for rows, cols in shapes) for _ in range(count)]


def model_products(args: argparse.Namespace) -> list[dict]:
    """The main matmul shapes of one training step of `args.model`: label, operand shapes, product."""
    cfg = load_model_config(args.model)
    tokens, dim = args.batch_size * args.seq_len, cfg.dim
    chunk = loss_chunk_tokens(cfg.vocab_size)
    expert_rows = tokens * cfg.n_activated_experts // cfg.n_routed_experts

    def product(label: str, shapes: tuple, flops: int, mm: Callable = F.linear, dnn: bool = True) -> dict:
        """`mm` is nn.Linear's product, x @ w.T, unless given."""
        return {"label": label, "shapes": shapes, "flops": flops, "mm": mm, "dnn": dnn}

    return [
        product(f"linear {tokens}x{dim} . {dim}x{dim}", ((tokens, dim), (dim, dim)), 2 * tokens * dim * dim),
        # g.t() @ x: oneDNN's op would first copy g.t() into a contiguous tensor, so torch.mm only.
        product(f"weight grad {dim}x{tokens} . {tokens}x{dim}", ((tokens, dim), (tokens, dim)),
                2 * tokens * dim * dim, mm=lambda g, x: g.t() @ x, dnn=False),
        product(f"dense FFN {tokens}x{dim} . {dim}x{cfg.dense_ffn_dim}", ((tokens, dim), (cfg.dense_ffn_dim, dim)),
                2 * tokens * dim * cfg.dense_ffn_dim),
        product(f"expert w13 {expert_rows}x{dim} . {dim}x{2 * cfg.moe_ffn_dim}",
                ((expert_rows, dim), (2 * cfg.moe_ffn_dim, dim)), 2 * expert_rows * dim * 2 * cfg.moe_ffn_dim),
        product(f"loss logits {cfg.vocab_size}x{dim} . {dim}x{chunk}", ((cfg.vocab_size, dim), (chunk, dim)),
                2 * cfg.vocab_size * dim * chunk),
    ]


def best_rate(flops: float, backends: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """GFLOP/s per backend, the best of `rounds`; the backends' order reverses every round."""
    best = dict.fromkeys(backends, float("inf"))
    for r in range(rounds):
        names = list(backends) if r % 2 == 0 else list(backends)[::-1]
        for name in names:
            best[name] = min(best[name], backends[name]())
    return {name: flops / seconds / 1e9 for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dnn = onednn_linear()
    progress = Console(stderr=True)

    progress.print("square peaks ...")
    square_backends = {"torch.mm": torch.mm} | ({"oneDNN": dnn} if dnn else {})
    runs = {name: [] for name in square_backends}
    for r in range(args.rounds):
        names = list(square_backends) if r % 2 == 0 else list(square_backends)[::-1]
        for name in names:
            runs[name].append(matmul_peak(torch.float32, mm=square_backends[name]))
    square = {n: {name: max(run[n] for run in runs[name]) for name in runs} for n in MATMUL_SIZES}

    products = []
    for product in model_products(args):
        progress.print(f"{product['label']} ...")
        backends = {}
        for temperature in ("hot", "cold"):
            sets = operand_sets(product["shapes"], cold=temperature == "cold")
            calls = max(CALLS_PER_ROUND, len(sets))
            backends[f"torch.mm {temperature}"] = partial(time_cycle, product["mm"], sets, calls)
            if dnn and product["dnn"]:
                backends[f"oneDNN {temperature}"] = partial(time_cycle, dnn, sets, calls)
        products.append({"label": product["label"], "gflops": best_rate(product["flops"], backends, args.rounds)})

    peak = {name: max(rates[name] for rates in square.values()) for name in square_backends}
    console = results_console()
    console.print(f"fp32, {args.threads} threads, torch {torch.__version__}; best of {args.rounds} rounds")
    table = Table(title="square fp32 GEMM, GFLOP/s")
    table.add_column("n", justify="right")
    for name in ("torch.mm", "oneDNN"):
        table.add_column(name, justify="right")
    for n, rates in square.items():
        table.add_row(str(n), *(f"{rates[name]:.0f}" if name in rates else "-" for name in ("torch.mm", "oneDNN")))
    console.print(table)
    columns = ("torch.mm hot", "torch.mm cold", "oneDNN hot", "oneDNN cold")
    table = Table(title=f"model={args.model} products, GFLOP/s (% of torch.mm's square peak {peak['torch.mm']:.0f})")
    table.add_column("product")
    for column in columns:
        table.add_column(column, justify="right")
    for product in products:
        rates = product["gflops"]
        table.add_row(product["label"], *(
            f"{rates[c]:.0f} ({rates[c] / peak['torch.mm']:.0%})" if c in rates else "-" for c in columns))
    console.print(table)
    if args.json:
        results = {"torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
                   "model": args.model, "square_gflops": square, "square_peak_gflops": peak, "products": products}
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
