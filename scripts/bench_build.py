"""Benchmark building a sharded model: the whole model on every rank, then sharded (the old
path), against the meta build (each rank materializes and initializes only its shards).

Each build runs in fresh torchrun workers (`--worker`), so each rank's high-water mark
(VmHWM) is that build's; the two paths alternate, the order flipping every round. Per rank:
the build's wall time (from before the model exists to a parallelized, initialized model,
after a barrier) and the peak resident memory it added. Both paths use the trainer's own
functions: `Transformer`, `parallelize`, `ParameterInit` and `local_rows`.

    python scripts/bench_build.py [--model bench] [--ranks 4] [--rounds 3] [--overrides dist.dp_shard=4 ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_module

    from ciuic_train.config import register_configs
    from ciuic_train.checks import to_config
    from ciuic_train.distributed.materialize import local_rows
    from ciuic_train.distributed.parallelize import parallelize
    from ciuic_train.distributed.process_group import Parallel
    from ciuic_train.model import Transformer
    from ciuic_train.model.init import ParameterInit

    register_configs()
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        config = to_config(compose(config_name="config", overrides=[f"model={args.model}", *args.overrides]))
    parallel = Parallel(config.dist, torch.device("cpu"), config.model.n_routed_experts)
    dist.barrier()
    before = vm_hwm_bytes()
    start = time.perf_counter()
    if args.path == "whole":
        model = Transformer(config.model, seed=config.seed)
        parallelize(model, parallel.mesh, config)
    else:
        with torch.device("meta"):
            model = Transformer(config.model)
        parallelize(model, parallel.mesh, config,
                    init=lambda m: m.init_weights(ParameterInit(config.seed, local_rows)))
    dist.barrier()
    seconds = time.perf_counter() - start
    figures = parallel.gather(json.dumps({"seconds": seconds, "added": vm_hwm_bytes() - before, "peak": vm_hwm_bytes()}))
    if parallel.is_main:
        print("RESULT " + json.dumps([json.loads(f) for f in figures]))
    parallel.close()


def run_build(args: argparse.Namespace, path: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}", __file__, "--worker",
           "--path", path, "--model", args.model, "--overrides", *args.overrides]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def cpu_flags() -> str:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return f"{model}; " + " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overrides", nargs="*", default=["dist.dp_shard=4"], help="config overrides: the mesh, the model's shape")
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=("whole", "meta"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    runs: dict[str, list[list[dict]]] = {"whole": [], "meta": []}
    for round_ in range(args.rounds):
        for path in ("whole", "meta") if round_ % 2 == 0 else ("meta", "whole"):
            runs[path].append(run_build(args, path))
    table = {}
    for path, rounds in runs.items():
        table[path] = {
            "seconds_median": statistics.median(max(rank["seconds"] for rank in r) for r in rounds),
            "added_mib_max_rank": statistics.median(max(rank["added"] for rank in r) for r in rounds) / 2**20,
            "peak_mib_max_rank": statistics.median(max(rank["peak"] for rank in r) for r in rounds) / 2**20,
        }
    report = {"model": args.model, "ranks": args.ranks, "overrides": args.overrides, "rounds": args.rounds,
              "cpu": cpu_flags(), "builds": table,
              "ratio_seconds_whole_over_meta": table["whole"]["seconds_median"] / table["meta"]["seconds_median"]}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
