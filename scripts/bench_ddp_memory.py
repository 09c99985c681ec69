"""DDP's peak memory per step: gradients as views of its buckets against separate copies.

Two ranks under torchrun (gloo, one thread each) train the same model two ways,
alternating from round to round:

- `views`: what the trainer builds (`gradient_as_bucket_view`, the gradients zeroed in
  place between steps once DDP has laid its buckets out again in the second step);
- `copies`: DDP's default, what the trainer built before: each `param.grad` a tensor of
  its own, copied into the reducer's bucket and back, set to None after each step.

Each rank records each step's own peak resident memory (VmHWM, reset before the step
through /proc/self/clear_refs), with glibc returning every freed block over 64 KiB at
once (`MALLOC_MMAP_THRESHOLD_`) so that resident memory follows the live tensors.
Prints, per variant, the peak of each step (the higher rank), and the gradients' bytes;
both variants end on bit-identical parameters (`param_checksum`, checked). Overrides after the defaults change
the model or the batch.

    python scripts/bench_ddp_memory.py [--steps 4] [--rounds 2] [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model=small", "model.dim=512", "model.n_routed_experts=64", "train.seq_len=16", "train.batch_size=1",
         "progress=plain"]
MIB = 2**20


def peak_resident() -> int:
    """This process's VmHWM, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0]) * 1024


def worker(variant: str, run_dir: Path, steps: int, overrides: list[str]) -> None:
    """One rank: `steps` steps, each step's peak, printed as one JSON line."""
    import torch
    import torch.nn.parallel

    from ciuic_train.cli.compose import compose, config_module, job_config, without_hydra
    from ciuic_train.distributed.params import param_checksum
    from ciuic_train.train.trainer import Trainer

    if variant == "copies":
        class CopiesDDP(torch.nn.parallel.DistributedDataParallel):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "gradient_as_bucket_view": False})

        torch.nn.parallel.DistributedDataParallel = CopiesDDP  # replicate_with_ddp imports it when called
    with config_module():
        config = job_config(without_hydra(compose(overrides)), overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config, run_dir)
    assert trainer.wrapped_model.gradient_as_bucket_view == (variant == "views")
    peaks = []
    for _ in range(steps):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        trainer.train_step()
        peaks.append(peak_resident())
    grad_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    checksum = param_checksum(trainer.model)
    print("MEMORY " + json.dumps({"rank": trainer.parallel.info.rank, "peaks": peaks, "grad_bytes": grad_bytes,
                                  "checksum": checksum}), flush=True)
    trainer.parallel.close()


def launch(variant: str, run_dir: Path, steps: int, overrides: list[str], port: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               __file__, "--worker", variant, "--run-dir", str(run_dir), "--steps", str(steps), *overrides]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"{variant} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("MEMORY ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--worker", choices=("views", "copies"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides after the defaults: " + " ".join(MODEL))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.run_dir, args.steps, args.overrides)

    overrides = [*MODEL, *args.overrides]
    results: dict[str, list[list[int]]] = {"copies": [], "views": []}
    checksums, grad_bytes = set(), 0
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for variant in ("copies", "views") if round_ % 2 == 0 else ("views", "copies"):
                ranks = launch(variant, Path(tmp) / f"{variant}{round_}", args.steps, overrides, args.port)
                results[variant].append([max(step) for step in zip(*(r["peaks"] for r in ranks))])
                checksums |= {r["checksum"] for r in ranks}
                grad_bytes = ranks[0]["grad_bytes"]
    print(f"{' '.join(overrides)}; 2 ranks; gradients {grad_bytes / MIB:,.0f} MiB per rank")
    for variant, rounds in results.items():
        for i, peaks in enumerate(rounds):
            print(f"  {variant:6} round {i}: peak per step (MiB) " + ", ".join(f"{p / MIB:,.0f}" for p in peaks))
    later = {variant: max(max(peaks[2:] or peaks) for peaks in rounds) for variant, rounds in results.items()}
    print(f"steps 3 on: copies {later['copies'] / MIB:,.0f} MiB, views {later['views'] / MIB:,.0f} MiB, "
          f"{(later['copies'] - later['views']) / MIB:,.0f} MiB less ({(later['copies'] - later['views']) / grad_bytes:.2f}"
          " of the gradients' bytes)")
    print("same parameters at the end in every run: " + ("yes" if len(checksums) == 1 else f"NO: {sorted(checksums)}"))


if __name__ == "__main__":
    main()
