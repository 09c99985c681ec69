"""Two emulated hosts (scripts/cluster/netns_cluster.sh): multi-node runs across a real link.

Each host is a network namespace with its own address and hostname, so a plain two-node
torchrun command runs on them unchanged. The cluster is brought up outside the tests
(`scripts/cluster/netns_cluster.sh up`, as root; `.ci/run` does it); without it these
tests are skipped, unless CIUIC_REQUIRE_NETNS=1 says it must be there.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_layouts
from conftest import free_port, write_text_corpus

pytestmark = pytest.mark.netns

CLUSTER = Path(__file__).resolve().parents[1] / "scripts" / "cluster" / "netns_cluster.sh"
TINY = ["model=tiny", "train.seq_len=64", "train.eval_windows=16", "sample.max_new_tokens=0", "progress=plain"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    status = subprocess.run([str(CLUSTER), "status"], capture_output=True, text=True)
    if status.returncode != 0 or "host1" not in status.stdout:
        reason = f"no emulated hosts ({(status.stdout + status.stderr).strip()}): run {CLUSTER} up as root"
        if os.environ.get("CIUIC_REQUIRE_NETNS"):
            pytest.fail(reason)
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("netns")
    write_text_corpus(root / "corpus")
    return root


def data(workdir: Path) -> list[str]:
    return ["data=text", f"data.path={workdir / 'corpus'}", f"data.cache_dir={workdir / 'cache'}"]


def common(workdir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*TINY, *data(workdir), f"hydra.run.dir={run_dir}", *extra]


def on_host(host: int, nproc: int, port: int, run_id: str, args: list[str], cwd: Path,
            restarts: int = 0, env: dict[str, str] | None = None, options: tuple[str, ...] = (),
            program: tuple[str, ...] = ("-m", "ciuic_train")) -> subprocess.Popen:
    """`torchrun` of `program` (`ciuic-train`'s module by default) on emulated host `host`,
    as a user would type it on that machine."""
    command = [
        str(CLUSTER), "exec", str(host), sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
        f"--nproc_per_node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=host0:{port}",
        f"--rdzv-id={run_id}", f"--max-restarts={restarts}", *options, *program, *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_job(host: subprocess.Popen) -> None:
    """SIGKILL an `on_host` job and every process under it (torchrun's workers run in
    sessions of their own), all at once, as a machine that lost power would lose them.
    Other processes on that host, such as a slurmd, live on."""
    tree, grown = {host.pid}, True
    while grown:
        grown = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grown = True
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def both_done(hosts: list[subprocess.Popen]) -> None:
    outputs = [host.communicate(timeout=300)[0] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]


def two_hosts(workdir: Path, name: str, nproc: int, *extra: str) -> Path:
    run_dir = workdir / name
    port = free_port()
    both_done([on_host(h, nproc, port, name, common(workdir, run_dir, *extra), workdir) for h in (0, 1)])
    return run_dir


def two_hosts_layouts(workdir: Path, nproc: int, layouts: dict[str, list[str]]) -> dict[str, Path]:
    """`layouts` (name -> overrides) across both hosts, `nproc` ranks on each, one after the
    other in one two-node launch of tests/train_layouts.py, in workdir/two_hosts; returns
    the run folders."""
    folder = workdir / "two_hosts"
    folder.mkdir(exist_ok=True)
    port, program = free_port(), (train_layouts.__file__, str(folder), json.dumps(layouts))
    both_done([on_host(h, nproc, port, f"layouts{nproc}", [*TINY, *data(workdir)], folder, program=program)
               for h in (0, 1)])
    return {name: folder / name for name in layouts}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if lines and json.loads(lines[-1])["step"] >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} did not reach step {step} in {timeout} s")


# name, ranks per host, the layout on two hosts, the same on one host.
LAYOUTS = [
    ("ddp", 1, [], []),
    ("fsdp", 1, ["dist.strategy=fsdp"], ["dist.strategy=fsdp"]),
    ("ep", 1, ["dist.dp_shard=2", "dist.ep=2"], ["dist.dp_shard=2", "dist.ep=2"]),
    # Shards within a host, replicas across them: the layout HSDP is for.
    ("hsdp_ep", 2, ["dist.strategy=hsdp", "dist.ep=2"], ["dist.dp_replicate=2", "dist.dp_shard=2", "dist.ep=2"]),
    # A pipeline stage per host: only activations cross the link (and FSDP2 within a host).
    ("pp", 1, ["dist.pp=2"], ["dist.pp=2"]),
    ("pp_fsdp_ep", 2, ["dist.pp=2", "dist.dp_shard=2", "dist.ep=2", "model.n_layers=4"],
     ["dist.pp=2", "dist.dp_shard=2", "dist.ep=2", "model.n_layers=4"]),
]


def steps(nproc: int) -> list[str]:
    return ["train.max_steps=6", f"train.batch_size={4 // nproc}"]


def layouts_by_ranks_per_host(across: bool) -> dict[int, dict[str, list[str]]]:
    """LAYOUTS grouped by ranks per host, each group name -> its steps and its overrides
    (the two-host ones where `across`, else the one-host ones): one launch per group."""
    groups: dict[int, dict[str, list[str]]] = {}
    for name, nproc, two_host_layout, one_host_layout in LAYOUTS:
        groups.setdefault(nproc, {})[name] = [*steps(nproc), *(two_host_layout if across else one_host_layout)]
    return groups


@pytest.fixture(scope="module")
def one_host(workdir) -> dict[str, Path]:
    """Each of LAYOUTS on this host alone, by name: the layouts of one world size one after
    the other in one torchrun launch (tests/train_layouts.py)."""
    runs = {}
    for nproc, layouts in layouts_by_ranks_per_host(across=False).items():
        runs.update(train_layouts.launch_layouts(workdir / "one_host", 2 * nproc, layouts, *TINY, *data(workdir)))
    return runs


@pytest.fixture(scope="module")
def across_hosts(workdir) -> dict[str, Path]:
    """Each of LAYOUTS across the two hosts, by name, likewise: one two-node launch per
    world size. (The CLI's own two-node command runs in the dead-node tests below.)"""
    runs = {}
    for nproc, layouts in layouts_by_ranks_per_host(across=True).items():
        runs.update(two_hosts_layouts(workdir, nproc, layouts))
    return runs


@pytest.mark.parametrize("name, nproc", [layout[:2] for layout in LAYOUTS], ids=[layout[0] for layout in LAYOUTS])
def test_two_hosts_end_with_the_weights_of_one_host(one_host, across_hosts, name, nproc):
    across, alone = across_hosts[name], one_host[name]
    assert summary(across)["world_size"] == 2 * nproc
    assert summary(across)["mesh"] == summary(alone)["mesh"]
    assert summary(across)["param_checksum"] == summary(alone)["param_checksum"]


LONG = ["train.max_steps=150", "train.batch_size=4", "train.log_every=1", "ckpt.every=50", "dist.timeout_s=30"]


@pytest.fixture(scope="module")
def uninterrupted(workdir) -> Path:
    return two_hosts(workdir, "uninterrupted", 1, *LONG)


def test_a_dead_node_fails_the_other_at_once_and_the_rerun_job_ends_as_if_it_had_not(workdir, uninterrupted):
    """Host 1's job dies past the step-50 checkpoint (`kill_job`): host 0 fails at once, in one line naming the
    lost rank; the job run again (a requeue) resumes and ends with the uninterrupted weights.
    (A replacement node under `--max-restarts`: the next test.)
    """
    run_dir, port = workdir / "dies", free_port()
    args = common(workdir, run_dir, *LONG)
    hosts = [on_host(h, 1, port, "dies", args, workdir) for h in (0, 1)]
    wait_for_step(run_dir, 60)
    kill_job(hosts[1])
    output = hosts[0].communicate(timeout=120)[0]
    hosts[1].wait(timeout=30)
    assert hosts[0].returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("ciuic-train: error:")]
    assert len(errors) == 1, output[-3000:]
    assert "rank 0 on host0 10.77.0.1 lost contact with rank 1 (host1 10.77.0.2)" in errors[0]
    # Seen at once, as a closed connection, not after dist.timeout_s as a collective that timed out.
    assert any(cause in errors[0] for cause in ("closed by peer", "reset by peer", "Broken pipe")), errors[0]
    assert "imed out" not in errors[0].split(". A node died")[0], errors[0]
    assert "Traceback" not in output.split("ciuic-train: error:")[0]  # ours is one line (torchrun's agent adds its own)

    port = free_port()
    hosts = [on_host(h, 1, port, "dies-rerun", args, workdir) for h in (0, 1)]
    outputs = [host.communicate(timeout=300)[0] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert summary(run_dir)["resumed_from"].endswith("step_000050")
    assert summary(run_dir)["param_checksum"] == summary(uninterrupted)["param_checksum"]


def test_a_dead_node_started_again_under_max_restarts_resumes_and_ends_as_if_it_had_not(workdir, uninterrupted):
    """Host 1's job dies past the step-50 checkpoint and its torchrun is started again: with
    `--max-restarts=1` the agents form a new worker group that resumes from step 50 and
    ends with the uninterrupted weights.

    Needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every host with torch 2.13: otherwise
    host 0's agent (rank 0 again) reuses round 0's store address and never writes
    MASTER_ADDR under the new round's prefix, which the new agent waits for, while host 0's
    waits for the new agent's role info: both time out (seen here). A 1 s keep-alive lets
    the new round start ~3 s after the death, not torch's 15 s.
    """
    run_dir, port = workdir / "replaced", free_port()
    args, env = common(workdir, run_dir, *LONG), {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    options = ("--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3",)
    hosts = [on_host(h, 1, port, "replaced", args, workdir, 1, env, options) for h in (0, 1)]
    wait_for_step(run_dir, 60)
    kill_job(hosts[1])
    hosts[1].wait(timeout=30)
    hosts[1] = on_host(1, 1, port, "replaced", args, workdir, 1, env, options)  # the node is back
    outputs = [host.communicate(timeout=300)[0] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000050'} at step 50" in (run_dir / "train.log").read_text()
    assert summary(run_dir)["param_checksum"] == summary(uninterrupted)["param_checksum"]


def test_a_link_down_for_seconds_is_survived(workdir, uninterrupted):
    """TCP retransmits across a short outage: the collective waits, then goes on."""
    run_dir, port = workdir / "blip", free_port()
    hosts = [on_host(h, 1, port, "blip", common(workdir, run_dir, *LONG), workdir) for h in (0, 1)]
    wait_for_step(run_dir, 10)
    subprocess.run([str(CLUSTER), "link", "1", "down"], check=True)
    time.sleep(4)
    subprocess.run([str(CLUSTER), "link", "1", "up"], check=True)
    outputs = [host.communicate(timeout=300)[0] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert summary(run_dir)["param_checksum"] == summary(uninterrupted)["param_checksum"]
