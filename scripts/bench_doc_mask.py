"""The training step with attention kept inside documents (`data.doc_mask=true`) against none.

A forward and backward of `--model` (default bench) on random tokens, `--batch-size`
windows of `--seq-len`, timed three ways, alternating from round to round: no mask, and
the document mask with documents of `--doc-lengths` tokens each (each window cut into
documents of that length, the first one starting a random distance into a document, as a
window of a real corpus does). Best of `--rounds` rounds, each the mean of `--steps` steps.

    python scripts/bench_doc_mask.py [--model bench] [--batch-size 8] [--seq-len 256]
                                     [--doc-lengths 64 256] [--kernels auto] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_peer import load_model_config
from ciuic_train.model import Transformer


def documents(batch: int, seq: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, seq] document numbers for documents of `length` tokens, each row offset at random."""
    offsets = torch.randint(0, length, (batch, 1), generator=generator)
    return (torch.arange(seq) + offsets) // length - offsets // length


def step_seconds(model: Transformer, inputs: torch.Tensor, docs: torch.Tensor | None, steps: int) -> float:
    extra = {} if docs is None else {"docs": docs}
    start = time.perf_counter()
    for _ in range(steps):
        model(inputs, inputs, **extra).backward()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--doc-lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cfg = load_model_config(args.model)
    cfg.kernels = args.kernels
    model = Transformer(cfg)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=generator)
    layouts = {"no mask": None}
    layouts.update({f"documents of {n}": documents(args.batch_size, args.seq_len, n, generator) for n in args.doc_lengths})
    for docs in layouts.values():
        step_seconds(model, inputs, docs, 1)  # warm-up
    best = {name: float("inf") for name in layouts}
    for _ in range(args.rounds):
        for name, docs in layouts.items():
            best[name] = min(best[name], step_seconds(model, inputs, docs, args.steps))
    print(f"model={args.model} kernels={args.kernels} {args.batch_size}x{args.seq_len}, {torch.get_num_threads()} threads")
    for name, seconds in best.items():
        print(f"  {name:>20}: {seconds * 1e3:8.1f} ms a step, {seconds / best['no mask']:.2f}x no mask")


if __name__ == "__main__":
    main()
