"""Wheels of installed pure-Python distributions, rebuilt from their installed files.

`scripts/gpu_check.sh` carries hydra-core, omegaconf and antlr4-python3-runtime to a GPU
machine that has no network, at the versions the tests here ran with. Repacking what is
installed asks no package index (`pip wheel NAME==VERSION` would): a wheel holds the
files its RECORD lists under site-packages and its .dist-info, with a RECORD of its own.
Scripts installed outside site-packages (antlr4's `pygrun`) are left out: nothing runs
them. A distribution with compiled code is refused, as its files fit one machine only.

    python scripts/repack_wheel.py OUT_DIR NAME [NAME ...]
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import re
import sys
import zipfile
from pathlib import Path

# What the installer wrote about this installation, not part of the distribution.
INSTALLER_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(name: str, out: Path) -> Path:
    dist = importlib.metadata.distribution(name)
    wheel_info = dist.read_text("WHEEL") or ""
    if "Root-Is-Purelib: true" not in wheel_info:
        raise SystemExit(f"repack_wheel: {name} is not pure Python; build its wheel with pip instead")
    files = [f for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in f.parts]
    (info,) = {f.parts[0] for f in files if f.parts[0].endswith(".dist-info")}
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}"
    path = out / f"{stem}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(files, key=str):
            if file.parts[0] == info and file.name in INSTALLER_FILES:
                continue
            data = Path(file.locate()).read_bytes()
            archive.writestr(file.as_posix(), data)
            record.append(f"{file.as_posix()},{record_hash(data)},{len(data)}")
        record.append(f"{info}/RECORD,,")
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in argv[1:]:
        print(repack(name, out).name)


if __name__ == "__main__":
    main(sys.argv[1:])
