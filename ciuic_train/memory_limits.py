"""What a rank can use: the memory limits of this process and its node, read without torch
(but for CUDA's).

On CUDA: the free memory of the rank's GPU (`torch.cuda.mem_get_info`), or, in a process
that only starts the workers and must not hold a CUDA context on every GPU for the whole
run, the GPUs' total memory. On CPU, the smallest of:

- the address-space limit (`ulimit -v`, RLIMIT_AS) less what the process maps already:
  it counts address space (VmSize), not resident memory, and it is per process, so it
  is not divided between the ranks;
- the memory cgroup's limit less its usage, page cache the kernel can drop excepted,
  for this process's cgroup and every one above it (v2 `memory.max`, v1
  `memory.limit_in_bytes`);
- the kernel's `MemAvailable`.

The last two are the node's, shared by its local ranks. Each reader takes the files it
reads as arguments, so tests can give them a fake tree.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Limits at or above this are "no limit" (cgroup v1 writes 2^63 rounded down to a page).
UNLIMITED = 2**62


@dataclass(frozen=True)
class Room:
    """Bytes a rank can use, and what bounds them (the tightest of the limits read)."""

    bytes: int
    bound: str


def usable_bytes_per_rank(device: str, local_ranks: int, local_rank: int | None = 0) -> Room | None:
    """What one of the node's `local_ranks` ranks can use on `device` (`cpu` or `cuda`);
    None where nothing says (not Linux, or no GPU for this rank). `local_rank=None`: this
    process trains on no GPU itself (it starts the workers), so it reads the GPUs' total
    memory, without a context."""
    if device == "cuda":
        import torch

        if local_rank is None:
            total = min(torch.cuda.get_device_properties(i).total_memory
                        for i in range(min(local_ranks, torch.cuda.device_count())))
            return Room(total, "total memory of a GPU")
        if local_rank >= torch.cuda.device_count():
            return None  # more ranks than GPUs: the trainer says so when it picks its device
        free, _ = torch.cuda.mem_get_info(local_rank)
        return Room(free, f"free memory of cuda:{local_rank}")
    shared = f" / {local_ranks} local ranks" if local_ranks > 1 else ""
    rooms = []
    if (space := address_space_left()) is not None:
        rooms.append(Room(space, "address-space limit (ulimit -v)"))
    if (cgroup := cgroup_memory_left()) is not None:
        rooms.append(Room(cgroup.bytes // local_ranks, cgroup.bound + shared))
    if (available := mem_available()) is not None:
        rooms.append(Room(available // local_ranks, "available memory" + shared))
    return min(rooms, key=lambda room: room.bytes, default=None)


def mapped_bytes(status: Path = Path("/proc/self/status")) -> int:
    """The address space this process maps (VmSize), what RLIMIT_AS counts."""
    return _kib_field(status.read_text(), "VmSize")


def peak_resident_bytes(status: Path = Path("/proc/self/status")) -> int:
    """The most resident memory this process has held (VmHWM); 0 where /proc is not there."""
    try:
        return _kib_field(status.read_text(), "VmHWM")
    except (OSError, ValueError):
        return 0


def address_space_left(status: Path = Path("/proc/self/status")) -> int | None:
    """RLIMIT_AS's soft limit less what this process maps already; None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - mapped_bytes(status))


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of what can be allocated without swapping (MemAvailable)."""
    try:
        return _kib_field(meminfo.read_text(), "MemAvailable")
    except (OSError, ValueError):
        return None


def _kib_field(text: str, name: str) -> int:
    match = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"no {name} in /proc")
    return int(match.group(1)) * 1024


def cgroup_memory_left(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> Room | None:
    """The least that any memory cgroup of this process (its own and each one above it)
    lets it allocate still: limit less usage, page cache that can be dropped excepted.
    cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`); None where none is limited.
    `root` is where the filesystem starts (tests give a fake tree)."""
    rooms = []
    for folder, files in _memory_cgroups(proc, root):
        limit, usage, inactive = files
        try:
            text = (folder / limit).read_text().strip()
            if text == "max" or int(text) >= UNLIMITED:
                continue
            used = int((folder / usage).read_text()) - _stat(folder / "memory.stat", inactive)
        except (OSError, ValueError):
            continue
        rooms.append(Room(max(0, int(text) - used), f"cgroup {limit}"))
    return min(rooms, key=lambda room: room.bytes, default=None)


V2_FILES = ("memory.max", "memory.current", "inactive_file")
V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _memory_cgroups(proc: Path, root: Path) -> Iterator[tuple[Path, tuple[str, str, str]]]:
    """This process's memory cgroup folders, its own first, then each parent up to the mount."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return
    paths = {}  # "v2" or "v1" -> the cgroup's path in its hierarchy
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    for line in mounts:
        fields = line.split()
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        version = "v2" if fstype == "cgroup2" else "v1" if fstype == "cgroup" and "memory" in options else None
        if version not in paths:
            continue
        mount_root, mount_point = fields[3], root / fields[4].lstrip("/")
        inside = os.path.relpath(paths[version], mount_root)  # ".." where the mount shows another part
        folder = mount_point if inside.startswith("..") else Path(os.path.normpath(mount_point / inside))
        files = V2_FILES if version == "v2" else V1_FILES
        while True:
            yield folder, files
            if folder == mount_point or folder == folder.parent:
                break
            folder = folder.parent


def _stat(path: Path, key: str) -> int:
    match = re.search(rf"^{key} (\d+)$", path.read_text() if path.is_file() else "", re.MULTILINE)
    return int(match.group(1)) if match else 0
