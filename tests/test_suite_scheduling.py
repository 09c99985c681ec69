"""The suite's own scheduling under `pytest -n 2` (tests/conftest.py): the machine's
readers-writer lock, probed without blocking, the groups tests are sent to workers by, and
the clean-up that must not reach another test's processes."""

import fcntl
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import descendants, kill_tree, machine_lock_files, machine_share, worker_group


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
    gate, share = machine_lock_files(run)
    yield run, gate, share
    gate.unlink(missing_ok=True)
    share.unlink(missing_ok=True)


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


class _Item:
    """What worker_group reads of a test: its markers and its module."""

    def __init__(self, module: str, *markers: str):
        self.module = SimpleNamespace(__name__=module)
        self.markers = set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_cluster_tests_share_one_group_and_the_rest_go_by_module():
    assert worker_group(_Item("tests.test_slurm", "slurm")) == "clusters"
    assert worker_group(_Item("tests.test_netns", "netns")) == "clusters"
    assert worker_group(_Item("tests.test_slurm_netns", "slurm", "netns")) == "clusters"
    assert worker_group(_Item("tests.test_slurm")) == "tests.test_slurm"
    assert worker_group(_Item("tests.test_pipeline", "slow")) == "tests.test_pipeline"


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
