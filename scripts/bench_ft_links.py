"""DDP against torchft DiLoCo replica groups across a rate-limited link: speed and loss.

Two emulated hosts (scripts/cluster/netns_cluster.sh: host0 = 10.77.0.1, host1 = 10.77.0.2,
each a network namespace, one tc tbf-limited link between them) train `model=small` with
2 ranks, one per host, one thread each (OMP_NUM_THREADS=1), for each seed of `--seeds`
(default 0,1,2), in each layout:

    ddp            plain DDP: torchrun --nnodes=2 --nproc_per_node=1 on each host, c10d
                   rendezvous on host0
    ddp_bf16       the same, dist.grad_compression=bf16
    ddp_powersgd   the same, dist.grad_compression=powersgd (rank dist.powersgd_rank=1,
                   after dist.powersgd_start_step=10 plain steps)
    diloco_8       two torchft replica groups of 1 rank, one per host (ft.enabled=true
                   ft.groups=2 ft.group=G ft.sync=diloco ft.sync_every=8)
    diloco_32      the same, ft.sync_every=32
    streaming_32   Streaming DiLoCo: ft.sync_every=32 ft.fragments=4 ft.sync_delay=2
    diloco_8_avg, diloco_32_avg (optional) diloco_8 and diloco_32 with ft.outer_lr=1
                   ft.outer_momentum=0: the groups' weights plainly averaged at each sync
    ddp_delayed_sync (optional) ddp with +trick=delayed_sync

at each link rate of `--rates` (Mbit/s, `LINK_MBIT=R netns_cluster.sh up`; 0 = unlimited).
Every run trains `--steps` steps (train.eval_every = steps: val_loss once, at the end, on the
fixed validation windows; sample.max_new_tokens=0, ckpt.every=0, one shared data.cache_dir so
the corpus is tokenized once, before the first measured run).

For the ft layouts this script plays the CLI launcher's part by hand, inside host0 (the
machine's own namespace cannot reach 10.77.0.x): one helper process holds a torchft
lighthouse (torchft's LighthouseServer, as `ciuic-train ... ft.enabled=true` starts it)
and a fresh TCPStore named by CIUIC_TRAIN_FT_START_STORE, where both groups' rank 0 meet
before their first step (so neither trains its first steps alone). Each group is its own
torchrun (--nnodes=1, its c10d store on its own host, so that the other group reaches the
torchft store through hostN), with its own hydra.run.dir (RUN/g0, RUN/g1) and a shared
ft.checkpoints (RUN/g0).

Figures (from each run's summary.json): tokens/s is GLOBAL: DDP's rank-0 summary already
counts both ranks' tokens; under ft each group's summary counts only its own, so the global
figure is the SUM of both groups' tokens_per_s. final_val_loss is rank 0's (ddp) or group
0's (ft; both groups end on the same weights, group 1's is kept too). wall_s, syncs, sync_s
are the summaries' (ft: both groups'). The table gives, per layout and rate, the global
tokens/s, its ratio to the same layout on the unlimited link, its ratio to ddp on the same
link, val_loss, and val_loss against ddp's in %: each the mean over the seeds run (a ratio
taken seed by seed, over the seeds both sides ran), with the half-width of its 95%
Student-t interval (ciuic_train/tools/report_stats.py, the ablation report's) where
there are two seeds or more.

Run it as root (network namespaces, tc), with nothing else busy on the cores:

    sudo .venv/bin/python scripts/bench_ft_links.py                        # rates 0,1000,300,100, seeds 0,1,2
    sudo .venv/bin/python scripts/bench_ft_links.py --rates 0,300 --steps 64 --layouts ddp,diloco_32
    sudo .venv/bin/python scripts/bench_ft_links.py --dry-run              # 8 steps, ft.sync_every=4

Raw results: `--out` (docs/bench/bench_ft_links.json; a dry run: /tmp/bench_ft_links_dry.json),
rewritten after every run. Runs' folders and logs: `--work` (/tmp/bench_ft_links). The hosts
are brought up if needed and brought down at the end (`--keep-up` leaves them up, unlimited).
`--budget-min` starts no run after that many minutes; the remaining ones are listed as skipped.
`--append` keeps the runs already in `--out` and runs only the missing or failed
(layout, rate, seed) triples (`--redo ddp@0,...` runs a pair again for every seed asked;
the table takes each triple's latest successful record).
DDP runs get dist.timeout_s=60, so that a collective that hangs fails in a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from netns_claims import cluster, set_link  # the emulated hosts and their link rate

from ciuic_train.tools.report_stats import mean_ci

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "scripts" / "cluster" / "netns_cluster.sh"
RUN_TIMEOUT_S = 600
HOSTS = 2
DDP_TIMEOUT_S = 60

# name: (kind, overrides)
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    "ddp": ("ddp", []),
    "ddp_bf16": ("ddp", ["dist.grad_compression=bf16"]),
    "ddp_powersgd": ("ddp", ["dist.grad_compression=powersgd"]),
    "diloco_8": ("ft", ["ft.sync=diloco", "ft.sync_every=8"]),
    "diloco_32": ("ft", ["ft.sync=diloco", "ft.sync_every=32"]),
    "streaming_32": ("ft", ["ft.sync=diloco", "ft.sync_every=32", "ft.fragments=4", "ft.sync_delay=2"]),
    "ddp_delayed_sync": ("ddp", ["+trick=delayed_sync"]),
}
DEFAULT_LAYOUTS = "ddp,ddp_bf16,ddp_powersgd,diloco_8,diloco_32,streaming_32"
# --dry-run: the same mechanics in 8 steps (a sync every 4; streaming: 2 fragments, delay 1).
DRY_LAYOUTS: dict[str, list[str]] = {
    "diloco_8": ["ft.sync=diloco", "ft.sync_every=4"],
    "diloco_32": ["ft.sync=diloco", "ft.sync_every=4"],
    "streaming_32": ["ft.sync=diloco", "ft.sync_every=4", "ft.fragments=2", "ft.sync_delay=1"],
}
# diloco_8_avg, diloco_32_avg: their DiLoCo layout with the outer optimizer set to plain averaging.
PLAIN_AVERAGING = ["ft.outer_lr=1", "ft.outer_momentum=0"]
for _base in ("diloco_8", "diloco_32"):
    LAYOUTS[f"{_base}_avg"] = ("ft", [*LAYOUTS[_base][1], *PLAIN_AVERAGING])
    DRY_LAYOUTS[f"{_base}_avg"] = [*DRY_LAYOUTS[_base], *PLAIN_AVERAGING]


def say(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc):%H:%M:%S}] {msg}", flush=True)


# ---------------------------------------------------------------- inside host0: lighthouse and start store


def serve(lighthouse_port: int, store_port: int, ready: Path) -> None:
    """Hold a torchft lighthouse and a TCPStore (the groups' start barrier) until SIGTERM."""
    os.environ.setdefault("RUST_LOG", "warn")
    from datetime import timedelta

    import torch.distributed as dist
    from torchft._torchft import LighthouseServer

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    lighthouse = LighthouseServer(bind=f"[::]:{lighthouse_port}", min_replicas=1, join_timeout_ms=1000,
                                  quorum_tick_ms=100, heartbeat_timeout_ms=5000)  # fmt: skip
    store = dist.TCPStore("0.0.0.0", store_port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))  # fmt: skip
    ready.write_text(json.dumps({"lighthouse": lighthouse.address(), "store_port": store.port}))
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        lighthouse.shutdown()


# ---------------------------------------------------------------- the hosts




def host_pids(host: int) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", f"ciuic-host{host}"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def tx_bytes(host: int) -> int:
    out = subprocess.run(["ip", "netns", "exec", f"ciuic-host{host}", "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout)


def kill_group(p: subprocess.Popen) -> None:
    """Stop a process started in its own session, and whatever it started: SIGTERM, then SIGKILL."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        except ProcessLookupError:
            pass


def sweep_hosts() -> list[int]:
    """Whatever is still running in a host's namespace after a run (all of it ours): killed."""
    left = [pid for h in range(HOSTS) for pid in host_pids(h)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return {"cpu_model": model, "avx512f": "avx512f" in flags, "cores": os.cpu_count()}


# ---------------------------------------------------------------- one run


def wait_all(procs: list[subprocess.Popen], name: str, timeout_s: float) -> None:
    """Until every process has exited; the first failure, or the timeout, ends the wait."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: still running after {timeout_s:.0f} s")
        time.sleep(0.2)


def cause(text: str) -> str:
    """The line of a failed run's logs that says why (gloo's abort, ciuic-train's one-line error)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for marker in ("what():", "ciuic-train: error", "Error:", "error:"):
        hit = next((ln for ln in lines if marker in ln), None)
        if hit:
            return hit
    return lines[-1] if lines else "?"


def tails(run_dir: Path, n: int = 40) -> str:
    return "\n".join(f"--- host{h}.log:\n{tail(run_dir / f'host{h}.log', n)}" for h in range(HOSTS))


def tail(path: Path, n: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def common(args, seed: int = 0) -> list[str]:
    return [
        "model=small", f"seed={seed}", f"train.max_steps={args.steps}", f"train.eval_every={args.steps}",
        "sample.max_new_tokens=0", "progress=plain", "ckpt.every=0", f"data.cache_dir={args.work / 'cache'}",
    ]  # fmt: skip


def run_ddp(args, run_dir: Path, overrides: list[str], port: int, seed: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A collective that hangs (a rank gone) fails after DDP_TIMEOUT_S, not the default 300 s;
    # every all-reduce of these runs takes a few seconds at most, even at 100 Mbit/s.
    overrides = [*overrides, f"dist.timeout_s={DDP_TIMEOUT_S}"]
    procs: list[subprocess.Popen] = []
    try:
        for h in range(HOSTS):
            cmd = [str(CLUSTER), "exec", str(h), sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={HOSTS}", "--nproc_per_node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=host0:{port}", f"--rdzv-id={run_dir.name}-{os.getpid()}",
                   "-m", "ciuic_train", *common(args, seed), *overrides, f"hydra.run.dir={run_dir}"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, cwd=args.work, env=env, start_new_session=True,
                                          stdout=open(run_dir / f"host{h}.log", "w"), stderr=subprocess.STDOUT))  # fmt: skip
        wait_all(procs, run_dir.name, RUN_TIMEOUT_S)
    finally:
        for p in procs:
            kill_group(p)
    bad = [h for h, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"host{bad[0]} exited with {procs[bad[0]].returncode}:\n{tails(run_dir)}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "tokens_per_s": summary["tokens_per_s"], "final_val_loss": summary.get("final_val_loss"),
        "final_train_loss": summary.get("final_train_loss"), "wall_s": summary.get("wall_s"),
        "syncs": None, "sync_s": None, "steps": summary.get("steps"), "world_size": summary.get("world_size"),
    }  # fmt: skip


def run_ft(args, run_dir: Path, overrides: list[str], port: int, seed: int) -> dict:
    """Both groups, a lighthouse and the start store (fresh: its count starts at 0)."""
    lighthouse_port, store_port = port, port + 1
    ready = run_dir / "serve.ready"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn",
           "CIUIC_TRAIN_FT_START_STORE": f"host0:{store_port}"}  # fmt: skip
    helper = subprocess.Popen(
        [str(CLUSTER), "exec", "0", sys.executable, str(Path(__file__).resolve()), "--_serve",
         str(lighthouse_port), str(store_port), str(ready)],
        cwd=args.work, env=env, start_new_session=True, stdout=open(run_dir / "serve.log", "w"),
        stderr=subprocess.STDOUT)  # fmt: skip
    procs: list[subprocess.Popen] = []
    folders = [run_dir / f"g{g}" for g in range(HOSTS)]
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if helper.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse/store helper on host0 did not start:\n{tail(run_dir / 'serve.log')}")
            time.sleep(0.1)
        for g, folder in enumerate(folders):
            folder.mkdir()
            cmd = [str(CLUSTER), "exec", str(g), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes=1", "--nproc_per_node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=host{g}:{port + 2 + g}", f"--rdzv-id={run_dir.name}-g{g}-{os.getpid()}",
                   "-m", "ciuic_train", *common(args, seed), *overrides,
                   "ft.enabled=true", f"ft.groups={HOSTS}", f"ft.group={g}",
                   f"ft.lighthouse=http://host0:{lighthouse_port}", f"ft.checkpoints={folders[0]}",
                   f"hydra.run.dir={folder}"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, cwd=args.work, env=env, start_new_session=True,
                                          stdout=open(run_dir / f"host{g}.log", "w"), stderr=subprocess.STDOUT))  # fmt: skip
        wait_all(procs, run_dir.name, RUN_TIMEOUT_S)
    finally:
        for p in procs:  # one group failed: the other, training alone, is stopped too
            kill_group(p)
        kill_group(helper)
    bad = [g for g, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"group {bad[0]} (host{bad[0]}) exited with {procs[bad[0]].returncode}:\n"
                           f"{tails(run_dir)}")  # fmt: skip
    sums = [json.loads((folder / "summary.json").read_text()) for folder in folders]
    return {
        "tokens_per_s": sum(s["tokens_per_s"] for s in sums),  # global: the groups' own rates, summed
        "tokens_per_s_groups": [s["tokens_per_s"] for s in sums],
        "final_val_loss": sums[0].get("final_val_loss"),
        "final_val_loss_groups": [s.get("final_val_loss") for s in sums],
        "final_train_loss": sums[0].get("final_train_loss"),
        "wall_s": max(s.get("wall_s") or 0 for s in sums), "wall_s_groups": [s.get("wall_s") for s in sums],
        "syncs": sums[0].get("syncs"), "syncs_groups": [s.get("syncs") for s in sums],
        "sync_s": sums[0].get("sync_s"), "sync_s_groups": [s.get("sync_s") for s in sums],
        "steps": [s.get("steps") for s in sums], "retried_syncs": [s.get("retried_syncs") for s in sums],
        "param_checksums": [s.get("param_checksum") for s in sums],
    }  # fmt: skip


def one_run(args, layout: str, mbit: int, seed: int, port: int) -> dict:
    kind, overrides = LAYOUTS[layout]
    if args.dry_run and layout in DRY_LAYOUTS:
        overrides = DRY_LAYOUTS[layout]
    run_dir = args.work / f"{layout}-{mbit or 'unl'}-s{seed}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    tx0 = [tx_bytes(h) for h in range(HOSTS)]
    t0 = time.monotonic()
    record = {"layout": layout, "kind": kind, "link_mbit": mbit, "seed": seed, "overrides": overrides,
              "run_dir": str(run_dir)}  # fmt: skip
    try:
        figures = (run_ddp if kind == "ddp" else run_ft)(args, run_dir, overrides, port, seed)
        record.update(ok=True, **figures)
    except Exception as error:  # noqa: BLE001 - one failed layout must not stop the others
        record.update(ok=False, error=str(error)[-6000:])
    record["driver_wall_s"] = time.monotonic() - t0
    record["tx_mb"] = [(tx_bytes(h) - tx0[h]) / 1e6 for h in range(HOSTS)]
    left = sweep_hosts()
    if left:
        record["left_behind_killed"] = left
    record.update(cpu_info())
    return record


# ---------------------------------------------------------------- table


def latest(records: list[dict]) -> dict[tuple, dict]:
    """Each (layout, rate, seed)'s latest record, a successful one before a failed one."""
    by: dict[tuple, dict] = {}
    for r in records:
        key = (r["layout"], r["link_mbit"], r.get("seed", 0))  # records from before --seeds: seed 0
        if r.get("ok") or not by.get(key, {}).get("ok"):
            by[key] = r
    return by


def table(records: list[dict], layouts: list[str], rates: list[int]) -> list[dict]:
    """A row per (layout, rate): means over the seeds that succeeded, with their 95% CIs.
    Ratios are taken seed by seed, over the seeds both sides ran, then averaged, so that
    the machine's drift between sittings (`--append`) stays out of a ratio's mean. Runs
    skipped past --budget-min are neither results nor failures: left out."""
    by = latest([r for r in records if not r.get("skipped")])
    runs: dict[tuple, dict[int, dict]] = {}
    for (layout, mbit, seed), r in by.items():
        runs.setdefault((layout, mbit), {})[seed] = r

    def good(layout: str, mbit: int) -> dict[int, dict]:
        return {seed: r for seed, r in runs.get((layout, mbit), {}).items() if r.get("ok")}

    def paired(mine: dict[int, dict], theirs: dict[int, dict], key: str) -> tuple[float | None, float | None]:
        """Mean of mine/theirs - 1 over the seeds both have, and its CI half-width."""
        ratios = [mine[s][key] / theirs[s][key] - 1 for s in sorted(mine.keys() & theirs.keys())
                  if mine[s].get(key) is not None and theirs[s].get(key) is not None]
        return mean_ci(ratios) if ratios else (None, None)

    rows = []
    for layout in layouts:
        for mbit in rates:
            if (layout, mbit) not in runs:
                continue
            ok = good(layout, mbit)
            row = {"layout": layout, "link": f"{mbit} Mbit/s" if mbit else "unlimited", "ok": bool(ok),
                   "seeds": sorted(ok)}  # fmt: skip
            failed = [r for seed, r in sorted(runs[(layout, mbit)].items()) if not r.get("ok")]
            if failed:
                row["failed_seeds"] = [r.get("seed", 0) for r in failed]
                row["error"] = cause(failed[-1].get("error") or "?")[:160]
            if ok:
                last = ok[max(ok)]
                tok, tok_ci = mean_ci([r["tokens_per_s"] for r in ok.values()])
                losses = [r["final_val_loss"] for r in ok.values() if r.get("final_val_loss") is not None]
                loss, loss_ci = mean_ci(losses) if losses else (None, None)
                ddp = good("ddp", mbit)
                vs_unl, _ = paired(ok, good(layout, 0), "tokens_per_s")
                vs_ddp, _ = paired(ok, ddp, "tokens_per_s")
                loss_vs_ddp, loss_vs_ddp_ci = paired(ok, ddp, "final_val_loss")
                row.update(
                    tok_s=round(tok), tok_s_ci=round(tok_ci) if tok_ci is not None else None,
                    vs_unlimited=round(1 + vs_unl, 3) if vs_unl is not None else None,
                    vs_ddp=round(1 + vs_ddp, 3) if vs_ddp is not None else None,
                    val_loss=round(loss, 4) if loss is not None else None,
                    val_loss_ci=round(loss_ci, 4) if loss_ci is not None else None,
                    val_loss_vs_ddp_pct=round(100 * loss_vs_ddp, 1) if loss_vs_ddp is not None else None,
                    val_loss_vs_ddp_pct_ci=round(100 * loss_vs_ddp_ci, 1) if loss_vs_ddp_ci is not None else None,
                    syncs=last.get("syncs"), sync_s=round(last["sync_s"], 2) if last.get("sync_s") is not None else None,
                    wall_s=round(sum(r["driver_wall_s"] for r in ok.values()) / len(ok), 1),
                )  # fmt: skip
            rows.append(row)
    return rows


def with_ci(value, half_width) -> str:
    if value is None:
        return ""
    return f"{value} ± {half_width}" if half_width is not None else str(value)


def print_table(rows: list[dict]) -> None:
    head = ["layout", "link", "seeds", "global tok/s", "/unlimited", "/ddp same link", "val_loss", "vs ddp %",
            "syncs", "sync_s", "wall s"]  # fmt: skip
    cells = [[row["layout"], row["link"], ",".join(map(str, row["seeds"])),
              with_ci(row.get("tok_s"), row.get("tok_s_ci")),
              *("" if row.get(c) is None else str(row.get(c)) for c in ("vs_unlimited", "vs_ddp")),
              with_ci(row.get("val_loss"), row.get("val_loss_ci")),
              with_ci(row.get("val_loss_vs_ddp_pct"), row.get("val_loss_vs_ddp_pct_ci")),
              *("" if row.get(c) is None else str(row.get(c)) for c in ("syncs", "sync_s", "wall_s"))]
             for row in rows]  # fmt: skip
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row, c in zip(rows, cells):
        line = "  ".join(x.ljust(w) for x, w in zip(c, widths))
        print(line + (f"  FAILED seeds {row['failed_seeds']}: {row['error']}" if row.get("failed_seeds") else ""))
    print("global tok/s: ddp = rank 0's summary (both ranks' tokens); ft layouts = the SUM of both groups' "
          "tokens_per_s (each group's summary counts only its own). val_loss: rank 0 / group 0, at the last step. "
          "x ± h: the mean over the seeds and the half-width of its 95% t interval. /unlimited, /ddp and "
          "vs ddp %: seed by seed, over the seeds both ran, then averaged. "
          "sync_s: group 0's time standing still for exchanges. wall s: the driver's, start-up included.")


# ---------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_serve":
        return serve(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0,1000,300,100", help="link rates in Mbit/s, in the order run (0: unlimited)")
    p.add_argument("--steps", type=int, default=64, help="train.max_steps of every run (a multiple of 32)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated, of: {','.join(LAYOUTS)}")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default docs/bench/bench_ft_links.json)")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_ft_links"), help="runs' folders, logs, token cache")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every (layout, rate) runs each")
    p.add_argument("--port", type=int, default=29600, help="first port; every run takes 4 fresh ones")
    p.add_argument("--budget-min", type=float, default=0, help="start no run after this many minutes (0: no limit)")
    p.add_argument("--dry-run", action="store_true", help="8 steps, ft.sync_every=4: check the mechanics")
    p.add_argument("--keep-up", action="store_true", help="leave the hosts up (unlimited) at the end")
    p.add_argument("--append", action="store_true",
                   help="keep the runs already in --out and run only the (layout, rate) pairs without a successful one")
    p.add_argument("--redo", default="", help="with --append: LAYOUT@RATE,... to run again even if they succeeded "
                                              "(the table takes the latest)")
    args = p.parse_args()
    rates = [int(x) for x in args.rates.split(",") if x.strip()]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    if args.dry_run:
        args.steps = 8
    elif any(LAYOUTS[x][0] == "ft" for x in layouts) and args.steps % 32:
        p.error(f"--steps={args.steps}: use a multiple of 32 (ft.sync_every=32 layouts)")
    if args.out is None:
        args.out = Path("/tmp/bench_ft_links_dry.json") if args.dry_run else REPO / "docs" / "bench" / "bench_ft_links.json"
    if os.geteuid() != 0:
        raise SystemExit("bench_ft_links: needs root (network namespaces, tc); run it with sudo")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.now(timezone.utc), time.monotonic()
    env = {"date_utc": started.isoformat(timespec="seconds"), **cpu_info(), "argv": sys.argv,
           "python": sys.version.split()[0], "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]}  # fmt: skip
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    records: list[dict] = []
    sessions: list[dict] = []
    if args.append and args.out.exists():
        old = json.loads(args.out.read_text())
        records = [r for r in old.get("runs", []) if not r.get("skipped")]
        sessions = old.get("sessions") or [{**old.get("env", {}), "session_wall_s": old.get("total_wall_s", 0.0)}]
        rates = list(dict.fromkeys([*old.get("rates_mbit", []), *rates]))
        layouts = list(dict.fromkeys([*old.get("layouts", []), *layouts]))
    redo = {tuple(x.split("@")) for x in args.redo.split(",") if x.strip()}
    have = {key for key, r in latest(records).items() if r.get("ok")}
    todo = [(m, x, seed) for m in [int(y) for y in args.rates.split(",") if y.strip()]
            for x in [y.strip() for y in args.layouts.split(",") if y.strip()] for seed in seeds
            if (x, m, seed) not in have or (x, str(m)) in redo]
    session = {**env, "session_wall_s": 0.0, "runs": [f"{x}@{m} seed {seed}" for m, x, seed in todo]}
    sessions.append(session)

    def save() -> None:
        session["session_wall_s"] = round(time.monotonic() - t0, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"what": "model=small, 2 ranks on 2 emulated hosts (netns, tc tbf link), 1 thread each; "
                       "tokens_per_s global (ft: sum of both groups)",
               "env": env, "sessions": sessions, "steps": args.steps, "rates_mbit": rates, "layouts": layouts,
               "total_wall_s": round(sum(x["session_wall_s"] for x in sessions), 1), "table": table(records, layouts, rates), "runs": records}  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")

    say(f"bench_ft_links: {len(todo)} runs ({len(layouts)} layouts x {len(rates)} rates x {len(seeds)} seeds), "
        f"{args.steps} steps each; "
        f"CPU {env['cpu_model']}, avx512f {env['avx512f']}")
    cluster("up", mbit=0)
    try:
        # The corpus tokenized once, in the machine's namespace, before anything is timed.
        cache_log = args.work / "cache.log"
        with open(cache_log, "w") as log:
            done = subprocess.run([sys.executable, "-m", "ciuic_train", *common(args)[:1], "train.max_steps=1",
                                   "train.eval_every=1", "train.eval_windows=1", "sample.max_new_tokens=0",
                                   "progress=plain", "ckpt.every=0", f"data.cache_dir={args.work / 'cache'}",
                                   f"hydra.run.dir={args.work / 'cache-run'}"],
                                  cwd=args.work, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=600)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"bench_ft_links: the token cache run failed:\n{tail(cache_log)}")
        port, status, at = args.port, "", None
        for mbit, layout, seed in todo:
            if at != mbit:
                status, at = set_link(mbit), mbit
            if args.budget_min and time.monotonic() - t0 > args.budget_min * 60:
                say(f"{layout} at {mbit or 'unlimited'}, seed {seed}: skipped (past --budget-min {args.budget_min:g})")
                records.append({"layout": layout, "link_mbit": mbit, "seed": seed, "ok": False,
                                "skipped": "past --budget-min"})  # fmt: skip
                continue
            say(f"{layout} at {mbit or 'unlimited'}{' Mbit/s' if mbit else ''}, seed {seed} ...")
            record = one_run(args, layout, mbit, seed, port)
            record["link_status"] = status.splitlines()
            if (layout, str(mbit)) in redo:
                record["redo"] = True
            port += 4
            records.append(record)
            save()
            if record["ok"]:
                say(f"  {record['tokens_per_s']:.0f} tok/s global, val_loss {record['final_val_loss']:.4f}, "
                    f"syncs {record['syncs']}, sync_s {record['sync_s']}, {record['driver_wall_s']:.0f} s"
                    + (f"; killed {len(record['left_behind_killed'])} left-behind processes"
                       if record.get("left_behind_killed") else ""))  # fmt: skip
            else:
                say(f"  FAILED: {cause(record['error'])[:300]}")
    finally:
        try:
            sweep_hosts()
            if args.keep_up:
                set_link(0)
            else:
                cluster("down")
        finally:
            save()
    say(f"done in {time.monotonic() - t0:.0f} s; results in {args.out}")
    print()
    print_table(table(records, layouts, rates))
    print(f"CPU: {env['cpu_model']}; /proc/cpuinfo lists avx512f: {env['avx512f']}; {env['cores']} cores")


if __name__ == "__main__":
    main()
