"""SIGKILL a rank of a real 2-process run at seeded random moments, resume each time: the run
must end exactly like an uninterrupted one (issue "Reliability", item 4). Each restart also
takes the run folder's lock again (ciuic_train/launch/runlock.py): a killed job leaves none behind.

Design. Nothing is patched: `ciuic-train dist.nproc_per_node=2` starts two gloo workers
through torch's elastic launcher, and the test SIGKILLs one of them (found among the
command's children by the RANK in its environment), as the OOM killer or a lost node
would. The launcher then stops the other worker and the command fails; the test reruns
the same command (`resume=auto`), which must load the latest complete checkpoint without
complaint, and so on, once per kill. The last attempt runs to the end without a kill: its
`param_checksum` and step count must equal an uninterrupted run's with the same overrides
and synchronous saves (one for both tests: started with the first, in its own folder, so
that it and the attempts share the two cores).

Saves are most of the run: with `ckpt.every=1` and `ckpt.keep_last=2` the tiny model
trains a step in ~25 ms on two cores while a save (DCP files, a JSON file per rank, three
agreements between the ranks, a rename, a prune) takes ~80 ms, so a kill at a random
moment of training lands inside a save most of the time. Startup (~11 s on two cores: imports, rendezvous, the
model, loading the checkpoint) dwarfs the training (~5 s for all 40 steps) and varies by
seconds, so moments are drawn relative to what each attempt has reached, not to its start.
Each kill has one of three kinds (KINDS, in an order shuffled by the seed) and a target
step drawn in its own slice of the run, so that the kills spread over it:
- "startup": a random moment in the workers' first 8 s, or at the attempt's first new
  checkpoint if that comes sooner (imports, rendezvous, building the model, loading the
  checkpoint);
- "any": a random moment in the ~2 steps after step `target`'s checkpoint is complete (a
  step, an evaluation, a save, a log line);
- "save": a random moment early in the save of step `target`, found by polling for its
  `.tmp-step_*` folder: at least one kill is inside a save whatever the timing.
A kill counts as inside a save when a `.tmp-step_*` folder written by this attempt exists
right after it. The seed fixes the kinds, targets, ranks and delays; where exactly each
kill lands still varies with the machine's timing, which is the point.

Each kill costs a restart (~14 s on two cores), which is what limits their number: 4
kills keep the test near 75 s. KILL_ANYWHERE_SEED and KILL_ANYWHERE_KINDS (e.g.
`startup,save,save,any,any,any`; KILL_ANYWHERE_ASYNC_KINDS for the run with
`ckpt.async_save=true`, 3 kills) try other draws by hand; `pytest -s` prints what each
kill hit.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import write_text_corpus

TINY = ["model=tiny", "train.seq_len=64", "train.batch_size=4", "train.eval_windows=8", "sample.max_new_tokens=0",
        "progress=plain"]
SEED = int(os.environ.get("KILL_ANYWHERE_SEED", 4))
STEPS = 40
KINDS = tuple(os.environ.get("KILL_ANYWHERE_KINDS", "startup,save,any,any").split(","))
# Asynchronous saves (ckpt.async_save): the kills that can meet a background write; a
# startup kill is the same in either mode.
ASYNC_KINDS = tuple(os.environ.get("KILL_ANYWHERE_ASYNC_KINDS", "save,any,any").split(","))
STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Kill:
    kind: str
    rank: int
    moment_s: float  # since the attempt's command started
    exit_s: float  # from the kill to the command's exit
    resumed_at: int  # the latest complete checkpoint when the attempt started
    reached: int  # the latest complete checkpoint right after the kill
    inside_save: str  # the `.tmp-step_*` folder the kill cut short, or ""
    exit_code: int


def start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """The installed command, as a user would run it (from outside the source tree), its output in `log`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    exe = Path(sys.executable).with_name("ciuic-train")
    with open(log, "w") as out:
        return subprocess.Popen([str(exe), *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen) -> None:
    """After a failed assertion: end a command still running, and its workers (each in a session of its own)."""
    if process.poll() is None:
        for pid in workers(process.pid).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.kill()
        process.wait(timeout=30)


def children(pid: int) -> list[int]:
    if not Path(f"/proc/{pid}/task/{pid}/children").exists():  # a kernel without CONFIG_PROC_CHILDREN: scan
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                    found.append(int(entry))
            except (OSError, IndexError):
                pass
        return found
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:  # the thread ended meanwhile
                pass
    except OSError:  # the process ended
        pass
    return found


def workers(pid: int) -> dict[int, int]:
    """The launcher's worker processes by rank: children of the command with a RANK in their environment."""
    found = {}
    for child in children(pid):
        try:
            environ = dict(
                entry.split("=", 1) for entry in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in entry
            )
        except OSError:
            continue
        if "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ:
            found[int(environ["RANK"])] = child
    return found


def latest_complete(checkpoints: Path) -> int:
    steps = [0]
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            match = STEP_DIR.match(p.name)
            if match and (p / "meta.json").is_file():
                steps.append(int(match.group(1)))
    return max(steps)


def temporary_saves(checkpoints: Path) -> dict[str, int]:
    """`.tmp-step_*` folders by name, with their mtime: a save that recreates one changes it."""
    found = {}
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            if p.name.startswith(".tmp-step_"):
                try:
                    found[p.name] = p.stat().st_mtime_ns
                except OSError:
                    pass
    return found


def wait_for(condition, process: subprocess.Popen, timeout: float, period: float = 0.002) -> bool:
    """Poll `condition` until true (True), or until `process` exits (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            return False
        assert time.monotonic() < deadline, "timed out waiting for the run to get there"
        time.sleep(period)
    return True


def describe(kills: list[Kill]) -> list[str]:
    return [
        f"  {k.kind:<7} rank {k.rank} at {k.moment_s:5.2f} s (attempt started at step {k.resumed_at}): latest "
        f"complete step {k.reached}, {'inside a save (' + k.inside_save + ')' if k.inside_save else 'outside a save'}; "
        f"exit {k.exit_code} {k.exit_s:.1f} s later"
        for k in kills
    ]


def overrides(text_corpus: Path, folder: Path, asynchronous: bool) -> list[str]:
    return [*TINY, "data=text", f"data.path={text_corpus}", f"data.cache_dir={folder / 'cache'}",
            f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=10", "ckpt.every=1",
            "ckpt.keep_last=2", "dist.nproc_per_node=2", "resume=auto", f"ckpt.async_save={str(asynchronous).lower()}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run both tests must end like: the same steps without a kill, with synchronous
    saves (how a save is written changes no weight) and the same corpus (written alike in
    its own folder). It starts when the first test does and runs beside its attempts, the
    two sharing the two cores; the second test finds it done. Returns its summary."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    corpus = write_text_corpus(folder / "corpus")
    process = start([*overrides(corpus, folder, False), f"hydra.run.dir={folder / 'whole'}"], folder,
                    folder / "whole.log")

    def summary() -> dict:
        assert process.wait(timeout=180) == 0, (folder / "whole.log").read_text()[-3000:]
        return json.loads((folder / "whole" / "summary.json").read_text())

    yield summary
    stop(process)


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_sigkill_a_rank_anywhere_and_resume_ends_like_an_uninterrupted_run(tmp_path, text_corpus, asynchronous,
                                                                           uninterrupted):
    """With ckpt.async_save=true a kill may also land while a save is written in the
    background, training going on meanwhile."""
    common = overrides(text_corpus, tmp_path, asynchronous)
    chosen = ASYNC_KINDS if asynchronous else KINDS
    kills_planned = len(chosen)
    run_dir = tmp_path / "killed"
    checkpoints = run_dir / "checkpoints"
    args = [*common, f"hydra.run.dir={run_dir}"]

    def resumed_line(step: int) -> str:
        return f"resumed from {checkpoints / f'step_{step:06d}'} at step {step}"

    assert set(chosen) <= {"startup", "any", "save"}, chosen
    rng = random.Random(SEED)
    kinds = list(chosen)
    rng.shuffle(kinds)
    # One target step per kill, each drawn in its own slice of the run so that the kills spread
    # over it; the last slice ends a few steps early, so that no kill comes after the end.
    edges = [1 + round(i * (STEPS - 4) / kills_planned) for i in range(kills_planned + 1)]
    targets = [rng.randint(lo, hi - 1) for lo, hi in zip(edges, edges[1:])]
    # Drawn before anything is timed, so that the seed alone fixes them.
    ranks, fractions = [rng.choice((0, 1)) for _ in kinds], [rng.random() for _ in kinds]

    kills: list[Kill] = []
    began = time.monotonic()
    process = None
    try:
        for attempt, (kind, target, rank, fraction) in enumerate(zip(kinds, targets, ranks, fractions)):
            resumed_at, stale = latest_complete(checkpoints), temporary_saves(checkpoints)
            target = max(target, resumed_at + 1)
            log = tmp_path / f"attempt{attempt}.log"
            process = start(args, tmp_path, log)
            started = time.monotonic()
            got_there = wait_for(lambda: len(workers(process.pid)) == 2, process, timeout=60, period=0.01)
            if got_there and kind == "startup":  # up to 8 s, but not past the attempt's first new checkpoint
                moment = time.monotonic() + 8.0 * fraction
                got_there = wait_for(lambda: time.monotonic() >= moment or latest_complete(checkpoints) > resumed_at,
                                     process, timeout=60)
            elif got_there and kind == "any":
                got_there = wait_for(lambda: latest_complete(checkpoints) >= target, process, timeout=60)
                time.sleep(0.25 * fraction)
            elif got_there and kind == "save":
                name = f".tmp-step_{target:06d}"  # new, or written anew over a folder a cut save left
                got_there = wait_for(lambda: temporary_saves(checkpoints).get(name, stale.get(name)) != stale.get(name),
                                     process, timeout=60, period=0.001)
                time.sleep(0.03 * fraction)
            pids = workers(process.pid)
            if not got_there or rank not in pids:  # the run ended first (too fast a machine): no more kills
                assert process.wait(timeout=60) == 0, "\n".join(describe(kills)) + "\n" + log.read_text()[-3000:]
                ended_first = f"  attempt {attempt} finished before its {kind} kill came"
                break
            os.kill(pids[rank], signal.SIGKILL)
            killed = time.monotonic()
            cut = sorted(name for name, mtime in temporary_saves(checkpoints).items() if stale.get(name) != mtime)
            reached = latest_complete(checkpoints)
            exit_code = process.wait(timeout=90)
            kills.append(Kill(kind, rank, killed - started, time.monotonic() - killed, resumed_at, reached,
                              cut[-1] if cut else "", exit_code))
            output, report = log.read_text(), "\n".join(describe(kills))
            # It failed because of the kill, and not over a checkpoint.
            assert exit_code != 0 and f"rank {rank} exit code -9" in output, f"{report}\n{output[-3000:]}"
            assert "corrupt or incomplete" not in output, f"{report}\n{output[-3000:]}"
            # An attempt that trained has loaded the latest complete checkpoint (one killed while
            # starting may not have got that far).
            if resumed_at and (kind != "startup" or reached > resumed_at or "resumed from" in output):
                assert resumed_line(resumed_at) in output, f"{report}\n{output[-3000:]}"
        else:  # every kill came: one more attempt, which must run to the end
            ended_first = ""
            resumed_at = latest_complete(checkpoints)
            log = tmp_path / "final.log"
            process = start(args, tmp_path, log)
            assert process.wait(timeout=180) == 0, log.read_text()[-3000:]
            assert resumed_line(resumed_at) in log.read_text(), log.read_text()[-3000:]
        whole = uninterrupted()
        elapsed = time.monotonic() - began
    finally:
        if process is not None:
            stop(process)
    summary = json.loads((run_dir / "summary.json").read_text())
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [f"kill-anywhere: {len(kills)} kills (seed {SEED}), {elapsed:.0f} s for all runs", *describe(kills),
             f"  final: steps {summary['steps']}, resumed_from {Path(summary['resumed_from'] or '-').name}, "
             f"param_checksum {summary['param_checksum']} (uninterrupted: {whole['param_checksum']})"]
    if ended_first:
        lines.append(ended_first)
    report = "\n".join(lines)
    print(report)

    assert any(k.inside_save for k in kills), report
    assert summary["steps"] == whole["steps"] == STEPS, report
    assert summary["param_checksum"] == whole["param_checksum"], report
    assert logged == list(range(1, STEPS + 1)), report  # every step logged once (lines precede saves)
