"""Benchmark DDP across two emulated hosts (root): the step at several link rates against the unlimited link.

The DDP variants of scripts/bench_ddp.py (ddp, nocomm, serial: three Trainers differing
only in the communication hook, scripts/bench_dist_common.py) run on the two hosts of
scripts/cluster/netns_cluster.sh, one process each (cores / 2 threads, as in
scripts/bench_ddp.py), started by the driver as
`netns_cluster.sh exec N torchrun --nnodes=2 --rdzv-endpoint=host0:PORT`; every gradient
crosses the hosts' link (veth pairs through a bridge). The run is a series of phases, the
link unlimited in every other one: 0, R1, 0, R2, 0, R3, 0 (`--rates`, Mbit/s). Before each
phase rank 0 asks the driver for its rate (a file in a shared folder), the driver sets it
with `LINK_MBIT=R netns_cluster.sh up` (tc tbf on each host's eth0; the process group's
connections stay open) and answers, and both ranks start after a barrier. A phase times
`--netns-steps` steps of each variant alternately, as scripts/bench_ddp.py does, then
replays one step's all-reduce alone (the serial hook's bucket sizes, back to back after a
barrier) as many times, reading the bytes each host's eth0 sent meanwhile. Per phase:
- comm share (ddp - nocomm) / ddp, as in scripts/bench_ddp.py;
- all-reduce alone (the slower rank's replay) and its bandwidth: gradient bytes / time,
  and the eth0 bytes / time, to set against the tbf rate;
- overlap = 1 - (ddp - nocomm) / all-reduce alone: how much of the all-reduce the
  backward hides (1: all of it; 0: none, the step waits for all of it);
- ddp step / the mean of the ddp steps of the unlimited phases right before and after.
The link is set back to unlimited when the run ends, fails or is killed (SIGTERM,
SIGHUP), and the driver checks that each phase's rate held to its end (nobody else
reset it). If the hosts are not up it says how to bring them up and exits 2, unless
given `--up`, which brings them up (and leaves them up, unlimited).

    python scripts/bench_ddp_links.py [--up] [--model small] [--rates 100,300,1000]
                                      [--netns-steps 3] [--batch-size 8] [--port 29470] [--json OUT]

A pipeline, FSDP and expert parallelism across the same hosts: scripts/bench_pipeline.py --netns.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from rich.console import Console
from rich.table import Table

from bench import results_console
from bench_dist_common import (
    RUN_TIMEOUT_S,
    WARMUP_STEPS,
    build_ddp_variants,
    busy_cpu_s,
    grad_bytes,
    run_table,
    time_ddp_variants,
)
from netns_claims import kill_group

NPROC = 2

progress = Console(stderr=True)

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
    rdzv_id = f"bench-ddp-links-{os.getpid()}"
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
        progress.print("bench_ddp_links: needs root (it sets the hosts' link rate with netns_cluster.sh)")
        sys.exit(2)
    hosts = netns_hosts()
    if hosts < NPROC:
        if not args.up:
            progress.print(
                f"bench_ddp_links: the emulated hosts are not up ({hosts} of {NPROC}). Bring them up with\n"
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
        progress.print(f"bench_ddp_links: --rates={args.rates} must be distinct rates of 1 Mbit/s or more "
                       f"and --netns-steps={args.netns_steps} at least 1")  # fmt: skip
        sys.exit(2)
    phases = netns_phases(rates)
    progress.print(
        f"torch {torch.__version__}, {cores} cores, load average (1 min) {load_at_start:.2f}; "
        f"{NPROC} hosts x 1 process x {threads} thread(s), model={args.model}, "
        f"phases (Mbit/s, 0 = unlimited): {', '.join(map(str, phases))}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_ddp_links_") as tmp:
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
        sys.exit(f"bench_ddp_links: check(s) failed: {', '.join(failed)}")


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
    parser.add_argument("--model", default="small", help="model config (default: small)")
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch")
    parser.add_argument("--rates", default="100,300,1000", help="link rates, Mbit/s, comma-separated")
    parser.add_argument("--netns-steps", type=int, default=3, help="timed steps of each variant per phase")
    parser.add_argument("--port", type=int, default=29470, help="rendezvous port on host0")
    parser.add_argument("--up", action="store_true", help="bring the emulated hosts up if they are not")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--netns-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--phases", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    cli_args = parse_args()
    if cli_args.netns_worker:
        netns_worker(cli_args)
    else:
        netns_main(cli_args)
