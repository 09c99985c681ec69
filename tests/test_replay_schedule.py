"""scripts/replay_schedule.py: two workers played through a run's test times, under the
suite's order (tests/conftest.py) and the one before it."""

import importlib.util
import sys
from pathlib import Path

from conftest import MarkedTest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "replay_schedule.py"
spec = importlib.util.spec_from_file_location("replay_schedule", SCRIPT)
replay_schedule = sys.modules["replay_schedule"] = importlib.util.module_from_spec(spec)  # its dataclass needs it
spec.loader.exec_module(replay_schedule)


def test_the_alone_file_first_and_whole_and_the_clusters_on_one_worker_save_the_waits():
    """Two `alone` tests of 10 s, two cluster tests of 20 s, one other of 30 s. Before: the
    second alone test waits for the cluster test slipped in after the first (10-30 s), and
    the second cluster test for it (to 40 s), then the other test ends at 70 s. Now: the
    alone tests hold the machine 0-20 s, the clusters follow on one worker (to 60 s), the
    other test on the other (20-50 s). No order beats 55 s: 20 s alone, then 70 s on two."""
    items = [MarkedTest("tests/test_big.py::test_a1", "slow", "alone"),
             MarkedTest("tests/test_big.py::test_a2", "slow", "alone"),
             MarkedTest("tests/test_netns.py::test_n1", "slow", "netns"),
             MarkedTest("tests/test_netns.py::test_n2", "slow", "netns"), MarkedTest("tests/test_x.py::test_x", "slow")]
    times = dict(zip((i.nodeid for i in items), (10.0, 10.0, 20.0, 20.0, 30.0)))
    assert replay_schedule.replay(items, times, current=False) == 70.0
    assert replay_schedule.replay(items, times, current=True) == 60.0
