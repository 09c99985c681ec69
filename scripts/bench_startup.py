"""CPU time of a short run in a fresh process, its start-up as the CLI runs it
(`ciuic_train/cli/startup.py`: the collector paused, then what start-up made frozen)
against the same with Python's cyclic garbage collector left alone, alternating.

    python scripts/bench_startup.py [--rounds 10] [--json OUT]

Each round starts one interpreter per variant (the order flipping every round) that does
what a one-process `ciuic-train model=tiny train.max_steps=20 ckpt.every=5` does, less
the CLI's checks: import the config code, compose the config, import the trainer (torch,
DCP with DTensor), build the Trainer (model, data, optimizer; dynamo loads with the
optimizer's first parameter group), then train 20 steps and save 4 checkpoints. It
reports the CPU time (user + system) and wall time of the start-up and of the whole; the
medians of both variants and their ratios are printed, and written to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from contextlib import nullcontext
from pathlib import Path

def cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

started = time.perf_counter()
from ciuic_train.cli.startup import start_up
with start_up() if sys.argv[1] == "start_up" else nullcontext():
    from ciuic_train.cli.compose import compose, config_module, job_config, without_hydra
    overrides = ["model=tiny", "sample.max_new_tokens=0", "progress=plain", "train.max_steps=20", "ckpt.every=5",
                 "train.eval_every=10", "train.log_every=10"]
    with config_module():
        config = job_config(without_hydra(compose(overrides)), overrides)
    from ciuic_train.train.trainer import Trainer
    trainer = Trainer(config, Path(sys.argv[2]))
start_cpu_s, start_wall_s = cpu_s(), time.perf_counter() - started
trainer.fit()
print(json.dumps({"start_cpu_s": start_cpu_s, "start_wall_s": start_wall_s, "cpu_s": cpu_s(),
                  "wall_s": time.perf_counter() - started}))
"""


def one_start(variant: str, folder: Path) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{variant}.", dir=folder))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, variant, str(run_dir)], cwd=folder, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    variants = ("running", "start_up")
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as folder:
        one_start("running", Path(folder))  # warm the page cache and the tokenizer's cache once
        for round_ in range(args.rounds):
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                results[variant].append(one_start(variant, Path(folder)))
    keys = ("start_cpu_s", "start_wall_s", "cpu_s", "wall_s")
    medians = {v: {k: statistics.median(r[k] for r in results[v]) for k in keys} for v in variants}
    ratios = {k: medians["start_up"][k] / medians["running"][k] for k in keys}
    for variant in variants:
        m = medians[variant]
        print(f"{variant:<8}: start-up {m['start_cpu_s']:.3f} CPU-s ({m['start_wall_s']:.3f} s), whole "
              f"{m['cpu_s']:.3f} CPU-s ({m['wall_s']:.3f} s); medians of {args.rounds}")
    print(f"start_up / running, CPU: start-up {ratios['start_cpu_s']:.3f}, whole {ratios['cpu_s']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "medians": medians, "ratios": ratios,
                                         "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
