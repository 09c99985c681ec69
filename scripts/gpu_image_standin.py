"""A venv that plays the GPU image's interpreter, for `scripts/gpu_check.sh --dry-run`.

The GPU image's python3 has torch, numpy, rich, safetensors, PyYAML, packaging and pytest,
and lacks hydra-core, omegaconf and antlr4-python3-runtime (the wheels gpu_check.sh
carries). The stand-in gets the first list, with everything they require, as links into
this interpreter's site-packages: nothing is installed, so no package index is asked and
no gigabyte of torch is copied. Whatever else this interpreter has (hydra among it) is not
linked, so the dry run fails where the GPU run would for want of a package.

    python scripts/gpu_image_standin.py VENV
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

IMAGE_HAS = ("torch", "numpy", "rich", "safetensors", "PyYAML", "packaging", "pytest")
IMAGE_LACKS = ("hydra-core", "omegaconf", "antlr4-python3-runtime")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(names: tuple[str, ...]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `names` need, theirs included; optional extras and
    requirements whose markers exclude this interpreter are not followed."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonical(todo.pop())
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # required only on other platforms, say; importing will tell
        found[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    venv = Path(argv[0])
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    target = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    source = Path(sysconfig.get_paths()["purelib"])
    dists = requirement_closure(IMAGE_HAS)
    lacking = sorted(set(map(canonical, IMAGE_LACKS)) & set(dists))
    if lacking:
        raise SystemExit(f"gpu_image_standin: {', '.join(lacking)} would come in as a requirement of the image's packages")
    for dist in dists.values():
        for top in {f.parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            here = target / top
            if (source / top).exists() and not (here.exists() or here.is_symlink()):  # the venv's own pip stays
                here.symlink_to(source / top)
    print(f"{venv}: {len(dists)} distributions linked from {source}: {', '.join(sorted(dists))}")


if __name__ == "__main__":
    main(sys.argv[1:])
