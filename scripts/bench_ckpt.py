"""Training time lost per checkpoint: synchronous saves against `ckpt.async_save=true`.

One process trains `--model` (bench by default) and saves every `--every` steps, two
ways side by side, alternating from round to round: synchronous saves, and saves staged
into memory and written by a background thread while the next steps run. A cycle is one
save and the `--every` steps after it; the time it loses is the cycle's wall time less
`--every` steps at the speed of the same trainer with no save (measured in the same
round). For the asynchronous saves that includes waiting for the previous write when
the next save comes, and the steps slowed by the writer competing for the cores.
Reports the best round's loss per save, and how much of it training stood still inside
the save call (staging; for synchronous saves the whole write) against the steps slowed
by the writer.

    python scripts/bench_ckpt.py [--model bench] [--every 4] [--cycles 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from ciuic_train.cli.compose import compose, config_module, job_config, without_hydra
from ciuic_train.files import format_bytes, tree_bytes
from ciuic_train.train.trainer import Trainer


def trainer(overrides: list[str], run_dir: Path) -> Trainer:
    with config_module():
        config = job_config(without_hydra(compose(overrides)), overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(config, run_dir)


def steps_seconds(t: Trainer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        t.train_step()
    return (time.perf_counter() - start) / steps


def lost_per_save(t: Trainer, every: int, cycles: int, step_s: float) -> float:
    """Seconds each save costs the training, over `cycles` saves."""
    start = time.perf_counter()
    for _ in range(cycles):
        t.save_checkpoint()
        for _ in range(every):
            t.train_step()
    t.checkpointer.wait()
    return (time.perf_counter() - start - cycles * every * step_s) / cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        common = [f"model={args.model}", "train.max_steps=100000", "ckpt.keep_last=1", "progress=plain",
                  f"data.cache_dir={root / 'cache'}"]
        modes = {"sync": [*common, "ckpt.async_save=false"], "async": [*common, "ckpt.async_save=true"]}
        trainers = {name: trainer(o, root / name) for name, o in modes.items()}
        for t in trainers.values():
            steps_seconds(t, 1)  # warm-up
        best = {name: float("inf") for name in trainers}
        for _ in range(args.rounds):
            for name, t in trainers.items():
                step_s = steps_seconds(t, args.every)
                best[name] = min(best[name], lost_per_save(t, args.every, args.cycles, step_s))
        size = tree_bytes(next((root / "sync" / "checkpoints").iterdir()))
        # The time training stood still inside save() and wait(), per save (all rounds).
        stood = {name: t.checkpointer.seconds / t.checkpointer.saves for name, t in trainers.items()}
    print(f"model={args.model}, checkpoint {format_bytes(size)}, a save every {args.every} steps, "
          f"{torch.get_num_threads()} threads")
    for name, seconds in best.items():
        print(f"  {name:>5}: {seconds:6.3f} s of training lost per save ({seconds / best['sync']:.0%} of sync), "
              f"{stood[name]:.3f} s of it standing still in the save")


if __name__ == "__main__":
    main()
