"""Measure the article's network claims on the emulated hosts of scripts/cluster/netns_cluster.sh.

    sudo .venv/bin/python scripts/netns_claims.py          # everything as in docs/ablation/netns/, ~25 min on 2 cores
    sudo .venv/bin/python scripts/netns_claims.py --parts a --reps 1 --rates 0,1000,300 --contended 300
    sudo .venv/bin/python scripts/netns_claims.py --parts b --seeds 0,1,2
    sudo .venv/bin/python scripts/netns_claims.py --append --parts a --reps 1 --rates 100 --contended ""   # add a condition

(a) delayed_sync, "fewer stalls from bandwidth contention". `model=small` DDP on 2 hosts x
    1 process (one thread each), every gradient byte over the hosts' veth link, with and
    without `+trick=delayed_sync` (default parameters: rank 1 sleeps uniform(0, 0.5) s
    before each step's first bucket, rank 0 is exempt), at each link rate of `--rates`
    (Mbit/s, `LINK_MBIT=R netns_cluster.sh up`, tc tbf on each host's eth0; 0 = unlimited),
    and at each rate of `--contended` with competing traffic: a bulk TCP transfer from
    host 1 to host 0 (this file's `_source` / `_sink`), started 2 s before training and
    stopped when it ends, which also stops by itself after `--contention-max-s` seconds or
    `--contention-max-mb` MB, whichever comes first. It shares host 1's egress (its tbf)
    with the gradients host 1 sends. Every step is logged (`train.log_every=1`); the first
    `--skip` steps are start-up and left out; the figures are the steady-state tokens/s
    (tokens over the time of the kept steps), step time p50 / p95 / max, and the ratio
    delayed_sync / baseline per condition. comm share = 1 - baseline step at unlimited /
    baseline step at the rate. Rank 1's sleeps are recomputed from the trick's seeded
    generator (rank 0, which writes the metrics, is exempt and logs 0).

(b) async_smoothed_loss, "40% better gradient consistency". `train.log_grad_consistency=true`
    logs, every step, the mean over ranks of cos(rank's own gradient, all-reduced mean).
    2 processes of plain `torchrun --standalone --nproc_per_node=2` on this machine (the
    link plays no part in it), with and without `+trick=async_smoothed_loss`, per seed.

Raw results go to `--out` (docs/ablation/netns/ by default): runs_a.json / runs_b.json
(one record per run, with the per-step metrics), claims_a.csv / claims_b.csv (the
tables), env.json (machine, CPU flags, torch), and tables.md. Every run's folder (Hydra
output and the hosts' logs) is under `--work`. Needs root and the hosts up
(`LINK_MBIT=0 scripts/cluster/netns_cluster.sh up`, or `--up`); the link is set back to
unlimited at the end, also on failure. Run it while nothing else uses the hosts or the cores.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "scripts" / "cluster" / "netns_cluster.sh"
RUN_TIMEOUT_S = 420
SINK_PORT = 29399

COMMON = [
    "model=small", "train.log_every=1", "train.eval_every=100000", "sample.max_new_tokens=0",
    "ckpt.every=0", "progress=plain",
]  # fmt: skip


def now() -> str:
    return datetime.now(timezone.utc).strftime("%H:%M:%S")


def say(msg: str) -> None:
    print(f"[{now()}] {msg}", flush=True)


# ---------------------------------------------------------------- contention: a bounded bulk transfer


def sink(port: int, max_s: float, stop: Path, out: Path) -> None:
    """Receive one connection's bytes and drop them; stop at EOF, after max_s, or when `stop` exists."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    srv.settimeout(max_s)
    started = time.monotonic()
    conn, _ = srv.accept()
    conn.settimeout(1.0)
    buf = bytearray(4 << 20)
    got, first = 0, None
    while time.monotonic() - started < max_s and not stop.exists():
        try:
            n = conn.recv_into(buf)
        except socket.timeout:
            continue
        if n == 0:
            break
        first = first or time.monotonic()
        got += n
    conn.close()
    dur = time.monotonic() - (first or started)
    out.write_text(json.dumps({"bytes": got, "seconds": dur, "mbit_s": got * 8 / dur / 1e6 if dur else 0,
                               "cpu_s": time.process_time()}))  # fmt: skip


def source(host: str, port: int, max_s: float, max_mb: float, stop: Path, out: Path) -> None:
    """Send zeros to host:port as fast as TCP allows until max_mb MB, max_s seconds, or `stop` exists."""
    started = time.monotonic()
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=2)
            break
        except OSError:
            if time.monotonic() - started > 20:
                raise
            time.sleep(0.1)
    chunk = bytes(1 << 20)
    sent, t0 = 0, time.monotonic()
    try:
        while sent < max_mb * 1e6 and time.monotonic() - t0 < max_s and not stop.exists():
            conn.sendall(chunk)
            sent += len(chunk)
    except (ConnectionResetError, BrokenPipeError):  # the sink saw the stop file first
        pass
    conn.close()
    dur = time.monotonic() - t0
    out.write_text(json.dumps({"bytes": sent, "seconds": dur, "mbit_s": sent * 8 / dur / 1e6,
                               "cpu_s": time.process_time()}))  # fmt: skip


# ---------------------------------------------------------------- the hosts


def cluster(*args: str, mbit: int | None = None) -> str:
    env = {**os.environ, **({"LINK_MBIT": str(mbit)} if mbit is not None else {})}
    done = subprocess.run([str(CLUSTER), *args], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"netns_cluster.sh {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def set_link(mbit: int) -> str:
    cluster("up", mbit=mbit)
    status = cluster("status")
    for line in status.splitlines():
        has_tbf = f"rate {mbit}Mbit" in line or (mbit >= 1000 and f"rate {mbit // 1000}Gbit" in line)
        if (mbit == 0 and "tbf" in line) or (mbit and not has_tbf):
            raise RuntimeError(f"link not at {mbit} Mbit/s: {status}")
    return status


def tx_bytes(host: int) -> int:
    out = subprocess.run(["ip", "netns", "exec", f"ciuic-host{host}", "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def kill_group(p: subprocess.Popen) -> None:
    """Stop a worker started in its own session, and whatever it started: SIGTERM, then SIGKILL."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


# ---------------------------------------------------------------- one run


def read_metrics(run_dir: Path) -> tuple[list[dict], dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()], json.loads((run_dir / "summary.json").read_text())


def steady(records: list[dict], skip: int, tokens_per_step: int) -> dict:
    """Steady-state figures over the steps after `skip` (each record is one step, log_every=1)."""
    kept = [r for r in records if r["step"] > skip]
    times = [tokens_per_step / r["tokens_per_s"] for r in kept]  # seconds of each kept step
    qs = statistics.quantiles(times, n=20, method="inclusive") if len(times) >= 2 else times * 19
    return {"steps": len(kept), "tokens_per_s": tokens_per_step * len(kept) / sum(times),
            "step_s_mean": sum(times) / len(times), "step_s_p50": statistics.median(times),
            "step_s_p95": qs[18], "step_s_max": max(times), "step_s": times}  # fmt: skip


def rank1_sleeps(seed: int, steps: int, max_delay_s: float = 0.5) -> list[float]:
    """delayed_sync's draws on rank 1 (per=step: one per step), from its seeded generator."""
    from ciuic_train.tricks.base import derived_seed

    rng = random.Random(derived_seed(seed, "delayed_sync", 1))
    return [rng.uniform(0.0, max_delay_s) for _ in range(steps)]


def two_host_run(args, work: Path, name: str, overrides: list[str], port: int, contention: bool) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, bulk = [], []
    stop = run_dir / "stop-contention"
    tx0 = [tx_bytes(h) for h in (0, 1)]
    load = Path("/proc/loadavg").read_text().split()[0]
    cpu0, t0 = busy_cpu_s(), time.monotonic()
    try:
        if contention:
            me = [sys.executable, str(Path(__file__).resolve())]
            for h, cmd in ((0, ["_sink", str(SINK_PORT), str(args.contention_max_s), str(stop), str(run_dir / "sink.json")]),
                           (1, ["_source", "host0", str(SINK_PORT), str(args.contention_max_s), str(args.contention_max_mb),
                                str(stop), str(run_dir / "source.json")])):  # fmt: skip
                bulk.append(subprocess.Popen([str(CLUSTER), "exec", str(h), *me, *cmd], cwd=work, start_new_session=True,
                                             stdout=open(run_dir / f"bulk{h}.log", "w"), stderr=subprocess.STDOUT))  # fmt: skip
                time.sleep(0.3)
            time.sleep(2.0)
        for h in (0, 1):
            cmd = [str(CLUSTER), "exec", str(h), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=host0:{port}", f"--rdzv-id={name}-{os.getpid()}",
                   "-m", "ciuic_train", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, cwd=work, env=env, start_new_session=True,
                                          stdout=open(run_dir / f"host{h}.log", "w"), stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: still running after {RUN_TIMEOUT_S} s")
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        stop.write_text("")
        for p in bulk:
            p.wait(timeout=30)
    finally:
        stop.write_text("")
        for p in procs + bulk:
            kill_group(p)
    wall, cpu = time.monotonic() - t0, busy_cpu_s() - cpu0
    bad = [h for h, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = "\n".join((run_dir / f"host{bad[0]}.log").read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{name}: host{bad[0]} exited with {procs[bad[0]].returncode}\n{tail}")
    out = {"tx_mb": [(tx_bytes(h) - tx0[h]) / 1e6 for h in (0, 1)], "wall_s": wall, "loadavg_before": load,
           "cores_busy": cpu / wall, "run_dir": str(run_dir)}  # fmt: skip
    if contention:
        out["contention"] = {k: json.loads((run_dir / f"{k}.json").read_text()) for k in ("source", "sink")}
    return out


# ---------------------------------------------------------------- part (a): delayed_sync on a slow / contended link


def part_a(args, work: Path, results: list[dict], save) -> None:
    conditions = [(r, False) for r in args.rates] + [(r, True) for r in args.contended]
    port = args.port
    tokens_per_step = 8 * 256 * 2  # batch 8 x seq 256 per rank x 2 ranks (config defaults)
    for mbit, contended in conditions:
        if mbit == 0 and contended:
            raise SystemExit("--contended 0: an unlimited link is not contended (the bulk flow would take a core)")
        set_link(mbit)
        for variant in ("delayed_sync", "baseline") if args.ds_first else ("baseline", "delayed_sync"):
            if args.deadline and time.time() > args.deadline:
                say(f"deadline reached: skipping {mbit} Mbit/s contended={contended} {variant}")
                continue
            name = f"a-{mbit or 'unl'}{'-cont' if contended else ''}-{variant}{f'-rep{args.rep}' if args.rep else ''}"
            say(f"{name}: link {mbit or 'unlimited'} Mbit/s, contention {contended} ...")
            overrides = [f"train.max_steps={args.steps}", f"seed={args.seed}"]
            if variant == "delayed_sync":
                overrides.append("+trick=delayed_sync")
            port += 1
            info = two_host_run(args, work, name, overrides, port, contended)
            records, summary = read_metrics(Path(info["run_dir"]))
            st = steady(records, args.skip, tokens_per_step)
            rec = {"name": name, "link_mbit": mbit, "contended": contended, "variant": variant, "rep": args.rep,
                   "overrides": overrides, **info, "steady": st, "summary_tokens_per_s": summary["tokens_per_s"],
                   "records": records}  # fmt: skip
            if variant == "delayed_sync":
                sleeps = rank1_sleeps(args.seed, args.steps)[args.skip:]
                rec["rank1_sleep_s_mean"] = sum(sleeps) / len(sleeps)
            results.append(rec)
            save()
            c = info.get("contention", {}).get("source")
            say(f"  {st['tokens_per_s']:.0f} tok/s, step p50 {st['step_s_p50']:.3f} s p95 {st['step_s_p95']:.3f} s"
                + (f"; bulk flow {c['mbit_s']:.0f} Mbit/s for {c['seconds']:.0f} s" if c else ""))


def pooled(runs: list[dict], tokens_per_step: int = 8 * 256 * 2) -> dict:
    """The kept steps of every repeat of one (rate, contention, variant), pooled."""
    times = [t for r in runs for t in r["steady"]["step_s"]]
    return {"runs": len(runs), "steps": len(times), "tokens_per_s": tokens_per_step * len(times) / sum(times),
            "step_s_mean": sum(times) / len(times), "step_s_p50": statistics.median(times),
            "step_s_p95": statistics.quantiles(times, n=20, method="inclusive")[18], "step_s_max": max(times)}  # fmt: skip


def table_a(results: list[dict]) -> list[dict]:
    by: dict[tuple, list[dict]] = {}
    for r in results:
        by.setdefault((r["link_mbit"], r["contended"], r["variant"]), []).append(r)
    unl = pooled(by[(0, False, "baseline")]) if (0, False, "baseline") in by else None
    rows = []
    for (mbit, contended, variant), runs in by.items():
        if variant != "baseline":
            continue
        b = pooled(runs)
        row = {"link_mbit": mbit or "unlimited", "contended": contended, "runs": b["runs"], "steps": b["steps"],
               "base_tok_s": round(b["tokens_per_s"]), "base_step_p50_s": round(b["step_s_p50"], 3),
               "base_step_p95_s": round(b["step_s_p95"], 3), "base_step_max_s": round(b["step_s_max"], 3),
               "comm_share": round(1 - unl["step_s_mean"] / b["step_s_mean"], 3) if unl else None,
               "bulk_mbit_s_base": round(statistics.mean(r["contention"]["source"]["mbit_s"] for r in runs)) if contended else None}  # fmt: skip
        ds_runs = by.get((mbit, contended, "delayed_sync"))
        if ds_runs:
            d = pooled(ds_runs)
            per_rep = {r.get("rep", 0): r["steady"]["tokens_per_s"] for r in runs}
            ratios = [r["steady"]["tokens_per_s"] / per_rep[r.get("rep", 0)] for r in ds_runs if r.get("rep", 0) in per_rep]
            row.update({"ds_runs": d["runs"], "ds_tok_s": round(d["tokens_per_s"]), "ds_step_p50_s": round(d["step_s_p50"], 3),
                        "ds_step_p95_s": round(d["step_s_p95"], 3), "ds_step_max_s": round(d["step_s_max"], 3),
                        "ratio_ds_over_base_tok_s": round(d["tokens_per_s"] / b["tokens_per_s"], 3),
                        "ratio_per_repeat": "/".join(f"{x:.3f}" for x in ratios),
                        "added_s_per_step": round(d["step_s_mean"] - b["step_s_mean"], 3),
                        "rank1_sleep_s_mean": round(statistics.mean(r["rank1_sleep_s_mean"] for r in ds_runs), 3),
                        "bulk_mbit_s_ds": round(statistics.mean(r["contention"]["source"]["mbit_s"] for r in ds_runs)) if contended else None})  # fmt: skip
        rows.append(row)
    return rows


# ---------------------------------------------------------------- part (b): async_smoothed_loss and gradient consistency


def part_b(args, work: Path, results: list[dict], save) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = args.port + 50
    for seed in args.seeds:
        for variant in ("baseline", "async_smoothed_loss"):
            if args.deadline and time.time() > args.deadline:
                say(f"deadline reached: skipping seed {seed} {variant}")
                continue
            name = f"b-seed{seed}-{variant}"
            run_dir = work / name
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            overrides = [f"train.max_steps={args.gc_steps}", f"seed={seed}", "train.log_grad_consistency=true"]
            if variant != "baseline":
                overrides.append("+trick=async_smoothed_loss")
            port += 1
            say(f"{name} ...")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   f"--master-port={port}", "-m", "ciuic_train", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]  # fmt: skip
            with open(run_dir / "torchrun.log", "w") as log:
                done = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{name} exited with {done.returncode}; see {run_dir}/torchrun.log")
            records, summary = read_metrics(run_dir)
            gc = [r["grad_consistency"] for r in records if "grad_consistency" in r]
            results.append({"name": name, "seed": seed, "variant": variant, "overrides": overrides,
                            "grad_consistency": gc, "mean": sum(gc) / len(gc),
                            "mean_after_start_step": (sum(gc[10:]) / len(gc[10:])) if len(gc) > 10 else None,
                            "loss": [r["loss"] for r in records], "param_checksum": summary["param_checksum"],
                            "records": records})  # fmt: skip
            save()
            say(f"  mean grad_consistency {results[-1]['mean']:.4f} over {len(gc)} steps")


def table_b(results: list[dict]) -> list[dict]:
    rows = []
    by = {(r["seed"], r["variant"]): r for r in results}
    for (seed, variant), r in by.items():
        if variant != "baseline":
            continue
        a = by.get((seed, "async_smoothed_loss"))
        row = {"seed": seed, "steps": len(r["grad_consistency"]), "base_mean": round(r["mean"], 4),
               "base_min": round(min(r["grad_consistency"]), 4), "base_max": round(max(r["grad_consistency"]), 4)}  # fmt: skip
        if a:
            n = min(len(a["grad_consistency"]), len(r["grad_consistency"]))
            diffs = [abs(x - y) for x, y in zip(a["grad_consistency"][:n], r["grad_consistency"][:n])]
            row.update({"asl_mean": round(a["mean"], 4), "ratio_asl_over_base": round(a["mean"] / r["mean"], 4),
                        "max_abs_diff_per_step": max(diffs), "same_final_weights": a["param_checksum"] == r["param_checksum"]})  # fmt: skip
        rows.append(row)
    return rows


# ---------------------------------------------------------------- main


def env_info() -> dict:
    import torch

    flags = sorted(set(re.findall(r"avx512[a-z]*|avx2", subprocess.run(["lscpu"], capture_output=True, text=True).stdout)))
    model = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if ln.startswith("Model name")), "?")  # fmt: skip
    return {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": model, "cores": os.cpu_count(),
            "cpu_flags": flags, "torch": torch.__version__, "python": sys.version.split()[0],
            "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3], "argv": sys.argv}  # fmt: skip


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def md_table(rows: list[dict]) -> str:
    if not rows:
        return "(none)\n"
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_sink":
        return sink(int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
    if len(sys.argv) > 1 and sys.argv[1] == "_source":
        return source(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), Path(sys.argv[6]), Path(sys.argv[7]))
    ints = lambda s: [int(x) for x in s.split(",") if x != ""]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b", help="a (delayed_sync), b (async_smoothed_loss), or both")
    p.add_argument("--rates", type=ints, default=[0, 1000, 300, 100], help="uncontended link rates, Mbit/s (0: unlimited)")
    p.add_argument("--contended", type=ints, default=[1000, 300], help="rates at which a bulk flow competes")
    p.add_argument("--steps", type=int, default=20, help="steps per run of (a)")
    p.add_argument("--skip", type=int, default=5, help="start-up steps left out of (a)'s figures")
    p.add_argument("--seed", type=int, default=0, help="seed of (a)")
    p.add_argument("--rep", type=int, default=0, help="repeat number of (a)'s runs (with --append: pooled with the others)")
    p.add_argument("--reps", type=int, default=2, help="repeats of (a), numbered from --rep, pooled in the tables")
    p.add_argument("--ds-first", action="store_true", help="run delayed_sync before the baseline in each condition")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2], help="seeds of (b)")
    p.add_argument("--gc-steps", type=int, default=20, help="steps per run of (b)")
    p.add_argument("--contention-max-s", type=float, default=300)
    p.add_argument("--contention-max-mb", type=float, default=20000)
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--deadline", default="", help="UTC HH:MM: start no run after it")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "ablation" / "netns")
    p.add_argument("--work", type=Path, default=Path("/tmp/netns_claims"))
    p.add_argument("--append", action="store_true", help="add to the results already in --out (other conditions)")
    p.add_argument("--up", action="store_true", help="bring the hosts up (unlimited) if they are not")
    args = p.parse_args()
    if args.deadline:
        h, m = map(int, args.deadline.split(":"))
        d = datetime.now(timezone.utc).replace(hour=h, minute=m, second=0, microsecond=0)
        args.deadline = d.timestamp()
    parts = set(args.parts.split(","))
    if os.geteuid() != 0 and "a" in parts:
        raise SystemExit("netns_claims: part a needs root (it sets the hosts' link rate)")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if "a" in parts:
        if args.up:
            cluster("up", mbit=0)
        elif subprocess.run([str(CLUSTER), "status"], capture_output=True).returncode != 0:
            raise SystemExit("netns_claims: the hosts are not up: LINK_MBIT=0 scripts/cluster/netns_cluster.sh up (or --up)")

    def load(name: str) -> list[dict]:
        path = args.out / name
        return json.loads(path.read_text()) if args.append and path.exists() else []

    env_path = args.out / "env.json"
    envs = json.loads(env_path.read_text()) if args.append and env_path.exists() else []
    envs.append(env_info())
    env_path.write_text(json.dumps(envs, indent=1))
    res_a, res_b = load("runs_a.json"), load("runs_b.json")

    def save() -> None:
        for name, res, table in (("a", res_a, table_a), ("b", res_b, table_b)):
            if res:
                (args.out / f"runs_{name}.json").write_text(json.dumps(res, indent=1))
                write_csv(args.out / f"claims_{name}.csv", table(res))
        (args.out / "tables.md").write_text(
            "## (a) delayed_sync\n\n" + md_table(table_a(res_a)) + "\n## (b) async_smoothed_loss\n\n" + md_table(table_b(res_b)))

    try:
        if "a" in parts:
            for i in range(args.reps):  # repeats alternate the order within each condition
                rep_args = argparse.Namespace(**{**vars(args), "rep": args.rep + i, "port": args.port + 20 * i,
                                                 "ds_first": args.ds_first != (i % 2 == 1)})  # fmt: skip
                part_a(rep_args, args.work, res_a, save)
        if "b" in parts:
            part_b(args, args.work, res_b, save)
    finally:
        if "a" in parts:
            set_link(0)
        save()
    say(f"done; tables in {args.out / 'tables.md'}")
    print((args.out / "tables.md").read_text())


if __name__ == "__main__":
    main()
