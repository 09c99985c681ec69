"""Test the tests: break five central claims on purpose and check that their tests notice.

A test that still passes on broken code proves nothing. For each claim below, this script
copies the working tree (uncommitted changes included) into a scratch folder, runs the
tests that guard the claim there as they are (the control: they must pass), then replaces
one line of the code with a realistic mistake (a forgotten restore, a missing wait) and
runs them again: they must fail. The real tree is never touched.

    python scripts/mutation_check.py                      # every claim (a few minutes)
    python scripts/mutation_check.py --only async_save    # one claim (repeatable)
    python scripts/mutation_check.py --list               # the claims, mutations and tests
    python scripts/mutation_check.py --json results.json --keep   # keep the scratch copy too

The package is installed in editable mode (pointing at this tree), so the tests run with
PYTHONPATH=<copy> first, from the copy; the subprocesses they start (torchrun, the
`ciuic-train` script) inherit it. Exit status 0 only if every control passed and every
mutant was caught.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_COPIED = (".git", ".venv", "outputs", "multirun", "build", "dist", "gpu_check_out", ".pytest_cache",
              "__pycache__", "*.egg-info", "*.whl", ".whl")
PYTEST_ARGS = ["-x", "-q", "-rfE", "-p", "no:cacheprovider", "--timeout=600", "-o", "addopts="]


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str
    path: str  # relative to the repository root
    before: str  # one whole line of `path`, stripped; it must occur exactly once
    after: str  # its replacement, written with the original line's indentation
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("resume_bit_identical", "a run resumed from a checkpoint ends bit-identical to an uninterrupted run",
             "ciuic_train/train/trainer.py", 'self.windows.load_state_dict(state["sampler"])',
             "pass  # mutant: the data sampler's position is not restored",
             ("tests/test_checkpoint.py::test_resume_ends_bit_identical_to_an_uninterrupted_run[plain]",)),
    Mutation("layout_invariant_init", "initialization gives the same weights whatever the layout (ranks, shards)",
             "ciuic_train/model/init.py", "start, stop = rows.start, rows.start + local.shape[0]",
             "start, stop = 0, local.shape[0]  # mutant: the shard's offset is ignored",
             ("tests/test_init.py::test_a_model_initialized_by_shards_equals_one_initialized_whole",
              "tests/test_init.py::test_rows_drawn_in_pieces_equal_the_whole")),
    Mutation("ep_equals_one_process", "expert parallelism (dist.ep=2) trains as one process does",
             "ciuic_train/distributed/expert_parallel.py",
             "rank_major[by_expert] = torch.arange(len(by_expert), device=x.device)",
             "rank_major = by_expert  # mutant: the permutation itself, not its inverse",
             ("tests/test_scale_out.py::test_expert_parallel_on_two_ranks_trains_as_one_process",)),
    Mutation("async_save", "ckpt.async_save writes in the background, and the next save waits for it",
             "ciuic_train/checkpoint/checkpointer.py", "self._in_flight.start()",
             "self._in_flight.start(); self._in_flight.join()  # mutant: the save waits for its own write",
             ("tests/test_checkpoint.py::test_an_async_save_is_written_while_steps_go_on_and_the_next_save_waits_for_it",)),
    Mutation("oom_one_line", "running out of memory is reported as one clear line, not a traceback",
             "ciuic_train/plan/memory_check.py", "raise RankFailed(self._message(what, err)) from None",
             "raise  # mutant: the allocator's error goes on as it is",
             ("tests/test_memory_check.py::test_out_of_memory_in_a_step_is_one_line_and_the_checkpoint_before_it_resumes",)),
)


@dataclass
class Result:
    name: str
    claim: str
    where: str  # file:line
    before: str
    after: str
    tests: list[str]
    verdict: str  # caught, NOT CAUGHT, control failed, error
    control_seconds: float
    mutant_seconds: float | None
    evidence: str  # the failure pytest reported (a caught mutant, a failed control)


def make_scratch_copy() -> Path:
    """The working tree in a temporary folder, where `import ciuic_train.conf` finds conf/."""
    copy = Path(tempfile.mkdtemp(prefix="mutation_check-")) / "tree"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(*NOT_COPIED))
    (copy / "ciuic_train" / "conf").symlink_to(Path("..") / "conf")  # pyproject's package-dir mapping
    return copy


def environment(copy: Path) -> dict[str, str]:
    # No bytecode written: a file mutated and restored within one second could reuse a stale .pyc.
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def assert_imports_come_from(copy: Path) -> None:
    probe = "import ciuic_train, ciuic_train.conf; print(ciuic_train.__file__); print(ciuic_train.conf.__file__)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=environment(copy), capture_output=True,
                            text=True)
    paths = result.stdout.split()
    if result.returncode != 0 or len(paths) != 2 or not all(Path(path).is_relative_to(copy) for path in paths):
        sys.exit(f"mutation_check: the tests would not import the scratch copy {copy}: {paths} {result.stderr[-500:]}")


def locate(copy: Path, mutation: Mutation) -> int:
    """The 0-based index of the mutation's line; exits unless it occurs exactly once."""
    lines = (copy / mutation.path).read_text().splitlines()
    found = [i for i, line in enumerate(lines) if line.strip() == mutation.before]
    if len(found) != 1:
        sys.exit(f"mutation_check: {mutation.name}: {mutation.before!r} occurs {len(found)} times in {mutation.path}"
                 " (expected once); update the mutation to the code")
    return found[0]


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    """pytest's exit status, the seconds it took, and what failed: the failed tests and
    the first lines of the error (or pytest's last lines)."""
    tic = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests], cwd=copy, env=environment(copy),
                            capture_output=True, text=True)
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if line.startswith("E ")][:4]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return result.returncode, time.perf_counter() - tic, "\n".join(failed + errors or lines[-5:])[:2000]


def check(copy: Path, mutation: Mutation) -> Result:
    source = copy / mutation.path
    original = source.read_text()
    index = locate(copy, mutation)
    lines = original.splitlines(keepends=True)
    indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
    result = Result(mutation.name, mutation.claim, f"{mutation.path}:{index + 1}", mutation.before, mutation.after,
                    list(mutation.tests), "control failed", 0.0, None, "")
    status, result.control_seconds, evidence = run_tests(copy, mutation.tests)
    if status != 0:
        result.evidence = evidence
        return result
    lines[index] = indent + mutation.after + "\n"
    source.write_text("".join(lines))
    try:
        status, result.mutant_seconds, result.evidence = run_tests(copy, mutation.tests)
    finally:
        source.write_text(original)
    # 1: tests ran and failed. Anything else (an interrupted run, no tests collected) proves nothing.
    result.verdict = {0: "NOT CAUGHT", 1: "caught"}.get(status, f"error (pytest exit status {status})")
    return result


def describe(result: Result) -> str:
    seconds = f"control {result.control_seconds:.1f} s" + (
        f", mutant {result.mutant_seconds:.1f} s" if result.mutant_seconds is not None else "")
    return (f"{result.name}: {result.where}: `{result.before}` -> `{result.after}`; tests: "
            f"{' '.join(result.tests)}; {result.verdict} ({seconds})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTATIONS], help="check only this claim")
    parser.add_argument("--list", action="store_true", help="list the claims, their mutations and tests, and exit")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy, unmutated (its path is printed)")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.claim}\n    {m.path}: `{m.before}` -> `{m.after}`\n    tests: {' '.join(m.tests)}")
        return 0

    tic = time.perf_counter()
    copy = make_scratch_copy()
    try:
        for mutation in chosen:  # every line is there, once, before anything runs
            locate(copy, mutation)
        assert_imports_come_from(copy)
        results = []
        for mutation in chosen:
            print(f"[{mutation.name}] control, then mutant: {' '.join(mutation.tests)}", file=sys.stderr, flush=True)
            results.append(check(copy, mutation))
            print(describe(results[-1]), flush=True)
            if results[-1].verdict != "caught" and results[-1].evidence:
                print("    " + results[-1].evidence.replace("\n", "\n    "), flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept at {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy.parent, ignore_errors=True)
    total = time.perf_counter() - tic
    all_caught = all(r.verdict == "caught" for r in results)
    print(f"{sum(r.verdict == 'caught' for r in results)}/{len(results)} mutants caught in {total:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"all_caught": all_caught, "seconds": round(total, 1),
                                         "results": [asdict(r) for r in results]}, indent=2) + "\n")
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
