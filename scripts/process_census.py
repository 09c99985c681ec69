"""Where a command's CPU goes, process by process: run it with every Python process it
starts (at any depth) recording itself at exit, then add up by kind of process and by test.

    python scripts/process_census.py run OUT.jsonl -- pytest -n 2
    python scripts/process_census.py report OUT.jsonl

`run` puts a `sitecustomize.py` on PYTHONPATH, which every Python process below inherits:
at exit each appends one JSON line to OUT.jsonl (its argv, CPU seconds, wall seconds,
RANK, and the test that was running, from pytest's PYTEST_CURRENT_TEST). A process that
dies by a signal (a SIGKILLed rank) or ends through `os._exit` writes none, nor do
programs that are not Python (g++ under inductor, Slurm's daemons).

`report` groups the lines by program (a rank of `python -m ciuic_train`, torchrun's agent,
the CLI's front process, a test's own script) and lists the tests whose processes took the
most CPU: what the suite spends on starting processes against what it spends training.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RECORDER = '''
import os
if os.environ.get("CIUIC_CENSUS"):
    import atexit, json, sys, time
    _began = time.monotonic()

    def _record():
        times = os.times()
        line = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[:8],
                "cpu_s": round(times.user + times.system, 3), "wall_s": round(time.monotonic() - _began, 3),
                "rank": os.environ.get("RANK"), "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]}
        with open(os.environ["CIUIC_CENSUS"], "a") as out:
            out.write(json.dumps(line) + "\\n")

    atexit.register(_record)
'''


def run(out: Path, command: list[str]) -> int:
    out = out.absolute()
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="census-") as folder:
        (Path(folder) / "sitecustomize.py").write_text(RECORDER)
        path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
        return subprocess.call(command, env={**os.environ, "PYTHONPATH": path, "CIUIC_CENSUS": str(out)})


def program(line: dict) -> str:
    """What kind of process the line is, from its argv and RANK."""
    argv = line["argv"]
    name = Path(argv[0]).name if argv else "?"
    if name == "__main__.py":
        name = "python -m ciuic_train"
    elif name == "run.py":
        name = "torchrun's agent"
    elif name == "ciuic-train" and line["rank"] is None:
        name = "ciuic-train (front process)"
    elif name == "-c":  # pytest-xdist's workers among them, which run the tests in-process
        name = "python -c"
    return name + (" (rank)" if line["rank"] is not None else "")


def report(census: Path, top: int) -> None:
    lines = [json.loads(text) for text in census.read_text().splitlines()]
    by_program: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_test: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for line in lines:
        for table, key in ((by_program, program(line)), (by_test, line["test"])):
            table[key][0] += 1
            table[key][1] += line["cpu_s"]
    total = sum(cpu for _, cpu in by_program.values())
    print(f"{len(lines)} Python processes, {total:,.0f} CPU-s\n\nby program:")
    for name, (count, cpu) in sorted(by_program.items(), key=lambda item: -item[1][1]):
        print(f"  {cpu:8,.1f} CPU-s {count:5d} processes ({cpu / count:5.2f} each)  {name}")
    print(f"\nthe {top} tests whose processes took the most CPU (the test's own process apart):")
    ranked = sorted(((cpu, count, test) for test, (count, cpu) in by_test.items() if test), reverse=True)
    for cpu, count, test in ranked[:top]:
        print(f"  {cpu:8,.1f} CPU-s {count:5d} processes  {test}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="what", required=True)
    run_parser = commands.add_parser("run", help="run a command, every Python process below it recording itself")
    run_parser.add_argument("out", type=Path)
    run_parser.add_argument("command", nargs=argparse.REMAINDER)
    report_parser = commands.add_parser("report", help="add up a census by program and by test")
    report_parser.add_argument("census", type=Path)
    report_parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.what == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run needs a command after --")
        sys.exit(run(args.out, command))
    report(args.census, args.top)


if __name__ == "__main__":
    main()
