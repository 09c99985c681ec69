import contextlib
import fcntl
import faulthandler
import gc
import os
import random
import signal
import time
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from ciuic_train.config import Config, register_configs
from ciuic_train.checks import to_config

register_configs()

# One thread per process, in the tests' processes and in every process they start (which
# inherit the variable; torchrun and the CLI's launcher keep one that is set). The models
# here are tiny and gain nothing from a second thread, and with two tests at a time on 2
# cores a thread has its core half the time while OpenMP's threads spin waiting for one
# another: the quick tier takes a third less time and CPU so (docs/performance.md). An
# OMP_NUM_THREADS the caller set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def compose_config(*overrides: str) -> Config:
    """The typed config `ciuic-train <overrides>` would run with."""
    with initialize_config_module(config_module="ciuic_train.conf", version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed console script as a user would, from `cwd`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    exe = Path(sys.executable).with_name("ciuic-train")
    return subprocess.run(
        [str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def torchrun(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchrun ARGS` with one thread per process, so two ranks fit two cores."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def write_text_corpus(folder: Path) -> Path:
    """A small folder of text files: enough windows for tiny runs, several files for the split."""
    folder.mkdir()
    line = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n"
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(f"# document {i}\n" + line * (20 + i))
    return folder


@pytest.fixture
def text_corpus(tmp_path: Path) -> Path:
    return write_text_corpus(tmp_path / "corpus")


def assert_refused(result: subprocess.CompletedProcess, expected: str, run_dir: Path) -> None:
    """A user's mistake: exit status 2, one line on stderr that holds `expected`, no run folder."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not run_dir.exists()


# Ports handed to a rendezvous lie below the kernel's ephemeral range, from which every
# outgoing connection (gloo's among them) takes its local port: a port asked of the OS
# (bind to 0) comes from that range, and could be taken by such a connection between the
# test choosing it and the rendezvous binding it.
RENDEZVOUS_PORTS = range(10000, 20000)  # Slurm jobs' rendezvous ports start at 20000 (launch/slurm.py)


def free_port() -> int:
    """A TCP port free now and outside the ephemeral range, for a rendezvous: drawn by an
    RNG of its own (other tests set the global ones), and checked by binding it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    draw = random.Random(f"{os.getpid()} {time.monotonic_ns()}")
    for _ in range(200):
        port = draw.randrange(RENDEZVOUS_PORTS.start, min(RENDEZVOUS_PORTS.stop, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {RENDEZVOUS_PORTS}")


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, as /proc lists each one's children (torch's launcher starts
    its workers in sessions of their own, so a process group would miss them)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            listed = children.read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        for child in map(int, listed):
            found += [child, *descendants(child)]
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL `process` and every process below it, if it has not been waited for yet.
    A process this test has reaped (`communicate`, `wait`, a `poll` that saw it end) no
    longer owns its pid: with pid_max at 32768 and torch's threads drawing from the same
    numbers, the kernel hands that pid to another test's process within minutes, and
    killing it there killed a restarted ft worker of a test on the other xdist worker."""
    if process.poll() is not None:
        return
    for pid in descendants(process.pid):  # an unreaped parent holds its pid: list below it, kill it last
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.kill()
    process.wait(timeout=60)


def peak_resident_growth(call) -> int:
    """Bytes by which this process's peak resident memory rose above its current one while
    `call()` ran: the peak (VmHWM) is reset first (Linux's /proc/self/clear_refs), so what
    earlier tests raised it to does not hide this call's allocations."""
    def read(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = read("VmRSS")
    call()
    return read("VmHWM") - before


@pytest.fixture(autouse=True)
def global_state_restored():
    """What a test changes of the process's global state is put back after it: torch's
    thread count, and the RNGs a trainer built in-process reseeds, so no test's outcome
    depends on which ran before it."""
    threads, python_rng, torch_rng = torch.get_num_threads(), random.getstate(), torch.random.get_rng_state()
    yield
    torch.set_num_threads(threads)
    random.setstate(python_rng)
    torch.random.set_rng_state(torch_rng)


@pytest.fixture(scope="module")
def made_once(tmp_path_factory):
    """`made_once(make, *args, **kwargs)`: `make(folder, *args, **kwargs)` run once per test
    module for the same arguments, in a folder of its own; later calls return the first
    result. For reference runs several tests compare against; a test must not change what
    it gets (copy a run folder first)."""
    made: dict = {}

    def get(make, *args, **kwargs):
        key = (make.__name__, args, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make(tmp_path_factory.mktemp(make.__name__), *args, **kwargs)
        return made[key]

    return get


@pytest.fixture
def one_rank_gloo(tmp_path: Path):
    """A one-rank gloo process group for tests that build DDP, FSDP or the expert exchange
    in-process. Torn down as `Parallel.close` does: what the test built (DDP's reducers
    hold the group) goes while the group is still registered, then a pause lets gloo's
    worker free its last tensors (it needs the GIL, which a destructor joining it would
    hold), and the destroy runs under a deadline: a hang anyway prints every thread's stack
    and ends the suite with status 1 (faulthandler's C timer needs no GIL), instead of
    holding CI until its limit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    gc.collect()
    time.sleep(0.2)
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def one_thread():
    """One thread for the test even where the caller's OMP_NUM_THREADS asks for more: tiny
    models gain nothing from threads, and two threads on a busy 2-core box crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Two tests at a time (`pytest -n 2`, pytest-xdist; docs/development.md): a slow test spends much of
# its time starting processes and waiting on them, and one test at a time leaves about a
# quarter of 2 cores idle. What must not run side by side is kept apart here:
# - the tests of one file run on one worker, in their written order (xdist's `loadfile`
#   distribution), so a module-scoped fixture (a reference run, `made_once`) is made once;
# - the tests on a cluster (the one-node Slurm, the emulated hosts and the Slurm on them)
#   take the clusters' lock: one at a time, as they wait for idle nodes, set the links'
#   rates and kill hosts. So that the lock seldom keeps a worker waiting (one core idle
#   while its next test waits for a cluster test on the other worker), their files
#   (CLUSTER_FILES) go to one worker as one unit, one file after the other;
# - a test marked `alone` (8 ranks of a model bigger than one rank: most of the machine's
#   memory) runs with no test beside it: every other test holds a shared lock on the
#   machine, it an exclusive one, and holds it from its file's first test to the last.
#   That file goes out first, while the other worker starts the clusters' unit: later,
#   it would first wait, one core idle, for the end of whatever long test the other
#   worker was running;
# - then the units go out longest first, so that the run does not end on one worker still
#   busy with a long file while the other has nothing left (xdist's own order, most tests
#   first, sent the few-but-long files last).
# Locks, not xdist's groups: xdist 3.8 writes a test's `xdist_group` into `item._nodeid`,
# which pytest 9.2 no longer reads, so its `loadgroup` sends each test on its own
# (tests/test_suite_scheduling.py runs two workers to hold all of it to what they did).

# The files holding the tests marked `slurm` or `netns`, by name: xdist's controller,
# which hands the units out, sees test ids only, not marks (the workers check the list).
# In this order: should the clusters' unit win the machine's lock at the start, the
# `alone` file waits for test_slurm.py's first test (a fraction of a second), not for
# test_netns.py's (about a minute).
CLUSTER_FILES = ("test_slurm.py", "test_netns.py", "test_slurm_netns.py")
CLUSTERS_UNIT = "the clusters' tests"


def unit_of(nodeid: str) -> str:
    """The unit of work a test goes out in under `-n`: its file, or the clusters' unit."""
    path = nodeid.split("::", 1)[0]
    return CLUSTERS_UNIT if Path(path).name in CLUSTER_FILES else path


def pytest_configure(config: pytest.Config) -> None:
    """Under `-n`, a file's tests go to one worker, the units in the order collected."""
    if getattr(config.option, "dist", "no") != "no":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)  # an xdist hook: where xdist is not installed (gpu_check's image), unused
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's `loadfile`, with the cluster files as one unit (`unit_of`)."""
    from xdist.scheduler import LoadFileScheduling

    class ClusterFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ClusterFilesTogether(config, log)


# What a test is expected to take: a slow one starts processes or compiles (5-110 s
# here, most 20-50 s), another takes well under a second.
SLOW_TEST_S, QUICK_TEST_S = 30.0, 0.5


def units_in_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items, the unit holding an `alone` test first, the others in the order of their
    expected time, longest first (the same order on every worker); the cluster files in
    CLUSTER_FILES's order, each file's tests together in their written order."""
    expected: dict[str, float] = {}
    alone: set[str] = set()
    for item in items:
        unit = unit_of(item.nodeid)
        expected[unit] = expected.get(unit, 0.0) + (SLOW_TEST_S if item.get_closest_marker("slow") else QUICK_TEST_S)
        if item.get_closest_marker("alone"):
            alone.add(unit)

    def order(item: pytest.Item) -> tuple[bool, float, str, int]:
        unit = unit_of(item.nodeid)
        in_unit = CLUSTER_FILES.index(item.path.name) if unit == CLUSTERS_UNIT else 0
        return unit not in alone, -expected[unit], unit, in_unit  # the name: two units of one time stay apart

    return sorted(items, key=order)  # stable: the tests of a file keep their written order


class MarkedTest:
    """A stand-in for a collected test where only its id, file and marks are read: the
    scheduling's own tests (tests/test_suite_scheduling.py, tests/test_replay_schedule.py)."""

    def __init__(self, nodeid: str, *marks: str):
        self.nodeid, self.path, self.marks = nodeid, Path(nodeid.split("::")[0]), set(marks)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None


def check_cluster_files(items: list[pytest.Item]) -> None:
    """Every test on a cluster lives in one of CLUSTER_FILES, or it would go out beside them."""
    for item in items:
        if on_a_cluster(item) and item.path.name not in CLUSTER_FILES:
            raise pytest.UsageError(f"{item.nodeid} is marked slurm or netns but {item.path.name} is not in "
                                    f"CLUSTER_FILES (tests/conftest.py): add it there")


def on_a_cluster(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("slurm") or item.get_closest_marker("netns"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that need a cluster (Slurm, emulated hosts) start several processes by nature:
    they are slow too, so `pytest -m "not slow"` leaves them out without listing each.
    In the workers of `pytest -n` (which collect, the controller does not), the units in
    the order they go out (`units_in_order`)."""
    for item in items:
        if on_a_cluster(item):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):
        check_cluster_files(items)
        items[:] = units_in_order(items)


def machine_lock_files(run: str) -> tuple[Path, Path, Path]:
    """The gate and the share lock of `pytest -n` run `run`, and its clusters' lock, in the
    system's temp folder."""
    folder = Path(tempfile.gettempdir())
    return tuple(folder / f"ciuic-tests-{run}.{name}" for name in ("gate", "share", "clusters"))


@contextlib.contextmanager
def machine_share(run: str, exclusive: bool):
    """The machine, shared between the workers of one `pytest -n` run: a readers-writer
    lock on two files (flock). A test takes the share lock shared, a test marked `alone`
    exclusive; the gate in front of it is held by an exclusive taker while it waits and
    runs, so tests that keep arriving on the other worker cannot starve it."""
    gate_file, share_file, _ = machine_lock_files(run)
    with open(gate_file, "a") as gate, open(share_file, "a") as share:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(share, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(share, fcntl.LOCK_SH)
        yield  # closing the files releases both


@contextlib.contextmanager
def clusters_turn(run: str):
    """The clusters, to one test of a `pytest -n` run at a time (an exclusive flock)."""
    with open(machine_lock_files(run)[2], "a") as clusters:
        fcntl.flock(clusters, fcntl.LOCK_EX)
        yield


def keeps_the_machine(item: pytest.Item) -> bool:
    """A test marked `alone` and on no cluster: the next such test of its worker takes the
    machine over from it, without letting the other worker's waiting test in between."""
    return item.get_closest_marker("alone") is not None and not on_a_cluster(item)


# The machine held exclusive from one `alone` test to the next (`pytest_runtest_protocol`).
_kept_machine: contextlib.ExitStack | None = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Setup (module fixtures included), call and teardown under the machine's lock (and a
    cluster test under the clusters' lock), when the test runs in a worker of `pytest -n`.
    Consecutive `alone` tests (a file of them) hold the machine from the first to the last:
    released in between, each would wait, one core idle, for the end of whichever test
    the other worker had slipped in."""
    worker = getattr(item.config, "workerinput", None)  # set in xdist's workers only
    if worker is None:
        return (yield)
    global _kept_machine
    run = worker["testrunuid"]
    with contextlib.ExitStack() as held:
        if keeps_the_machine(item):
            if _kept_machine is None:  # the first of them takes the machine
                _kept_machine = contextlib.ExitStack()
                _kept_machine.enter_context(machine_share(run, exclusive=True))
            if nextitem is None or not keeps_the_machine(nextitem):  # the last gives it back after its teardown
                held.push(_kept_machine)
                _kept_machine = None
        else:
            if on_a_cluster(item):  # first: waiting for the clusters holds no share an `alone` test waits for
                held.enter_context(clusters_turn(run))
            held.enter_context(machine_share(run, exclusive=item.get_closest_marker("alone") is not None))
        return (yield)
