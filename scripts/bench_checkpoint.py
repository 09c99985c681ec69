"""Checkpoint cost for a model: save and load time, size on disk, and training time lost per save.

Saving is synchronous, so the training time lost per save is the save time; it is shown
beside the step time so the cost of a policy (`ckpt.every`) can be read off directly.

    python scripts/bench_checkpoint.py [--model small] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_module
from rich.console import Console
from rich.table import Table

from ciuic_train.config import register_configs
from ciuic_train.checks import to_config
from ciuic_train.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    register_configs()
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        config = to_config(compose(config_name="config", overrides=[f"model={args.model}", "device=cpu"]))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        trainer = Trainer(config, run_dir)
        steps = []
        for _ in range(args.repeats + 2):
            tic = time.perf_counter()
            trainer.train_step()
            steps.append(time.perf_counter() - tic)
        saves, loads = [], []
        for _ in range(args.repeats):
            tic = time.perf_counter()
            path = trainer.save_checkpoint()
            saves.append(time.perf_counter() - tic)
            tic = time.perf_counter()
            trainer.checkpointer.load(path, trainer.model, trainer.optimizer)
            loads.append(time.perf_counter() - tic)
            trainer.train_step()
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    step = statistics.median(steps[2:])
    table = Table(title=f"checkpoint cost, model={args.model} (median of {args.repeats})", show_header=False)
    for key, value in {
        "size on disk": f"{size / 2**20:.1f} MiB (model + AdamW state)",
        "save": f"{statistics.median(saves):.3f} s",
        "load": f"{statistics.median(loads):.3f} s",
        "training step": f"{step:.3f} s",
        "training time lost per save": f"{statistics.median(saves):.3f} s = {statistics.median(saves) / step:.2f} steps",
    }.items():
        table.add_row(key, value)
    Console().print(table)


if __name__ == "__main__":
    main()
