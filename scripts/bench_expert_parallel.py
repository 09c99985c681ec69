"""Benchmark expert parallelism on 2 CPU ranks: step time, all-to-all time and bytes, peak memory.

FSDP over 2 ranks with every expert on each rank (`dist.dp_shard=2`, "ep1") against the
routed experts split in 2 (`dist.dp_shard=2 dist.ep=2`, "ep2"), their token exchanges in
the background while the shared experts compute (the default) or, in "ep2_blocking"
(`dist.ep_overlap=false`), waited for where they are made; at `--model` bench by default:
- step time: each of 2 workers (this file, `--ep-worker`, under torchrun) builds every
  layout's Trainers from the same seed and times their `train_step()`s alternately, step
  by step, the order flipping every step, so machine noise lands on every layout alike.
  Their first-step losses must agree within 1e-5.
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

    python scripts/bench_expert_parallel.py [--model bench] [--batch-size 8] [--ep-steps 20]
                                            [--ep-warmup 2] [--ep-memory-steps 3] [--json OUT]

Exits non-zero when a check fails (losses, bytes, overlap): the comparison does not hold then.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
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
from bench_dist_common import run_logged, run_table
from ciuic_train.config import register_configs
from ciuic_train.checks import to_config
from ciuic_train.distributed.params import param_bytes
from ciuic_train.distributed.process_group import Parallel
from ciuic_train.train.trainer import Trainer

NPROC = 2

progress = Console(stderr=True)

# The layouts compared, on NPROC=2 ranks: FSDP with every expert gathered on each rank,
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


def peak_rss_mib() -> float:
    """This process's peak resident memory: VmHWM, which, unlike ru_maxrss, exec does not inherit."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


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
    with tempfile.TemporaryDirectory(prefix="bench_expert_parallel_") as tmp:
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
        sys.exit(f"bench_expert_parallel: check(s) failed: {', '.join(failed)}; the comparison does not hold")


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="model config (default: bench)")
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch")
    parser.add_argument("--ep-steps", type=int, default=20, help="timed steps of each layout")
    parser.add_argument("--ep-warmup", type=int, default=2, help="untimed steps of each layout first")
    parser.add_argument("--ep-memory-steps", type=int, default=3, help="steps of each layout's memory run")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--ep-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="ep1,ep2", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    cli_args = parse_args()
    if cli_args.ep_worker:
        ep_worker(cli_args)
    else:
        ep_main(cli_args)
