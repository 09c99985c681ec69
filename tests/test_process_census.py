"""scripts/process_census.py: every Python process below the command records itself, and
the report adds them up by program and by test."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "process_census.py"

# A parent that starts a busy child as rank 1 of a test's launch would.
PARENT = """
import os, subprocess, sys
env = {**os.environ, "RANK": "1", "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"}
subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], env=env, check=True)
"""


def test_each_python_process_below_the_command_is_counted_by_program_and_test(tmp_path):
    census = tmp_path / "census.jsonl"
    ran = subprocess.run([sys.executable, str(SCRIPT), "run", str(census), "--", sys.executable, "-c", PARENT],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    lines = [json.loads(text) for text in census.read_text().splitlines()]
    child, parent = lines  # the child ends first
    assert child["rank"] == "1" and child["test"] == "tests/test_x.py::test_y" and child["ppid"] == parent["pid"]
    assert parent["rank"] is None and child["cpu_s"] > 0.05

    report = subprocess.run([sys.executable, str(SCRIPT), "report", str(census)], capture_output=True, text=True,
                            timeout=60)
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("2 Python processes")
    assert "1 processes" in report.stdout and "python -c (rank)" in report.stdout
    assert "tests/test_x.py::test_y" in report.stdout


def test_a_failing_command_fails_the_census_with_its_status(tmp_path):
    ran = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path / "c.jsonl"), "--", sys.executable, "-c",
                          "raise SystemExit(3)"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 3
