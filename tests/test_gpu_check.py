"""scripts/gpu_check.sh rehearsed on CPU (`--dry-run`): every stage's set-up and command,
the carried wheels installed into an interpreter without hydra included, so the few
minutes a lent GPU gives are not spent on the script's own mistakes."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def stages(summary: Path) -> dict[str, tuple[str, str]]:
    """summary.txt's stage lines: name -> (verdict, summary line)."""
    rows = {}
    for line in summary.read_text().splitlines()[1:]:
        name, verdict, _seconds, *rest = line.split(None, 3)
        rows[name] = (verdict, rest[0] if rest else "")
    return rows


def work_folder(stdout: str) -> Path:
    """The work folder the script names in its first line."""
    return Path(re.search(r"work folder (\S+),", stdout).group(1))


def tree_state() -> dict[str, int]:
    """Every file under the repository root but the venv and git's own, with its mtime."""
    skip = (REPO / ".venv", REPO / ".git")
    return {str(p): p.stat().st_mtime_ns for p in REPO.rglob("*")
            if p.is_file() and not any(p.is_relative_to(s) for s in skip) and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_the_dry_run_passes_every_stage_on_cpu(tmp_path):
    """Offline too: the stand-in links this interpreter's packages and the carried wheels
    are repacked from the installed ones (the dry run asks no package index), and nothing
    in the tree is written (its wheels are built in the work folder)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "BUILD_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PIP_NO_INDEX": "1"}
    before = tree_state()
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=900)
    found = stages(tmp_path / "out" / "summary.txt")
    assert result.returncode == 0, json.dumps(found, indent=1) + result.stdout[-3000:]
    assert list(found) == ["standin", "env", "install", "tests", "meta_build", "ranks", "bench"]
    assert {verdict for verdict, _ in found.values()} == {"PASS"}
    assert "without hydra-core/omegaconf/antlr4" in found["standin"][1]
    assert "ciuic-train 0.1.0, hydra-core " in found["install"][1] and "omegaconf " in found["install"][1]
    assert "skipped" in found["tests"][1]  # collected and imported from the carried wheels, skipped without CUDA
    assert found["ranks"][1].startswith("torchrun: 2 rank(s) on cpu, 3 steps")
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert bench["tokens_per_s"] > 0 and bench["datasheet_tflops"] == 989 and 0 < bench["datasheet_mfu"] < 1
    assert found["bench"][1].startswith(bench["cpu"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "bench.json", "gpu_check.log", "summary.txt", "test_gpu.xml"
    ]
    assert not work_folder(result.stdout).exists()
    assert tree_state() == before

    # Without a GPU the real run (its wheels built first, as on the machine that carries
    # them) says so in its env stage, checks the carried wheels, skips the stages that need
    # CUDA, and exits 1.
    real_env = {**env, "OUT": str(tmp_path / "real"), "PYTHON": sys.executable, "WHEELS": str(tmp_path / "carried")}
    carried = subprocess.run(["bash", str(SCRIPT), "--build-wheels"], env=real_env, capture_output=True, text=True,
                             timeout=300)
    assert carried.returncode == 0, carried.stdout[-3000:] + carried.stderr[-3000:]
    tree = (tmp_path / "carried" / "SOURCE").read_text().strip()
    real = subprocess.run(["bash", str(SCRIPT)], env=real_env, capture_output=True, text=True, timeout=600)
    found = stages(tmp_path / "real" / "summary.txt")
    assert real.returncode == 1, real.stdout[-3000:]
    assert found["env"][0] == "FAIL(1)" and "torch sees no CUDA device" in found["env"][1]
    assert list(found) == ["env", "install", "tests", "meta_build", "ranks", "bench"]
    assert found["install"][0] == "PASS"
    assert {found[stage] for stage in ("tests", "meta_build", "ranks", "bench")} == {("SKIPPED", "torch sees no CUDA device")}
    assert not work_folder(real.stdout).exists()  # gone after a failed run too

    # A GPU run refuses wheels built from another tree (here: SOURCE says so) in one line.
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "SOURCE").write_text("0123456789abcdef\n")
    work = tmp_path / "work"
    work.mkdir()
    stage_env = {**env, "GPU_CHECK_STAGE": "stage_install", "REPO": str(REPO), "WORK": str(work), "WHEELS": str(wheels),
                 "SITE": str(work / "site"), "PY": sys.executable, "DRY_RUN": "0", "OUT_DIR": str(tmp_path / "out")}
    stale = subprocess.run(["bash", str(SCRIPT)], env=stage_env, capture_output=True, text=True, timeout=60)
    assert stale.returncode == 1
    assert (work / "install.line").read_text() == (
        f".whl was built from tree 0123456789abcdef, this is tree {tree}: "
        "run bash scripts/gpu_check.sh --build-wheels here and carry .whl\n"
    )
    assert not (work / "site").exists()
