"""Training on a streamed Hugging Face dataset against the same rows from the token cache.

Writes a parquet corpus of `--rows` rows (`--row-chars` characters each, from the
standard library's sources, so that the bytes are real text), builds the cache entry
once, then times `--steps` training steps of `--model` two ways, alternating from round
to round: `data=hf` tokenized into the cache (windows sampled from a memmap), and
`data=hf data.streaming=true` (each row tokenized as it is read, windows cut and drawn
from the shuffle pool). Reports each one's best step time, the share of the step spent
waiting for data (the trainer's own `fetching_data` clock), and the peak resident memory
of this process. One process, bytes tokenizer unless `--tokenizer` names a tokenizer.json.

    python scripts/bench_stream.py [--model small] [--rows 20000] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import resource
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ciuic_train.cli.compose import compose, config_module, job_config, without_hydra
from ciuic_train.train.trainer import Trainer


def write_corpus(path: Path, rows: int, row_chars: int) -> None:
    """`rows` rows of standard-library source text, `row_chars` characters each."""
    text = "".join(p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    step = max(1, (len(text) - row_chars) // rows)
    pq.write_table(pa.Table.from_pylist([{"text": text[i * step: i * step + row_chars]} for i in range(rows)]), path)


def trainer(overrides: list[str], run_dir: Path) -> Trainer:
    with config_module():
        config = job_config(without_hydra(compose(overrides)), overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(config, run_dir)


def time_steps(t: Trainer, steps: int) -> tuple[float, float]:
    """Mean seconds a step, and the fraction of it spent fetching data."""
    fetching = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t.train_step()
        fetching += t.step_times.data_s
    elapsed = time.perf_counter() - start
    return elapsed / steps, fetching / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--row-chars", type=int, default=2000)
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(root / "rows.parquet", args.rows, args.row_chars)
        common = [f"model={args.model}", "data=hf", "data.dataset=parquet", f"data.data_files={root / 'rows.parquet'}",
                  f"data.cache_dir={root / 'cache'}", f"data.tokenizer={args.tokenizer}", "train.max_steps=100000",
                  "progress=plain"]
        layouts = {"cached": common, "streamed": [*common, "data.streaming=true"]}
        trainers = {name: trainer(o, root / name) for name, o in layouts.items()}
        for t in trainers.values():
            time_steps(t, 2)  # warm-up: the stream's pool fills, the allocator settles
        best = {name: (float("inf"), 0.0) for name in trainers}
        for _ in range(args.rounds):
            for name, t in trainers.items():
                best[name] = min(best[name], time_steps(t, args.steps))
    cfg = trainers["cached"].config
    print(f"model={args.model} {cfg.train.batch_size}x{cfg.train.seq_len}, tokenizer {args.tokenizer}, "
          f"{args.rows:,} rows of {args.row_chars:,} chars, {torch.get_num_threads()} threads")
    for name, (seconds, fetching) in best.items():
        print(f"  {name:>8}: {seconds * 1e3:8.1f} ms a step ({fetching:.1%} waiting for data), "
              f"{seconds / best['cached'][0]:.3f}x cached")
    print(f"peak resident memory of this process (both runs): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
