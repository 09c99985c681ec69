"""The suite's own scheduling under `pytest -n 2` (tests/conftest.py): the machine's
readers-writer lock and the clusters' lock, probed without blocking; two real workers held
to what conftest.py promises of them; and the clean-up that must not reach another test's
processes."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import (
    MarkedTest, check_cluster_files, clusters_turn, descendants, kill_tree, machine_lock_files, machine_share,
)


def can_take(path: Path, mode: int) -> bool:
    """Whether another holder could take `mode` on `path` now (a fresh open: its own lock)."""
    with open(path, "a") as probe:
        try:
            fcntl.flock(probe, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


@pytest.fixture
def lock_files():
    run = f"probe-{uuid.uuid4().hex}"
    gate, share, clusters = machine_lock_files(run)
    yield run, gate, share
    for path in (gate, share, clusters):
        path.unlink(missing_ok=True)


def test_tests_beside_each_other_share_the_machine_and_keep_the_gate_open(lock_files):
    run, gate, share = lock_files
    with machine_share(run, exclusive=False):
        assert can_take(share, fcntl.LOCK_SH)  # another ordinary test runs beside it
        assert not can_take(share, fcntl.LOCK_EX)  # a test marked alone waits
        assert can_take(gate, fcntl.LOCK_EX)  # the gate is passed, not held
    assert can_take(share, fcntl.LOCK_EX)


def test_a_test_alone_excludes_every_other_and_holds_the_gate(lock_files):
    run, gate, share = lock_files
    with machine_share(run, exclusive=True):
        assert not can_take(share, fcntl.LOCK_SH)
        assert not can_take(gate, fcntl.LOCK_EX)  # tests arriving now wait at the gate
    assert can_take(share, fcntl.LOCK_SH) and can_take(gate, fcntl.LOCK_EX)


def test_one_cluster_test_at_a_time_and_it_holds_no_share_of_the_machine(lock_files):
    run, _gate, share = lock_files
    clusters = machine_lock_files(run)[2]
    with clusters_turn(run):
        assert not can_take(clusters, fcntl.LOCK_EX)  # a cluster test on the other worker waits
        assert can_take(share, fcntl.LOCK_EX)  # while it waits for its turn, an `alone` test may run
    assert can_take(clusters, fcntl.LOCK_EX)


# Files of an inner `pytest -n 2` run on tests/conftest.py: each test logs where and when it ran.
INNER_TEST = """
import json, os, time, pytest
def record(request):
    start = time.time()
    time.sleep(0.5)
    with open(os.environ["SCHEDULING_LOG"], "a") as log:
        log.write(json.dumps({{"test": request.node.nodeid, "worker": os.environ["PYTEST_XDIST_WORKER"],
                              "start": start, "end": time.time()}}) + "\\n")
{tests}
"""


@pytest.mark.slow
def test_two_workers_keep_a_file_together_the_cluster_files_on_one_and_alone_tests_apart(tmp_path):
    """Five files on two real xdist workers: one with two `alone` tests, two with cluster
    (slow) tests, named as CLUSTER_FILES names them, one with a slow test and one of more
    but quick tests. The alone tests' file goes out first, the cluster files as one unit
    to the other worker, one file after the other in CLUSTER_FILES's order, then the rest
    longest first (xdist's own order, most tests first, and the collected order would both
    send the quick file first); each file's tests run on one worker in their written
    order, no two cluster tests run at once, and nothing runs beside the `alone` tests,
    nor between them."""
    plain = [f"def test_{i}(request): record(request)" for i in range(2)]
    cluster = [f"@pytest.mark.{mark}\ndef test_{mark}_{i}(request): record(request)"
               for i in range(2) for mark in ("slurm", "netns")]
    alone = [f"@pytest.mark.alone\ndef test_alone_{i}(request): record(request)" for i in range(2)]
    quick = [f"def test_quick_{i}(request): record(request)" for i in range(8)]
    slow = ["@pytest.mark.slow\ndef test_slow(request): record(request)", *plain]
    files = {"test_a.py": quick, "test_b.py": alone + plain, "test_c.py": slow, "test_netns.py": cluster + plain,
             "test_slurm.py": plain + cluster}
    for name, tests in files.items():
        (tmp_path / name).write_text(INNER_TEST.format(tests="\n".join(tests)))
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    log = tmp_path / "log.jsonl"
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                             "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                            cwd=tmp_path, env={**os.environ, "SCHEDULING_LOG": str(log)}, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda r: r["start"])
    of = {name: [r for r in runs if r["test"].startswith(f"{name}::")] for name in files}
    for name, tests in files.items():
        written = [test.split("def ", 1)[1].split("(", 1)[0] for test in tests]
        assert [r["test"].split("::")[1] for r in of[name]] == written, of[name]
        assert len({r["worker"] for r in of[name]}) == 1, of[name]
    assert {r["worker"] for r in runs} == {"gw0", "gw1"}
    # The cluster files: one worker, one file and then the other, in CLUSTER_FILES's order.
    assert of["test_netns.py"][0]["worker"] == of["test_slurm.py"][0]["worker"]
    assert max(r["end"] for r in of["test_slurm.py"]) <= min(r["start"] for r in of["test_netns.py"]), runs
    # What each worker began with: the alone test's file, the clusters' unit; then the longer file first.
    first = {worker: next(r["test"].split("::")[0] for r in runs if r["worker"] == worker) for worker in ("gw0", "gw1")}
    assert sorted(first.values()) == ["test_b.py", "test_slurm.py"], first
    assert of["test_c.py"][0]["start"] < of["test_a.py"][0]["start"], runs

    def overlap(x: dict, y: dict) -> bool:
        return x["start"] < y["end"] and y["start"] < x["end"]

    clustered = [r for r in runs if "_slurm_" in r["test"] or "_netns_" in r["test"]]
    assert not any(overlap(x, y) for x in clustered for y in clustered if x is not y), clustered
    # The alone tests, one after the other, hold the machine from the first's start to the last's end.
    lone = [r for r in runs if "::test_alone_" in r["test"]]
    held = {"start": lone[0]["start"], "end": lone[-1]["end"]}
    assert not any(overlap(held, other) for other in runs if other not in lone), runs


def test_a_cluster_test_outside_the_cluster_files_is_refused_by_name():
    """xdist's controller groups the cluster files by name (it sees no marks): a test
    marked slurm or netns elsewhere would go out beside them, so collection stops."""
    check_cluster_files([MarkedTest("tests/test_slurm.py::test_x", "slurm"), MarkedTest("tests/test_b.py::test_x")])
    with pytest.raises(pytest.UsageError, match=r"^tests/test_b.py::test_x is marked slurm or netns but test_b.py "
                                                r"is not in CLUSTER_FILES"):
        check_cluster_files([MarkedTest("tests/test_b.py::test_x", "netns")])


def test_kill_tree_reaches_a_grandchild_in_a_session_of_its_own():
    """As torch's launcher starts its workers: below the process, in a new session."""
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen(['sleep', '120'], start_new_session=True); print(child.pid, flush=True); "
            "time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    assert grandchild in descendants(parent.pid)
    kill_tree(parent)
    assert parent.returncode == -9
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and _state(grandchild) != "Z":  # a zombie until init reaps it
        assert time.monotonic() < deadline, "the grandchild outlived kill_tree"
        time.sleep(0.05)


def test_kill_tree_leaves_the_pid_of_a_reaped_process_alone(monkeypatch):
    """Once waited for, the pid is the kernel's to hand out again: nothing is sent to it."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(subprocess.Popen, "send_signal", lambda self, sig: sent.append((self.pid, sig)))
    kill_tree(process)
    assert sent == []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
