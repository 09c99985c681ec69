#!/usr/bin/env bash
# One-command GPU check: the CUDA tests (tests/test_gpu.py) and a ~1B-parameter bf16
# benchmark (scripts/bench.py), sized for about 8 minutes on one H200.
#
#   bash scripts/gpu_check.sh              # on the GPU machine, from anywhere in the repo
#   bash scripts/gpu_check.sh --cpu-only   # no GPU: check the plumbing on a tiny CPU config
#
# Options: --cpu-only (accept a CPU torch; tiny fp32 bench), --no-install (never run pip),
# --budget SECONDS (the whole run's, default 450).
# Environment: OUT (outputs go to ${OUT:-gpu_check_out}/), PYTHON (interpreter to try
# first), PEAK_TFLOPS (datasheet dense bf16 peak for MFU, default 989 = H200 SXM),
# BENCH_STEPS / BENCH_ROUNDS / BENCH_BATCH / BENCH_SEQ (default 10 / 2 / 8 / 1024),
# GPU_CHECK_OFFLINE=1 (skip the package-index probe and every download).
#
# Stages (each under `timeout`, clipped to what is left of the budget; a failing stage
# does not stop the next): env (nvidia-smi, GPU seen), python (find an interpreter with
# CUDA torch and ciuic_train, else install: see below), torch (versions, CUDA, device
# capability, SDPA flags), tests (pytest tests/test_gpu.py -m gpu -v -rA; among them the
# meta build straight onto the GPU, no host copy), params (the ~1B config's parameter
# count, on meta), matmul (measured bf16/fp32 peak), bare (bare-loop
# tokens/s and MFU), bench (scripts/bench.py: trainer and bare loop, 2 rounds). Output:
# OUT/gpu_check.log (everything), OUT/summary.txt (verdicts and figures), test_gpu.xml,
# params.json, matmul.json, bench.json, nvidia-smi.txt. Exit status: 0 every stage
# passed, 1 some stage failed or timed out, 2 no usable GPU or interpreter.
#
# Installing: interpreters tried in order are $PYTHON, .venv, .venv-gpu, python3, python.
# If none has CUDA torch and an importable ciuic_train: wheels in .whl/ (if any) go to a
# folder on PYTHONPATH; then, with a package index reachable, `pip install torch==2.13.0
# -e '.[test,bench]'` in a new venv (or `-e '.[test,bench]'` into a venv that already has
# CUDA torch; then CUDA wheel indexes if plain pip gave a CPU torch); offline, only
# `pip install --no-index --no-deps --no-build-isolation -e .`. Each step is printed.
#
# This workplace's GPU machine has no network, and its python3 (/opt/torch/.venv, torch
# 2.11 with CUDA 13) lacks hydra-core, omegaconf and antlr4-python3-runtime. Carry them:
# here, with network, in the repo root (antlr4 4.9.3 is a source release, hence the build):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
# then run with `.whl` in the device tool's carry list:
#   OUT=$OUT bash scripts/gpu_check.sh     (timeout_s 540: the budget plus start-up)
set -euo pipefail
if [[ " $* " == *" -h "* || " $* " == *" --help "* ]]; then
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d'
    exit 0
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT_DIR=${OUT:-gpu_check_out}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

# Everything this script prints also goes to OUT/gpu_check.log.
if [[ -z "${GPU_CHECK_LOGGED:-}" ]]; then
    export GPU_CHECK_LOGGED=1
    set +o pipefail
    bash "${BASH_SOURCE[0]}" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi

CPU_ONLY=0
INSTALL=1
BUDGET_S=450
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cpu-only) CPU_ONLY=1 ;;
        --no-install) INSTALL=0 ;;
        --budget) BUDGET_S=$2; shift ;;
        *) echo "gpu_check.sh: unknown option $1 (see --help)"; exit 2 ;;
    esac
    shift
done

export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=15 PIP_RETRIES=1
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
# Stage logs, the helper and intermediate figures live here; OUT gets at most 8 files
# (what the device tool brings back): gpu_check.log, summary.txt, nvidia-smi.txt,
# test_gpu.xml, params.json, matmul.json, bench.json.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
RESERVE_S=10 # kept for the summary
STAGES=()
declare -A VERDICT=() SECONDS_TAKEN=()

# The ~1B config: model=bench with DeepSeek-V2-Lite-like attention (16 heads, qk 128+64,
# v 128, kv latent 512) and fine-grained experts (64 routed of 256, top-6, 2 shared).
BENCH_MODEL=bench
BENCH_OVERRIDES=(
    model.vocab_size=32768 model.dim=1024 model.n_layers=16 model.n_dense_layers=1 model.n_heads=16
    model.q_lora_rank=0 model.kv_lora_rank=512 model.qk_nope_head_dim=128 model.qk_rope_head_dim=64
    model.v_head_dim=128 model.dense_ffn_dim=4096 model.moe_ffn_dim=256 model.n_routed_experts=64
    model.n_shared_experts=2 model.n_activated_experts=6 model.max_seq_len=1024
)
BENCH_DEVICE=cuda
BENCH_PRECISION=bf16
BENCH_STEPS=${BENCH_STEPS:-10}
BENCH_ROUNDS=${BENCH_ROUNDS:-2}
BENCH_BATCH=${BENCH_BATCH:-8}
BENCH_SEQ=${BENCH_SEQ:-1024}
if [[ $CPU_ONLY == 1 ]]; then # the plumbing only: a tiny model on CPU
    BENCH_MODEL=tiny
    BENCH_OVERRIDES=(model.vocab_size=512 model.max_seq_len=64)
    # fp32: bf16 matmuls crawl on CPUs without native bf16 (minutes for bench.py's peak).
    BENCH_DEVICE=cpu BENCH_PRECISION=fp32 BENCH_STEPS=2 BENCH_ROUNDS=1 BENCH_BATCH=2 BENCH_SEQ=64
fi

banner() { printf '\n======== %s ======== (%ss elapsed, %ss left)\n' "$1" "$(($(date +%s) - START))" "$((DEADLINE - $(date +%s)))"; }
record() { STAGES+=("$1"); VERDICT[$1]=$2; SECONDS_TAKEN[$1]=${3:-0}; }

# run_stage NAME CAP_SECONDS COMMAND...: run under `timeout` (clipped to the budget left),
# output to the terminal and WORK/NAME.log; records PASS / FAIL (rc) / TIMEOUT / SKIPPED.
run_stage() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - $(date +%s) - RESERVE_S))
    local limit=$((cap < left ? cap : left))
    banner "$name"
    if ((limit < 15)); then
        echo "skipped: only ${left}s of the ${BUDGET_S}s budget left"
        record "$name" "SKIPPED (time budget)"
        return 0
    fi
    echo "+ timeout ${limit}s $*"
    local t0 rc
    t0=$(date +%s)
    set +o pipefail
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    set -o pipefail
    local took=$(($(date +%s) - t0))
    case $rc in
        0) record "$name" PASS "$took" ;;
        124 | 137) record "$name" "TIMEOUT after ${limit}s" "$took" ;;
        *) record "$name" "FAIL (exit $rc)" "$took" ;;
    esac
    echo "[$name] ${VERDICT[$name]} in ${took}s"
}

finish() {
    local status=$1 note=${2:-}
    banner "summary"
    {
        echo "gpu_check.sh summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), ${BUDGET_S}s budget, $(($(date +%s) - START))s used)"
        echo "repo: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')" \
            "($(git -C "$REPO" status --short 2>/dev/null | wc -l) changed files)"
        echo "python: ${PY:-none}"
        if [[ -n $note ]]; then echo "note: $note"; fi
        for stage in "${STAGES[@]}"; do
            printf '  %-8s %-28s %4ss\n' "$stage" "${VERDICT[$stage]}" "${SECONDS_TAKEN[$stage]}"
        done
        if [[ -f $WORK/tests.log ]]; then
            echo "tests: $(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* =+$' "$WORK/tests.log" | tail -1 | tr -d '=' | xargs || true)"
            grep -E '^(FAILED|ERROR) ' "$WORK/tests.log" | sed 's/^/  /' || true
        fi
        for f in params bare bench; do
            if [[ -f $WORK/$f.summary ]]; then sed 's/^/  /' "$WORK/$f.summary"; fi
        done
        echo "outputs: $OUT_DIR (stage logs: $WORK)"
    } | tee "$OUT_DIR/summary.txt" || true
    for f in test_gpu.xml params.json matmul.json bench.json; do
        if [[ -f $WORK/$f ]]; then cp "$WORK/$f" "$OUT_DIR/"; fi
    done
    exit "$status"
}

# --- the Python helper (probes, counts and timings), written next to the outputs ------------
HELPER=$WORK/gpu_check_helper.py
cat >"$HELPER" <<'PYEOF'
"""Helper of scripts/gpu_check.sh: `python gpu_check_helper.py COMMAND [bench.py arguments]`.

Lives outside the repo root on purpose: run from there, the source tree's `ciuic_train`
would shadow the installed one, whose `ciuic_train.conf` Hydra needs.
"""
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(os.environ["GPU_CHECK_REPO"])
OUT = Path(os.environ["GPU_CHECK_WORK"])
PEAK = float(os.environ.get("PEAK_TFLOPS", "989")) * 1e12


def probe():
    """exit 0: CUDA torch and ciuic_train; 3: CUDA torch, no ciuic_train; 4: ciuic_train, torch
    without CUDA; 5: no torch; 6: neither CUDA nor ciuic_train."""
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        print(f"no torch ({type(err).__name__}: {err})")
        return 5
    cuda = torch.cuda.is_available()
    try:
        import importlib
        importlib.import_module("ciuic_train.conf")  # Hydra's config package: only an install maps it
        importlib.import_module("ciuic_train.train.trainer")
        ours = f"ciuic_train from {Path(sys.modules['ciuic_train'].__file__).parent}"
    except Exception as err:  # noqa: BLE001
        ours = f"ciuic_train not importable ({type(err).__name__}: {err})"
    print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), cuda available: {cuda}; {ours}")
    ok = ours.startswith("ciuic_train from")
    if not cuda:
        return 4 if ok else 6
    return 0 if ok else 3


def env():
    import torch
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device 0: {props.name}, capability {props.major}.{props.minor}, "
              f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs")
        print(f"torch._grouped_mm: {hasattr(torch, '_grouped_mm')}; tf32 matmul: {torch.backends.cuda.matmul.allow_tf32}; "
              f"sdp flash/mem-efficient/cudnn/math enabled: {torch.backends.cuda.flash_sdp_enabled()}/"
              f"{torch.backends.cuda.mem_efficient_sdp_enabled()}/"
              f"{getattr(torch.backends.cuda, 'cudnn_sdp_enabled', lambda: 'n/a')()}/{torch.backends.cuda.math_sdp_enabled()}")
    for name in ("ciuic_train", "hydra", "omegaconf", "numpy", "pytest", "transformers"):
        try:
            module = __import__(name)
            print(f"{name} {getattr(module, '__version__', '')} at {Path(module.__file__).parent}")
        except Exception as err:  # noqa: BLE001
            print(f"{name}: not importable ({type(err).__name__})")
    return 0


def run_pytest(args):
    import pytest
    return pytest.main(args)


def bench_config(args):
    """bench.py's own argument parsing and config composition, for the same arguments."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench
    sys.argv = ["bench.py", *args]
    parsed = bench.parse_args()
    return bench, parsed, bench.compose_config(parsed)


def params(args):
    import torch
    from ciuic_train.model import Transformer, count_parameters
    from ciuic_train.model.counting import training_flops_per_token
    _, parsed, config = bench_config(args)
    with torch.device("meta"):
        model = Transformer(config.model)
        total, active = count_parameters(model)
        flops = training_flops_per_token(model, parsed.seq_len)
    m = config.model
    routed = sum(moe.w13.numel() + moe.w2.numel() for moe in model.moe_layers().values())
    lines = [
        f"config: model={parsed.model} " + " ".join(parsed.override),
        f"parameters: {total:,} total ({total / 1e9:.3f} B), {active:,} active per token ({active / 1e6:.0f} M); "
        f"routed experts {routed / 1e9:.3f} B, embedding + head {2 * m.vocab_size * m.dim / 1e6:.0f} M",
        f"shape: dim {m.dim}, {m.n_layers} layers ({m.n_dense_layers} dense), {m.n_heads} heads "
        f"(qk {m.qk_nope_head_dim}+{m.qk_rope_head_dim}, v {m.v_head_dim}, kv latent {m.kv_lora_rank}), "
        f"{m.n_routed_experts} experts of {m.moe_ffn_dim} top-{m.n_activated_experts} + {m.n_shared_experts} shared, "
        f"vocab {m.vocab_size}",
        f"training FLOPs per token at seq {parsed.seq_len}: {flops / 1e9:.3f} GFLOP",
    ]
    print("\n".join(lines))
    (OUT / "params.summary").write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    (OUT / "params.json").write_text(json.dumps(
        {"total": total, "active": active, "flops_per_token": flops, "overrides": parsed.override}, indent=2) + "\n")
    return 0


def matmul(args):
    import torch
    bench, parsed, _ = bench_config(args)
    figures = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        if name == "bf16" and parsed.precision != "bf16":
            continue
        figures[name] = bench.matmul_peak(dtype, device=parsed.device)
        print(f"matmul {name} ({parsed.device}): " + ", ".join(f"n={n}: {g / 1e3:,.2f} TFLOP/s" for n, g in figures[name].items()))
    best = max(figures[parsed.precision].values()) * 1e9
    print(f"best {parsed.precision} square matmul: {best / 1e12:,.2f} TFLOP/s = {best / PEAK:.1%} "
          f"of the {PEAK / 1e12:g} TFLOP/s datasheet bf16 peak (PEAK_TFLOPS)")
    (OUT / "matmul.json").write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def mfu_lines(tokens_per_s, flops, label, precision):
    lines = [f"{label}: {tokens_per_s:,.0f} tokens/s, {tokens_per_s * flops / 1e12:,.2f} TFLOP/s model FLOPs"]
    lines.append(f"  MFU vs datasheet bf16 {PEAK / 1e12:g} TFLOP/s: {tokens_per_s * flops / PEAK:.2%}")
    measured = OUT / "matmul.json"
    figures = json.loads(measured.read_text()) if measured.is_file() else {}
    if precision in figures:
        peak = max(figures[precision].values()) * 1e9
        lines.append(f"  MFU vs measured {precision} matmul peak {peak / 1e12:,.2f} TFLOP/s (gpu_check matmul stage): "
                     f"{tokens_per_s * flops / peak:.2%}")
    return lines


def bare(args):
    import torch
    from ciuic_train.model import Transformer
    from ciuic_train.model.counting import training_flops_per_token
    bench, parsed, config = bench_config(args)
    with torch.device("meta"):
        flops = training_flops_per_token(Transformer(config.model), parsed.seq_len)
    tic = time.perf_counter()
    bench.bare_tokens_per_s(config, bench.WARMUP_STEPS)
    print(f"warm-up ({bench.WARMUP_STEPS} steps, model built on {parsed.device}): {time.perf_counter() - tic:.1f}s")
    rates = [bench.bare_tokens_per_s(config, parsed.steps) for _ in range(parsed.rounds)]
    rate = max(rates)
    lines = mfu_lines(rate, flops, f"bare loop {parsed.precision} B={parsed.batch_size} S={parsed.seq_len} "
                                   f"(best of {len(rates)} x {parsed.steps} steps: {', '.join(f'{r:,.0f}' for r in rates)})",
                      parsed.precision)
    if parsed.device == "cuda":
        lines.append(f"  peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print("\n".join(lines))
    (OUT / "bare.summary").write_text("\n".join(lines) + "\n")
    return 0


def bench_mfu(args):
    results = json.loads(Path(args[0]).read_text())
    flops = results["flops_per_token"]
    precision = results["precision"]
    lines = [f"bench.py on {results.get('gpu') or results.get('cpu')}: its measured {precision} matmul peak "
             f"{results['peak_gflops'] / 1e3:,.2f} TFLOP/s (n={results['peak_size']}); bench.py's own MFU "
             f"(vs that peak): bare {results['mfu']:.2%}, trainer {results['trainer_mfu']:.2%}"]
    lines += mfu_lines(results["tokens_per_s"], flops, "bench.py bare loop (median)", precision)
    lines += mfu_lines(results["trainer_tokens_per_s"], flops, "bench.py trainer (median)", precision)
    lines.append(f"  trainer / bare: {results['trainer_bare_ratio']:.3f}")
    print("\n".join(lines))
    (OUT / "bench.summary").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    commands = {"probe": probe, "env": env}
    if command in commands:
        sys.exit(commands[command]())
    sys.exit({"pytest": run_pytest, "params": params, "matmul": matmul, "bare": bare, "bench_mfu": bench_mfu}[command](rest))
PYEOF
export GPU_CHECK_REPO=$REPO GPU_CHECK_WORK=$WORK PEAK_TFLOPS

# --- env --------------------------------------------------------------------------------------
banner "env"
echo "repo $REPO at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), outputs in $OUT_DIR"
echo "host $(hostname), $(nproc) cores, $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB memory"}')"
GPU_SEEN=0
if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi 2>&1 | tee "$OUT_DIR/nvidia-smi.txt" || true
    timeout 30 nvidia-smi --query-gpu=name,compute_cap,memory.total,clocks.max.sm,power.limit,driver_version \
        --format=csv 2>&1 || true
    if timeout 30 nvidia-smi -L 2>/dev/null | grep -q GPU; then GPU_SEEN=1; fi
else
    echo "nvidia-smi: not found"
fi
if [[ -e /dev/nvidia0 ]]; then GPU_SEEN=1; fi
echo "NVIDIA GPU visible to this machine: $([[ $GPU_SEEN == 1 ]] && echo yes || echo no)"
record env PASS

# --- python: an interpreter with CUDA torch and ciuic_train -----------------------------------
banner "python"
PY_T0=$(date +%s)
probe() { timeout 120 "$1" "$HELPER" probe; }
# Probe codes: 0 CUDA torch + ciuic_train, 3 CUDA torch only, 4 CPU torch + ciuic_train,
# 6 CPU torch only, 5 no torch. --cpu-only accepts a CPU torch.
TORCH_KIND="CUDA torch"
if [[ $CPU_ONLY == 1 ]]; then TORCH_KIND="torch"; fi
accepts() { [[ $1 == 0 || ($CPU_ONLY == 1 && $1 == 4) ]]; }
lacks_project() { [[ $1 == 3 || ($CPU_ONLY == 1 && $1 == 6) ]]; }
candidates=()
if [[ -n ${PYTHON:-} ]]; then candidates+=("$PYTHON"); fi
candidates+=("$REPO/.venv/bin/python" "$REPO/.venv-gpu/bin/python" python3 python)
PY=""
FALLBACK="" # the first with torch (CUDA unless --cpu-only) but without ciuic_train
pick() {
    local candidate rc
    PY="" FALLBACK=""
    for candidate in "${candidates[@]}"; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        echo -n "probe $candidate: "
        rc=0
        probe "$candidate" || rc=$?
        if accepts $rc; then PY=$(command -v "$candidate"); return 0; fi
        if lacks_project $rc && [[ -z $FALLBACK ]]; then FALLBACK=$(command -v "$candidate"); fi
    done
}
pick
install_note=""
# Wheels carried in .whl (the GPU machine has no network: hydra-core, omegaconf and
# antlr4-python3-runtime are not in its image) go to a folder on PYTHONPATH.
wheels=("$REPO"/.whl/*.whl)
if [[ -z $PY && -e ${wheels[0]} ]]; then
    WHEEL_SITE=/tmp/gpu_check_site
    pip_py=${FALLBACK:-$(command -v python3 || command -v python)}
    echo "+ $pip_py -m pip install --no-index --no-deps --target $WHEEL_SITE .whl/*.whl"
    if timeout 120 "$pip_py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WHEEL_SITE" "${wheels[@]}"; then
        export PYTHONPATH=$WHEEL_SITE${PYTHONPATH:+:$PYTHONPATH}
        install_note="installed ${#wheels[@]} carried wheels from .whl into $WHEEL_SITE (PYTHONPATH)"
        echo "$install_note"
        pick
    fi
fi
if [[ -z $PY && $INSTALL == 1 && ($GPU_SEEN == 1 || $CPU_ONLY == 1) ]]; then
    echo "no interpreter has both $TORCH_KIND and ciuic_train: installing"
    online=1
    if [[ ${GPU_CHECK_OFFLINE:-0} == 1 ]] || ! timeout 8 "${FALLBACK:-python3}" -c \
        'import urllib.request; urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=6)' >/dev/null 2>&1; then
        online=0
    fi
    echo "package index reachable: $([[ $online == 1 ]] && echo yes || echo 'no (offline installs only)')"
    pip_try() { # a pip command under a time limit, echoed; never fatal
        local left=$((DEADLINE - $(date +%s) - 240))
        if ((left < 30)); then echo "  (no time left for: $*)"; return 1; fi
        echo "+ $*"
        timeout $((left < 300 ? left : 300)) "$@" 2>&1 | tail -n 15
        return "${PIPESTATUS[0]}"
    }
    in_venv() { "$1" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; }
    vpy=""
    if [[ -n $FALLBACK ]] && in_venv "$FALLBACK"; then
        vpy=$FALLBACK # a venv with torch but not the project: the project goes into it, its torch stays
        install_note="${install_note:+$install_note; }torch found in the venv of $FALLBACK: installed the project there"
    else
        venv=$REPO/.venv
        if [[ -x $venv/bin/python ]]; then venv=$REPO/.venv-gpu; fi # .venv is there but unusable: left alone
        base=${FALLBACK:-$(command -v python3 || command -v python)}
        echo "+ $base -m venv --system-site-packages $venv"
        if [[ -x $venv/bin/python ]] || "$base" -m venv --system-site-packages "$venv"; then
            vpy=$venv/bin/python
            install_note="${install_note:+$install_note; }made $venv from $base (it sees $base's packages)"
        fi
    fi
    if [[ -n $vpy && $online == 1 ]]; then
        # The usual install first; then without the torch pin (keeps a present torch of
        # another 2.x); then the project alone.
        if [[ -n $FALLBACK ]]; then
            pip_try "$vpy" -m pip install -e '.[test,bench]' || pip_try "$vpy" -m pip install -e '.[test]' ||
                pip_try "$vpy" -m pip install --no-deps --no-build-isolation -e . || true
        else
            pip_try "$vpy" -m pip install torch==2.13.0 -e '.[test,bench]' ||
                pip_try "$vpy" -m pip install -e '.[test]' ||
                pip_try "$vpy" -m pip install --no-deps --no-build-isolation -e . || true
        fi
    elif [[ -n $vpy ]]; then
        pip_try "$vpy" -m pip install --no-index --no-deps --no-build-isolation -e . || true
        install_note="$install_note; offline: pip install --no-index --no-deps --no-build-isolation -e ."
    fi
    if [[ -n $vpy ]]; then
        rc=0
        echo -n "probe $vpy: "
        probe "$vpy" || rc=$?
        if [[ ($rc == 4 || $rc == 6) && $CPU_ONLY == 0 && $online == 1 ]]; then
            # A CPU-only torch from the plain index: the CUDA wheels of download.pytorch.org.
            install_note="$install_note; plain pip gave a CPU-only torch, tried --index-url download.pytorch.org/whl/{cu130,cu128,cu126}"
            for cu in cu130 cu128 cu126; do
                pip_try "$vpy" -m pip install --force-reinstall torch==2.13.0 --index-url "https://download.pytorch.org/whl/$cu" || continue
                rc=0
                echo -n "probe $vpy: "
                probe "$vpy" || rc=$?
                if [[ $rc != 4 && $rc != 6 ]]; then
                    install_note="$install_note ($cu worked)"
                    break
                fi
            done
        fi
        if accepts $rc; then PY=$vpy; fi
    fi
    echo "install: $install_note; result: ${PY:-still no usable interpreter}"
elif [[ -z $PY && $INSTALL == 0 ]]; then
    install_note="${install_note:+$install_note; }--no-install: nothing installed"
fi
if [[ -z $PY ]]; then
    if [[ $GPU_SEEN == 0 && $CPU_ONLY == 0 ]]; then
        why="no NVIDIA GPU on this machine (no GPU in nvidia-smi -L, no /dev/nvidia0); --cpu-only checks the plumbing"
    else
        why="no interpreter has $TORCH_KIND and an importable ciuic_train (${install_note:-see the probes above})"
        if grep -q -E "No module named '(hydra|omegaconf|antlr4)" "$OUT_DIR/gpu_check.log" 2>/dev/null; then
            why="$why; hydra-core/omegaconf/antlr4 are missing and cannot be downloaded here: carry them as wheels in .whl (see this script's header)"
        fi
    fi
    echo "gpu_check: ERROR: $why"
    record python "FAIL: no usable python" $(($(date +%s) - PY_T0))
    finish 2 "$why"
fi
echo "using $PY${install_note:+ ($install_note)}"
record python PASS $(($(date +%s) - PY_T0))
run_stage torch 60 "$PY" "$HELPER" env

# --- tests ------------------------------------------------------------------------------------
run_stage tests 200 "$PY" "$HELPER" pytest tests/test_gpu.py -m gpu -v -rA -p no:cacheprovider \
    --junitxml="$WORK/test_gpu.xml"

# --- the ~1B benchmark --------------------------------------------------------------------------
bench_args=(--model "$BENCH_MODEL" --device "$BENCH_DEVICE" --precision "$BENCH_PRECISION" --steps "$BENCH_STEPS"
    --batch-size "$BENCH_BATCH" --seq-len "$BENCH_SEQ")
for o in "${BENCH_OVERRIDES[@]}"; do bench_args+=(--override "$o"); done
run_stage params 60 "$PY" "$HELPER" params "${bench_args[@]}"
run_stage matmul 60 "$PY" "$HELPER" matmul "${bench_args[@]}"
run_stage bare 150 "$PY" "$HELPER" bare "${bench_args[@]}" --rounds 2

# bench.py's trainer side saves a checkpoint per round (weights and Adam state, ~12 GB at
# 1B): on tmpfs when it has room, so disk speed is not what the wall clock measures.
shm_free_gb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}' || echo 0)
if [[ ${shm_free_gb:-0} -ge 40 ]]; then
    export TMPDIR=/dev/shm/gpu_check_tmp
    mkdir -p "$TMPDIR"
fi
echo
echo "temporary run folders (bench.py's trainer checkpoints) in ${TMPDIR:-/tmp}" \
    "($(df -Ph "${TMPDIR:-/tmp}" | awk 'NR==2 {print $4}') free)"
rounds=$BENCH_ROUNDS
if ((DEADLINE - $(date +%s) < 240 && rounds > 1)); then
    rounds=1
    echo "less than 240s left: bench.py runs 1 round instead of $BENCH_ROUNDS"
fi
run_stage bench 330 "$PY" scripts/bench.py "${bench_args[@]}" --rounds "$rounds" --json "$WORK/bench.json"
if [[ -f $WORK/bench.json && ${VERDICT[bench]} == PASS ]]; then
    "$PY" "$HELPER" bench_mfu "$WORK/bench.json" || true
fi
if [[ ${TMPDIR:-} == /dev/shm/gpu_check_tmp ]]; then rm -rf "$TMPDIR"; fi

status=0
for stage in "${STAGES[@]}"; do
    [[ ${VERDICT[$stage]} == PASS ]] || status=1
done
finish "$status" "${install_note:-}"
