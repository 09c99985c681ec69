"""Benchmark multi-process training on CPU: one process using every core vs two DDP processes.

Two questions, one run:

1. Throughput. The real CLI trains `--steps` steps as 1 process x all cores' threads and
   as 2 processes (DDP over gloo) x half the threads each; tokens/s comes from each run's
   summary.json (global tokens/s of the training loop, evaluation excluded, start-up and
   the first steps included). With the same per-rank batch, 2 processes train twice the
   tokens per step, so 1 process is also run at twice the batch: that pair compares the
   same global batch. The cases alternate within each round and the order flips every
   round, so machine noise and drift land on every case.

2. Communication share. Under torchrun, each of 2 workers (this file, `--worker`) builds
   three Trainers on the same config, differing only in the DDP communication hook; a hook
   cannot be re-registered on an existing DDP model, hence three. Their `train_step()`s are
   timed alternately, step by step, in the same processes:
   - ddp: DDP's own bucketed all-reduce, overlapped with backward (what training does);
   - nocomm: a hook that returns each bucket's own gradient, so no gradient leaves the rank;
   - serial: a hook that all-reduces each bucket synchronously and times it, so backward
     waits for it. Its sum per step is the raw all-reduce time, including the wait for the
     slower rank to reach the same bucket. An async all-reduce timed to its future's
     completion would overlap backward and bill compute to communication, hence blocking.
   share = (ddp - nocomm) / ddp is the step time gradient communication costs. The small
   MoE expert-bias all-reduce at the end of each step runs in all three variants.

    python scripts/bench_dist.py [--model small] [--steps 20] [--rounds 2] [--batch-size 8]
                                 [--comm-steps 8] [--json OUT]

3. Expert parallelism (`--ep`, instead of 1 and 2). FSDP over 2 ranks with every expert on
   each rank (`dist.dp_shard=2`, "ep1") against the routed experts split in 2
   (`dist.dp_shard=2 dist.ep=2`, "ep2"), at `--model` bench by default:
   - step time: each of 2 workers (`--ep-worker`) builds both layouts' Trainers from the
     same seed and times their `train_step()`s alternately, step by step, the order
     flipping every step, as in 2. Their first-step losses must agree within 1e-5.
   - all-to-all: in the worker processes only, `ciuic_train.distributed.expert_parallel`'s `dist`
     is replaced by a proxy that times every `all_to_all_single` and counts the bytes
     each sends to and receives from the other ranks, and `_AllToAll`'s forward and
     backward are wrapped to say which pass a row exchange belongs to. The bytes are
     checked against what the per-expert counts the dispatch exchanged say they must be
     (every rank's counts, gathered after the timing): per MoE layer per micro-batch, a
     rank sends the rows of its assignments to experts on the other rank, then sends
     back the rows it received for its own experts; backward sends as many rows again;
     rows x dim x 4 bytes (fp32). Time inside an all-to-all includes waiting for the
     other rank to arrive; after the timing each step's exchanges are replayed alone,
     same split sizes, a barrier before each, for the transfer time without the wait.
   - peak memory: each layout also runs alone in a fresh pair of workers, a few steps,
     with glibc's mmap threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_=65536`): every
     tensor of that size or more is a mapping of its own, returned to the kernel when
     freed, so the peak RSS follows live tensor memory rather than the heap's high-water
     mark. The figure is each rank's peak RSS (VmHWM) and its growth past the point where
     the worker had imported everything and composed the config, i.e. what building the
     model, the process group's mesh, the optimizer and training cost. Parameter bytes
     per rank are `ciuic_train.distributed.params.param_bytes`. (torch has no CPU allocator
     statistics to read instead.)

    python scripts/bench_dist.py --ep [--model bench] [--batch-size 8] [--ep-steps 20]
                                 [--ep-memory-steps 3] [--json OUT]

5. Pipeline parallelism (`--pp`): `dist.pp=2` under each schedule against DDP and FSDP at
   the same global batch, and the measured bubble; with `--netns`, a stage per emulated
   host at several link rates. scripts/bench_pipeline.py does it (its docstring); this
   file hands `--pp` and the other flags over to it.

    python scripts/bench_dist.py --pp [--model small] [--batch-size 8] [--pp-steps 12] [--json OUT]

4. Across two emulated hosts (`--netns`, root). The workers of 2 run on the two hosts of
   scripts/cluster/netns_cluster.sh, one process each (cores / 2 threads, as in 2), started
   by the driver as `netns_cluster.sh exec N torchrun --nnodes=2 --rdzv-endpoint=host0:PORT`;
   every gradient crosses the hosts' link (veth pairs through a bridge). The run is a series
   of phases, the link unlimited in every other one: 0, R1, 0, R2, 0, R3, 0 (`--rates`, Mbit/s).
   Before each phase rank 0 asks the driver for its rate (a file in a shared folder), the
   driver sets it with `LINK_MBIT=R netns_cluster.sh up` (tc tbf on each host's eth0; the
   process group's connections stay open) and answers, and both ranks start after a
   barrier. A phase times `--netns-steps` steps of each variant as in 2, then replays one
   step's all-reduce alone (the serial hook's bucket sizes, back to back after a barrier) as
   many times, reading the bytes each host's eth0 sent meanwhile. Per phase:
   - comm share (ddp - nocomm) / ddp, as in 2;
   - all-reduce alone (the slower rank's replay) and its bandwidth: gradient bytes / time,
     and the eth0 bytes / time, to set against the tbf rate;
   - overlap = 1 - (ddp - nocomm) / all-reduce alone: how much of the all-reduce the
     backward hides (1: all of it; 0: none, the step waits for all of it);
   - ddp step / the mean of the ddp steps of the unlimited phases right before and after.
   The link is set back to unlimited when the run ends, fails or is killed (SIGTERM,
   SIGHUP), and the driver checks that each phase's rate held to its end (nobody else
   reset it). If the hosts are not up it says how to bring them up and exits 2, unless
   given `--up`, which brings them up (and leaves them up, unlimited).

    python scripts/bench_dist.py --netns [--up] [--model small] [--rates 100,300,1000]
                                 [--netns-steps 3] [--batch-size 8] [--port 29470] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from rich.console import Console
from rich.table import Table

import ciuic_train.distributed.expert_parallel as expert_parallel
from bench import results_console
from netns_claims import kill_group
from ciuic_train.launch.paths import quote_override
from ciuic_train.config import register_configs, to_config
from ciuic_train.distributed.params import param_bytes
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.train.trainer import Trainer

NPROC = 2
# Untimed steps of each Trainer before the comm timing: DDP rebuilds its buckets after
# the first step, and lazy setup (allocator, oneDNN primitives) should not be billed.
WARMUP_STEPS = 2
# A hung collective or launcher fails the benchmark instead of stalling it.
RUN_TIMEOUT_S = 900

progress = Console(stderr=True)


# ---------------------------------------------------------------------------- worker


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
    """The process group and three DDP Trainers on one config: ddp, nocomm and serial (see above)."""
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


def worker(args: argparse.Namespace) -> None:
    """Time the three DDP variants step by step; rank 0 prints one JSON line."""
    parallel, trainers, serial = build_ddp_variants(args)
    timed = time_ddp_variants(trainers, serial, WARMUP_STEPS, args.comm_steps)
    if parallel.is_main:
        print(
            json.dumps(
                {
                    "world_size": parallel.world_size,
                    "threads_per_rank": torch.get_num_threads(),
                    "batch_size_per_rank": args.batch_size,
                    "grad_mbytes": grad_bytes(trainers["ddp"]) / 2**20,
                    "buckets_per_step": statistics.median(timed["buckets"]),
                    "step_s": timed["step_s"],
                    "all_reduce_s": timed["all_reduce_s"],
                }
            ),
            flush=True,
        )
    parallel.close()


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


def cli_run(case: dict, args: argparse.Namespace, work: Path, tag: str) -> dict[str, float]:
    """One training run through the real CLI: its summary.json's global tokens/s, and the noise."""
    run_dir = work / tag
    cmd = [
        sys.executable, "-m", "ciuic_train",
        f"model={args.model}",
        f"train.max_steps={args.steps}",
        f"train.batch_size={case['batch_size']}",
        f"hydra.run.dir={quote_override(str(run_dir))}",
        "progress=plain",
        "sample.max_new_tokens=0",
        "train.eval_every=100000",
        "train.eval_windows=1",
    ]  # fmt: skip
    if case["nproc"] > 1:
        cmd.append(f"dist.nproc_per_node={case['nproc']}")
    env = {**os.environ, "OMP_NUM_THREADS": str(case["threads"])}
    _, other_cores = run_logged(cmd, env, work / f"{tag}.log")
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["world_size"] == case["nproc"], summary
    return {"tokens_per_s": summary["tokens_per_s"], "other_cores": other_cores}


def comm_share(args: argparse.Namespace, threads: int, work: Path) -> dict:
    """The worker's step times under torchrun, reduced to medians and the comm share."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
        __file__, "--worker",
        f"--model={args.model}", f"--batch-size={args.batch_size}", f"--comm-steps={args.comm_steps}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    stdout, other_cores = run_logged(cmd, env, work / "comm.log")
    raw = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    median = {name: statistics.median(times) for name, times in raw["step_s"].items()}
    all_reduce = statistics.median(raw["all_reduce_s"])
    return {
        **raw,
        "median_step_s": median,
        "median_all_reduce_s": all_reduce,
        "comm_share": (median["ddp"] - median["nocomm"]) / median["ddp"],
        "serial_all_reduce_share": all_reduce / median["serial"],
        "other_cores": other_cores,
    }


# ---------------------------------------------------------------------------- expert parallelism (--ep)

# The layouts --ep compares, on NPROC=2 ranks: FSDP with every expert gathered on each rank,
# and FSDP with the routed experts split over the 2 ranks, its token exchanges overlapped
# with the shared experts (the default) or blocking.
EP_LAYOUTS = {
    "ep1": ["dist.dp_shard=2"],
    "ep2": ["dist.dp_shard=2", "dist.ep=2"],
    "ep2_blocking": ["dist.dp_shard=2", "dist.ep=2", "dist.ep_overlap=false"],
}
# The layouts whose all-to-alls the probe reports, and the layouts of the memory runs.
EP_SPLIT = ("ep2", "ep2_blocking")
EP_MEMORY = ("ep1", "ep2")
# First-step losses of the two layouts, same seed and data, may differ by this much.
EP_LOSS_TOLERANCE = 1e-5
ROW_BYTES_FP32 = 4
# The memory runs' glibc setting: every allocation of 64 KiB or more is a mapping of its own,
# unmapped when freed, so the peak RSS follows the live tensors, not the heap's high-water
# mark and its fragmentation (which made the two ranks of one layout differ by ~50 MiB).
MEMORY_RUN_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


class _ProbedDist:
    """`torch.distributed` as `ciuic_train.distributed.expert_parallel` sees it, with `all_to_all_single`
    timed and sized; everything else is torch's. Only that module's name is rebound, so
    FSDP's and everyone else's collectives are left alone."""

    def __init__(self, probe: "AllToAllProbe"):
        self._probe = probe

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):  # fmt: skip
        return self._probe.record(output, input, output_split_sizes, input_split_sizes, group, async_op)


class _TimedWork:
    """An async all-to-all's handle whose `wait()` adds the time spent in it to its call's record."""

    def __init__(self, work, call: dict[str, Any]):
        self._work, self._call = work, call

    def wait(self):
        tic = time.perf_counter()
        result = self._work.wait()
        self._call["seconds"] += time.perf_counter() - tic
        return result


class AllToAllProbe:
    """Every all-to-all of `ExpertDispatch` in this process: which one, how long, how many bytes.

    `kind` is `counts` (the per-expert counts), `rows_forward` or `rows_backward` (the
    differentiable row exchanges, out and back, in forward or in backward); the latter two
    are told apart by wrapping the autograd functions that run them (`_AllToAll` when the
    exchanges block, `_Launch` and `_Land` when they overlap). The time of a call is what
    the training thread spends in it: the whole call when it blocks; starting it plus
    waiting for it when it runs in the background (the time the step cannot hide). Bytes
    count only what crosses to or from another rank, not the slice a rank keeps.
    """

    def __init__(self):
        self.kind = "counts"
        self.step: tuple[str, int] | None = None
        self.calls: list[dict[str, Any]] = []
        self.counts: list[tuple[tuple[str, int] | None, torch.Tensor]] = []

    def install(self) -> None:
        expert_parallel.dist = _ProbedDist(self)
        for cls in (expert_parallel._AllToAll, expert_parallel._Launch, expert_parallel._Land):
            cls.forward = staticmethod(self._labelled(cls.forward, "rows_forward"))
            cls.backward = staticmethod(self._labelled(cls.backward, "rows_backward"))
        # An overlapped exchange waits in the other function than the one it started in.
        self.waits: dict[int, dict[str, Any]] = {}

    def _labelled(self, method, kind: str):
        def probed(ctx, *args):
            self.kind = kind
            try:
                return method(ctx, *args)
            finally:
                self.kind = "counts"

        return probed

    def record(self, output, input, output_split_sizes, input_split_sizes, group, async_op=False):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        even = [input.shape[0] // size] * size
        sent = list(input_split_sizes) if input_split_sizes else even
        received = list(output_split_sizes) if output_split_sizes else [output.shape[0] // size] * size
        row_bytes = input[:1].numel() * input.element_size()
        if self.kind == "counts":
            self.counts.append((self.step, input.detach().clone()))
        tic = time.perf_counter()
        work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)  # fmt: skip
        seconds = time.perf_counter() - tic
        self.calls.append({
            "step": self.step,
            "kind": self.kind,
            "seconds": seconds,
            "async": async_op,
            "bytes_sent": (sum(sent) - sent[rank]) * row_bytes,
            "bytes_received": (sum(received) - received[rank]) * row_bytes,
            # what `replay` needs to run the same exchange again
            "splits": (received, sent),
            "row_shape": tuple(input.shape[1:]),
            "dtype": input.dtype,
            "group": group,
        })  # fmt: skip
        return _TimedWork(work, self.calls[-1]) if async_op else work

    def replay(self, name: str, step: int) -> float:
        """Seconds the all-to-alls of one step take run again alone: same sizes, a barrier
        before each, so no rank waits in it for the other to arrive.

        Every rank replays its own calls of the step, in their order, which is the same on
        every rank (they are collectives), as are their split sizes.
        """
        seconds = 0.0
        for call in self.calls:
            if call["step"] != (name, step):
                continue
            received, sent = call["splits"]
            output = torch.empty(sum(received), *call["row_shape"], dtype=call["dtype"])
            input = torch.ones(sum(sent), *call["row_shape"], dtype=call["dtype"])
            dist.barrier(group=call["group"])
            tic = time.perf_counter()
            dist.all_to_all_single(output, input, received, sent, group=call["group"])
            seconds += time.perf_counter() - tic
        return seconds

    def per_step(self, name: str, step: int) -> dict[str, float]:
        """Seconds and bytes of this step's all-to-alls, per kind and in all."""
        figures: dict[str, float] = {"calls": 0, "seconds": 0.0, "bytes_sent": 0, "bytes_received": 0}
        for kind in ("counts", "rows_forward", "rows_backward"):
            figures[f"{kind}_s"] = 0.0
            figures[f"{kind}_bytes_sent"] = 0
        for call in self.calls:
            if call["step"] != (name, step):
                continue
            figures["calls"] += 1
            figures["seconds"] += call["seconds"]
            figures["bytes_sent"] += call["bytes_sent"]
            figures["bytes_received"] += call["bytes_received"]
            figures[f"{call['kind']}_s"] += call["seconds"]
            figures[f"{call['kind']}_bytes_sent"] += call["bytes_sent"]
        return figures


def expected_row_bytes(counts: torch.Tensor, rank: int, dim: int) -> tuple[int, int]:
    """Row bytes rank `rank` must send and receive in one MoE layer's forward and backward.

    counts[s, e]: the assignments rank s routed to global expert e, as the dispatch
    exchanged them. The ranks split the experts in equal consecutive slices. Forward:
    out, the rank's rows for the other ranks' experts; back, the rows the others sent
    for its experts. Backward runs both exchanges in reverse, the same rows again.
    """
    ranks, n_experts = counts.shape
    mine = torch.zeros(n_experts, dtype=torch.bool)
    mine[rank * n_experts // ranks : (rank + 1) * n_experts // ranks] = True
    others = torch.arange(ranks) != rank
    out = int(counts[rank, ~mine].sum())
    back = int(counts[others][:, mine].sum())
    row = dim * ROW_BYTES_FP32
    # sent: out + back, forward and backward; received: by symmetry, the same two flows mirrored
    return 2 * (out + back) * row, 2 * (back + out) * row


def ep_worker(args: argparse.Namespace) -> None:
    """Time the layouts in `--layouts` step by step, probe the all-to-alls; rank 0 prints one JSON line."""
    logging.getLogger("ciuic_train").setLevel(logging.WARNING)
    layouts = args.layouts.split(",")
    base = [
        f"model={args.model}",
        f"train.batch_size={args.batch_size}",
        "device=cpu",
        "precision=fp32",
        "dist.backend=gloo",
    ]
    register_configs()
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        configs = {
            name: to_config(compose(config_name="config", overrides=base + EP_LAYOUTS[name])) for name in layouts
        }
    config = configs[layouts[0]]
    rss_before_mib = peak_rss_mib()

    probe = AllToAllProbe()
    probe.install()
    parallels, trainers = {}, {}
    # Only fit() writes to the run folder; train_step() never does, so a throwaway one will do.
    with tempfile.TemporaryDirectory() as run_dir:
        for name in layouts:  # each Trainer seeds torch itself before building its model
            parallels[name] = Parallel(configs[name].dist, torch.device("cpu"), config.model.n_routed_experts)
            trainers[name] = Trainer(configs[name], Path(run_dir), parallels[name])
    for name in layouts:
        ep = NPROC if name in EP_SPLIT else 1
        assert parallels[name].mesh.shape.as_dict() == {"dp_replicate": 1, "dp_shard": NPROC, "ep": ep}
    rss_built_mib = peak_rss_mib()

    step_s: dict[str, list[float]] = {name: [] for name in layouts}
    losses: dict[str, list[float]] = {name: [] for name in layouts}
    a2a: dict[str, list[dict[str, float]]] = {name: [] for name in layouts if name in EP_SPLIT}
    for i in range(args.ep_warmup + args.ep_steps):
        order = layouts if i % 2 == 0 else list(reversed(layouts))
        for name in order:
            probe.step = (name, i)
            dist.barrier()  # both ranks start the step together
            tic = time.perf_counter()
            figures = trainers[name].train_step()
            elapsed = time.perf_counter() - tic
            probe.step = None
            losses[name].append(figures["loss"])
            if i >= args.ep_warmup:
                step_s[name].append(elapsed)
                if name in a2a:
                    a2a[name].append(probe.per_step(name, i))
    rss_peak_mib = peak_rss_mib()
    replayed_s = [probe.replay("ep2", i) for i in range(args.ep_warmup, args.ep_warmup + args.ep_steps)] if (
        "ep2" in layouts) else []  # fmt: skip

    rank = dist.get_rank()
    mine: dict[str, Any] = {
        "rank": rank,
        "rss_before_build_mib": rss_before_mib,
        "peak_rss_after_build_mib": rss_built_mib,
        "peak_rss_mib": rss_peak_mib,
        "param_bytes": {name: param_bytes(trainers[name].model) for name in layouts},
        "losses": losses,
    }
    if "ep2" in layouts:
        # The counts each of this rank's dispatches exchanged, every rank's gathered here, in
        # call order (each dispatch is a collective of the ep group, here every rank).
        assert dist.get_world_size(trainers["ep2"].parallel.mesh.experts().get_group()) == dist.get_world_size()
        ep2_counts = [(step, c) for step, c in probe.counts if step is not None and step[0] == "ep2"]
        steps = [step for step, _ in ep2_counts]
        local = torch.stack([c for _, c in ep2_counts])
        every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(every, local)
        counts = torch.stack(every, dim=1)  # [dispatch calls, ranks, experts]
        dim = config.model.dim
        expected_sent = [0] * (args.ep_warmup + args.ep_steps)
        expected_received = [0] * (args.ep_warmup + args.ep_steps)
        for step, call_counts in zip(steps, counts):
            sent, received = expected_row_bytes(call_counts, rank, dim)
            expected_sent[step[1]] += sent
            expected_received[step[1]] += received
        rows_sent = [
            sum(c["bytes_sent"] for c in probe.calls if c["step"] == ("ep2", i) and c["kind"] != "counts")
            for i in range(args.ep_warmup + args.ep_steps)
        ]
        rows_received = [
            sum(c["bytes_received"] for c in probe.calls if c["step"] == ("ep2", i) and c["kind"] != "counts")
            for i in range(args.ep_warmup + args.ep_steps)
        ]
        assignments = counts[:, rank].sum(-1)
        n_experts = counts.shape[-1]
        own = [e for e in range(n_experts) if e * NPROC // n_experts == rank]
        mine.update({
            "a2a_per_step": a2a,
            "a2a_replayed_s": replayed_s,
            "dispatches_per_step": len(steps) / (args.ep_warmup + args.ep_steps),
            "assignments_per_dispatch": sorted(set(assignments.tolist())),
            "row_bytes_sent_per_step": rows_sent,
            "row_bytes_sent_expected_per_step": expected_sent,
            "row_bytes_received_per_step": rows_received,
            "row_bytes_received_expected_per_step": expected_received,
            "foreign_share_of_assignments": [
                float(1 - counts[:, rank, own].sum() / assignments.sum())
            ],
            # Rows this rank's experts ran, per dispatch, over the rows of a balanced split.
            "expert_rows_over_balanced": [float(counts[:, :, own].sum() / assignments.sum())],
            "unprobed_calls": sum(1 for c in probe.calls if c["step"] is None),
            "async_calls_per_step": {
                name: sum(1 for c in probe.calls if c["step"] == (name, args.ep_warmup) and c["async"]) for name in a2a
            },
        })  # fmt: skip
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)

    if parallels[layouts[0]].is_main:
        print(
            json.dumps(
                {
                    "world_size": dist.get_world_size(),
                    "threads_per_rank": torch.get_num_threads(),
                    "batch_size_per_rank": args.batch_size,
                    "seq_len": config.train.seq_len,
                    "dim": config.model.dim,
                    "top_k": config.model.n_activated_experts,
                    "n_routed_experts": config.model.n_routed_experts,
                    "moe_layers": config.model.n_layers - config.model.n_dense_layers,
                    "layouts": {name: EP_LAYOUTS[name] for name in layouts},
                    "warmup_steps": args.ep_warmup,
                    "step_s": step_s,
                    "ranks": gathered,
                }
            ),
            flush=True,
        )
    for name in reversed(layouts):  # the first one started the process group
        parallels[name].close()


def peak_rss_mib() -> float:
    """This process's peak resident memory: VmHWM, which, unlike ru_maxrss, exec does not inherit."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def ep_run(args: argparse.Namespace, threads: int, work: Path, layouts: list[str], steps: int, warmup: int,
           tag: str, extra_env: dict[str, str] | None = None) -> dict:  # fmt: skip
    """One pair of `--ep-worker`s under torchrun: its JSON line, and the noise."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
        __file__, "--ep-worker", f"--layouts={','.join(layouts)}",
        f"--model={args.model}", f"--batch-size={args.batch_size}",
        f"--ep-steps={steps}", f"--ep-warmup={warmup}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
    stdout, other_cores = run_logged(cmd, env, work / f"{tag}.log")
    raw = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    return {**raw, "other_cores": other_cores, "env": extra_env or {}}


def ep_main(args: argparse.Namespace) -> None:
    load_at_start = os.getloadavg()[0]
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    threads = max(1, cores // NPROC)
    progress.print(f"torch {torch.__version__}, {cores} cores, load average (1 min) {load_at_start:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench_dist_ep_") as tmp:
        work = Path(tmp)
        progress.print(f"step time: {NPROC} workers x {threads} thread(s), {', '.join(EP_LAYOUTS)} alternating, "
                       f"{args.ep_warmup} + {args.ep_steps} steps each ...")  # fmt: skip
        timing = ep_run(args, threads, work, list(EP_LAYOUTS), args.ep_steps, args.ep_warmup, "ep-timing")
        memory = {}
        for name in EP_MEMORY:
            progress.print(f"peak memory: {name} alone, {args.ep_memory_steps} steps ...")
            memory[name] = ep_run(
                args, threads, work, [name], args.ep_memory_steps, 0, f"ep-memory-{name}", MEMORY_RUN_ENV
            )
    results = ep_results(timing, memory)
    results = {
        "torch": torch.__version__,
        "cores": cores,
        "load_avg_1min_at_start": load_at_start,
        "load_avg_1min_at_end": os.getloadavg()[0],
        "model": args.model,
        **results,
        "wall_s": time.perf_counter() - started,
    }
    show_ep(results)
    headline = {key: results[key] for key in ("model", "threads_per_rank", "median_step_s", "ratio_ep2_over_ep1",
                                              "ratio_ep2_over_ep2_blocking", "a2a", "memory", "checks",
                                              "wall_s")}  # fmt: skip
    print(json.dumps(headline), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    failed = [name for name, ok in results["checks"].items() if not ok]
    if failed:
        sys.exit(f"bench_dist --ep: check(s) failed: {', '.join(failed)}; the comparison does not hold")


def ep_results(timing: dict, memory: dict[str, dict]) -> dict:
    """The worker pairs' raw figures, reduced: medians, ratios, the all-to-all share, the checks."""
    step_s = timing["step_s"]
    median = {name: statistics.median(times) for name, times in step_s.items()}
    paired = [b / a for a, b in zip(step_s["ep1"], step_s["ep2"])]
    ranks = timing["ranks"]
    warmup = timing["warmup_steps"]

    a2a_by_rank, a2a_blocking_by_rank = [], []
    for r in ranks:
        per_step = r["a2a_per_step"]["ep2"]
        keys = per_step[0].keys()
        figures = {key: statistics.median(step[key] for step in per_step) for key in keys}
        figures["share_of_ep2_step"] = statistics.median(
            step["seconds"] / s for step, s in zip(per_step, step_s["ep2"])
        )
        figures["async_calls_per_step"] = r["async_calls_per_step"]["ep2"]
        blocking = r["a2a_per_step"]["ep2_blocking"]
        a2a_blocking_by_rank.append({key: statistics.median(step[key] for step in blocking) for key in keys} | {
            "share_of_ep2_blocking_step": statistics.median(
                step["seconds"] / s for step, s in zip(blocking, step_s["ep2_blocking"])),
            "async_calls_per_step": r["async_calls_per_step"]["ep2_blocking"],
        })  # fmt: skip
        figures["row_bytes_sent_measured_total"] = sum(r["row_bytes_sent_per_step"])
        figures["row_bytes_sent_expected_total"] = sum(r["row_bytes_sent_expected_per_step"])
        figures["row_bytes_received_measured_total"] = sum(r["row_bytes_received_per_step"])
        figures["row_bytes_received_expected_total"] = sum(r["row_bytes_received_expected_per_step"])
        figures["row_bytes_sent_per_timed_step_median"] = statistics.median(r["row_bytes_sent_per_step"][warmup:])
        figures["foreign_share_of_assignments"] = r["foreign_share_of_assignments"][0]
        figures["expert_rows_over_balanced"] = r["expert_rows_over_balanced"][0]
        figures["dispatches_per_step"] = r["dispatches_per_step"]
        a2a_by_rank.append(figures)
    # A rank that reaches an all-to-all first waits there for the other: the rank that waited
    # least in a step is the nearer to the exchanges' own cost.
    least = [min(steps) for steps in zip(*([step["seconds"] for step in r["a2a_per_step"]["ep2"]] for r in ranks))]
    a2a_least = {
        "seconds": statistics.median(least),
        "share_of_ep2_step": statistics.median(s / t for s, t in zip(least, step_s["ep2"])),
    }
    # The same exchanges run again after the timing, alone, a barrier before each: the raw
    # transfer time, without the waiting (the slower rank's figure, step by step).
    replayed = [max(steps) for steps in zip(*(r["a2a_replayed_s"] for r in ranks))]
    a2a_replayed = {
        "seconds": statistics.median(replayed),
        "share_of_ep2_step": statistics.median(s / t for s, t in zip(replayed, step_s["ep2"])),
    }
    tokens = timing["batch_size_per_rank"] * timing["seq_len"]
    # The plan's estimate: uniform routing sends (ep - 1) / ep of the assignments away.
    uniform = tokens * timing["top_k"] * (NPROC - 1) / NPROC * 2 * 2 * timing["dim"] * ROW_BYTES_FP32
    uniform *= timing["moe_layers"]

    first_losses = {name: [r["losses"][name][0] for r in ranks] for name in step_s}
    loss_diff = max(abs(a - b) for a, b in zip(first_losses["ep1"], first_losses["ep2"]))
    second_diff = max(abs(r["losses"]["ep1"][1] - r["losses"]["ep2"][1]) for r in ranks)
    overlap_identical = all(r["losses"]["ep2"] == r["losses"]["ep2_blocking"] for r in ranks)
    bytes_exact = all(
        r["row_bytes_sent_per_step"] == r["row_bytes_sent_expected_per_step"]
        and r["row_bytes_received_per_step"] == r["row_bytes_received_expected_per_step"]
        for r in ranks
    )
    expected_assignments = tokens * timing["top_k"]

    memory_by_layout = {}
    for name, run in memory.items():
        memory_by_layout[name] = [
            {
                "rank": r["rank"],
                "peak_rss_mib": r["peak_rss_mib"],
                "growth_mib": r["peak_rss_mib"] - r["rss_before_build_mib"],
                "growth_at_build_mib": r["peak_rss_after_build_mib"] - r["rss_before_build_mib"],
                "param_bytes": r["param_bytes"][name],
                "expert_rows_over_balanced": r.get("expert_rows_over_balanced", [None])[0],
            }
            for r in run["ranks"]
        ]
    return {
        "threads_per_rank": timing["threads_per_rank"],
        "batch_size_per_rank": timing["batch_size_per_rank"],
        "seq_len": timing["seq_len"],
        "layouts": timing["layouts"],
        "timed_steps": len(step_s["ep1"]),
        "warmup_steps": warmup,
        "memory_steps": {name: len(run["ranks"][0]["losses"][name]) for name, run in memory.items()},
        "median_step_s": median,
        "ratio_ep2_over_ep1": {
            "of_medians": median["ep2"] / median["ep1"],
            "paired_median": statistics.median(paired),
            "paired_min": min(paired),
            "paired_max": max(paired),
        },
        "ratio_ep2_over_ep2_blocking": {
            "of_medians": median["ep2"] / median["ep2_blocking"],
            "paired_median": statistics.median(b / a for a, b in zip(step_s["ep2_blocking"], step_s["ep2"])),
        },
        "a2a": {
            "by_rank": a2a_by_rank,
            "blocking_by_rank": a2a_blocking_by_rank,
            "least_over_ranks": a2a_least,
            "replayed_alone": a2a_replayed,
            "uniform_estimate_bytes_sent_per_step": uniform,
        },
        "memory": memory_by_layout,
        "first_step_loss": first_losses,
        "first_step_loss_max_abs_diff": loss_diff,
        "second_step_loss_max_abs_diff": second_diff,
        "checks": {
            "first_step_losses_agree": loss_diff <= EP_LOSS_TOLERANCE,
            "bytes_measured_equal_expected": bytes_exact,
            "assignments_per_dispatch": all(r["assignments_per_dispatch"] == [expected_assignments] for r in ranks),
            "every_a2a_in_a_step": all(r["unprobed_calls"] == 0 for r in ranks),
            # ep2 starts its 4 row exchanges per MoE layer in the background, ep2_blocking none.
            "ep2_overlaps_every_row_exchange": all(
                r["async_calls_per_step"]["ep2"] == 4 * timing["moe_layers"]
                and r["async_calls_per_step"]["ep2_blocking"] == 0 for r in ranks),
            "ep2_losses_equal_blocking_every_step": overlap_identical,
        },
        "raw_timing": timing,
        "raw_memory": memory,
    }


def show_ep(results: dict) -> None:
    console = results_console()
    summary = run_table(
        "ciuic_train expert-parallel bench", results,
        f"model={results['model']}, {NPROC} ranks (gloo) x {results['threads_per_rank']} thread(s), "
        f"batch {results['batch_size_per_rank']} x {results['seq_len']} tokens per rank, fp32",
    )
    for name, overrides in results["layouts"].items():
        summary.add_row(f"layout {name}", " ".join(overrides))
    summary.add_row("wall time", f"{results['wall_s']:.0f} s")
    console.print(summary)

    median, ratio = results["median_step_s"], results["ratio_ep2_over_ep1"]
    other_cores = results["raw_timing"]["other_cores"]
    steps = Table(
        title=f"step time, median of {results['timed_steps']} steps each after {results['warmup_steps']} warm-up, "
        f"alternating (cores other processes kept busy: {other_cores:.2f})",
        show_header=False,
    )
    steps.add_row("ep1 (dp_shard=2)", f"{median['ep1'] * 1e3:,.0f} ms")
    steps.add_row("ep2 (dp_shard=2, ep=2)", f"{median['ep2'] * 1e3:,.0f} ms")
    steps.add_row("ep2_blocking (the same, dist.ep_overlap=false)", f"{median['ep2_blocking'] * 1e3:,.0f} ms")
    blocking_ratio = results["ratio_ep2_over_ep2_blocking"]
    steps.add_row("ep2 / ep2_blocking, of the medians; step by step, median",
                  f"{blocking_ratio['of_medians']:.3f}; {blocking_ratio['paired_median']:.3f}")
    steps.add_row("ep2 / ep1, of the medians", f"{ratio['of_medians']:.3f}")
    steps.add_row(
        "ep2 / ep1, step by step: median [range]",
        f"{ratio['paired_median']:.3f} [{ratio['paired_min']:.3f}, {ratio['paired_max']:.3f}]",
    )
    steps.add_row(
        "first-step loss ep1 / ep2 (rank 0), max |diff| over ranks",
        f"{results['first_step_loss']['ep1'][0]:.6f} / {results['first_step_loss']['ep2'][0]:.6f}, "
        f"{results['first_step_loss_max_abs_diff']:.1e} (2nd step {results['second_step_loss_max_abs_diff']:.1e})",
    )
    console.print(steps)

    a2a = Table(title="ep2: all-to-alls per step (medians over the timed steps), per rank; "
                "time: what the training thread spends in them (starting and waiting, when overlapped)")
    a2a.add_column("")
    by_rank = results["a2a"]["by_rank"]
    for r in range(len(by_rank)):
        a2a.add_column(f"rank {r}", justify="right")

    def row(label: str, fmt) -> None:
        a2a.add_row(label, *(fmt(f) for f in by_rank))

    row("calls (MoE dispatches)", lambda f: f"{f['calls']:g} ({f['dispatches_per_step']:g})")
    row("time in all-to-alls", lambda f: f"{f['seconds'] * 1e3:,.1f} ms")
    row("  counts exchange", lambda f: f"{f['counts_s'] * 1e3:,.1f} ms")
    row("  rows, forward (out + back)", lambda f: f"{f['rows_forward_s'] * 1e3:,.1f} ms")
    row("  rows, backward (out + back)", lambda f: f"{f['rows_backward_s'] * 1e3:,.1f} ms")
    row("share of the ep2 step", lambda f: f"{f['share_of_ep2_step']:.1%}")
    blocking = results["a2a"]["blocking_by_rank"]
    a2a.add_row("ep2_blocking: time in all-to-alls", *(
        f"{f['seconds'] * 1e3:,.1f} ms = {f['share_of_ep2_blocking_step']:.1%}" for f in blocking))
    a2a.add_row("  of which rows (forward + backward)", *(
        f"{(f['rows_forward_s'] + f['rows_backward_s']) * 1e3:,.1f} ms" for f in blocking))
    least = results["a2a"]["least_over_ranks"]
    a2a.add_row(
        "the rank that waited least, step by step",
        f"{least['seconds'] * 1e3:,.1f} ms = {least['share_of_ep2_step']:.1%}", "",
    )
    replayed = results["a2a"]["replayed_alone"]
    a2a.add_row(
        "the same exchanges replayed alone (barrier first)",
        f"{replayed['seconds'] * 1e3:,.1f} ms = {replayed['share_of_ep2_step']:.1%}", "",
    )
    row("assignments sent to the other rank", lambda f: f"{f['foreign_share_of_assignments']:.1%}")
    row("rows its experts ran / balanced", lambda f: f"{f['expert_rows_over_balanced']:.3f}")
    row("row bytes sent per step", lambda f: f"{f['row_bytes_sent_per_timed_step_median'] / 2**20:.3f} MiB")
    uniform = results["a2a"]["uniform_estimate_bytes_sent_per_step"]
    row("  uniform-routing estimate (plan)", lambda f: f"{uniform / 2**20:.3f} MiB")
    row("row bytes sent, all steps: measured", lambda f: f"{f['row_bytes_sent_measured_total']:,}")
    row("  expected from the exchanged counts", lambda f: f"{f['row_bytes_sent_expected_total']:,}")
    row("row bytes received, all steps: measured", lambda f: f"{f['row_bytes_received_measured_total']:,}")
    row("  expected from the exchanged counts", lambda f: f"{f['row_bytes_received_expected_total']:,}")
    row("counts bytes sent per step", lambda f: f"{f['counts_bytes_sent']:,}")
    console.print(a2a)

    memory = Table(
        title=f"memory per rank: each layout alone in a fresh worker pair, {results['memory_steps']['ep1']} steps, "
        + " ".join(f"{k}={v}" for k, v in MEMORY_RUN_ENV.items())
        + "; peak RSS (VmHWM), and its growth past imports and config"
    )
    for column in ("layout", "rank", "peak RSS", "growth", "growth by end of build", "expert rows / balanced",
                   "param bytes: experts", "other", "total"):  # fmt: skip
        memory.add_column(column, justify="right")
    for name, ranks in results["memory"].items():
        for r in ranks:
            pb, rows = r["param_bytes"], r["expert_rows_over_balanced"]
            memory.add_row(
                name, str(r["rank"]), f"{r['peak_rss_mib']:,.1f} MiB", f"{r['growth_mib']:,.1f} MiB",
                f"{r['growth_at_build_mib']:,.1f} MiB", "-" if rows is None else f"{rows:.3f}",
                f"{pb['experts']:,}", f"{pb['other']:,}",
                f"{pb['experts'] + pb['other']:,}",
            )  # fmt: skip
    console.print(memory)
    checks = ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in results["checks"].items())
    console.print(f"checks: {checks}")


# ---------------------------------------------------------------------------- two emulated hosts (--netns)

# scripts/cluster/netns_cluster.sh: its hosts are the network namespaces ciuic-host0, 1, ...
NETNS_CLUSTER = Path(__file__).resolve().parent / "cluster" / "netns_cluster.sh"
NETNS_HOST_PREFIX = "ciuic-host"
# How long a worker waits for the driver to set the link rate, and the driver for a phase.
NETNS_HANDSHAKE_S = 120


def netns_hosts() -> int:
    """How many emulated hosts are up (0 when `ip` is missing or lists none)."""
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    except FileNotFoundError:
        return 0
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return sum(1 for name in names if name.startswith(NETNS_HOST_PREFIX) and name[len(NETNS_HOST_PREFIX):].isdigit())


def link_status() -> list[str]:
    """`netns_cluster.sh status`: one line per host with its eth0's root qdisc."""
    done = subprocess.run([str(NETNS_CLUSTER), "status"], capture_output=True, text=True, timeout=60)
    return done.stdout.splitlines()


def qdisc_rate_mbit(line: str) -> float:
    """The tbf rate a `status` line shows, in Mbit/s; 0 when the link has no tbf (unlimited)."""
    match = re.search(r"\btbf\b.*\brate (\d+(?:\.\d+)?)([KMG]?)bit", line)
    if not match:
        return 0.0
    return float(match[1]) * {"K": 1e-3, "M": 1.0, "G": 1e3, "": 1e-6}[match[2]]


def set_link(mbit: int, hosts: int) -> list[str]:
    """Rate-limit every host's eth0 to `mbit` Mbit/s (0: unlimited) and return `status`.

    `up` on a cluster that is already up only re-applies the limit; HOSTS is the number of
    hosts that are up, so that a cluster of another size is never rebuilt from here."""
    env = {**os.environ, "LINK_MBIT": str(mbit), "HOSTS": str(hosts)}
    done = subprocess.run([str(NETNS_CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"LINK_MBIT={mbit} {NETNS_CLUSTER} up exited with {done.returncode}: {done.stderr.strip()}")
    return link_status()


def link_is(lines: list[str], mbit: int) -> bool:
    return bool(lines) and all(abs(qdisc_rate_mbit(line) - mbit) < 1e-6 for line in lines)


def tx_bytes() -> int:
    """Bytes this host's eth0 has sent (inside a namespace, /sys is that namespace's)."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def replay_all_reduce(numels: list[int]) -> dict[str, float]:
    """One step's gradient all-reduce alone: buckets of the same sizes, blocking, back to back,
    after a barrier; its seconds and the bytes this host's eth0 sent meanwhile (read after a
    second barrier, so that the last packets have left the queue)."""
    buffers = [torch.ones(n) for n in numels]
    dist.barrier()
    sent = tx_bytes()
    tic = time.perf_counter()
    for buffer in buffers:
        dist.all_reduce(buffer)
    seconds = time.perf_counter() - tic
    dist.barrier()
    return {"seconds": seconds, "tx_bytes": tx_bytes() - sent}


def wait_for(path: Path, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not alive():
            raise RuntimeError(f"gave up waiting for {path}: a process it depends on has exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s:.0f} s")
        time.sleep(0.05)


def netns_worker(args: argparse.Namespace) -> None:
    """The three DDP variants on two hosts, phase by phase; rank 0 prints one JSON line.

    Phase i runs at link rate `--phases`[i]: rank 0 writes `want-i` in `--sync-dir`, the
    driver sets the rate and answers `set-i`, and both ranks start together after a barrier.
    The connections of the process group stay open throughout; tbf applies to new packets."""
    parallel, trainers, serial = build_ddp_variants(args)
    sync = Path(args.sync_dir)
    phases: list[dict[str, Any]] = []
    for i, mbit in enumerate(int(r) for r in args.phases.split(",")):
        if parallel.is_main:
            (sync / f"want-{i}").write_text(str(mbit))
            wait_for(sync / f"set-{i}", NETNS_HANDSHAKE_S)
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        timed = time_ddp_variants(trainers, serial, WARMUP_STEPS if i == 0 else 0, args.netns_steps)
        replays = [replay_all_reduce(timed["bucket_numels"]) for _ in range(args.netns_steps)]
        mine = {
            "rank": dist.get_rank(),
            "host": socket.gethostname(),
            "cpu_s": time.process_time() - cpu,  # every thread of this rank, gloo's included
            "wall_s": time.perf_counter() - wall,
            "serial_all_reduce_s": timed["all_reduce_s"],
            "replays": replays,
        }
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        phases.append({
            "link_mbit": mbit,
            "step_s": timed["step_s"],
            "buckets_per_step": statistics.median(timed["buckets"]),
            "bucket_numels": timed["bucket_numels"],
            "ranks": ranks,
        })  # fmt: skip
    if parallel.is_main:
        (sync / "done").write_text("")
        print(
            json.dumps(
                {
                    "world_size": parallel.world_size,
                    "threads_per_rank": torch.get_num_threads(),
                    "batch_size_per_rank": args.batch_size,
                    "seq_len": trainers["ddp"].config.train.seq_len,
                    "grad_bytes": grad_bytes(trainers["ddp"]),
                    "warmup_steps": WARMUP_STEPS,
                    "phases": phases,
                }
            ),
            flush=True,
        )
    parallel.close()


def netns_phases(rates: list[int]) -> list[int]:
    """Every limited phase between two unlimited ones: each rate's ratio is taken against the
    unlimited phases right before and after it, so a slow spell of the machine lands on both."""
    phases = [0]
    for rate in rates:
        phases += [rate, 0]
    return phases


def netns_run(args: argparse.Namespace, hosts: int, threads: int, work: Path, phases: list[int]) -> dict:
    """Start a worker on host 0 and one on host 1 (torchrun, c10d rendezvous at host0), set the
    link rate each phase asks for, and return rank 0's JSON line with the driver's notes.

    The link is back to unlimited when this returns or raises."""
    sync = work / "sync"
    sync.mkdir()
    rdzv_id = f"bench-dist-netns-{os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs: list[subprocess.Popen] = []
    logs = [work / f"host{h}.log" for h in range(NPROC)]
    notes: list[dict[str, Any]] = []
    busy_at_set = time.perf_counter(), busy_cpu_s()

    def alive() -> bool:  # rank 0 writes `done` before any worker may exit
        return all(p.poll() is None for p in procs)

    def close_phase(i: int, mbit: int) -> None:
        held = link_status()
        busy = busy_cpu_s() - busy_at_set[1]
        notes[i].update(link_at_end=held, link_held=link_is(held, mbit) and notes[i]["link_held"],
                        window_s=time.perf_counter() - busy_at_set[0], busy_cpu_s=busy)  # fmt: skip

    try:
        for h in range(NPROC):
            cmd = [
                str(NETNS_CLUSTER), "exec", str(h),
                sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={NPROC}", "--nproc_per_node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=host0:{args.port}", f"--rdzv-id={rdzv_id}",
                str(Path(__file__).resolve()), "--netns-worker", f"--sync-dir={sync}",
                f"--phases={','.join(map(str, phases))}", f"--netns-steps={args.netns_steps}",
                f"--model={args.model}", f"--batch-size={args.batch_size}",
            ]  # fmt: skip
            with open(logs[h], "w", encoding="utf-8") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
        for i, mbit in enumerate(phases):
            wait_for(sync / f"want-{i}", RUN_TIMEOUT_S, alive)
            if i > 0:
                close_phase(i - 1, phases[i - 1])
            progress.print(f"phase {i + 1}/{len(phases)}: link {mbit or 'unlimited'}{' Mbit/s' if mbit else ''} ...")
            status = set_link(mbit, hosts)
            notes.append({"link_mbit": mbit, "link_at_start": status, "link_held": link_is(status, mbit)})
            busy_at_set = time.perf_counter(), busy_cpu_s()
            (sync / f"set-{i}").write_text("")
        wait_for(sync / "done", RUN_TIMEOUT_S, alive)
        close_phase(len(phases) - 1, phases[-1])
        for p in procs:
            p.wait(timeout=120)
    except Exception as error:
        tails = "\n".join(
            f"--- host{h} ({'running' if p.poll() is None else f'exit {p.returncode}'}), last lines of its log:\n"
            + "\n".join(logs[h].read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
            for h, p in enumerate(procs)
        )
        raise RuntimeError(f"{error}\n{tails}") from error
    finally:
        try:
            for p in procs:  # only on failure: a worker left behind must not hold the hosts' ports
                kill_group(p)
        finally:
            set_link(0, hosts)
    failed = [h for h, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = "\n".join(logs[failed[0]].read_text(encoding="utf-8").splitlines()[-20:])
        raise RuntimeError(f"the worker on host{failed[0]} exited with {procs[failed[0]].returncode}:\n{tail}")
    lines = [line for log in logs for line in log.read_text(encoding="utf-8").splitlines() if line.startswith("{")]
    raw = json.loads(lines[-1])
    for phase, note in zip(raw["phases"], notes):
        ranks_cpu = sum(r["cpu_s"] for r in phase["ranks"])
        note["other_cores"] = max(0.0, note["busy_cpu_s"] - ranks_cpu) / note["window_s"]
        phase["driver"] = note
    return raw


def netns_main(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        progress.print("bench_dist --netns: needs root (it sets the hosts' link rate with netns_cluster.sh)")
        sys.exit(2)
    hosts = netns_hosts()
    if hosts < NPROC:
        if not args.up:
            progress.print(
                f"bench_dist --netns: the emulated hosts are not up ({hosts} of {NPROC}). Bring them up with\n"
                f"  LINK_MBIT=0 {NETNS_CLUSTER} up\n"
                "or pass --up to have this script do it (it leaves them up, unlimited)."
            )
            sys.exit(2)
        progress.print(f"bringing the emulated hosts up: LINK_MBIT=0 {NETNS_CLUSTER} up")
        set_link(0, NPROC)
        hosts = netns_hosts()
    # Rate restored (to unlimited) however this process ends: `netns_run` does it in a
    # `finally`, which SIGTERM and SIGHUP reach through SystemExit.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))

    load_at_start = os.getloadavg()[0]
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    threads = max(1, cores // NPROC)
    rates = [int(r) for r in args.rates.split(",")]
    if min(rates) < 1 or len(set(rates)) != len(rates) or args.netns_steps < 1:
        progress.print(f"bench_dist --netns: --rates={args.rates} must be distinct rates of 1 Mbit/s or more "
                       f"and --netns-steps={args.netns_steps} at least 1")  # fmt: skip
        sys.exit(2)
    phases = netns_phases(rates)
    progress.print(
        f"torch {torch.__version__}, {cores} cores, load average (1 min) {load_at_start:.2f}; "
        f"{NPROC} hosts x 1 process x {threads} thread(s), model={args.model}, "
        f"phases (Mbit/s, 0 = unlimited): {', '.join(map(str, phases))}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_dist_netns_") as tmp:
        raw = netns_run(args, hosts, threads, Path(tmp), phases)
    results = {
        "torch": torch.__version__,
        "cores": cores,
        "load_avg_1min_at_start": load_at_start,
        "load_avg_1min_at_end": os.getloadavg()[0],
        "model": args.model,
        "hosts": [r["host"] for r in raw["phases"][0]["ranks"]],
        "link_latency_ms": int(os.environ.get("LATENCY_MS", "50")),
        **netns_results(raw),
        "raw": raw,
        "wall_s": time.perf_counter() - started,
    }
    show_netns(results)
    headline = {key: results[key] for key in ("model", "threads_per_rank", "grad_mbytes", "by_rate",
                                              "ratio_at_1000", "checks", "wall_s")}  # fmt: skip
    print(json.dumps(headline), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    failed = [name for name, ok in results["checks"].items() if not ok]
    if failed:
        sys.exit(f"bench_dist --netns: check(s) failed: {', '.join(failed)}")


def phase_figures(phase: dict, grad: int) -> dict[str, Any]:
    """One phase's medians: step per variant, all-reduce in the step and alone, bytes on the wire."""
    median = {name: statistics.median(times) for name, times in phase["step_s"].items()}
    ranks = phase["ranks"]
    # The serial hook's all-reduce per step, and each replay, as the slower rank saw it.
    in_step = statistics.median(max(steps) for steps in zip(*(r["serial_all_reduce_s"] for r in ranks)))
    alone = statistics.median(max(rs) for rs in zip(*([x["seconds"] for x in r["replays"]] for r in ranks)))
    tx = [statistics.median(x["tx_bytes"] for x in r["replays"]) for r in ranks]
    exposed = median["ddp"] - median["nocomm"]
    return {
        "link_mbit": phase["link_mbit"],
        "median_step_s": median,
        "comm_share": exposed / median["ddp"],
        "exposed_comm_s": exposed,
        "all_reduce_in_serial_step_s": in_step,
        "all_reduce_alone_s": alone,
        "payload_mbyte_per_s": grad / alone / 1e6,
        "tx_bytes_per_all_reduce": tx,
        "wire_mbit_per_s": [b * 8 / alone / 1e6 for b in tx],
        "overlap": 1 - exposed / alone,
        "other_cores": phase["driver"]["other_cores"],
        "link_held": phase["driver"]["link_held"],
        "link": phase["driver"]["link_at_start"],
    }


def netns_results(raw: dict) -> dict:
    """Per phase figures; per rate, the ratio of its ddp step to the unlimited phases around it."""
    grad = raw["grad_bytes"]
    per_phase = [phase_figures(phase, grad) for phase in raw["phases"]]
    unlimited_steps = {
        name: [s for phase in raw["phases"] if phase["link_mbit"] == 0 for s in phase["step_s"][name]]
        for name in raw["phases"][0]["step_s"]
    }
    by_rate: dict[str, dict[str, Any]] = {}
    for i, figures in enumerate(per_phase):
        if figures["link_mbit"] == 0:
            continue
        around = [per_phase[j]["median_step_s"]["ddp"] for j in (i - 1, i + 1) if 0 <= j < len(per_phase)]
        baseline = statistics.mean(around)
        by_rate[str(figures["link_mbit"])] = {
            **{key: value for key, value in figures.items() if key != "link"},
            "unlimited_ddp_around_s": around,
            "ratio_to_unlimited": figures["median_step_s"]["ddp"] / baseline,
        }
    unlimited = [f for f in per_phase if f["link_mbit"] == 0]
    by_rate["unlimited"] = {
        "phases": len(unlimited),
        "median_step_s": {name: statistics.median(times) for name, times in unlimited_steps.items()},
        "comm_share_per_phase": [f["comm_share"] for f in unlimited],
        "all_reduce_alone_s_per_phase": [f["all_reduce_alone_s"] for f in unlimited],
        "payload_mbyte_per_s_per_phase": [f["payload_mbyte_per_s"] for f in unlimited],
        "wire_mbit_per_s_per_phase": [f["wire_mbit_per_s"] for f in unlimited],
        "overlap_per_phase": [f["overlap"] for f in unlimited],
        "other_cores_per_phase": [f["other_cores"] for f in unlimited],
    }
    first = raw["phases"][0]
    return {
        "threads_per_rank": raw["threads_per_rank"],
        "batch_size_per_rank": raw["batch_size_per_rank"],
        "seq_len": raw["seq_len"],
        "grad_mbytes": grad / 2**20,
        "buckets_per_step": first["buckets_per_step"],
        "bucket_mbytes": [n * 4 / 2**20 for n in first["bucket_numels"]],
        "timed_steps": len(first["step_s"]["ddp"]),
        "warmup_steps": raw["warmup_steps"],
        "phases": per_phase,
        "by_rate": by_rate,
        "ratio_at_1000": by_rate.get("1000", {}).get("ratio_to_unlimited"),
        "checks": {"link_rate_as_asked_every_phase": all(f["link_held"] for f in per_phase)},
    }


def show_netns(results: dict) -> None:
    console = results_console()
    summary = run_table(
        "ciuic_train DDP across two emulated hosts", results,
        f"model={results['model']}, {NPROC} hosts ({', '.join(results['hosts'])}) x 1 process (gloo) x "
        f"{results['threads_per_rank']} thread(s), batch {results['batch_size_per_rank']} x "
        f"{results['seq_len']} tokens per rank, fp32",
    )  # fmt: skip
    summary.add_row(
        "gradient all-reduce",
        f"{results['grad_mbytes']:.2f} MiB per step in {results['buckets_per_step']:g} buckets "
        f"({', '.join(f'{b:.1f}' for b in results['bucket_mbytes'])} MiB)",
    )
    summary.add_row("link", f"tc tbf on each host's eth0 (egress), latency {results['link_latency_ms']} ms")
    summary.add_row("wall time", f"{results['wall_s']:.0f} s")
    console.print(summary)

    table = Table(
        title=f"median of {results['timed_steps']} steps per variant per phase (after {results['warmup_steps']} "
        "warm-up steps in the first), variants alternating; every limited phase between two unlimited ones"
    )
    columns = ("link Mbit/s", "ddp", "nocomm", "serial", "comm share", "all-reduce alone (in serial step)",
               "payload MB/s", "wire Mbit/s (rank 0, 1)", "overlap", "ddp / unlimited", "others' cores")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    ms = "{:,.0f} ms".format
    for i, f in enumerate(results["phases"]):
        rate = f["link_mbit"]
        ratio = results["by_rate"][str(rate)]["ratio_to_unlimited"] if rate else None
        label = f"{rate}" if rate else "unlimited"
        table.add_row(
            label if f["link_held"] else f"{label} (NOT HELD)",
            ms(f["median_step_s"]["ddp"] * 1e3), ms(f["median_step_s"]["nocomm"] * 1e3),
            ms(f["median_step_s"]["serial"] * 1e3), f"{f['comm_share']:.1%}",
            f"{f['all_reduce_alone_s'] * 1e3:,.0f} ({f['all_reduce_in_serial_step_s'] * 1e3:,.0f}) ms",
            f"{f['payload_mbyte_per_s']:,.1f}", ", ".join(f"{w:,.0f}" for w in f["wire_mbit_per_s"]),
            f"{f['overlap']:.2f}",
            "" if ratio is None else (f"[bold]{ratio:.2f}[/bold]" if rate == 1000 else f"{ratio:.2f}"),
            f"{f['other_cores']:.2f}",
        )  # fmt: skip
    unlimited = results["by_rate"]["unlimited"]
    median = unlimited["median_step_s"]
    table.add_row(
        f"unlimited, {unlimited['phases']} phases pooled",
        ms(median["ddp"] * 1e3), ms(median["nocomm"] * 1e3), ms(median["serial"] * 1e3),
        f"{(median['ddp'] - median['nocomm']) / median['ddp']:.1%}", "", "", "", "", "", "",
    )  # fmt: skip
    console.print(table)
    if results["ratio_at_1000"] is not None:
        console.print(
            f"[bold]ddp step at 1000 Mbit/s / unlimited: {results['ratio_at_1000']:.2f}[/bold] "
            "(against the unlimited phases right before and after)"
        )
    console.print(
        "comm share = (ddp - nocomm) / ddp; all-reduce alone: one step's buckets all-reduced back to back after a "
        "barrier (median of as many replays as steps, the slower rank's time); payload = gradient bytes / that "
        "time; wire = eth0 tx bytes / that time; overlap = 1 - (ddp - nocomm) / all-reduce alone"
    )
    checks = ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in results["checks"].items())
    console.print(f"checks: {checks}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model config (default: small; bench with --ep)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per CLI run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every CLI case, interleaved")
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch")
    parser.add_argument("--comm-steps", type=int, default=8, help="timed steps of each DDP variant")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--ep", action="store_true", help="expert parallelism instead: ep=1 vs ep=2 under FSDP")
    parser.add_argument("--ep-steps", type=int, default=20, help="--ep: timed steps of each layout")
    parser.add_argument("--ep-warmup", type=int, default=2, help="--ep: untimed steps of each layout first")
    parser.add_argument("--ep-memory-steps", type=int, default=3, help="--ep: steps of each layout's memory run")
    parser.add_argument("--netns", action="store_true",
                        help="DDP across the two hosts of scripts/cluster/netns_cluster.sh at several link rates")
    parser.add_argument("--rates", default="100,300,1000", help="--netns: link rates, Mbit/s, comma-separated")
    parser.add_argument("--netns-steps", type=int, default=3, help="--netns: timed steps of each variant per phase")
    parser.add_argument("--port", type=int, default=29470, help="--netns: rendezvous port on host0")
    parser.add_argument("--up", action="store_true", help="--netns: bring the emulated hosts up if they are not")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--netns-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--phases", help=argparse.SUPPRESS)
    parser.add_argument("--ep-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="ep1,ep2", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        args.model = "bench" if args.ep or args.ep_worker else "small"
    return args


def main(args: argparse.Namespace) -> None:
    # Another job on these few cores slows every figure; the load says whether one was running.
    load_at_start = os.getloadavg()[0]
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    threads = max(1, cores // NPROC)
    b = args.batch_size
    progress.print(f"torch {torch.__version__}, {cores} cores, load average (1 min) {load_at_start:.2f}")
    cases = {
        f"1x{cores} B{b}": {"nproc": 1, "threads": cores, "batch_size": b},
        f"{NPROC}x{threads} B{b}": {"nproc": NPROC, "threads": threads, "batch_size": b},
        f"1x{cores} B{NPROC * b}": {"nproc": 1, "threads": cores, "batch_size": NPROC * b},
    }
    single, multi, single_big = cases

    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="bench_dist_") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            figures = {}
            for name in order:
                progress.print(f"round {r + 1}/{args.rounds}: {name} ...")
                run = figures[name] = cli_run(cases[name], args, work, f"r{r}-{name.replace(' ', '-')}")
                progress.print(f"  {run['tokens_per_s']:,.0f} tok/s, others kept {run['other_cores']:.2f} cores busy")
            rounds.append({name: figures[name] for name in cases})
        progress.print(f"comm share: {NPROC} workers x 3 DDP variants, {args.comm_steps} timed steps each ...")
        comm = comm_share(args, threads, work)

    # The median, as bench.py reports; the best too, as a neighbour's job only ever slows a run.
    tokens = {
        stat: {name: reduce(r[name]["tokens_per_s"] for r in rounds) for name in cases}
        for stat, reduce in (("median", statistics.median), ("best", max))
    }
    ratios = {
        stat: {"same_rank_batch": t[multi] / t[single], "same_global_batch": t[multi] / t[single_big]}
        for stat, t in tokens.items()
    }
    results = {
        "torch": torch.__version__,
        "cores": cores,
        "load_avg_1min_at_start": load_at_start,
        "load_avg_1min_at_end": os.getloadavg()[0],
        "model": args.model,
        "batch_size_per_rank": b,
        "steps": args.steps,
        "cases": cases,
        "rounds": rounds,
        "tokens_per_s": tokens,
        "ratio_multi_over_single": ratios,
        "comm": comm,
        "wall_s": time.perf_counter() - started,
    }
    show(results, single, multi, single_big)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


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


def show(results: dict, single: str, multi: str, single_big: str) -> None:
    console = results_console()
    summary = run_table(
        "ciuic_train distributed bench", results,
        f"model={results['model']}, per-rank batch {results['batch_size_per_rank']}, {results['steps']} steps per run",
    )
    summary.add_row("wall time", f"{results['wall_s']:.0f} s")
    console.print(summary)

    rounds = results["rounds"]
    per_round = Table(
        title="global tokens/s from the CLI's summary.json (cores other processes kept busy meanwhile)\n"
        "NxT = processes x threads each, B = per-rank batch"
    )
    for column in ("round", *rounds[0], f"{multi} / {single}", f"{multi} / {single_big}"):
        per_round.add_column(column, justify="right")
    for i, r in enumerate(rounds, 1):
        tokens = {name: run["tokens_per_s"] for name, run in r.items()}
        per_round.add_row(
            str(i),
            *(f"{run['tokens_per_s']:,.0f} ({run['other_cores']:.2f})" for run in r.values()),
            f"{tokens[multi] / tokens[single]:.2f}",
            f"{tokens[multi] / tokens[single_big]:.2f}",
        )
    for stat, tokens in results["tokens_per_s"].items():
        ratios = results["ratio_multi_over_single"][stat]
        per_round.add_row(
            stat,
            *(f"{v:,.0f}" for v in tokens.values()),
            f"{ratios['same_rank_batch']:.2f}",
            f"{ratios['same_global_batch']:.2f}",
        )
    console.print(per_round)
    console.print(
        f"{multi} trains {NPROC}x the tokens of {single} per step; {single_big} has the same global batch as {multi}."
    )

    comm = results["comm"]
    median = comm["median_step_s"]
    table = Table(
        title=f"DDP step time, {comm['world_size']} ranks x {comm['threads_per_rank']} thread(s), "
        f"batch {comm['batch_size_per_rank']}/rank (median of {len(comm['step_s']['ddp'])} steps)",
        show_header=False,
    )
    table.add_row("ddp (overlapped all-reduce)", f"{median['ddp'] * 1e3:,.0f} ms")
    table.add_row("nocomm (hook skips all-reduce)", f"{median['nocomm'] * 1e3:,.0f} ms")
    table.add_row("comm share (ddp - nocomm) / ddp", f"{comm['comm_share']:.1%}")
    table.add_row("serial (blocking all-reduce hook)", f"{median['serial'] * 1e3:,.0f} ms")
    table.add_row(
        "raw all-reduce per step (blocking)",
        f"{comm['median_all_reduce_s'] * 1e3:,.0f} ms = {comm['serial_all_reduce_share']:.1%} of serial step, "
        f"{comm['grad_mbytes']:.1f} MiB in {comm['buckets_per_step']:g} buckets",
    )
    table.add_row("cores other processes kept busy", f"{comm['other_cores']:.2f}")
    console.print(table)


if __name__ == "__main__":
    if "--pp" in sys.argv:  # pipeline parallelism: scripts/bench_pipeline.py, its own flags
        pipeline = Path(__file__).with_name("bench_pipeline.py")
        os.execv(sys.executable, [sys.executable, str(pipeline), *(a for a in sys.argv[1:] if a != "--pp")])
    cli_args = parse_args()
    if cli_args.worker:
        worker(cli_args)
    elif cli_args.ep_worker:
        ep_worker(cli_args)
    elif cli_args.netns_worker:
        netns_worker(cli_args)
    elif cli_args.netns:
        netns_main(cli_args)
    elif cli_args.ep:
        ep_main(cli_args)
    else:
        main(cli_args)
