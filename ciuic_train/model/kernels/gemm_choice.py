"""Which fp32 GEMM backend is faster on this CPU, MKL (`torch.mm`) or oneDNN, per product.

torch runs fp32 `torch.mm` and `F.linear` through MKL, which takes a slow path on AMD
CPUs with AVX-512 (about half the chip's peak); oneDNN's fp32 GEMM, through torch's
oneDNN linear operator, reaches it. On an AVX2-only AMD CPU MKL is the faster one. So
the choice is measured, not guessed: once per process, for each of a linear layer's
three products (forward x @ w^T, input gradient g @ w, weight gradient g^T @ x), at the
model's typical shapes, and oneDNN is taken only where it is clearly faster (`MARGIN`),
so noise does not flip the choice.

A measurement disturbed by other jobs on the cores (`QUIET`) decides nothing: after
`TRIES` of them the process takes what is known of the CPU instead (`known_plan`: oneDNN
on an AMD CPU with AVX-512, the case measured, MKL elsewhere), so that processes which
measure on a busy machine still agree with those that measured quietly where it matters.

The result is cached per machine kind in `$XDG_CACHE_HOME/ciuic-train/fp32_gemm.json`
(`~/.cache/ciuic-train`, where the token caches live), keyed by the CPU model, the ISA
flags that decide the kernels, the torch version and the thread count. A disturbed
measurement is not cached; a corrupt file is measured again; the file is replaced atomically, so ranks writing at
once leave a whole one. `CIUIC_FP32_GEMM=mkl|onednn` skips the measurement and forces the backend
for every product (`auto`, the default, measures).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

ENV = "CIUIC_FP32_GEMM"
CACHE_FILE = "fp32_gemm.json"
# oneDNN is chosen for a product where MKL takes more than MARGIN times its time (on the
# AVX-512 EPYC of issue 30, 2.2x at the square peak; on an AVX2 EPYC, 0.9x).
MARGIN = 1.25
# A measurement during which this process had less than QUIET of its cores is disturbed:
# other jobs on the cores made MKL look up to 1.8x slower than oneDNN on an AVX2 EPYC
# where it is the faster. Such a one decides nothing; after TRIES disturbed ones the
# process takes `known_plan`, uncached, and the next process measures again.
QUIET = 0.9
TRIES = 2
# (rows, in, out) of x @ w^T: model=bench's attention projections (B x T = 2048 tokens,
# dim 256) and its dense FFN.
SHAPES = ((2048, 256, 256), (2048, 256, 1024))
ROUNDS = 3  # each backend's best of, after one warm-up call
PASSES = 2
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


@dataclass(frozen=True)
class GemmPlan:
    """Whether each product of a linear layer runs through oneDNN (else MKL)."""

    forward: bool = False  # x @ w^T
    grad_input: bool = False  # g @ w
    grad_weight: bool = False  # g^T @ x

    @property
    def any(self) -> bool:
        return self.forward or self.grad_input or self.grad_weight


MKL = GemmPlan()
ONEDNN = GemmPlan(True, True, True)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# --- The products, each by both backends --------------------------------------------------


def onednn_mm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T in full fp32 by oneDNN (a [m, k], b [n, k], either may be strided)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def onednn_weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad^T @ x [out, in] by oneDNN's inner-product backward (grad [N, out], x [N, in];
    `weight` gives the result's dtype and device).

    Its operands go in oneDNN's own layout; measured on an AVX2 EPYC, that copy and the
    backward kernel beat `onednn_mm_nt` of the two transposes by 15%.
    """
    return torch.ops.aten.mkldnn_linear_backward_weights(
        grad.contiguous().to_mkldnn(), x.contiguous().to_mkldnn(), weight, False
    )[0]


def products(rows: int, fan_in: int, fan_out: int) -> dict[str, tuple[Callable, Callable]]:
    """Each product's (MKL, oneDNN) calls on random operands of one shape."""
    x, w, g = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in), torch.randn(rows, fan_out)
    return {
        "forward": (lambda: torch.nn.functional.linear(x, w), lambda: onednn_mm_nt(x, w)),
        "grad_input": (lambda: g @ w, lambda: onednn_mm_nt(g, w.t())),
        "grad_weight": (lambda: g.t() @ x, lambda: onednn_weight_grad(g, x, w)),
    }


def measure() -> tuple[dict[str, float], float]:
    """Each product's time by MKL over its time by oneDNN, the lower of `PASSES` (~0.5 s on
    2 cores), and the share of the cores this process had meanwhile (CPU time over wall
    time times threads: 0.98 on an idle machine, 0.6 beside one busy loop on 2 cores).

    Each call is timed alone, the backends alternating, and each keeps its best time over
    `ROUNDS`: another job on the cores only adds time, so the best is the least disturbed.
    Contention can still favour one backend for a while (see `QUIET`), hence the lower
    ratio of two passes, the margin, and the share returned.
    """
    ratios = {name: float("inf") for name in ("forward", "grad_input", "grad_weight")}
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for _ in range(PASSES):
            seconds = {name: [0.0, 0.0] for name in ratios}
            for shape in SHAPES:
                for name, calls in products(*shape).items():
                    for call in calls:
                        call()  # warm-up: oneDNN builds its kernel for the shape
                    best = [float("inf")] * 2
                    for r in range(ROUNDS):
                        for backend in (0, 1) if r % 2 == 0 else (1, 0):
                            tic = time.perf_counter()
                            calls[backend]()
                            best[backend] = min(best[backend], time.perf_counter() - tic)
                    for backend in (0, 1):
                        seconds[name][backend] += best[backend]
            for name, (mkl, dnn) in seconds.items():
                ratios[name] = min(ratios[name], mkl / dnn)
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads())
    return ratios, share


# --- The cache ------------------------------------------------------------------------------


def cache_path() -> Path:
    # files.user_cache_dir's folder, restated: model/ imports only itself (bench_peer.py
    # --baseline copies it out of git and runs it alone; test_layout checks it).
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ciuic-train" / CACHE_FILE


def cpu_info() -> tuple[str, str, set[str]]:
    """The first CPU's vendor, model name and flags from /proc/cpuinfo ("unknown", set() where unreadable)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields.get("vendor_id", "unknown"), fields.get("model name", "unknown"), set(fields.get("flags", "").split())


def known_plan() -> GemmPlan:
    """The choice without a measurement: oneDNN for every product on an AMD CPU with
    AVX-512, where MKL's fp32 GEMM reaches half of oneDNN's (issue 30's EPYC), else MKL."""
    vendor, _, flags = cpu_info()
    return ONEDNN if vendor == "AuthenticAMD" and "avx512f" in flags and onednn_available() else MKL


def machine_key() -> str:
    """What decides which backend is faster: the CPU model, its GEMM-relevant flags, torch, threads."""
    _, model, flags = cpu_info()
    isa = "+".join(flag for flag in FLAGS if flag in flags) or "-"
    return f"{model} | {isa} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def read_cache(path: Path) -> dict:
    """The cached plans by machine key; {} when the file is missing or unreadable."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def cached_plan(entries: dict, key: str) -> GemmPlan | None:
    entry = entries.get(key)
    try:
        return GemmPlan(**{name: bool(entry[name]) for name in ("forward", "grad_input", "grad_weight")})
    except (TypeError, KeyError):
        return None


def write_cache(path: Path, entries: dict) -> None:
    """Write `entries` whole: to a temporary file beside `path`, then renamed over it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                         delete=False, encoding="utf-8") as tmp:
            json.dump(entries, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError:  # a read-only home: measured again next time
        pass


def choose() -> GemmPlan:
    """This process's plan: forced by `CIUIC_FP32_GEMM`, else cached for this machine, else measured."""
    forced = os.environ.get(ENV, "auto").lower()
    if forced in ("mkl", "onednn"):
        return ONEDNN if forced == "onednn" and onednn_available() else MKL
    if forced != "auto":
        raise ValueError(f"{ENV}={forced!r} is not one of: auto, mkl, onednn")
    path, key = cache_path(), machine_key()
    entries = read_cache(path)
    plan = cached_plan(entries, key)
    if plan is not None:
        return plan
    if not onednn_available():
        return MKL
    for _ in range(TRIES):
        ratios, share = measure()
        if share >= QUIET:
            break
    else:
        return known_plan()
    plan = GemmPlan(**{name: ratio > MARGIN for name, ratio in ratios.items()})
    entries = read_cache(path)  # another rank may have written since
    entries[key] = {**asdict(plan), "mkl_over_onednn": {name: round(r, 3) for name, r in ratios.items()},
                    "cpu_share": round(share, 2)}
    write_cache(path, entries)
    return plan


@lru_cache(maxsize=1)
def fp32_gemm_plan() -> GemmPlan:
    """`choose()`, once per process (`fp32_gemm_plan.cache_clear()` to choose again)."""
    return choose()
