"""What the distributed benchmarks share: the three DDP variants, running a child with the
machine's noise beside it, and the first rows of every result table. Not a benchmark itself.

scripts/bench_ddp.py (on one machine) and scripts/bench_ddp_links.py (across two emulated
hosts) build three DDP Trainers on one config, differing only in the communication hook (a
hook cannot be re-registered on an existing DDP model, hence three), and time their
`train_step()`s alternately, step by step, in the same processes:
- ddp: DDP's own bucketed all-reduce, overlapped with backward (what training does);
- nocomm: a hook that returns each bucket's own gradient, so no gradient leaves the rank;
- serial: a hook that all-reduces each bucket synchronously and times it, so backward waits
  for it (scripts/bench_ddp.py's docstring says why blocking).

scripts/bench_ddp.py and scripts/bench_expert_parallel.py run their workers through
`run_logged`, which also says how many cores other processes kept busy meanwhile.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from rich.table import Table

from ciuic_train.config import register_configs
from ciuic_train.checks import to_config
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.train.trainer import Trainer

# Untimed steps of each Trainer before the comm timing: DDP rebuilds its buckets after
# the first step, and lazy setup (allocator, oneDNN primitives) should not be billed.
WARMUP_STEPS = 2
# A hung collective or launcher fails the benchmark instead of stalling it.
RUN_TIMEOUT_S = 900


# ---------------------------------------------------------------------------- the three DDP variants


def no_comm_hook(state, bucket):
    """Skip the all-reduce: the bucket's local gradient, as an already completed future."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class SerialTimes:
    """What `serial_all_reduce_hook` records in one step: each bucket's seconds and elements."""

    def __init__(self):
        self.seconds: list[float] = []
        self.numels: list[int] = []

    def clear(self) -> None:
        self.seconds.clear()
        self.numels.clear()


def serial_all_reduce_hook(times: SerialTimes, bucket):
    """Average the bucket across ranks, blocking backward meanwhile, and record how long it took."""
    grad = bucket.buffer()
    tic = time.perf_counter()
    dist.all_reduce(grad)
    times.seconds.append(time.perf_counter() - tic)
    times.numels.append(grad.numel())
    grad.div_(dist.get_world_size())
    fut = torch.futures.Future()
    fut.set_result(grad)
    return fut


def build_ddp_variants(args: argparse.Namespace) -> tuple[Parallel, dict[str, Trainer], SerialTimes]:
    """The process group and three DDP Trainers on one config: ddp, nocomm and serial (see above).

    `args` needs `model` and `batch_size`."""
    logging.getLogger("ciuic_train").setLevel(logging.WARNING)
    overrides = [
        f"model={args.model}",
        f"train.batch_size={args.batch_size}",
        "device=cpu",
        "dist.strategy=ddp",
        "dist.backend=gloo",
    ]
    register_configs()
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        config = to_config(compose(config_name="config", overrides=overrides))

    parallel = Parallel(config.dist, torch.device("cpu"), config.model.n_routed_experts)
    serial = SerialTimes()
    # Only fit() writes to the run folder; train_step() never does, so a throwaway one will do.
    with tempfile.TemporaryDirectory() as run_dir:
        trainers = {name: Trainer(config, Path(run_dir), parallel) for name in ("ddp", "nocomm", "serial")}
    trainers["nocomm"].wrapped_model.register_comm_hook(state=None, hook=no_comm_hook)
    trainers["serial"].wrapped_model.register_comm_hook(state=serial, hook=serial_all_reduce_hook)
    return parallel, trainers, serial


def time_ddp_variants(trainers: dict[str, Trainer], serial: SerialTimes, warmup: int, steps: int) -> dict[str, Any]:
    """`warmup` untimed then `steps` timed steps of each variant, alternating, the order flipping
    every step: each variant's step seconds, and the serial variant's all-reduce seconds and
    bucket count per step, with its last step's bucket sizes (elements)."""
    step_s: dict[str, list[float]] = {name: [] for name in trainers}
    all_reduce_s: list[float] = []
    buckets: list[int] = []
    bucket_numels: list[int] = []
    for i in range(warmup + steps):
        order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
        for name in order:
            serial.clear()
            dist.barrier()  # both ranks start the step together
            tic = time.perf_counter()
            trainers[name].train_step()
            elapsed = time.perf_counter() - tic
            if name == "serial":
                bucket_numels = list(serial.numels)
            if i >= warmup:
                step_s[name].append(elapsed)
                if name == "serial":
                    all_reduce_s.append(sum(serial.seconds))
                    buckets.append(len(serial.seconds))
    return {"step_s": step_s, "all_reduce_s": all_reduce_s, "buckets": buckets, "bucket_numels": bucket_numels}


def grad_bytes(trainer: Trainer) -> int:
    return sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------- driver


def busy_cpu_s() -> float:
    """CPU seconds every process on the machine has used since boot (Linux /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds used by this script's finished children, their own children included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_logged(cmd: list[str], env: dict[str, str], log_path: Path) -> tuple[str, float]:
    """Run a command with its output in a log; its stdout and the cores others kept busy meanwhile.

    On shared cores a neighbour's job can hit one case and spare the next; the machine's
    busy CPU time less the command's own says which runs it hit. On failure, raise with
    the log's tail.
    """
    busy, own, tic = busy_cpu_s(), children_cpu_s(), time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=RUN_TIMEOUT_S)
        log.write(done.stdout)
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text(encoding="utf-8").splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{tail}")
    other_cores = (busy_cpu_s() - busy - (children_cpu_s() - own)) / (time.perf_counter() - tic)
    return done.stdout, other_cores


def run_table(title: str, results: dict, config: str) -> Table:
    """The rows every result table starts with: versions, machine load, the config."""
    table = Table(title=title, show_header=False)
    table.add_row("torch / cores", f"{results['torch']} / {results['cores']}")
    table.add_row(
        "load average (1 min) start / end",
        f"{results['load_avg_1min_at_start']:.2f} / {results['load_avg_1min_at_end']:.2f}",
    )
    table.add_row("config", config)
    return table
