"""Replay a `pytest -n 2` run's test times through the suite's scheduling, without the noise.

    python scripts/replay_schedule.py RUN.xml [RUN.xml ...]

Whole runs of the suite differ by a tenth or more on one machine (docs/performance.md), so
a change to how tests are handed out (tests/conftest.py) cannot be weighed by timing two
runs. This takes each test's time from a run's JUnit XML (`PYTEST_ADDOPTS=--junitxml=F
pytest -n 2`, as `.ci/run` runs it), collects the tests of this checkout with their marks,
and plays two workers through them, printing the time the run would take under
conftest.py's order (`units_in_order`, `unit_of`, an `alone` file holding the machine from
its first test to its last) and under the order before it (files only, longest first, an
`alone` test taking the machine test by test), with the bound no order beats: the other
tests' times halved, plus the `alone` ones'.

The model: xdist's `loadfile` hands a worker its next unit once at most 2 of its tests
are left; a test starts when its worker is free, the clusters are free (if it needs them)
and no `alone` test runs; an `alone` test also waits for the test running on the other
worker. What it leaves out: collection, and a test taking longer when the other worker's
is busier. On two runs of the order before it came within 3% of the time measured
(1,201 s against 1,221 s of pytest, 1,508 s against 1,552 s).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import conftest  # noqa: E402  (the policy replayed is the suite's own)


class Collector:
    """A pytest plugin that keeps the collected items (marks included)."""

    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.items = list(items)


def collect() -> list[pytest.Item]:
    collector = Collector()
    with contextlib.redirect_stdout(io.StringIO()):  # its list of 900 tests
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(REPO / "tests")], plugins=[collector])
    if code != 0:
        sys.exit(f"collecting the tests failed (pytest exit status {code}); `pytest --collect-only` says why")
    return collector.items


def times_in(junit: Path) -> dict[str, float]:
    """Each test's time in a run (setup, call and teardown: JUnit's `time`), by node id."""
    times = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        times[f"{path}::{case.get('name')}"] = float(case.get("time", 0.0))
    return times


def files_longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The order before `units_in_order`: files by their expected time, longest first."""
    expected: dict[Path, float] = collections.Counter()
    for item in items:
        expected[item.path] += conftest.SLOW_TEST_S if item.get_closest_marker("slow") else conftest.QUICK_TEST_S
    return sorted(items, key=lambda item: -expected[item.path])


@dataclass
class Worker:
    pending: list[pytest.Item] = field(default_factory=list)
    free_at: float = 0.0
    ran: list[tuple[float, float]] = field(default_factory=list)


def replay(items: list[pytest.Item], times: dict[str, float], current: bool) -> float:
    """The pytest time two workers take over `items` under the current order or the one before."""
    order, unit = (conftest.units_in_order, conftest.unit_of) if current else (
        files_longest_first, lambda nodeid: nodeid.split("::", 1)[0])
    queue: dict[str, list[pytest.Item]] = {}
    for item in order(items):
        queue.setdefault(unit(item.nodeid), []).append(item)
    units = iter(queue.values())
    workers = [Worker(next(units, [])) for _ in range(2)]
    clusters_free = alone_until = 0.0
    while any(w.pending for w in workers):
        me = min((w for w in workers if w.pending), key=lambda w: w.free_at)
        other = workers[1 - workers.index(me)]
        item = me.pending.pop(0)
        alone = item.get_closest_marker("alone") is not None
        start = max(me.free_at, alone_until, clusters_free if conftest.on_a_cluster(item) else 0.0)
        if alone:  # it waits for the other worker's test to end
            start = max([start] + [end for begin, end in other.ran if begin <= start < end])
        took = times.get(item.nodeid, 0.0)
        if alone and current:  # the rest of its file follows without letting the other worker in
            while me.pending and conftest.keeps_the_machine(me.pending[0]):
                took += times.get(me.pending.pop(0).nodeid, 0.0)
        me.free_at = start + took
        me.ran.append((start, me.free_at))
        if conftest.on_a_cluster(item):
            clusters_free = me.free_at
        if alone:
            alone_until = me.free_at
        if len(me.pending) <= 2:
            me.pending += next(units, [])
    return max(w.free_at for w in workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JUnit XML files of `pytest -n 2` runs")
    args = parser.parse_args()
    items = collect()
    print(f"{'run':40} {'before':>8} {'now':>8} {'bound':>8}  (seconds of pytest)")
    for junit in args.runs:
        times = times_in(junit)
        alone = sum(times.get(i.nodeid, 0.0) for i in items if i.get_closest_marker("alone"))
        bound = (sum(times.get(i.nodeid, 0.0) for i in items) - alone) / 2 + alone
        print(f"{str(junit):40} {replay(items, times, False):8.0f} {replay(items, times, True):8.0f} {bound:8.0f}")


if __name__ == "__main__":
    main()
